"""`sandbox-server doctor`: is this host able to run sandboxes, and are the limits real?

Every check yields a Check; a failed one carries what to do next. The probe runs a
real sandbox with small limits and reads back what the kernel applied, then
exceeds the memory and process limits to prove they hold.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING

import anyio
import anyio.to_thread

from sandbox_server.errors import EngineError, SandboxServerError
from sandbox_server.sandbox import wire
from sandbox_server.sandbox.engine.connection import EngineInfo
from sandbox_server.sandbox.engine.images import catalog, image_reference, image_status
from sandbox_server.sandbox.engine.runtime import DockerRuntime
from sandbox_server.sandbox.engine.wheels import libraries
from sandbox_server.sandbox.spec import ExecutionResult, ResourceLimits, SandboxSpec

if TYPE_CHECKING:
    from sandbox_server.policy.model import Policy

__all__ = ["Check", "DoctorReport", "image_state", "run_doctor"]

PROBE_MEMORY_MB = 48
PROBE_PIDS = 24
PROBE_SCRIPT = r"""
echo "uid=$(id -u)"
grep -E '^(CapEff|NoNewPrivs|Seccomp):' /proc/self/status | tr -d '\t ' | tr ':' '='
echo "net=$(ls /sys/class/net | tr '\n' ',')"
if touch /usr/.probe 2>/dev/null; then echo rootfs=writable; else echo rootfs=readonly; fi
echo "memory_limit=$(cat /sys/fs/cgroup/memory/memory.limit_in_bytes 2>/dev/null || cat /sys/fs/cgroup/memory.max)"
echo "pids_limit=$(cat /sys/fs/cgroup/pids/pids.max 2>/dev/null || cat /sys/fs/cgroup/pids.max)"
head -c 200000000 /dev/zero | tail >/dev/null
echo "memory_hog_exit=$?"
sh -c 'i=0; while [ $i -lt 100 ]; do sleep 30 >/dev/null 2>&1 & i=$((i+1)); echo $i >/tmp/.forked; done' 2>/dev/null
read -r forked </tmp/.forked
echo "forked=$forked"
"""
"""The fork count is kept in a file and read back with the shell's builtins: once the sleeps hold every pid the
limit allows, no further program can start (a `tail` in a pipe beside the loop could be refused its own)."""


@dataclass(frozen=True, slots=True)
class Check:
    """One line of the report."""

    name: str
    ok: bool
    detail: str
    fix: str = ""
    required: bool = True


@dataclass(slots=True)
class DoctorReport:
    """All checks; healthy when every required one passed."""

    checks: list[Check] = field(default_factory=list)

    @property
    def healthy(self) -> bool:
        """True when no required check failed."""
        return all(check.ok or not check.required for check in self.checks)

    def to_json(self) -> str:
        """The report for machines."""
        return json.dumps({"healthy": self.healthy, "checks": [asdict(c) for c in self.checks]}, indent=2)

    def to_text(self) -> str:
        """The report for people."""
        lines = []
        for check in self.checks:
            mark = "ok  " if check.ok else ("FAIL" if check.required else "warn")
            lines.append(f"[{mark}] {check.name}: {check.detail}")
            if not check.ok and check.fix:
                lines.append(f"       -> {check.fix}")
        lines.append("healthy" if self.healthy else "NOT healthy: fix the lines marked FAIL")
        return "\n".join(lines)


def _parse_probe(stdout: str) -> dict[str, str]:
    facts = {}
    for line in stdout.splitlines():
        key, sep, value = line.partition("=")
        if sep:
            facts[key.strip()] = value.strip()
    return facts


def _probe_checks(facts: dict[str, str], oom_killed: bool) -> list[Check]:
    fix = "the engine is not applying the hardened settings; check its version and the kernel's cgroups"
    expected_memory = str(PROBE_MEMORY_MB * 1024 * 1024)
    forked = int(facts.get("forked", "0") or 0)
    return [
        Check("probe: non-root user", facts.get("uid") not in (None, "0"), f"uid {facts.get('uid')}", fix),
        Check(
            "probe: no capabilities", facts.get("CapEff") == "0000000000000000", f"CapEff {facts.get('CapEff')}", fix
        ),
        Check("probe: no-new-privileges", facts.get("NoNewPrivs") == "1", f"NoNewPrivs {facts.get('NoNewPrivs')}", fix),
        Check("probe: seccomp filter", facts.get("Seccomp") == "2", f"Seccomp mode {facts.get('Seccomp')}", fix),
        Check("probe: network none", facts.get("net") == "lo,", f"interfaces {facts.get('net')}", fix),
        Check(
            "probe: read-only root", facts.get("rootfs") == "readonly", f"root filesystem {facts.get('rootfs')}", fix
        ),
        Check(
            "probe: memory limit enforced",
            facts.get("memory_limit") == expected_memory and facts.get("memory_hog_exit") == "137" and oom_killed,
            f"cgroup limit {facts.get('memory_limit')} bytes (asked {expected_memory}); "
            f"a 200 MB hog exited {facts.get('memory_hog_exit')}, oom_killed={oom_killed}",
            fix,
        ),
        Check(
            "probe: pids limit enforced",
            facts.get("pids_limit") == str(PROBE_PIDS) and 0 < forked < PROBE_PIDS,
            f"cgroup pids.max {facts.get('pids_limit')} (asked {PROBE_PIDS}); 100 forks stopped after {forked}",
            fix,
        ),
    ]


def _probe_fix(error: str) -> str:
    """What to do when the probe container could not run, from what the engine said."""
    if "catatonit" in error:
        return (
            "install catatonit (Debian: apt-get install catatonit): Podman runs it as the init every sandbox asks for"
        )
    if "setting rlimit" in error:
        return "the engine gives containers resource limits this host cannot grant; see docs/sandbox.md, On Podman"
    return "see the engine's log"


@dataclass(frozen=True, slots=True)
class WarmPlan:
    """What a policy's python-data pools preload, how many containers they keep, and their memory budget."""

    preload: tuple[str, ...] = ()
    least: int = 0
    """Containers of preloading pools kept waiting when no call comes."""
    most: int = 0
    """What those pools grow to under demand."""
    budget_mb: int = 0

    @classmethod
    def of(cls, policy: Policy, tool_names: Iterable[str]) -> WarmPlan:
        """The plan of a policy's enabled tools (tools with equal container settings share one pool)."""
        pools: dict[tuple[object, ...], tuple[int, int]] = {}
        for name in tool_names:
            tool = policy.for_tool(name)
            if tool.enabled and tool.preload:
                most = tool.pool_most
                pools[tool.container_spec().container_key()] = (tool.pool_size, most)
        return cls(
            policy.for_tool("run_python").preload,
            sum(least for least, _ in pools.values()),
            sum(most for _, most in pools.values()),
            policy.host.pool_memory_mb,
        )


COLD = "cold: no warm interpreter"
"""What the warm interpreter check's cell says in a sandbox that has none: one forked while its warm template
still imports (each sandbox of an image is forked from that template once it is ready)."""


async def _warm_answer(runtime: DockerRuntime, spec: SandboxSpec) -> tuple[ExecutionResult, int]:
    """The check's cell run in a waiting sandbox once its imports are done (what it holds stops growing), and what
    it held then; a sandbox made while its warm template imported is made again (within 30 s)."""
    result, held = None, 0
    with anyio.move_on_after(30):
        while True:
            warm = await anyio.to_thread.run_sync(runtime.prepare, spec)
            held, previous = 0, -1
            with anyio.move_on_after(20):  # until its imports are done: what it holds stops growing
                while held != previous or held == 0:
                    previous, held = held, runtime.memory(warm)
                    await anyio.sleep(0.5)
            result = await runtime.run(spec, warm=warm)
            if result.stdout.strip() != COLD.encode():
                return result, held
            await anyio.sleep(0.5)
    if result is None:
        raise EngineError("no python-data sandbox answered within 30 s")
    return result, held


async def warm_interpreter_check(runtime: DockerRuntime, plan: WarmPlan) -> Check:
    """Whether a warm python-data container imports the plan's modules before its call, what it then holds,
    and what the policy's pools of such containers hold."""
    preload = plan.preload
    if not preload:
        return Check("warm interpreter", True, "the policy preloads nothing: python-data calls start cold", "", False)
    spec = SandboxSpec(
        image=image_reference("python-data"),
        argv=("python3", wire.RUN_CELL),
        stdin=f"import os\nprint(open({wire.WARM_ERRORS!r}).read() if os.path.exists({wire.WARM_ERRORS!r}) else {COLD!r})".encode(),
        env=((wire.PRELOAD_ENV, " ".join(preload)),),
        limits=ResourceLimits(timeout_s=60, memory_mb=1024),
    )
    try:
        result, held = await _warm_answer(runtime, spec)
    except SandboxServerError as exc:
        return Check("warm interpreter", False, str(exc), "see the engine's log", False)
    said = result.stdout.decode(errors="replace")
    problems = [line for line in said.splitlines() if line.startswith("preload ")]
    ok = "preloaded in" in said and not problems
    detail = "; ".join(problems) if problems else (said.strip().splitlines() or ["no answer"])[-1]
    one = held / 2**20
    pools = (
        f"; the policy's pools keep {plan.least} of them ({plan.least * one:.0f} MiB) and grow to {plan.most} "
        f"({plan.most * one:.0f} MiB) within host.pool_memory_mb {plan.budget_mb} MiB"
        if plan.least or plan.most
        else " (host.pool_memory_mb counts it)"
    )
    return Check(
        "warm interpreter",
        ok,
        f"{detail}; a warm python-data container holds {one:.0f} MiB{pools}",
        "install the missing modules in the image, or drop them from the tool's `preload`",
        False,
    )


async def run_doctor(runtime: DockerRuntime, plan: WarmPlan | None = None) -> DoctorReport:
    """Run every check against the engine the runtime is connected to."""
    report = DoctorReport()
    try:
        info = runtime.info()
    except SandboxServerError as exc:
        report.checks.append(
            Check(
                "engine", False, str(exc), "run `sandbox-server setup` (as root on Debian), or start dockerd yourself"
            )
        )
        return report
    report.checks.extend(_engine_checks(info))
    images_current = True
    for check in _image_checks(runtime):
        images_current &= check.ok
        report.checks.append(check)
    named = ", ".join(f"{library} {version}" for library, version in libraries("python-data"))
    report.checks.append(Check("python-data libraries", bool(named), named or "its wheels.lock names none", "", False))
    if not images_current and runtime.image(image_reference("base")) is None:
        return report
    spec = SandboxSpec(
        image=image_reference("base"),
        argv=("/bin/sh", "-c", PROBE_SCRIPT),
        limits=ResourceLimits(timeout_s=20, memory_mb=PROBE_MEMORY_MB, pids=PROBE_PIDS),
    )
    try:
        result = await runtime.run(spec)
    except SandboxServerError as exc:
        report.checks.append(Check("probe container", False, str(exc), _probe_fix(str(exc))))
        return report
    report.checks.append(
        Check(
            "probe container",
            not result.timed_out and not result.killed,
            f"ran in {result.duration_ms} ms" + (", timed out" if result.timed_out else ""),
            "see the engine's log",
        )
    )
    report.checks.extend(_probe_checks(_parse_probe(result.stdout.decode(errors="replace")), result.oom_killed))
    if "runsc" in info.runtimes:
        report.checks.append(await _gvisor_check(runtime))
    report.checks.append(await warm_interpreter_check(runtime, plan or WarmPlan()))
    report.checks.append(await runc_sandboxes_check())
    return report


def _engine_checks(info: EngineInfo) -> list[Check]:
    """The engine that answered, how it differs from Docker, and the runtimes it has."""
    checks = []
    dialect = info.dialect
    checks.append(
        Check("engine", True, f"{dialect.name} {info.server_version} (API {info.api_version}), {info.operating_system}")
    )
    if dialect.podman:
        checks.append(
            Check(
                "engine differences",
                False,
                "; ".join(dialect.differences()),
                "use Docker where these caps matter (docs/sandbox.md, On Podman, says what else differs)",
                required=False,
            )
        )
    checks.append(
        Check("runtime runc", "runc" in info.runtimes, f"runtimes: {', '.join(info.runtimes)}", "install runc")
    )
    checks.append(
        Check(
            "runtime runsc (gVisor)",
            "runsc" in info.runtimes,
            "available"
            if "runsc" in info.runtimes
            else ("cannot be chosen through this engine" if not dialect.chooses_runtime else "not registered"),
            "install runsc and register it in /etc/docker/daemon.json (`sandbox-server setup` does both when it starts the engine)"
            if dialect.chooses_runtime
            else "run policies that need gVisor on Docker",
            required=False,
        )
    )
    return checks


def _image_checks(runtime: DockerRuntime) -> list[Check]:
    """Whether each shipped image is built and current."""
    checks = []
    for definition in catalog().values():
        status = image_status(runtime, definition)
        checks.append(
            Check(
                f"image {status.reference}",
                status.built and status.current,
                image_state(status.built, status.current),
                f"run `sandbox-server images build {definition.name}`",
            )
        )
    return checks


def image_state(built: bool, current: bool) -> str:
    """An image as a check says it: built and current, stale, or not built."""
    return "built and current" if built and current else ("stale: its build context changed" if built else "not built")


async def _gvisor_check(runtime: DockerRuntime) -> Check:
    """Whether a sandbox runs under gVisor here."""
    gvisor = SandboxSpec(image=image_reference("base"), argv=("/bin/true",), runtime="runsc")
    try:
        outcome = await runtime.run(gvisor)
        ok, detail = outcome.exit_code == 0, f"`true` under gVisor exited {outcome.exit_code}"
    except SandboxServerError as exc:
        ok, detail = False, str(exc)
    return Check("probe under runsc", ok, detail, "check runsc's registration in /etc/docker/daemon.json", False)


async def runc_sandboxes_check() -> Check:
    """Whether runc itself can make calls' sandboxes here (serve --sandboxes auto or runc), and fork them from a
    template (auto), shown by making one."""
    from sandbox_server.sandbox.runc.runtime import RuncRuntime

    runc = RuncRuntime(None, "auto")
    try:
        why_not = runc.runc_refused()
        if why_not is not None:
            return Check(
                "sandboxes by runc", False, f"the engine makes every sandbox: {why_not}",
                "serve as root on the engine's host with runc installed (docs/sandbox.md)", required=False,
            )  # fmt: skip
        image = image_reference("shell" if runc.templates else "base")  # (base has no python3 for a template)
        outcome = await runc.run(SandboxSpec(image=image, argv=("/bin/true",)))
        shared = runc.own_ids_refused()
        gvisor = SandboxSpec(image=image_reference("base"), argv=("/bin/true",), runtime="runsc")
        under_gvisor = await runc.run(gvisor) if runc.takes(gvisor) else None
    except SandboxServerError as exc:
        return Check("sandboxes by runc", False, str(exc), "see the runc log the message names", required=False)
    finally:
        runc.close()
    said = (
        "gVisor's are the engine's (no runsc here)" if under_gvisor is None else
        f"`true` in a gVisor sandbox runsc made exited {under_gvisor.exit_code} in {under_gvisor.duration_ms} ms"
    )  # fmt: skip
    return Check(
        "sandboxes by runc",
        outcome.exit_code == 0 and (under_gvisor is None or under_gvisor.exit_code == 0),
        f"`true` in a sandbox {'forked from its image template' if runc.templates else 'runc made'} exited "
        f"{outcome.exit_code} in {outcome.duration_ms} ms, "
        + ("as host ids of its own; " if shared is None else f"as the sandbox user's host ids ({shared}); ")
        + f"{said} "
        "(serve --sandboxes auto makes every call's sandbox so, runc has runc start each, and gVisor's)",
        "see the runc log the message names",
        required=False,
    )
