"""A sandbox made ahead of its call (by the engine, or by runc itself): its attach stream, its key, the slot its
workspace is mounted on, its init's host pid and its address; and the host's view of the processes under that
init, which says when a sandbox's processes have settled."""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sandbox_server.sandbox import mounts
from sandbox_server.sandbox.engine.attach import close_socket
from sandbox_server.sandbox.streams import Stream

__all__ = [
    "SETTLED_STATES", "SETTLE_S", "WarmContainer", "process_state", "process_tree", "sandbox_processes", "settled",
]  # fmt: skip


@dataclass(frozen=True, slots=True)
class WarmContainer:
    """A container created, attached and started, its launcher waiting for a request on stdin."""

    container_id: str
    stream: Stream
    key: tuple[object, ...]
    ready_at: float
    """time.monotonic() when it became ready."""
    handle: Any = None
    """The engine client's file object around `stream`: the socket is really closed only once both are."""
    slot: str | None = None
    """The host folder bound at its workspace, where a kept workspace is mounted for its call."""
    pid: int = 0
    """The host pid of its init, to read its memory from the host (0: unknown)."""
    address: str = ""
    """Its IP address on its network ("" with no network): how the proxy's log names it."""
    namespace: Path | None = None
    """Where its user namespace is held, when it has host ids of its own (sandbox.host_ids): what is bound on its
    slot is idmapped for it."""
    ends: int | None = None
    """A descriptor readable once every process of the sandbox has ended (a pidfd of its first process, where that
    process's end says so: template.host.Forked); None: the host looks at its processes after its trailer."""

    def close(self) -> None:
        """Close our end of the attach stream; never raises."""
        close_socket(self.stream)
        if self.handle is not None and self.handle is not self.stream:
            with contextlib.suppress(OSError):
                self.handle.close()

    def free_slot(self) -> None:
        """Detach what is mounted on its slot and remove the slot; never raises."""
        if self.slot is not None:
            mounts.drop_outputs(self.slot)
            mounts.detach(self.slot)
            with contextlib.suppress(OSError):
                os.rmdir(self.slot)


SETTLE_S = 1.0
"""How long the host waits, after the trailer, for the sandbox's processes to have stopped."""
SETTLED_STATES = frozenset("TtZX")
"""Process states that can do nothing more: stopped (the launcher waits so for its removal), or dead."""
PF_EXITING = 0x4
"""The kernel's flag of a thread in its exit (in /proc's stat): it runs no code of its own again. A warm cell's
process says its exit code as it exits, and the launcher goes on while the kernel tears its memory down."""


def _stat(path: str) -> list[bytes]:
    """The fields of a process's or thread's /proc stat after its name (its state first); raises OSError when it
    is gone, IndexError when the file says nothing."""
    with open(path, "rb") as stat:
        return stat.read().rsplit(b")", 1)[1].split()


def process_state(pid: int) -> str:
    """The state letter of a process from the host ("X" when it is gone)."""
    try:
        return _stat(f"/proc/{pid}/stat")[0].decode()
    except (OSError, IndexError):
        return "X"


def settled(pid: int) -> bool:
    """Whether a process can do nothing more: each of its threads stopped, dead or exiting (PF_EXITING), or it
    is gone."""
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return True
    for task in tasks:
        try:
            fields = _stat(f"/proc/{pid}/task/{task}/stat")
            state, flags = fields[0].decode(), int(fields[6])
        except (OSError, IndexError, ValueError):
            continue  # (ended meanwhile)
        if state not in SETTLED_STATES and not flags & PF_EXITING:
            return False
    return True


def process_tree(pid: int) -> list[int]:
    """`pid` and its descendants, from the kernel's lists of each task's children (nothing when it is gone)."""
    found: list[int] = []
    pending = [pid]
    while pending:
        current = pending.pop()
        try:
            tasks = os.listdir(f"/proc/{current}/task")
        except OSError:
            continue  # ended meanwhile
        found.append(current)
        for task in tasks:
            try:
                with open(f"/proc/{current}/task/{task}/children", "rb") as children:
                    pending.extend(int(child) for child in children.read().split())
            except (OSError, ValueError):
                continue
    return found


def sandbox_processes(first: int) -> list[int]:
    """A sandbox's processes: `first` (its first process) and its descendants, then every other process of its
    cgroup in its pid namespace (a warm template's sandbox has its program forked into it by the template, not by
    its first process; a forked sandbox's cgroup also holds the template's child that waits for it, outside);
    nothing when `first` is gone."""
    found = process_tree(first)
    if not found:
        return found
    try:
        sandbox = os.readlink(f"/proc/{first}/ns/pid")
        with open(f"/proc/{first}/cgroup", encoding="utf-8") as cgroups:
            path = next(line.split(":", 2)[2].strip() for line in cgroups if line.split(":", 2)[1] == "pids")
        with open(f"/sys/fs/cgroup/pids{path}/cgroup.procs", "rb") as procs:
            members = [int(pid) for pid in procs.read().split()]
    except (OSError, StopIteration, ValueError, IndexError):
        return found  # (no pids hierarchy of cgroup v1 here, or it ended meanwhile)
    known = set(found)
    return found + [pid for pid in members if pid not in known and _pid_namespace(pid) == sandbox]


def _pid_namespace(pid: int) -> str | None:
    try:
        return os.readlink(f"/proc/{pid}/ns/pid")
    except OSError:
        return None  # (ended meanwhile)
