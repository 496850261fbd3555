"""Frozen data passed across the sandbox boundary: what to run, with what limits, and what came out."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import BinaryIO

from sandbox_server.sandbox import wire

__all__ = [
    "SANDBOX_LABEL",
    "ExecutionResult",
    "InputFile",
    "Mount",
    "OutputFile",
    "ResourceLimits",
    "SandboxSpec",
]

SANDBOX_LABEL = "org.sandbox-server.sandbox"
"""Every container we create carries this label, so strays can be found and removed."""


@dataclass(frozen=True, slots=True)
class ResourceLimits:
    """What one sandbox may use; units are in the names."""

    timeout_s: float = 30.0
    memory_mb: int = 512
    cpus: float = 1.0
    pids: int = 128
    nofile: int = 256
    file_size_mb: int = 64
    tmp_mb: int = 64
    workspace_mb: int = 128
    workspace_files: int | None = None
    """Inodes of /workspace; None: 256 per MiB."""
    workspace_exec: bool = True
    """Whether programs may be run from files under /workspace (False: mounted noexec); /tmp never."""
    shm_mb: int = 16
    output_bytes: int = 100_000
    returned_files: int = 20
    returned_file_bytes: int = 8_000_000
    returned_images: int = 8
    returned_image_bytes: int = 4_000_000

    @property
    def workspace_inodes(self) -> int:
        """The inodes of the /workspace tmpfs: workspace_files, or 256 per MiB (at least 1024)."""
        return self.workspace_files or max(1024, self.workspace_mb * 256)


@dataclass(frozen=True, slots=True)
class Mount:
    """A host folder made visible inside the sandbox."""

    host_path: str
    sandbox_path: str
    read_only: bool = True


@dataclass(frozen=True, slots=True)
class InputFile:
    """A file written under the workspace before the program starts."""

    path: str
    content: bytes
    mode: int = 0o644
    mtime: float | None = None
    """Its modification time, in seconds since 1970 (None: the time of the call)."""


@dataclass(frozen=True, slots=True)
class SandboxSpec:
    """Everything needed to run one program in one fresh container."""

    image: str
    argv: tuple[str, ...]
    limits: ResourceLimits = field(default_factory=ResourceLimits)
    runtime: str = "runc"
    user: str = "1000:1000"
    network: str = "none"
    env: tuple[tuple[str, str], ...] = ()
    """The container's environment (the policy's); part of what a warm container is made with."""
    call_env: tuple[tuple[str, str], ...] = ()
    """Environment of this call only, sent with the request (a warm container starts without it)."""
    stdin: bytes = b""
    files: tuple[InputFile, ...] = ()
    call_workdir: str = ""
    """Folder of this call, relative to the workspace ("" is the workspace itself); the launcher makes it."""
    mounts: tuple[Mount, ...] = ()
    workdir: str = wire.WORKSPACE
    seccomp_profile: str | None = None
    """A seccomp profile as JSON text; None keeps the engine's default profile."""
    labels: tuple[tuple[str, str], ...] = ()
    saved_workspace: str | None = None
    """A kept workspace: the path of its saved archive on the host ("" when new), restored before the
    program runs and written out again after it; None when the workspace is not kept."""
    workspace_slots: str | None = None
    """A host folder (a shared mount) under which the container gets a slot of its own, bound at
    `workdir` with slave propagation instead of a tmpfs: a kept workspace is mounted there per call."""
    mounted_workspace: str | None = None
    """A kept workspace's mounted filesystem on the host, bound onto the container's slot for this call."""
    reads_only: bool = False
    """The program only reads the workspace (the files tool's read, find and grep, a fixed program of the
    server's): what the call changed there is known without walking the workspace before and after it."""
    service_network: str | None = None
    """The private network of its workspace's services, which the sandbox joins to reach them by name."""

    @property
    def networked(self) -> bool:
        """Whether the sandbox joins any network (an egress one, its services' or both)."""
        return self.network != "none" or self.service_network is not None

    @property
    def preloads(self) -> bool:
        """Whether its warm container's interpreter imports libraries before its request (ready later)."""
        return any(name == wire.PRELOAD_ENV and value for name, value in self.env)

    def container_key(self) -> tuple[object, ...]:
        """What the container is created with: calls with equal keys can use the same kind of warm container."""
        limits = self.limits
        return (
            self.image, self.runtime, self.user, self.network, self.env, self.mounts, self.workdir,
            self.seccomp_profile, self.labels, self.workspace_slots, self.service_network, limits.memory_mb, limits.cpus, limits.pids, limits.nofile,
            limits.file_size_mb, limits.tmp_mb, limits.workspace_mb, limits.workspace_files, limits.shm_mb, limits.workspace_exec,
        )  # fmt: skip


@dataclass(frozen=True, slots=True)
class OutputFile:
    """A regular file the program left under the output folder."""

    path: str
    content: bytes
    size: int
    mtime: float = 0.0
    """Its modification time as the program left it, in seconds since 1970."""


@dataclass(frozen=True, slots=True)
class ExecutionResult:
    """What happened to one program: outcomes are data, never exceptions."""

    exit_code: int | None
    stdout: bytes
    stderr: bytes
    duration_ms: int
    timed_out: bool = False
    oom_killed: bool = False
    pids_limited: bool = False
    """A fork or thread failed because the process limit was reached (the cgroup counted it)."""
    killed: bool = False
    """The container was killed from outside (neither by our timeout nor by OOM)."""
    flooded: bool = False
    """The program wrote far more than its output cap and was stopped."""
    stdout_truncated_bytes: int = 0
    stderr_truncated_bytes: int = 0
    whole_output: tuple[tuple[str, bytes], ...] = ()
    """A stream cut to the output cap, as it came (up to 8 MiB): ("stdout" or "stderr", its bytes)."""
    files: tuple[OutputFile, ...] = ()
    skipped_files: tuple[str, ...] = ()
    """Notes on output entries not returned (links, devices, over the caps)."""
    container_id: str = ""
    address: str = ""
    """The sandbox's IP address on its network ("" with none)."""
    cpu_s: float | None = None
    """CPU time the sandbox's processes used during the call, read by the host (None: it cannot read it)."""
    peak_memory_bytes: int | None = None
    """The sandbox's peak memory, read by the host (None: it cannot read it)."""
    at_memory_limit: bool = False
    """Its memory met its limit during the call (what a program slowed by the kernel's reclaim shows)."""
    workspace: BinaryIO | None = None
    """A kept workspace as the program left it (a tar in a temporary file, which the keeper closes), when
    the launcher could write it whole."""
    workspace_problem: str | None = None
    """Why a persistent workspace was not kept as this call left it (then the call is an error)."""

    @property
    def truncated(self) -> bool:
        """True when any output was cut to fit the byte cap."""
        return bool(self.stdout_truncated_bytes or self.stderr_truncated_bytes)
