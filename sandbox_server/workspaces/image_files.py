"""The files of mounted workspaces on the host: what a new one is made with and an image a process holds, the
key their names are made with, images moved to another
filesystem, what a server process leaves (its run folder, its spare images) removed, and a workspace's files
written out as a tar or filled in from one (export and import)."""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import hmac
import os
import tarfile
from collections.abc import Callable, Collection
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from sandbox_server.sandbox import mounts
from sandbox_server.sandbox.archive import WORKSPACE_DIR
from sandbox_server.sandbox.host_files import file_states, open_regular
from sandbox_server.sandbox.spec import ResourceLimits, SandboxSpec

__all__ = [
    "Held",
    "ImageNames",
    "Shape",
    "create_image",
    "fill_folder",
    "image_key",
    "move_image",
    "remove_run_folder",
    "remove_spares",
    "folder_entries",
]


@dataclass(frozen=True, slots=True)
class Shape:
    """What a new workspace is made with: its filesystem's size and files, its owner, whether programs run
    from it."""

    size_mb: int
    files: int
    user: str
    executable: bool

    @classmethod
    def of(cls, spec: SandboxSpec) -> Shape:
        limits = spec.limits
        return cls(limits.workspace_mb, limits.workspace_inodes, spec.user, limits.workspace_exec)


@dataclass(frozen=True, slots=True)
class Held:
    """An image this process mounted: where (a spare's named at random), and the open image whose lock says so
    (-1: none)."""

    image: Path
    where: Path
    handle: int


@dataclass(frozen=True, slots=True)
class ImageNames:
    """What the host calls each workspace's image and mount point: a keyed hash of its id, nothing a sandbox (which
    may learn its image's path from its loop device) could use as the id."""

    key: bytes
    folder: Path
    """Where the images are."""
    mounts: Path
    """Where this process mounts them."""

    def name(self, workspace_id: str) -> str:
        return hmac.new(self.key, workspace_id.encode(), hashlib.sha256).hexdigest()[:32]

    def image(self, workspace_id: str) -> Path:
        return self.folder / f"img-{self.name(workspace_id)}.img"

    def mount_point(self, workspace_id: str) -> Path:
        return self.mounts / self.name(workspace_id)


def create_image(image: Path, limits: ResourceLimits, user: str) -> None:
    """A new workspace's image: an empty filesystem of the policy's size and files (as the sandbox's tmpfs is)."""
    try:
        mounts.make_image(image, limits.workspace_mb, limits.workspace_inodes, user)
    except BaseException:
        image.unlink(missing_ok=True)
        raise


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


def folder_entries(
    where: Path, add: Callable[[tarfile.TarInfo, IO[bytes] | None], None], skip: Collection[str]
) -> None:
    """A mounted workspace's regular files, each given to `add` with its relative name (an export), never through
    a link; the folders in `skip` (the calls' output folders) left out. Links and empty folders are not carried: a
    workspace's files and kept variables are."""
    for path, _ in file_states(mounts.open_folder(where), skip=skip):
        handle = open_regular(mounts.open_folder(where), path)
        if handle is None:
            continue
        with os.fdopen(handle, "rb") as opened:
            info = os.fstat(opened.fileno())
            entry = tarfile.TarInfo(path)
            entry.size, entry.mtime, entry.mode = info.st_size, int(info.st_mtime), info.st_mode & 0o755
            add(entry, opened)


def fill_folder(where: Path, kept: Path, user: str) -> None:
    """Unpack a kept (cleaned) archive into a new workspace's empty filesystem, owned by the sandbox's user. The
    archive came from elsewhere: each entry also passes tarfile's `data` filter (nothing outside the folder, no
    devices, no set-uid bits, no owner of its own) or is left out."""
    uid, _, gid = user.partition(":")
    ids = (int(uid), int(gid or uid))
    if kept.stat().st_size == 0:
        return  # an empty workspace's (a cleaned archive carries no end marker)
    with open(kept, "rb") as source, tarfile.open(fileobj=source, mode="r:") as tar:
        for member in tar:
            member.name = member.name.removeprefix(WORKSPACE_DIR + "/")
            if member.islnk():
                member.linkname = member.linkname.removeprefix(WORKSPACE_DIR + "/")
            try:
                tar.extract(member, where, filter="data")
            except (tarfile.FilterError, tarfile.ExtractError):
                continue
    for folder, names, files in os.walk(where):
        for name in [*names, *files]:
            os.lchown(os.path.join(folder, name), *ids)
