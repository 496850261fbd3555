"""The state folder belongs to one server at a time.

Two servers on one folder would each load the other's workspace records and manage them as their own (remove
them to make room, sweep them as expired, tell their clients they were "removed to make room"). So a server takes
an exclusive lock on `<folder>/server.lock` for as long as it runs (the kernel lets go of it when the process ends,
however it ends) and writes its process id there. A folder one server was given (`--state-dir`) that another
server holds is refused at start, naming that server; the default folder (SANDBOX_STATE_DIR, else the host's or
the user's), which every server started from one environment would otherwise share, gives the second server a
subfolder of its own (`servers/2`, `servers/3`, ...), so two MCP clients that each start a server over stdio
both work, whatever environment their configuration hands them.
"""

from __future__ import annotations

import fcntl
import os
from dataclasses import dataclass
from pathlib import Path

from sandbox_server.errors import UsageError

__all__ = ["LOCK_NAME", "StateFolder", "claim_state_folder", "default_state_dir", "servers_folders"]

LOCK_NAME = "server.lock"
MAX_SUBFOLDERS = 64
"""Servers that may share the default folder's host at once, each in a subfolder of its own."""


@dataclass(frozen=True, slots=True)
class StateFolder:
    """A state folder this process holds (for as long as it keeps this object's descriptor open)."""

    path: Path
    descriptor: int
    shared_with: int | None = None
    """The process id of the server holding the folder asked for (0: not recorded), when this one took a subfolder
    of it instead."""


def _try_lock(folder: Path) -> tuple[int | None, int | None]:
    """(the lock's descriptor, None) when taken; (None, the holder's process id if known) when another holds it."""
    folder.mkdir(parents=True, exist_ok=True, mode=0o700)
    descriptor = os.open(folder / LOCK_NAME, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
    try:
        fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        try:
            holder = int(os.pread(descriptor, 32, 0).decode().strip() or 0) or None
        except (OSError, ValueError):
            holder = None
        os.close(descriptor)
        return None, holder
    os.ftruncate(descriptor, 0)
    os.pwrite(descriptor, f"{os.getpid()}\n".encode(), 0)
    return descriptor, None


def claim_state_folder(folder: Path, chosen: bool) -> StateFolder:
    """Hold `folder` for this server; `chosen` when it was named on purpose (refused if another server holds it),
    else the first free subfolder of it when it is held."""
    descriptor, holder = _try_lock(folder)
    if descriptor is not None:
        return StateFolder(folder, descriptor)
    who = f"(process {holder})" if holder else "(its process id is not recorded)"
    if chosen:
        raise UsageError(
            f"the state folder {folder} is in use by another sandbox-server {who}: two servers on one folder would "
            "manage each other's workspaces; give this one a folder of its own (serve --state-dir)"
        )
    for number in range(2, MAX_SUBFOLDERS + 2):
        own = folder / "servers" / str(number)
        taken, _ = _try_lock(own)
        if taken is not None:
            return StateFolder(own, taken, holder or 0)
    raise UsageError(
        f"the state folder {folder} and its {MAX_SUBFOLDERS} subfolders are all in use by other sandbox-servers; "
        "give this one a folder of its own (serve --state-dir)"
    )


def default_state_dir() -> Path:
    """Where workspaces are kept: SANDBOX_STATE_DIR, /var/lib/sandbox-server as root, else the user's state folder."""
    configured = os.environ.get("SANDBOX_STATE_DIR")
    if configured:
        return Path(configured).expanduser().absolute()
    if os.geteuid() == 0:
        return Path("/var/lib/sandbox-server")
    base = os.environ.get("XDG_STATE_HOME") or os.path.expanduser("~/.local/state")
    return Path(base) / "sandbox-server"


def servers_folders(folder: Path) -> list[tuple[Path, int | None]]:
    """A default state folder and the subfolders later servers took (`servers/2`, ...), those that exist, each with
    the process id of the server holding it now (None: none holds it, as far as its lock file tells)."""
    found = []
    for place in (folder, *(folder / "servers" / str(n) for n in range(2, MAX_SUBFOLDERS + 2))):
        if place.is_dir():
            found.append((place, _holder(place)))
    return found


def _holder(folder: Path) -> int | None:
    """The process that wrote its id in a folder's lock, if it still runs (read, never locked: a server starting
    meanwhile must find the lock free)."""
    try:
        pid = int((folder / LOCK_NAME).read_text().strip() or 0)
        if pid <= 0:
            return None
        os.kill(pid, 0)  # (a signal of 0: whether it runs)
    except (OSError, ValueError):
        return None
    return pid
