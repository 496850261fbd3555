"""Reading from the host a folder sandboxes write in (a mounted workspace, a call's output folder on it), never
through anything a sandbox made there.

Every path is opened one component at a time from the workspace's root, without following
a link and without blocking on a FIFO; only regular files are read; a listing holds one
open folder per level it stands in, never one per folder it has seen.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Collection, Iterator

__all__ = ["MAX_DEPTH", "MAX_LISTED", "FileState", "file_states", "open_below", "open_regular"]

FileState = tuple[int, int, int]
"""A regular file as a call may have changed it: (size, modification time in ns, inode)."""

MAX_DEPTH = 64
"""Folders deeper than this in a workspace are not listed (a walk holds one descriptor per level)."""
MAX_LISTED = 100_000
"""Entries a listing looks at, at most."""


def file_states(top: int, skip: Collection[str] = ()) -> Iterator[tuple[str, FileState]]:
    """(path, (size, mtime_ns, inode)) of the regular files under an open folder, which it closes; never through
    a link.

    It holds one open folder per level it stands in (at most MAX_DEPTH, never one per folder
    it has seen), reading each folder's entries whole before going into any of them, and looks
    at MAX_LISTED entries at most; the entries at the paths in `skip`, and all under them, are left out
    unopened. Names are as
    the kernel gives them: bytes that are not UTF-8 arrive as surrogate escapes, for the
    caller to show escaped.
    """
    seen = 0
    stack: list[tuple[str, int, Iterator[tuple[str, bool, FileState]]]] = [("", top, iter(()))]
    try:
        stack[0] = ("", top, iter(_entries(top)))
        while stack:
            prefix, folder, pending = stack[-1]
            entry = next(pending, None)
            if entry is None:
                os.close(folder)
                stack.pop()
                continue
            seen += 1
            if seen > MAX_LISTED:
                return
            name, is_folder, state = entry
            path = prefix + name
            if path in skip:
                continue
            if not is_folder:
                yield path, state
            elif len(stack) < MAX_DEPTH:
                try:
                    inner = open_below(folder, name, directory=True)
                except OSError:
                    continue
                try:
                    listed = _entries(inner)
                except OSError:
                    os.close(inner)
                    continue
                stack.append((path + "/", inner, iter(listed)))
    finally:
        for _, folder, _ in stack:
            os.close(folder)


def _entries(folder: int) -> list[tuple[str, bool, FileState]]:
    """(name, is a folder, state) of a folder's regular files and folders; links and the rest left out."""
    found = []
    with os.scandir(folder) as listing:
        for entry in listing:
            info = entry.stat(follow_symlinks=False)
            if stat.S_ISREG(info.st_mode):
                found.append((entry.name, False, (info.st_size, info.st_mtime_ns, info.st_ino)))
            elif stat.S_ISDIR(info.st_mode):
                found.append((entry.name, True, (0, 0, 0)))
    return found


def open_below(folder: int, name: str, *, directory: bool) -> int:
    """Open one entry of an open folder without following a link (nor blocking on a FIFO)."""
    flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK
    return os.open(name, flags | (os.O_DIRECTORY if directory else 0), dir_fd=folder)


def open_regular(top: int, path: str) -> int | None:
    """A descriptor of the regular file at `path` under an open folder (which it closes); None when there is
    none, or something else is there."""
    folder = top
    *parents, leaf = path.split("/")
    if any(part in ("", ".", "..") for part in (*parents, leaf)):  # never above the folder, whoever asks
        os.close(folder)
        return None
    try:
        for part in parents:
            inner = open_below(folder, part, directory=True)
            os.close(folder)
            folder = inner
        handle = open_below(folder, leaf, directory=False)
    except OSError:
        return None
    finally:
        os.close(folder)
    if not stat.S_ISREG(os.fstat(handle).st_mode):
        os.close(handle)
        return None
    return handle
