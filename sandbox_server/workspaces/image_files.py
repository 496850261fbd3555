"""The files of mounted workspaces on the host: the key their names are made with, images moved to another
filesystem, and what a server process leaves (its run folder, its spare images) removed."""

from __future__ import annotations

import contextlib
import fcntl
import os
from pathlib import Path

from sandbox_server.sandbox import mounts

__all__ = ["image_key", "move_image", "remove_run_folder", "remove_spares"]


def image_key(path: Path) -> bytes:
    """The key images are named with: made once, kept beside them."""
    try:
        handle = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    except FileExistsError:
        key = path.read_bytes()
        if len(key) >= 32:
            return key
        raise ValueError(f"{path}: a workspace image key of {len(key)} bytes; remove it to make a new one") from None
    key = os.urandom(32)
    with os.fdopen(handle, "wb") as written:
        written.write(key)
    return key


def move_image(old: Path, new: Path) -> None:
    """An image moved to another filesystem (copied, holes left holes, then removed); one a process holds stays."""
    handle = os.open(old, os.O_RDONLY | os.O_CLOEXEC)
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        mounts.copy_sparse(old, new)
        old.unlink()
    except OSError:
        return
    finally:
        os.close(handle)


def remove_spares(folder: Path) -> None:
    """Remove a process's spare images (let go of already) and their folder."""
    with contextlib.suppress(OSError):
        for spare in os.scandir(folder):
            if spare.name.endswith(".img"):
                os.unlink(spare.path)
        os.rmdir(folder)


def remove_run_folder(folder: Path) -> None:
    """Remove a process's run folder: only empty folders once nothing is mounted there, and its spare images."""
    with contextlib.suppress(OSError):
        for spare in os.scandir(folder / "spares"):
            if spare.name.endswith(".img"):
                os.unlink(spare.path)
    for part in ("ws", "slots", "spares"):
        with contextlib.suppress(OSError):
            for child in os.scandir(folder / part):
                with contextlib.suppress(OSError):
                    os.rmdir(child.path)  # an empty mount point; never a workspace's own folder
            os.rmdir(folder / part)
    with contextlib.suppress(OSError):
        folder.rmdir()
