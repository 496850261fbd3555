"""Where a kept workspace's files live between its calls: a mounted ext4 image, or an archive.

Both keep the fresh single-use container and the kernel's limits:

- **mounted** (root on the engine's host): each workspace is a sparse ext4 image of its
  policy's size and inode count, mounted on the host and bound into the call's warm
  container through its slot (sandbox_server.sandbox.mounts). Nothing is copied; the
  filesystem is the limit; a killed program leaves it as it was at the kill.
- **archived** (anywhere, a remote engine included): the launcher writes all of /workspace
  as a tar after the program; the host cleans and keeps that tar, and the next request
  carries it into the new sandbox's sized tmpfs.

The host reads a workspace's files only for `resources/list` and `resources/read`, and
never follows what a sandbox left there: archive entries are data; in a mounted image
every path is opened component by component without following links, and only regular
files are read.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import hmac
import mimetypes
import os
import tarfile
import threading
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Protocol

from sandbox_server.errors import Refusal
from sandbox_server.policy import WorkspaceSettings
from sandbox_server.sandbox import mounts
from sandbox_server.sandbox.archive import OUTPUT_LEAF, WorkspaceTooLarge, keep_workspace, kept_entries
from sandbox_server.sandbox.spec import ExecutionResult, ResourceLimits, SandboxSpec
from sandbox_server.workspaces.files import open_regular, regular_files

__all__ = ["ArchivedContents", "Contents", "MountedContents", "mime_type", "too_large"]

IMAGE_KEY = "image-key"
"""The state folder's key for naming workspace images (32 random bytes, mode 0600)."""
Room = Callable[[str, int], str | None]
"""Asked before a workspace grows to a size: None when the host has room, else why not."""


def mime_type(path: str) -> str:
    """The MIME type a workspace file is listed and read with."""
    return mimetypes.guess_type(path)[0] or "application/octet-stream"


def too_large(path: str, size: int, max_bytes: int) -> Refusal:
    """The answer to reading a workspace file above the policy's byte limit."""
    return Refusal(
        f"{path} is {size} bytes, above the {max_bytes} bytes a read may return "
        "(policy field limits.returned_file_bytes); copy out what you need with a call",
        "limits.returned_file_bytes",
    )


class Contents(Protocol):
    """How one host keeps its workspaces' files."""

    side_by_side: bool
    """Whether calls in one workspace may run at the same time (they share its files as they run)."""

    def shape(self, spec: SandboxSpec) -> SandboxSpec:
        """The container settings of a call in a kept workspace (what its warm containers are made with)."""

    def reserve(self, settings: WorkspaceSettings) -> int:
        """Bytes a new workspace takes of the host's cap as soon as it exists."""

    def begin(self, workspace_id: str, spec: SandboxSpec) -> SandboxSpec:
        """The spec of one call in the workspace, as its previous call left it."""

    def finish(self, workspace_id: str, result: ExecutionResult, settings: WorkspaceSettings, room: Room) -> str | None:
        """After a call: keep what it left; the problem, when the workspace could not be kept as it left it."""

    def files(self, workspace_id: str) -> list[tuple[str, int]]:
        """The regular files of a workspace (path, size)."""

    def read_file(
        self, workspace_id: str, path: str, max_bytes: int, offset: int = 0, length: int | None = None
    ) -> tuple[int, bytes] | None:
        """A regular file's size and its bytes from `offset` (at most `length`); None when there is none; raises
        Refusal when the file is above max_bytes."""

    def kept_files(self, workspace_ids: list[str]) -> set[str]:
        """The names of the files in the store's folder that hold these workspaces."""

    def remove(self, workspace_id: str) -> None:
        """Delete a workspace's files."""

    def sweep(self) -> None:
        """Let go of what server processes that no longer run left behind."""

    def close(self) -> None:
        """The server is stopping: let go of what this process holds (the files stay)."""


class ArchivedContents:
    """Each workspace is the tar its last call's launcher wrote, cleaned on the host once, at save."""

    side_by_side = False
    """Each call starts from the last saved archive and saves its own: calls side by side would lose files."""

    def __init__(self, root: Path) -> None:
        self.root = root

    def _archive(self, workspace_id: str) -> Path:
        return self.root / f"{workspace_id}.tar"

    def kept_files(self, workspace_ids: list[str]) -> set[str]:
        return {self._archive(workspace_id).name for workspace_id in workspace_ids}

    def shape(self, spec: SandboxSpec) -> SandboxSpec:
        return spec

    def reserve(self, settings: WorkspaceSettings) -> int:
        return 0  # counted when saved, at its real size

    def begin(self, workspace_id: str, spec: SandboxSpec) -> SandboxSpec:
        path = self._archive(workspace_id)
        return replace(spec, saved_workspace=str(path) if path.exists() else "")

    def finish(self, workspace_id: str, result: ExecutionResult, settings: WorkspaceSettings, room: Room) -> str | None:
        if result.workspace is None:
            return "the workspace was not saved: the sandbox ended before writing it out; it is as the previous call left it"
        temporary = self.root / f".{workspace_id}.tar.new"
        try:
            with open(temporary, "wb") as kept:
                keep_workspace(result.workspace, kept, settings.size_mb * 1024 * 1024, settings.files)
                size = kept.tell()
        except (tarfile.TarError, EOFError, WorkspaceTooLarge) as exc:
            temporary.unlink(missing_ok=True)
            return f"the workspace was not saved ({exc}); it is as the previous call left it"
        finally:
            result.workspace.close()
        problem = room(workspace_id, size)
        if problem is None:
            os.replace(temporary, self._archive(workspace_id))
        temporary.unlink(missing_ok=True)
        return problem

    def _members(self, workspace_id: str) -> Iterator[tuple[str, tarfile.TarInfo, tarfile.TarFile]]:
        try:
            with open(self._archive(workspace_id), "rb") as kept:
                yield from kept_entries(kept)
        except FileNotFoundError:
            return

    def files(self, workspace_id: str) -> list[tuple[str, int]]:
        return [(name, member.size) for name, member, _ in self._members(workspace_id) if member.isreg()]

    def read_file(
        self, workspace_id: str, path: str, max_bytes: int, offset: int = 0, length: int | None = None
    ) -> tuple[int, bytes] | None:
        for name, member, tar in self._members(workspace_id):
            if member.isreg() and name == path:
                if member.size > max_bytes:
                    raise too_large(path, member.size, max_bytes)
                handle = tar.extractfile(member)
                if handle is None:
                    return member.size, b""
                handle.seek(offset)
                return member.size, handle.read(max_bytes if length is None else min(length, max_bytes))
        return None

    def remove(self, workspace_id: str) -> None:
        self._archive(workspace_id).unlink(missing_ok=True)

    def sweep(self) -> None:
        pass  # nothing outlives a process but the archives, which their records account for

    def close(self) -> None:
        pass


class MountedContents:
    """Each workspace is a sized ext4 image, mounted by the one server process that holds its lock.

    Layout under the store's folder: `img-<name>.img` (the image), and `run/<process>/` of
    each serving process, holding `ws/<name>` (its mounted images) and `slots/` (a small
    tmpfs, shared, under which every warm container gets a slot of its own). A process that
    ends lets go of all of them; a later one sweeps what a killed process left.

    A sandbox may learn where its workspace lives on the host (a loop device names its backing
    file), so nothing there names the workspace: `<name>` is a keyed hash of its id (the key,
    `image-key`, is the state folder's own, readable by root alone), and the slots' tmpfs keeps
    the state folder's path out of the sandbox's mount table.
    """

    side_by_side = True
    """Calls share the one filesystem as programs on one computer share a folder."""

    def __init__(self, root: Path, process: str, process_alive: Callable[[str], bool]) -> None:
        self.root = root
        self._key = _image_key(root / IMAGE_KEY)
        self.run = root / "run" / process.replace("/", "_")
        self._process_alive = process_alive
        self._lock = threading.Lock()
        self._held: dict[str, int] = {}
        self._executable: dict[str, bool] = {}
        """Whether each held workspace is mounted to let programs run from it."""
        """Workspaces this process has mounted, with the open image whose lock says so."""
        self._giving_back: dict[str, threading.Thread] = {}
        """After a call, off its answer's path: the workspace's freed blocks go back to the host."""
        self._making: dict[str, threading.Lock] = {}
        """Per workspace: held while it is made and mounted."""
        self._again: set[str] = set()
        """Workspaces whose calls ended while their blocks were being given back: once more, then."""
        self.sweep()
        for old in root.glob("ws-*.img"):  # named by their id before names were keyed
            with contextlib.suppress(OSError):
                os.replace(old, self._image(old.name.removesuffix(".img")))
        self.slots = self.run / "slots"
        mounts.make_shared(self.slots)

    def sweep(self) -> None:
        """Let go of what server processes that no longer run left mounted."""
        for folder in (self.root / "run").glob("*"):
            if folder != self.run and not self._process_alive(folder.name):
                mounts.detach_under(folder)
                _remove_tree(folder)

    def _name(self, workspace_id: str) -> str:
        """What the host calls a workspace's image and mount: nothing a sandbox could use as its id."""
        return hmac.new(self._key, workspace_id.encode(), hashlib.sha256).hexdigest()[:32]

    def _image(self, workspace_id: str) -> Path:
        return self.root / f"img-{self._name(workspace_id)}.img"

    def kept_files(self, workspace_ids: list[str]) -> set[str]:
        """The names of the files in the store's folder that hold these workspaces."""
        return {self._image(workspace_id).name for workspace_id in workspace_ids}

    def _where(self, workspace_id: str) -> Path:
        return self.run / "ws" / self._name(workspace_id)

    def shape(self, spec: SandboxSpec) -> SandboxSpec:
        return replace(spec, workspace_slots=str(self.slots))

    def reserve(self, settings: WorkspaceSettings) -> int:
        return mounts.image_bytes(settings.size_mb, settings.files)

    def _create(self, workspace_id: str, limits: ResourceLimits, user: str) -> None:
        """A new workspace: an empty filesystem of the policy's size and files (as the sandbox's tmpfs is)."""
        image = self._image(workspace_id)
        try:
            mounts.make_image(image, limits.workspace_mb, limits.workspace_inodes, user)
        except BaseException:
            image.unlink(missing_ok=True)
            raise

    def _mounted(self, workspace_id: str, executable: bool | None = None) -> Path:
        """The workspace's filesystem, mounted by this process (which then holds its image's lock); for a call,
        `executable` says whether programs may run from it (None: as it is, noexec when newly mounted)."""
        where = self._where(workspace_id)
        with self._lock:
            if workspace_id in self._held:
                if executable is not None and self._executable.get(workspace_id) != executable:
                    mounts.set_executable(where, executable)
                    self._executable[workspace_id] = executable
                return where
            handle = os.open(self._image(workspace_id), os.O_RDONLY | os.O_CLOEXEC)
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(handle)
                raise Refusal(
                    f"busy: workspace {workspace_id} is open in another sandbox-server process on this host; "
                    "retry when that process has let it go, or leave out `workspace` for a new one",
                    "workspace",
                    kind="busy",
                    retry_after_s=5,
                ) from None
            try:
                mounts.detach(str(where))  # a mount of a process killed on this id before us
                mounts.mount_image(self._image(workspace_id), where, bool(executable))
                mounts.clear_calls(where)  # calls' output folders a killed process left
            except BaseException:
                os.close(handle)
                raise
            self._held[workspace_id] = handle
            self._executable[workspace_id] = bool(executable)
        return where

    def begin(self, workspace_id: str, spec: SandboxSpec) -> SandboxSpec:
        # Each call gets an output folder of its own when its container's slot is bound (mounts.bind_outputs),
        # so nothing here waits for, or clears after, another call in the workspace.
        with self._lock:
            making = self._making.setdefault(workspace_id, threading.Lock())
        with making:  # calls side by side in a new workspace: the first makes it, the others wait for it
            if not self._image(workspace_id).exists():
                self._create(workspace_id, spec.limits, spec.user)
            where = self._mounted(workspace_id, spec.limits.workspace_exec)
        return replace(self.shape(spec), mounted_workspace=str(where))

    def finish(self, workspace_id: str, result: ExecutionResult, settings: WorkspaceSettings, room: Room) -> str | None:
        # The filesystem is the workspace: whatever the program did is kept already. What it deleted goes
        # back to the host's disk after the answer, beside whatever the workspace's next call does: one
        # thread per workspace, which goes round again when calls ended while it worked.
        with self._lock:
            if workspace_id in self._giving_back:
                self._again.add(workspace_id)
                return None
            giving_back = threading.Thread(target=self._give_back, args=(workspace_id,), daemon=True)
            self._giving_back[workspace_id] = giving_back
        giving_back.start()
        return None

    def _give_back(self, workspace_id: str) -> None:
        while True:
            mounts.give_back(str(self._where(workspace_id)))
            with self._lock:
                if workspace_id not in self._again:
                    self._giving_back.pop(workspace_id, None)
                    return
                self._again.discard(workspace_id)

    def _settle(self, workspace_id: str) -> None:
        """Wait until what the workspace's calls freed is back with the host (before it is let go of)."""
        with self._lock:
            self._again.discard(workspace_id)
            giving_back = self._giving_back.get(workspace_id)
        if giving_back is not None:
            giving_back.join()

    def files(self, workspace_id: str) -> list[tuple[str, int]]:
        if not self._image(workspace_id).exists():
            return []
        return sorted(regular_files(mounts.open_folder(self._mounted(workspace_id)), skip=OUTPUT_LEAF))

    def read_file(
        self, workspace_id: str, path: str, max_bytes: int, offset: int = 0, length: int | None = None
    ) -> tuple[int, bytes] | None:
        if not self._image(workspace_id).exists() or path.split("/", 1)[0] == OUTPUT_LEAF:
            return None
        handle = open_regular(mounts.open_folder(self._mounted(workspace_id)), path)
        if handle is None:
            return None
        with os.fdopen(handle, "rb") as opened:
            info = os.fstat(opened.fileno())
            if info.st_size > max_bytes:
                raise too_large(path, info.st_size, max_bytes)
            wanted = max_bytes if length is None else min(length, max_bytes)
            return info.st_size, os.pread(opened.fileno(), wanted, offset) if wanted else b""

    def remove(self, workspace_id: str) -> None:
        self._settle(workspace_id)
        with self._lock:
            handle = self._held.pop(workspace_id, None)
            self._executable.pop(workspace_id, None)
            self._making.pop(workspace_id, None)
            where = self._where(workspace_id)
            mounts.detach(str(where))
            with contextlib.suppress(OSError):
                where.rmdir()
            if handle is not None:
                os.close(handle)
        self._image(workspace_id).unlink(missing_ok=True)

    def close(self) -> None:
        for workspace_id in list(self._giving_back):
            self._settle(workspace_id)
        with self._lock:
            mounts.detach_under(self.run)
            for handle in self._held.values():
                os.close(handle)
            self._held.clear()
        _remove_tree(self.run)


def _image_key(path: Path) -> bytes:
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


def _remove_tree(folder: Path) -> None:
    """Remove a process's run folder: only empty folders once nothing is mounted there."""
    for part in ("ws", "slots"):
        with contextlib.suppress(OSError):
            for child in os.scandir(folder / part):
                with contextlib.suppress(OSError):
                    os.rmdir(child.path)  # an empty mount point; never a workspace's own folder
            os.rmdir(folder / part)
    with contextlib.suppress(OSError):
        folder.rmdir()
