"""The sandboxes runc runs for servers of this host, by name: where runc keeps them, whose they are, and how one is
deleted (by its server, by the reaper of a server killed with SIGKILL, by the next server's sweep).

A sandbox's name carries its server's pid and start time (`sbx-<random>-<pid>-<start>`): a sandbox whose server is
gone is known without reading anything else. runc's state and the bundles live in a folder of their own, under
/run: gone with a reboot, as the sandboxes are.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import socket
import subprocess
from pathlib import Path

__all__ = [
    "CGROUP_PARENT", "IMAGES", "PREFIX", "STATE", "delete", "delete_left_by", "is_runc", "listed", "oom_kills",
    "owner_of", "run_runc", "runc_path", "sandbox_name",
]  # fmt: skip

STATE = Path(os.environ.get("SANDBOX_RUNC_STATE", "/run/sandbox-server/runc"))
"""runc's own state (`runc --root`) and each sandbox's bundle."""
IMAGES = Path(os.environ.get("SANDBOX_RUNC_IMAGES", "/var/lib/sandbox-server/images"))
"""Images' root filesystems, unpacked once by id and shared by every server of the host."""
PREFIX = "sbx-"
"""How every sandbox runc runs for us is named: sbx-<random>-<server pid>-<its start time> (its first 12
characters, as ids are shown short, are its own)."""
CGROUP_PARENT = "sandbox-server"
RUNC_WAIT_S = 10.0


def runc_path() -> str | None:
    """The runc binary of this host, if there is one."""
    return shutil.which("runc") or next((p for p in ("/usr/sbin/runc", "/usr/bin/runc") if os.access(p, os.X_OK)), None)


def owner_of(name: str) -> str:
    """The owner label of the server that made the sandbox `name` (this host's)."""
    _, _, pid, created = (name.split("-", 3) + ["", "", ""])[:4]
    return f"{socket.gethostname()}:{pid}:{created}"


def sandbox_name(owner: str) -> str:
    """A new sandbox's name, for the server whose owner label is `owner`."""
    _, pid, created = owner.split(":")
    return f"{PREFIX}{secrets.token_hex(4)}-{pid}-{created}"


def is_runc(container_id: str) -> bool:
    """Whether a sandbox id names one that runc runs for us (the engine's ids are hexadecimal)."""
    return container_id.startswith(PREFIX)


def run_runc(state: Path, *args: str) -> subprocess.CompletedProcess[bytes]:
    return subprocess.run(
        [runc_path() or "runc", "--root", str(state / "runc"), *args],
        stdin=subprocess.DEVNULL,
        capture_output=True,
        timeout=RUNC_WAIT_S * 3,
        check=False,
    )


def delete(state: Path, name: str) -> None:
    """Kill and delete one sandbox and remove its bundle; never raises."""
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        run_runc(state, "delete", "--force", name)
    shutil.rmtree(state / "bundles" / name, ignore_errors=True)


def listed(state: Path) -> set[str]:
    """Every sandbox runc knows of, or whose bundle is left, under `state`."""
    found: set[str] = set()
    for place in (state / "runc", state / "bundles"):
        with contextlib.suppress(OSError):
            found.update(name for name in os.listdir(place) if is_runc(name))
    return found


def delete_left_by(owner: str, state: Path = STATE) -> int:
    """Delete the sandboxes a server (by its owner label) left; returns how many."""
    left = [name for name in listed(state) if owner_of(name) == owner]
    for name in left:
        delete(state, name)
    return len(left)


def oom_kills(name: str) -> int:
    """How many processes the kernel killed for memory in a sandbox's cgroup (0 when it cannot be read)."""
    for path in (
        Path("/sys/fs/cgroup/memory") / CGROUP_PARENT / name / "memory.oom_control",  # v1
        Path("/sys/fs/cgroup") / CGROUP_PARENT / name / "memory.events",  # v2
    ):
        with contextlib.suppress(OSError, ValueError):
            for line in path.read_text().splitlines():
                key, _, value = line.partition(" ")
                if key == "oom_kill":
                    return int(value)
    return 0
