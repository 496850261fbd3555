"""`sandbox-server doctor --posture`: what the kernel really applied to a sandbox, against its policy.

For each distinct container of a policy's enabled tools, a sandbox is started exactly as
a call would get it (a warm container: init and the launcher waiting for its request)
and read from the host, never from inside: `/proc/<pid>/status` of every process of the
container (user, capabilities, no-new-privileges, seccomp), `/proc/<pid>/limits` (open
files, file size), its cgroup's memory, swap, pids and CPU limits, the interfaces of its
network namespace, and its mount table (read-only root, tmpfs sizes, the policy's
mounts). Each difference from the policy is a failed check naming the policy field.

Under runsc the process the host sees is gVisor's sandbox kernel, not the program: its
cgroup, network and no-new-privileges/seccomp are checked; the program's own user,
capabilities and mounts live inside gVisor and are read by the in-sandbox probe and the
security battery instead.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import anyio.to_thread

from sandbox_server.errors import SandboxServerError
from sandbox_server.ops.doctor import Check
from sandbox_server.ops.egress_posture import behind, probe, trial
from sandbox_server.policy import Policy, ToolPolicy
from sandbox_server.sandbox import wire
from sandbox_server.sandbox.engine.host_config import RUNSC_PIDS_BASE, RUNSC_PIDS_FACTOR
from sandbox_server.sandbox.engine.runtime import DockerRuntime
from sandbox_server.sandbox.spec import SandboxSpec

__all__ = ["ProcessView", "SandboxView", "compare", "read_view", "run_posture"]

MiB = 1024 * 1024
CGROUP_ROOT = Path("/sys/fs/cgroup")
PROC = Path("/proc")


@dataclass(frozen=True, slots=True)
class ProcessView:
    """What the kernel says of one process of the sandbox."""

    pid: int
    uid: int
    gid: int
    cap_eff: int
    cap_prm: int
    no_new_privs: int
    seccomp: int
    nofile: int | None
    fsize: int | None
    """Max file size in bytes; None when unlimited."""


@dataclass(frozen=True, slots=True)
class MountView:
    target: str
    options: frozenset[str]
    fstype: str
    super_options: frozenset[str]


@dataclass(frozen=True, slots=True)
class SandboxView:
    """Everything read from the host about one running sandbox."""

    processes: tuple[ProcessView, ...]
    memory_bytes: int | None
    memory_swap_bytes: int | None
    """Memory plus swap (cgroup v1 memsw) or swap alone (v2, normalised to memory + swap)."""
    pids_max: int | None
    cpus: float | None
    interfaces: tuple[str, ...]
    mounts: tuple[MountView, ...]


def _status(pid: int) -> dict[str, str]:
    fields = {}
    for line in (PROC / str(pid) / "status").read_text().splitlines():
        name, _, value = line.partition(":")
        fields[name] = value.strip()
    return fields


def _limit(pid: int, title: str) -> int | None:
    for line in (PROC / str(pid) / "limits").read_text().splitlines():
        if line.startswith(title):
            soft = line[len(title) :].split()[0]
            return None if soft == "unlimited" else int(soft)
    return None


def _inside(pid: int, kind: str, host_id: int) -> int:
    """A host id as the sandbox of process `pid` sees it: through its user namespace's map (a sandbox with host ids
    of its own, sandbox.host_ids), else itself."""
    for line in (PROC / str(pid) / kind).read_text().splitlines():
        inside, start, count = (int(word) for word in line.split())
        if start <= host_id < start + count:
            return inside + host_id - start
    return host_id


def _process(pid: int) -> ProcessView:
    status = _status(pid)
    return ProcessView(
        pid=pid,
        uid=_inside(pid, "uid_map", int(status["Uid"].split()[1])),
        gid=_inside(pid, "gid_map", int(status["Gid"].split()[1])),
        cap_eff=int(status["CapEff"], 16),
        cap_prm=int(status["CapPrm"], 16),
        no_new_privs=int(status.get("NoNewPrivs", "0")),
        seccomp=int(status.get("Seccomp", "0")),
        nofile=_limit(pid, "Max open files"),
        fsize=_limit(pid, "Max file size"),
    )


def _cgroup_paths(pid: int) -> dict[str, str]:
    """Controller -> path of the process's cgroup ("" for the unified hierarchy)."""
    paths = {}
    for line in (PROC / str(pid) / "cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        for controller in controllers.split(",") if controllers else [""]:
            paths[controller] = path
    return paths


def _read_int(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    return None if text == "max" else int(text)


def _cgroup_limits(pid: int) -> tuple[int | None, int | None, int | None, float | None]:
    paths = _cgroup_paths(pid)
    if "memory" in paths:  # cgroup v1: one hierarchy per controller
        memory = CGROUP_ROOT / "memory" / paths["memory"].lstrip("/")
        memory_bytes = _read_int(memory / "memory.limit_in_bytes")
        swap = _read_int(memory / "memory.memsw.limit_in_bytes")
        pids_max = _read_int(CGROUP_ROOT / "pids" / paths["pids"].lstrip("/") / "pids.max")
        cpu = CGROUP_ROOT / "cpu" / paths["cpu"].lstrip("/")
        quota, period = _read_int(cpu / "cpu.cfs_quota_us"), _read_int(cpu / "cpu.cfs_period_us")
        cpus = quota / period if quota and quota > 0 and period else None
        return memory_bytes, swap, pids_max, cpus
    group = CGROUP_ROOT / paths[""].lstrip("/")
    memory_bytes = _read_int(group / "memory.max")
    swap_only = _read_int(group / "memory.swap.max")
    swap = memory_bytes + swap_only if memory_bytes is not None and swap_only is not None else None
    cpus = None
    try:
        quota_text, period_text = (group / "cpu.max").read_text().split()
        cpus = int(quota_text) / int(period_text) if quota_text != "max" else None
    except OSError:
        pass
    return memory_bytes, swap, _read_int(group / "pids.max"), cpus


def _mounts(pid: int) -> tuple[MountView, ...]:
    mounts = []
    for line in (PROC / str(pid) / "mountinfo").read_text().splitlines():
        before, _, after = line.partition(" - ")
        fields, tail = before.split(), after.split()
        mounts.append(
            MountView(
                target=fields[4].replace("\\040", " "),
                options=frozenset(fields[5].split(",")),
                fstype=tail[0],
                super_options=frozenset(tail[2].split(",")) if len(tail) > 2 else frozenset(),
            )
        )
    return tuple(mounts)


def _interfaces(pid: int) -> tuple[str, ...]:
    lines = (PROC / str(pid) / "net" / "dev").read_text().splitlines()[2:]
    return tuple(sorted(line.split(":", 1)[0].strip() for line in lines))


def _living(pids: list[int]) -> Iterator[ProcessView]:
    """The processes that still exist when read: a short-lived one (the launcher's `mkfifo` while a warm
    interpreter starts) may end between the listing and the reading, and then has nothing left to check."""
    for index, pid in enumerate(pids):
        try:
            yield _process(pid)
        except (FileNotFoundError, ProcessLookupError):  # (its user namespace's map: "No such process")
            if index == 0:
                raise  # the container's init: the sandbox itself is gone


def read_view(pids: list[int]) -> SandboxView:
    """Read one sandbox from the host's /proc and cgroup files, given its processes' host pids."""
    first = pids[0]
    memory, swap, pids_max, cpus = _cgroup_limits(first)
    return SandboxView(
        processes=tuple(_living(pids)),
        memory_bytes=memory,
        memory_swap_bytes=swap,
        pids_max=pids_max,
        cpus=cpus,
        interfaces=_interfaces(first),
        mounts=_mounts(first),
    )


def _size_kib(mount: MountView) -> int | None:
    for option in mount.super_options:
        if option.startswith("size="):
            value = option[len("size=") :]
            units = {"k": 1, "m": 1024, "g": 1024 * 1024}
            return int(value[:-1]) * units[value[-1].lower()] if value[-1].isalpha() else int(value) // 1024
    return None


def compare(view: SandboxView, tool: ToolPolicy, label: str) -> list[Check]:
    """One check per policy field the kernel must have applied; a difference names the field."""
    checks: list[Check] = []
    fix = "the engine did not apply the policy: check the engine's version, its daemon.json and the kernel"

    def check(field: str, ok: bool, applied: str, wanted: str) -> None:
        detail = f"{applied}" if ok else f"policy field {field} wants {wanted}; the kernel applied {applied}"
        checks.append(Check(f"posture {label}: {field}", ok, detail, fix))

    limits = tool.limits
    gvisor = tool.runtime == "runsc"
    uid, _, gid = tool.user.partition(":")
    every = view.processes
    if not gvisor:
        users = sorted({(p.uid, p.gid) for p in every})
        check("user", users == [(int(uid), int(gid or uid))], f"uid:gid {users}", tool.user)
        caps = sorted({f"{p.cap_eff:016x}/{p.cap_prm:016x}" for p in every})
        check("capabilities (all dropped)", all(p.cap_eff == p.cap_prm == 0 for p in every),
              f"CapEff/CapPrm {caps}", "0 (no capability)")  # fmt: skip
    else:
        check("user", all(p.uid != 0 for p in every), f"gVisor's sandbox process runs as uid {every[0].uid}",
              "not root on the host")  # fmt: skip
    check("no-new-privileges", all(p.no_new_privs == 1 for p in every),
          f"NoNewPrivs {sorted({p.no_new_privs for p in every})}", "1")  # fmt: skip
    check("seccomp_profile", all(p.seccomp == 2 for p in every), f"Seccomp mode {sorted({p.seccomp for p in every})}",
          "2 (a filter)")  # fmt: skip
    memory = limits.memory_mb * MiB
    check("limits.memory_mb", view.memory_bytes == memory, f"{view.memory_bytes} bytes", f"{memory} bytes")
    if view.memory_swap_bytes is not None:
        check("limits.memory_mb (no swap)", view.memory_swap_bytes == memory,
              f"memory+swap {view.memory_swap_bytes} bytes", f"{memory} bytes")  # fmt: skip
    pids = limits.pids * RUNSC_PIDS_FACTOR + RUNSC_PIDS_BASE if gvisor else limits.pids
    check("limits.pids", view.pids_max == pids, f"pids.max {view.pids_max}", str(pids))
    check("limits.cpus", view.cpus is not None and abs(view.cpus - limits.cpus) < 0.01, f"{view.cpus} CPUs",
          f"{limits.cpus:g} CPUs")  # fmt: skip
    if tool.egress is None:
        check("network", view.interfaces == ("lo",), f"interfaces {list(view.interfaces)}", "only lo")
    else:
        check("network", len(view.interfaces) == 2 and "lo" in view.interfaces, f"interfaces {list(view.interfaces)}",
              "lo and the allow list's internal network alone")  # fmt: skip
    if gvisor:
        return checks
    check("limits.nofile", all(p.nofile == limits.nofile for p in every),
          f"open files {sorted({p.nofile for p in every}, key=str)}", str(limits.nofile))  # fmt: skip
    fsize = limits.file_size_mb * MiB
    check("limits.file_size_mb", all(p.fsize == fsize for p in every),
          f"file size {sorted({p.fsize for p in every}, key=str)} bytes", f"{fsize} bytes")  # fmt: skip
    mounts = {mount.target: mount for mount in view.mounts}
    root = mounts.get("/")
    check("read-only root", root is not None and "ro" in root.options,
          f"/ mounted {sorted(root.options) if root else 'nowhere'}", "ro")  # fmt: skip
    for target, field, size_mb in (("/tmp", "limits.tmp_mb", limits.tmp_mb),
                                   ("/workspace", "limits.workspace_mb", limits.workspace_mb),
                                   ("/dev/shm", "limits.shm_mb", limits.shm_mb)):  # fmt: skip
        mount = mounts.get(target)
        size = _size_kib(mount) if mount else None
        ok = mount is not None and mount.fstype == "tmpfs" and size == size_mb * 1024 and "nosuid" in mount.options
        applied = f"{target}: {mount.fstype}, size {size} KiB, {sorted(mount.options)}" if mount else f"{target} absent"
        check(field, ok, applied, f"tmpfs of {size_mb * 1024} KiB, nosuid")
    for target, field, executable in (("/workspace", "workspace.exec", limits.workspace_exec),
                                      ("/tmp", "/tmp noexec", False)):  # fmt: skip
        mount = mounts.get(target)
        if mount is not None:
            applied = "noexec" if "noexec" in mount.options else "exec"
            check(field, applied == ("exec" if executable else "noexec"), f"{target} {applied}",
                  f"{target} {'exec' if executable else 'noexec'}")  # fmt: skip
    for index, wanted in enumerate(tool.mounts):
        mount = mounts.get(wanted.sandbox_path)
        mode = "ro" if wanted.read_only else "rw"
        ok = mount is not None and mode in mount.options
        applied = f"{wanted.sandbox_path} {sorted(mount.options)}" if mount else f"{wanted.sandbox_path} not mounted"
        check(f"mounts[{index}].mode", ok, applied, f"{wanted.sandbox_path} mounted {mode}")
    return checks


def _targets(policy: Policy, tool_names: list[str]) -> dict[tuple[object, ...], tuple[str, ToolPolicy, SandboxSpec]]:
    found: dict[tuple[object, ...], tuple[str, ToolPolicy, SandboxSpec]] = {}
    for name in tool_names:
        tool = policy.for_tool(name)
        if tool.enabled:
            spec = tool.container_spec()
            key = (spec.container_key(), tool.egress.key() if tool.egress is not None else None)
            label = found[key][0] + "+" + name if key in found else name
            found[key] = (label, tool, spec)
    return found


async def run_posture(
    runtime: DockerRuntime, policy: Policy, tool_names: list[str], read: Callable[[list[int]], SandboxView] = read_view
) -> list[Check]:
    """Start each distinct sandbox of the policy's enabled tools and compare what the host sees with the policy."""
    if not PROC.joinpath(str(os.getpid())).exists():
        return [Check("posture", False, "no /proc on this host", "run the posture check on the engine's host")]
    checks = []
    for label, tool, spec in _targets(policy, tool_names).values():
        if tool.egress is None:
            checks.extend(await _posture(runtime, f"{policy.name}/{label}", tool, spec, read))
            continue
        async with trial(runtime, label, tool.egress, policy.name) as found:
            checks.extend(found.checks)
            if found.endpoint is not None:
                checks.extend(
                    await _posture(runtime, f"{policy.name}/{label}", tool, behind(spec, found.endpoint), read)
                )
                checks.extend(await probe(runtime, tool, found, policy.name))
    return checks


LAUNCHED_WITHIN_S = 10.0
"""How long the posture check waits for a sandbox's launcher to run before reading it as it is."""


async def _launched(runtime: DockerRuntime, container_id: str) -> list[int]:
    """The sandbox's processes once its launcher runs: the shell before it may still be setting the sandbox's
    limits on itself (a sandbox with host ids of its own), and read then they would look unapplied."""
    with anyio.move_on_after(LAUNCHED_WITHIN_S):
        while not any(map(_runs_launcher, await anyio.to_thread.run_sync(runtime.host_pids, container_id))):
            await anyio.sleep(0.02)
    return await anyio.to_thread.run_sync(runtime.host_pids, container_id)


def _runs_launcher(pid: int) -> bool:
    try:
        argv = (PROC / str(pid) / "cmdline").read_bytes().split(b"\0")
    except OSError:
        return False
    return len(argv) > 1 and argv[1] == wire.LAUNCHER.encode()


async def _posture(
    runtime: DockerRuntime, name: str, tool: ToolPolicy, spec: SandboxSpec, read: Callable[[list[int]], SandboxView]
) -> list[Check]:
    """One sandbox started as a call would get it, read from the host and held against the tool's policy."""
    try:
        warm = await anyio.to_thread.run_sync(runtime.prepare, spec)
    except SandboxServerError as exc:
        return [Check(f"posture {name}", False, str(exc), "see `sandbox-server doctor`")]
    try:
        if tool.runtime == "runsc":  # (the host sees gVisor's sentry, never the sandbox's own processes)
            pids = await anyio.to_thread.run_sync(runtime.host_pids, warm.container_id)
        else:
            pids = await _launched(runtime, warm.container_id)
        view = await anyio.to_thread.run_sync(read, pids)
    except (OSError, SandboxServerError, ValueError, KeyError) as exc:
        return [Check(f"posture {name}", False, f"cannot read the sandbox from the host: {exc}",
                      "the posture check reads /proc of the engine's host: run it there, as root")]  # fmt: skip
    finally:
        await anyio.to_thread.run_sync(runtime.discard, warm)
    return compare(view, tool, name)
