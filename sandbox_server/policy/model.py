"""Frozen policy objects, built once from a validated policy file; units are in the names."""

from __future__ import annotations

from dataclasses import dataclass, field

from sandbox_server.network.egress import Egress
from sandbox_server.sandbox import wire
from sandbox_server.sandbox.spec import Mount, ResourceLimits, SandboxSpec

__all__ = [
    "ApprovalSettings",
    "AuditSettings",
    "HostAdmission",
    "Policy",
    "RateLimits",
    "ServiceSettings",
    "TaskSettings",
    "ToolPolicy",
    "WorkspaceSettings",
]


@dataclass(frozen=True, slots=True)
class ToolPolicy:
    """What one tool runs in and may do."""

    image: str = "sandbox-server/base:latest"
    packages: tuple[str, str] | None = None
    """A team's own wheels added to an image: (the image they are added to, the lock's path); `image` is then
    the image `images build --policy` makes of them."""
    build: str | None = None
    """A team's own build context (a folder with a Dockerfile); `image` is then the sandbox image
    `images build --policy` makes of it, named by its content."""
    runtime: str = "runc"
    user: str = "1000:1000"
    egress: Egress | None = None
    """The allow list a proxy opens to this tool's sandboxes; None: no network (only loopback)."""
    seccomp_profile: str | None = None
    """The profile's JSON text (read at load time), or None for the engine's default."""
    seccomp_profile_source: str | None = None
    """Where the profile was read from, for people."""
    limits: ResourceLimits = field(default_factory=ResourceLimits)
    max_timeout_s: float = 120.0
    """The most a caller may ask for with `timeout_s`; more is refused, never lowered."""
    max_task_s: float = 3600.0
    """The most a task may run: its `timeout_s`, else this."""
    allow_shell: bool = True
    commands_allow: tuple[str, ...] = ()
    commands_deny: tuple[str, ...] = ()
    max_argument_bytes: int = 16 * 1024 * 1024
    """Arguments larger than this (JSON-encoded) are refused before anything runs."""
    max_input_file_bytes: int = 64 * 1024 * 1024
    max_input_files: int = 1000
    max_csv_bytes: int = 4 * 1024**3
    """Largest file analyze_csv reads (its size is checked before it is opened)."""
    max_csv_line_bytes: int = 2 * 1024 * 1024
    mounts: tuple[Mount, ...] = ()
    env: tuple[tuple[str, str], ...] = ()
    """The program's environment, resolved at load time (passed names and fixed values)."""
    enabled: bool = True
    pool_size: int = 2
    """Warm containers kept ready for this tool's container settings at the least (0: every call starts cold)."""
    pool_max: int = 0
    """The most its pool grows to under demand (0: no growth, it stays at pool_size)."""
    pool_ahead: int = 0
    """How many its pool keeps ready once in use, made in the pauses between calls (0: only demand grows it)."""
    pool_on_runc: tuple[int, int] | None = None
    """Its pool's (ahead, max) where runc itself makes its sandboxes, which cost less to keep waiting (None: as
    everywhere else)."""
    pool_idle_s: float = 300.0
    """How long a warm container may wait before it is replaced."""
    preload: tuple[str, ...] = ()
    """Modules a warm interpreter imports before the request (images with warm_python.py)."""

    @property
    def writable_mounts(self) -> tuple[Mount, ...]:
        """The host folders its sandboxes may write to."""
        return tuple(mount for mount in self.mounts if not mount.read_only)

    @property
    def pool_most(self) -> int:
        """The most containers its pool holds: pool_max, never below pool_size or pool_ahead.

        Not bounded by the policy's concurrency: each call uses up one container, so calls one after another
        empty a pool as surely as calls side by side (the memory budget bounds it instead)."""
        return max(self.pool_size, self.pool_max, self.pool_ahead)

    def container_spec(self) -> SandboxSpec:
        """The container this tool's calls run in, before any call (warm containers are made from it)."""
        return SandboxSpec(
            image=self.image,
            argv=("true",),
            limits=self.limits,
            runtime=self.runtime,
            user=self.user,
            env=self.env + ((wire.PRELOAD_ENV, " ".join(self.preload)),) if self.preload else self.env,
            mounts=self.mounts,
            seccomp_profile=self.seccomp_profile,
        )


@dataclass(frozen=True, slots=True)
class RateLimits:
    """Admission limits: calls per minute answered at once; calls past the concurrency cap wait their turn."""

    calls_per_minute: int = 120
    concurrent_calls: int = 8
    queue_wait_s: float = 30.0
    """The longest a call waits for a slot (never past its own timeout); 0 refuses at once."""
    queue_length: int = 64
    """Calls that may wait for a slot at once; past them a call is refused at once."""


@dataclass(frozen=True, slots=True)
class HostAdmission:
    """No new sandbox on a saturated host."""

    min_available_memory_mb: int = 256
    max_load_per_cpu: float = 8.0
    pool_memory_mb: int = 2048
    """All warm containers together may hold at most this much memory."""
    pool_sandboxes: int = 160
    """All warm pools together, every caller's policy's included, keep at most this many sandboxes waiting."""
    workspace_storage_mb: int = 8192
    """All kept workspaces together may take at most this much of the host's disk (each at what its files take, a
    mounted one at its whole size while a call works in it)."""


@dataclass(frozen=True, slots=True)
class WorkspaceSettings:
    """Whether /workspace lasts across the calls of a session, and its bounds."""

    persist: bool = False
    size_mb: int = 256
    files: int = 20000
    idle_ttl_s: float = 1800.0
    max_per_client: int = 8
    protect_recent_s: float = 300.0
    """A workspace continued this recently is never removed to make room; the new call is refused instead."""
    exec: bool = True
    """Whether programs may be run from files under /workspace (uploads marked executable, `./run.sh`)."""
    keep_s: float = 2592000.0
    """A named workspace unused for this long is removed (an unnamed one: idle_ttl_s)."""
    named_per_caller: int = 20
    """Named workspaces one caller may hold (apart from max_per_client's unnamed ones)."""
    snapshots_per_caller: int = 20
    """Snapshots one caller may hold (apart from its workspaces)."""
    storage_per_caller_mb: int = 0
    """What one caller's workspaces, snapshots and live exports may take together, MiB (each counted as for
    host.workspace_storage_mb); 0: no share of its own (half of host.workspace_storage_mb where callers by token
    share the server)."""


@dataclass(frozen=True, slots=True)
class TaskSettings:
    """Calls that outlive their request: how many, for how long their results are kept, how often to poll."""

    running: int = 4
    """Tasks running at once, every caller together (0: no tasks); apart from the calls' own slots."""
    running_per_caller: int = 2
    per_caller: int = 20
    """Tasks one caller may hold, running or kept."""
    ttl_s: float = 86400.0
    poll_interval_ms: int = 2000
    first: tuple[str, ...] = ()
    """Tools whose calls run as tasks whenever the client can take one."""


@dataclass(frozen=True, slots=True)
class ServiceSettings:
    """Programs that outlive their call (a web server, an API), reachable by their session's next calls."""

    tools: tuple[str, ...] = ()
    """Tools whose calls may start a service (empty: none may)."""
    per_session: int = 3
    """Services one workspace (a session's) may have running at once."""
    per_caller: int = 6
    """Services one caller may have running at once, all its workspaces together."""
    running: int = 16
    """Services running at once on this server, every caller together."""
    memory_mb: int = 512
    cpus: float = 1.0
    start_timeout_s: float = 30.0
    """How long a service has to listen on its port before its start is refused (and it is stopped)."""
    idle_s: float = 1800.0
    """A service is stopped after this long without a call in its workspace or a request through its preview."""
    max_lifetime_s: float = 14400.0
    """A service is stopped this long after its start, whatever it does."""
    preview: bool = True
    """Whether a person may open a service through the server's preview routes (HTTP transport)."""
    log_kb: int = 1024
    """The engine keeps at most this much of a service's log (its tail)."""


@dataclass(frozen=True, slots=True)
class ApprovalSettings:
    """Calls a person must approve, through the client, before they run."""

    commands: tuple[str, ...] = ()
    """execute_command: glob patterns matched on the program (as written, or its file name) and the whole line."""
    tools: tuple[str, ...] = ()
    """Every call of these tools."""
    writable_mounts: bool = False
    """Every call of a tool that has a host folder mounted writable."""


@dataclass(frozen=True, slots=True)
class AuditSettings:
    """Where the audit trail goes and what it holds."""

    path: str | None = None
    include_arguments: bool = False
    max_bytes: int = 10_000_000
    keep: int = 5
    max_age_h: float = 0
    """Rotate once the file's first line is this many hours old (0: by size alone)."""
    seal_interval_s: int | None = 60
    """Seal the trail this often with a forward-secure key (None: the chain alone)."""


@dataclass(frozen=True, slots=True)
class Policy:
    """A named, fully resolved policy."""

    name: str = "default"
    description: str = ""
    """The policy's own words for what it is for (tools/list says them beside the shell)."""
    tool_prefix: str = ""
    """Put before every tool name clients see (`sbx_` gives `sbx_execute_command`)."""
    default: ToolPolicy = field(default_factory=ToolPolicy)
    tools: tuple[tuple[str, ToolPolicy], ...] = ()
    rate: RateLimits = field(default_factory=RateLimits)
    host: HostAdmission = field(default_factory=HostAdmission)
    audit: AuditSettings = field(default_factory=AuditSettings)
    workspace: WorkspaceSettings = field(default_factory=WorkspaceSettings)
    approval: ApprovalSettings = field(default_factory=ApprovalSettings)
    tasks: TaskSettings = field(default_factory=TaskSettings)
    services: ServiceSettings = field(default_factory=ServiceSettings)
    source: str = "(built in)"
    digest: str = ""
    """sha256 of the resolved policy document, recorded in every audit line."""
    notes: tuple[str, ...] = ()
    """What the file does that its reader may not expect (a tool's mounts leaving out defaults'): said by `policy
    check`, `policy explain` and `serve`, never refused."""

    def for_tool(self, tool_name: str) -> ToolPolicy:
        """The effective policy of one tool."""
        return dict(self.tools).get(tool_name, self.default)
