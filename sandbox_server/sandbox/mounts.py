"""The host's mounts for kept workspaces: a sized ext4 image per workspace, bound into a warm container.

A warm container is created before its call, so it cannot be created with the workspace it
will work in. It is created instead with an empty *slot* (a host folder of its own) bound at
/workspace with slave propagation; when its call comes, the host binds the workspace's
mounted filesystem onto the slot, the kernel propagates that mount into the container, and
after the call the host detaches it again. The filesystem's size and inode count are the
kernel's limits on what a workspace can hold.

Needs root on the engine's own host (mount(2), loop devices); the archive keeping of
sandbox_server.workspaces.contents works everywhere else.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import os
import shutil
import struct
import subprocess
from pathlib import Path

__all__ = [
    "MountError",
    "bind",
    "detach",
    "detach_under",
    "give_back",
    "image_bytes",
    "make_image",
    "make_shared",
    "mount_image",
    "set_executable",
    "mounted",
    "open_folder",
    "unavailable",
]

MS_NOSUID, MS_NODEV, MS_NOEXEC = 0x2, 0x4, 0x8
MS_BIND, MS_REC, MS_SHARED = 0x1000, 0x4000, 0x100000
FITRIM = 0xC0185879
MNT_DETACH, UMOUNT_NOFOLLOW = 0x2, 0x8
JOURNAL_MB = 4
INODE_BYTES = 256

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_void_p]
_libc.umount2.argtypes = [ctypes.c_char_p, ctypes.c_int]


class MountError(OSError):
    """A mount the host could not make."""


def _mount(source: str | None, target: str, flags: int, kind: str | None = None, data: str | None = None) -> None:
    encoded = source.encode() if source is not None else None
    options = ctypes.c_char_p(data.encode()) if data is not None else None
    if _libc.mount(encoded, target.encode(), kind.encode() if kind else None, flags, options) != 0:
        code = ctypes.get_errno()
        raise MountError(code, f"mount {source or ''} on {target}: {os.strerror(code)}")


def bind(source: str, target: str) -> None:
    """Bind-mount a folder (and what is mounted under it) onto another."""
    _mount(source, target, MS_BIND | MS_REC)


def detach(target: str) -> None:
    """Detach whatever is mounted on a folder (lazily: still-open files keep it alive); never raises."""
    while _libc.umount2(target.encode(), MNT_DETACH | UMOUNT_NOFOLLOW) == 0:
        pass  # a folder may carry more than one mount, one on top of the other


def mounted(folder: Path) -> list[str]:
    """The mount points at or under a folder, deepest first (from this process's mount table)."""
    prefix = str(folder.resolve())
    found = []
    with open("/proc/self/mountinfo", encoding="utf-8", errors="replace") as table:
        for line in table:
            target = line.split(" ", 5)[4].encode().decode("unicode_escape")
            if target == prefix or target.startswith(prefix + "/"):
                found.append(target)
    return sorted(set(found), key=len, reverse=True)


def detach_under(folder: Path) -> None:
    """Detach every mount at or under a folder; never raises."""
    if folder.exists():
        for target in mounted(folder):
            detach(target)


def make_shared(folder: Path) -> None:
    """Make a folder a small tmpfs of its own whose sub-mounts propagate into the containers bound to it.

    A tmpfs rather than the folder bound to itself: a container's mount table shows where a bind
    mount's folder lies in its filesystem, and a slot on the host's own disk would show the state
    folder's path; on a tmpfs of its own it shows only the slot's name."""
    folder.mkdir(parents=True, exist_ok=True, mode=0o700)
    if str(folder.resolve()) not in mounted(folder):
        _mount("sandbox-slots", str(folder), MS_NOSUID | MS_NODEV | MS_NOEXEC, "tmpfs", "size=1m,mode=0700")
    _mount(None, str(folder), MS_SHARED)


def image_bytes(size_mb: int, inodes: int) -> int:
    """The image file of a workspace of `size_mb` usable MiB and `inodes` files (ext4's own needs on top)."""
    usable = size_mb * 1024 * 1024
    return usable + usable // 48 + inodes * INODE_BYTES + (JOURNAL_MB + 1) * 1024 * 1024


def make_image(path: Path, size_mb: int, inodes: int, owner: str) -> None:
    """A new sparse ext4 image whose root folder belongs to the sandbox's user ("uid:gid").

    ext4 rounds the inode count down to fill whole tables and keeps eleven for itself, so a
    workspace holds slightly fewer files than `inodes`, never more.
    """
    uid, _, gid = owner.partition(":")
    with open(path, "wb") as image:
        image.truncate(image_bytes(size_mb, inodes))
    _run(
        "mkfs.ext4", "-q", "-F", "-m", "0", "-N", str(inodes), "-J", f"size={JOURNAL_MB}",
        "-E", f"root_owner={uid}:{gid or uid},nodiscard", "-L", "workspace", str(path),
    )  # fmt: skip


def mount_image(image: Path, target: Path, executable: bool) -> None:
    """Mount a workspace image (never devices or set-uid; programs run from it only when `executable`) and drop
    lost+found."""
    target.mkdir(parents=True, exist_ok=True, mode=0o700)
    options = "loop,noatime,nodev,nosuid" + ("" if executable else ",noexec")
    _run("mount", "-t", "ext4", "-o", options, str(image), str(target))
    with contextlib.suppress(OSError):
        os.rmdir(target / "lost+found")


def set_executable(target: Path, executable: bool) -> None:
    """Allow or forbid running programs from a mounted workspace (a policy reloaded with another workspace.exec)."""
    _run("mount", "-o", "remount," + ("exec" if executable else "noexec"), str(target))


def open_folder(folder: str | Path) -> int:
    """A descriptor of a folder itself, never of what a link there points to."""
    return os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)


def give_back(folder: str) -> None:
    """Write a mounted workspace out and return its free blocks to the host (holes in its image); never raises."""
    try:
        handle = open_folder(folder)
    except OSError:
        return
    try:
        _libc.syncfs(handle)  # commits what the call deleted, so that its blocks are free to trim
        with contextlib.suppress(OSError):
            fcntl.ioctl(handle, FITRIM, bytearray(struct.pack("QQQ", 0, 2**64 - 1, 0)))
    finally:
        os.close(handle)


def _run(*argv: str) -> None:
    done = subprocess.run(argv, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise MountError(errno.EIO, f"{argv[0]} failed: {done.stderr.strip() or done.returncode}")


def unavailable(local_engine: bool) -> str | None:
    """Why this host cannot keep workspaces as mounted images; None when it can."""
    if not local_engine:
        return "the engine is not on this host"
    if os.geteuid() != 0:
        return "the server does not run as root"
    missing = [tool for tool in ("mkfs.ext4", "mount") if shutil.which(tool) is None]
    if missing:
        return f"{' and '.join(missing)} not found"
    if not os.path.exists("/dev/loop-control"):
        return "this host has no loop devices"
    return None
