"""A call's output folder read by the host on its own mount of a kept workspace, where the launcher would otherwise
send it as a tar (the `tar` it starts for that costs a call some milliseconds, and every kept cell writes its
report on its variables there).

The call's own folder (sandbox.mounts.bind_outputs) lies on the workspace's filesystem, which the host has mounted
and bound onto the sandbox's slot: once the launcher has written its trailer, the host walks it there. What comes
back is what the archive's reader (archive.read_outputs) would take from the launcher's tar of the same folder: the
regular files in it and below, in the order the folders list them, within the same caps, with the same note for
everything skipped. The folder is the program's: every entry is opened relative to its folder's descriptor, never
through a link (O_NOFOLLOW), and a file only once it is seen to be a regular one, opened without blocking.
"""

from __future__ import annotations

import contextlib
import os
import stat

from sandbox_server.sandbox import mounts
from sandbox_server.sandbox.archive import LINK_SKIPPED, NOT_REGULAR_SKIPPED, printable, skipped_for_caps, valid_text
from sandbox_server.sandbox.host_files import MAX_DEPTH, open_below
from sandbox_server.sandbox.spec import OutputFile, SandboxSpec

__all__ = ["read_by_host", "read_folder", "read_outputs_of"]


def read_by_host(spec: SandboxSpec) -> bool:
    """Whether a call's output folder is read by the host rather than sent by its launcher: its workspace is kept
    mounted (on the host's filesystem, which the host reads as the program left it), and its kernel is the host's
    (a gVisor sandbox's writes may wait in its own kernel)."""
    return spec.mounted_workspace is not None and spec.saved_workspace is None and spec.runtime != "runsc"


def read_outputs_of(slot: str, max_files: int, max_bytes: int) -> tuple[tuple[OutputFile, ...], tuple[str, ...]]:
    """The outputs of the call whose sandbox has this slot: its `out`, the call's own folder bound there (or the
    workspace's shared one where it had none)."""
    try:
        top = mounts.open_folders(slot, (mounts.OUTPUT_NAME,))
    except OSError as exc:  # (where it had no folder of its own, the program may have replaced `out`)
        return (), (f"{mounts.OUTPUT_NAME}: skipped, the output folder could not be opened ({exc.strerror})",)
    return read_folder(top, max_files, max_bytes)


def read_folder(top: int, max_files: int, max_bytes: int) -> tuple[tuple[OutputFile, ...], tuple[str, ...]]:
    """The regular files below the open folder `top` (which it closes) within the caps, and a note for everything
    skipped, as archive.read_outputs says them for a tar of that folder."""
    files: list[OutputFile] = []
    notes: list[str] = []
    seen: set[tuple[int, int]] = set()
    """Each regular file taken or skipped for the caps, by its inode: a second name of one is a hard link (a tar's
    `islnk` member), skipped as links are."""
    used = 0
    walking = [(top, "", iter(_listed(top)))]
    try:
        while walking:
            folder, prefix, entries = walking[-1]
            entry = next(entries, None)
            if entry is None:
                os.close(walking.pop()[0])
                continue
            name = prefix + entry.name
            shown = printable(name)
            if entry.is_symlink():
                notes.append(f"{shown}: skipped, {LINK_SKIPPED}")
            elif entry.is_dir(follow_symlinks=False):
                inner = _folder(folder, entry.name, shown, len(walking), notes)
                if inner >= 0:
                    walking.append((inner, name + "/", iter(_listed(inner))))
            elif not entry.is_file(follow_symlinks=False):
                notes.append(f"{shown}: skipped, {NOT_REGULAR_SKIPPED}")
            else:
                found = entry.stat(follow_symlinks=False)
                if (found.st_dev, found.st_ino) in seen:
                    notes.append(f"{shown}: skipped, {LINK_SKIPPED}")
                    continue
                seen.add((found.st_dev, found.st_ino))
                capped = skipped_for_caps(shown, found.st_size, len(files), used, max_files, max_bytes)
                if capped is not None:
                    notes.append(capped)
                    continue
                content = _content(folder, entry.name, found.st_size)
                if content is None:
                    notes.append(f"{shown}: skipped, {NOT_REGULAR_SKIPPED}")
                    continue
                used += len(content)
                files.append(OutputFile(valid_text(name), content, len(content), found.st_mtime))
    finally:
        for folder, _, _ in walking:
            os.close(folder)
    return tuple(files), tuple(notes)


def _listed(folder: int) -> list[os.DirEntry[str]]:
    with os.scandir(folder) as entries:
        return list(entries)


def _folder(parent: int, name: str, shown: str, depth: int, notes: list[str]) -> int:
    """A folder below `parent`, open (-1, said in `notes`, when it is too deep or is no longer a folder)."""
    if depth > MAX_DEPTH:
        notes.append(f"{shown}: skipped, more than {MAX_DEPTH} folders deep")
        return -1
    try:
        return open_below(parent, name, directory=True)
    except OSError:
        notes.append(f"{shown}: skipped, {NOT_REGULAR_SKIPPED}")
        return -1


def _content(folder: int, name: str, size: int) -> bytes | None:
    """The file's bytes, at most `size` (what its listing said, within the caps); None when it is no longer a
    regular file."""
    try:
        handle = open_below(folder, name, directory=False)
    except OSError:
        return None
    try:
        if not stat.S_ISREG(os.fstat(handle).st_mode):
            return None
        chunks, left = [], size
        with contextlib.suppress(OSError):
            while left > 0 and (chunk := os.read(handle, min(left, 1 << 20))):
                chunks.append(chunk)
                left -= len(chunk)
        return b"".join(chunks)
    finally:
        os.close(handle)
