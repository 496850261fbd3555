"""A template sandbox's cgroups, made by the host as runc makes a sandbox's (cgroup v1, one folder per
hierarchy, at `<hierarchy>/sandbox-server/<name>`, where the meters read them), with the config's limits; the
child joins them through their `cgroup.procs`, handed over open."""

from __future__ import annotations

import contextlib
import functools
import os
import signal
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

__all__ = [
    "FAVOR_MOVES",
    "HIERARCHIES",
    "charged",
    "favor_moves",
    "kill_and_remove",
    "made",
    "moves_here",
    "moves_mount",
    "usable",
]

ROOT = Path("/sys/fs/cgroup")
HIERARCHIES = ("memory", "cpu", "cpuacct", "pids", "devices", "freezer", "blkio")
"""The v1 hierarchies a sandbox has a cgroup in (cpuset stays the host's: a sandbox's CPU time is its quota)."""
DEVICES = ("c 1:3 rwm", "c 1:5 rwm", "c 1:7 rwm", "c 1:8 rwm", "c 1:9 rwm", "c 5:0 rwm", "c 5:2 rwm", "c 136:* rwm")
"""The devices a sandbox may use (null, zero, full, random, urandom, tty, ptmx, its terminals), as runc allows."""
GONE_WITHIN_S = 5.0


def usable() -> str | None:
    """Why a template sandbox's cgroups cannot be made here (None: they can): cgroup v1's hierarchies."""
    missing = [h for h in HIERARCHIES if not (ROOT / h / "cgroup.procs").exists()]
    return f"cgroup v1's {', '.join(missing)} hierarchies are not mounted at {ROOT}" if missing else None


FAVOR_MOVES = "favordynmods"
"""The cgroup2 mount option (Linux 6.0) that keeps a process's move into a cgroup from waiting for the kernel's RCU
grace period. Each sandbox's child moves itself into its call's cgroups: without it, the first move after a pause
waited 6 to 15 ms on our 2-core hosts (a call's sandbox made on its path waits that long), with it under 1 ms. The
kernel's price is on every fork and exit (its reading side takes a plain lock, not a per-CPU count)."""


def moves_mount(mountinfo: str) -> tuple[str, bool] | None:
    """Where the cgroup2 hierarchy is mounted (the unified one beside v1's), and whether FAVOR_MOVES is set there,
    from /proc/self/mountinfo's text (None: no cgroup2 hierarchy is mounted). The option holds for every hierarchy:
    the lock a move takes is one for the whole kernel."""
    for line in mountinfo.splitlines():
        mount, _, filesystem = line.partition(" - ")
        fields, at = filesystem.split(), mount.split()
        if len(fields) >= 3 and len(at) >= 5 and fields[0] == "cgroup2":
            return at[4], FAVOR_MOVES in fields[2].split(",")
    return None


def moves_here() -> tuple[str, bool] | None:
    """moves_mount of this host's mount table."""
    with open("/proc/self/mountinfo", encoding="utf-8") as listed:
        return moves_mount(listed.read())


def favor_moves() -> str | None:
    """FAVOR_MOVES set on the cgroup2 hierarchy (a remount that keeps its other options: util-linux's mount merges
    them), where we are root and it is not set yet: what was done, or why not (None: nothing to do)."""
    import subprocess

    found = moves_here()
    if found is None or found[1] or os.geteuid() != 0:
        return None
    target = found[0]
    try:
        subprocess.run(["mount", "-o", f"remount,{FAVOR_MOVES}", target], check=True, capture_output=True, timeout=30)
    except subprocess.CalledProcessError as exc:
        why = exc.stderr.decode(errors="replace").strip() or f"exit code {exc.returncode}"
    except (OSError, subprocess.SubprocessError) as exc:
        why = str(exc)
    else:
        why = ""
    if why:
        return (f"could not remount {target} {FAVOR_MOVES} ({why}; Linux 6.0 has it): each sandbox made on a call's "
                "path waits for the kernel as it joins its cgroups")  # fmt: skip
    return f"remounted {target} {FAVOR_MOVES}: a sandbox joins its cgroups without waiting for the kernel"


def _folders(path: str) -> dict[str, str]:
    """Each hierarchy's folder of the cgroup at `path` (strings: a sandbox's cgroups are made and removed per call,
    where pathlib's joins cost more than the system calls)."""
    return {h: f"{ROOT}/{h}/{path.lstrip('/')}" for h in HIERARCHIES}


def made(path: str, resources: Mapping[str, Any]) -> list[int]:
    """The cgroups at `path` with the config's `resources`: their `cgroup.procs`, open for writing."""
    folders = _folders(path)
    opened: list[int] = []
    try:
        for hierarchy, folder in folders.items():
            os.makedirs(folder, exist_ok=True)
            _limit(hierarchy, folder, resources)
            opened.append(os.open(f"{folder}/cgroup.procs", os.O_WRONLY | os.O_CLOEXEC))
    except BaseException:
        for fd in opened:
            os.close(fd)
        kill_and_remove(path)
        raise
    return opened


def _limit(hierarchy: str, folder: str, resources: Mapping[str, Any]) -> None:
    def put(name: str, value: object) -> None:  # (one write each, as the kernel takes a cgroup file's value)
        fd = os.open(f"{folder}/{name}", os.O_WRONLY | os.O_CLOEXEC)
        try:
            os.write(fd, str(value).encode())
        finally:
            os.close(fd)

    if hierarchy == "memory":
        memory = resources["memory"]
        put("memory.limit_in_bytes", memory["limit"])
        if _swap_accounted():
            put("memory.memsw.limit_in_bytes", memory.get("swap", memory["limit"]))
    elif hierarchy == "pids":
        put("pids.max", resources["pids"]["limit"])
    elif hierarchy == "cpu":
        put("cpu.cfs_period_us", resources["cpu"]["period"])
        put("cpu.cfs_quota_us", resources["cpu"]["quota"])
    elif hierarchy == "devices":
        put("devices.deny", "a")
        for device in DEVICES:
            put("devices.allow", device)


@functools.cache
def _swap_accounted() -> bool:
    """Whether the memory hierarchy limits swap too (the kernel's swap accounting, fixed at its boot)."""
    return (ROOT / "memory" / "memory.memsw.limit_in_bytes").exists()


def kill_and_remove(path: str) -> bool:
    """Every process in the cgroups killed, then the cgroups removed: whether they are gone."""
    folders = _folders(path)
    deadline = time.monotonic() + GONE_WITHIN_S
    for folder in folders.values():
        while True:
            try:
                os.rmdir(folder)  # (its processes ended with its sandbox, as they mostly have: nothing to kill)
                break
            except FileNotFoundError:
                break  # (gone, or never made)
            except OSError:
                if time.monotonic() > deadline:
                    return False
            try:
                with open(f"{folder}/cgroup.procs", "rb") as listed:
                    pids = [int(p) for p in listed.read().split()]
            except FileNotFoundError:
                break
            except (OSError, ValueError):
                pids = []
            for pid in pids:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(pid, signal.SIGKILL)
            time.sleep(0.002)  # the killed processes leave their cgroup as the kernel reaps them
    return True


def charged(path: str) -> int | None:
    """The memory charged to the cgroup at `path`: what its sandbox holds of its own (pages it shares with its
    template, charged where they were first touched, are not in it); None when it cannot be read."""
    try:
        return int((ROOT / "memory" / path.lstrip("/") / "memory.usage_in_bytes").read_text())
    except (OSError, ValueError):
        return None
