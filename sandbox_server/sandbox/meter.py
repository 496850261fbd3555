"""What a call's sandbox used, read by the host from the container's own cgroup: CPU time and peak memory.

Read from the host, never from the sandbox: the launcher's trailer is the program's to forge, the kernel's
counters are not. A warm container was made before its call (a warm interpreter imports its libraries then), so
the CPU time is counted from the call's start, and the peak memory (cgroup v1, which may reset it) too; under
cgroup v2 the peak is the container's whole life's. Read before the container is removed, while its launcher
waits stopped. None where the host cannot read them: gVisor's processes, an engine on another host.
"""

from __future__ import annotations

import contextlib
import functools
import os
from dataclasses import dataclass
from pathlib import Path

__all__ = ["Meter", "Usage", "memory_events"]

CGROUP_ROOT = Path("/sys/fs/cgroup")


@dataclass(frozen=True, slots=True)
class Usage:
    cpu_s: float | None = None
    peak_memory_bytes: int | None = None
    memory_limit_hits: int = 0
    """How often an allocation met the memory limit (the kernel then reclaims, and a program near it crawls)."""
    oom_kills: int = 0
    """How many processes the kernel killed for memory."""


class Meter:
    """One call's counters of one container, from its start."""

    def __init__(self, cpu: Path | None, peak: Path | None) -> None:
        self.cpu, self.peak = cpu, peak
        self.cpu_start = _cpu_ns(cpu) if cpu is not None else None
        if peak is not None and peak.name == "memory.max_usage_in_bytes":
            with contextlib.suppress(OSError):
                _write(peak, b"0")  # v1: the peak from now on (the warm-up's is not the call's)
        self.memory_start = memory_events(peak.parent) if peak is not None else (0, 0)

    @classmethod
    def start(cls, pid: int) -> Meter:
        """Count from now for the container whose init has this host pid (0: a meter that reads nothing)."""
        paths = _cgroups(pid) if pid > 0 else {}
        cpu = peak = None
        if "cpuacct" in paths:  # v1 (a hybrid host's controllers are v1 too)
            root = _cpuacct_root()
            cpu = root / paths["cpuacct"].lstrip("/") / "cpuacct.usage" if root is not None else None
        elif "" in paths:
            cpu = CGROUP_ROOT / paths[""].lstrip("/") / "cpu.stat"
        if "memory" in paths:
            peak = CGROUP_ROOT / "memory" / paths["memory"].lstrip("/") / "memory.max_usage_in_bytes"
        elif "" in paths:
            peak = CGROUP_ROOT / paths[""].lstrip("/") / "memory.peak"
        return cls(cpu, peak)

    def read(self) -> Usage:
        """The CPU time since the start and the peak memory (None for what cannot be read)."""
        cpu_s = None
        if self.cpu is not None and self.cpu_start is not None:
            now = _cpu_ns(self.cpu)
            cpu_s = round((now - self.cpu_start) / 1e9, 6) if now is not None else None
        peak, hits, kills = None, 0, 0
        if self.peak is not None:
            with contextlib.suppress(OSError, ValueError):
                peak = int(_read(self.peak).split()[0])
            now_hits, now_kills = memory_events(self.peak.parent)
            hits, kills = now_hits - self.memory_start[0], now_kills - self.memory_start[1]
        return Usage(cpu_s, peak, hits, kills)


def memory_events(folder: Path) -> tuple[int, int]:
    """A memory cgroup's count of allocations that met its limit and of processes killed for memory (v1's
    failcnt and oom_control, v2's memory.events); zeros where they cannot be read."""
    hits = kills = 0
    with contextlib.suppress(OSError, ValueError):
        if _memory_v1():
            hits = int(_read(folder / "memory.failcnt"))
            lines = _read(folder / "memory.oom_control").splitlines()
        else:
            lines = _read(folder / "memory.events").splitlines()
        for line in lines:
            key, _, value = line.partition(b" ")
            if key == b"max":  # v2's failcnt
                hits = int(value)
            elif key == b"oom_kill":
                kills = int(value)
    return hits, kills


def _cgroups(pid: int) -> dict[str, str]:
    """The process's cgroup path per controller ("" for the v2 hierarchy)."""
    found: dict[str, str] = {}
    try:
        lines = _read(Path(f"/proc/{pid}/cgroup")).decode().splitlines()
    except OSError:
        return found
    for line in lines:
        _, controllers, path = line.split(":", 2)
        for controller in controllers.split(",") if controllers else [""]:
            found[controller] = path
    return found


@functools.cache
def _cpuacct_root() -> Path | None:
    """Where v1's cpuacct hierarchy is mounted on this host (alone, or with cpu), found once."""
    return next((CGROUP_ROOT / name for name in ("cpuacct", "cpu,cpuacct") if (CGROUP_ROOT / name).is_dir()), None)


@functools.cache
def _memory_v1() -> bool:
    """Whether this host's memory controller is v1's (its counters in failcnt and oom_control), found once."""
    return (CGROUP_ROOT / "memory" / "memory.failcnt").exists()


def _read(path: Path) -> bytes:
    """A small file's bytes, in two system calls past the open (a cgroup's or /proc's file; no buffered reader)."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        return os.read(fd, 65536)
    finally:
        os.close(fd)


def _write(path: Path, data: bytes) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CLOEXEC)
    try:
        os.write(fd, data)
    finally:
        os.close(fd)


def _cpu_ns(path: Path) -> int | None:
    try:
        text = _read(path)
    except OSError:
        return None
    if path.name == "cpu.stat":  # v2: usage_usec
        for line in text.splitlines():
            name, _, value = line.partition(b" ")
            if name == b"usage_usec":
                return int(value) * 1000
        return None
    return int(text.strip())
