"""Copies of the host's mounts made for one sandbox: detached (open_tree(2)), made read-only or idmapped for the
sandbox's user namespace (mount_setattr(2)), and mounted where its bundle or its workspace's slot names them
(move_mount(2)). An idmapped copy shows a file of uid 1000 on disk as the sandbox's user 1000 however its namespace
maps ids onto the host's (sandbox.host_ids), and what the sandbox writes through it is uid 1000 on disk."""

from __future__ import annotations

import ctypes
import errno
import os
from pathlib import Path

__all__ = ["view", "view_on"]

AT_FDCWD, AT_EMPTY_PATH, AT_RECURSIVE = -100, 0x1000, 0x8000
OPEN_TREE_CLONE, MOVE_MOUNT_F_EMPTY_PATH, MOVE_MOUNT_T_EMPTY_PATH = 1, 0x4, 0x40
MOUNT_ATTR_RDONLY, MOUNT_ATTR_IDMAP = 0x1, 0x100000
SYS_OPEN_TREE, SYS_MOVE_MOUNT, SYS_MOUNT_SETATTR = 428, 429, 442  # the same on every architecture since 5.2

_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long


def _failed(what: str) -> OSError:
    code = ctypes.get_errno()
    return OSError(code, f"{what}: {os.strerror(code)}")


class _MountAttr(ctypes.Structure):
    _fields_ = [
        ("attr_set", ctypes.c_uint64),
        ("attr_clr", ctypes.c_uint64),
        ("propagation", ctypes.c_uint64),
        ("userns_fd", ctypes.c_uint64),
    ]


def view(source: str | Path, target: Path, namespace: Path | None, *, read_only: bool = False) -> None:
    """Mount a copy of `source` (a folder and what is mounted under it, or a file) on `target` (made here),
    idmapped for the user namespace held on `namespace` (None: as it is), read-only if asked. A file system that
    cannot be idmapped gets a plain copy when `read_only` (what the sandbox only reads needs no ids of its own),
    else OSError."""
    tree = _copy(source, namespace, read_only)
    try:
        if os.path.isdir(source):
            target.mkdir(mode=0o755, exist_ok=True)
        else:
            target.touch(mode=0o600, exist_ok=True)
        if _libc.syscall(SYS_MOVE_MOUNT, tree, b"", AT_FDCWD, os.fsencode(target), MOVE_MOUNT_F_EMPTY_PATH) < 0:
            raise _failed(f"mount {source} on {target}")
    finally:
        os.close(tree)


def view_on(source: str | Path, target_fd: int, namespace: Path) -> None:
    """Mount a copy of folder `source`, idmapped for the namespace held on `namespace`, on the open folder
    `target_fd` (a mount made on a descriptor follows no link a program left)."""
    tree = _copy(source, namespace, False)
    try:
        flags = MOVE_MOUNT_F_EMPTY_PATH | MOVE_MOUNT_T_EMPTY_PATH
        if _libc.syscall(SYS_MOVE_MOUNT, tree, b"", target_fd, b"", flags) < 0:
            raise _failed(f"mount {source} in the sandbox's workspace")
    finally:
        os.close(tree)


def _copy(source: str | Path, namespace: Path | None, read_only: bool) -> int:
    """A detached copy of the mount at `source` (open_tree(2)), made read-only and idmapped as asked."""
    flags = OPEN_TREE_CLONE | os.O_CLOEXEC | AT_RECURSIVE
    tree = int(_libc.syscall(SYS_OPEN_TREE, AT_FDCWD, os.fsencode(source), flags))
    if tree < 0:
        raise _failed(f"copy the mount of {source}")
    try:
        if read_only and _setattr(tree, MOUNT_ATTR_RDONLY, 0) < 0:
            raise _failed(f"make the copy of {source} read-only")
        if namespace is not None:
            handle = os.open(namespace, os.O_RDONLY | os.O_CLOEXEC)
            try:
                idmapped = _setattr(tree, MOUNT_ATTR_IDMAP, handle) == 0
                if not idmapped and not (read_only and ctypes.get_errno() == errno.EINVAL):
                    raise _failed(f"give {source} the sandbox's ids (its file system may not allow idmapped mounts)")
            finally:
                os.close(handle)
    except BaseException:
        os.close(tree)
        raise
    return tree


def _setattr(tree: int, flags: int, namespace_fd: int) -> int:
    attr = _MountAttr(flags, 0, 0, namespace_fd)
    return int(_libc.syscall(SYS_MOUNT_SETATTR, tree, b"", AT_EMPTY_PATH | AT_RECURSIVE, ctypes.byref(attr), ctypes.sizeof(attr)))  # fmt: skip
