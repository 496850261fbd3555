"""Where a kept workspace's files live between its calls: a mounted ext4 image, or an archive.

Both keep the fresh single-use container and the kernel's limits:

- **mounted** (root on the engine's host): each workspace is a sparse ext4 image of its
  policy's size and inode count, mounted on the host and bound into the call's warm
  container through its slot (sandbox_server.workspaces.mounted). Nothing is copied; the
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
import copy
import mimetypes
import os
import tarfile
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import IO, TYPE_CHECKING, Protocol

from sandbox_server.errors import Refusal
from sandbox_server.policy import WorkspaceSettings
from sandbox_server.sandbox.archive import (
    WORKSPACE_DIR,
    WorkspaceTooLarge,
    keep_workspace,
    kept_entries,
    member_content,
)
from sandbox_server.sandbox.host_files import FileState
from sandbox_server.sandbox.spec import ExecutionResult, SandboxSpec

if TYPE_CHECKING:  # the PostgreSQL driver is imported only by a server given --state
    from sandbox_server.state.homes import Homes

__all__ = ["ArchivedContents", "Contents", "Homing", "Room", "mime_type", "too_large"]

Room = Callable[[str, int], str | None]
"""Asked before a workspace grows to a size: None when the host has room, else why not."""


Add = Callable[[tarfile.TarInfo, IO[bytes] | None], None]
"""Takes one entry of a workspace (a relative name; a regular file's content), as an export does."""


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


class Homing(Protocol):
    """Replicas that keep each workspace mounted on one of them, its home (workspaces.homed)."""

    homes: Homes
    """Where each workspace lives, in the shared state."""

    def homed_here(self, workspace_id: str) -> bool: ...

    def come_home(self, workspace_id: str, user: str) -> str | None:
        """Make this replica the workspace's home; the replica it was taken over from, when that one was lost."""
        ...

    def let_go_of_homes(self) -> None:
        """This replica stops: every workspace homed here saved and homed nowhere."""
        ...

    def hand_over(self, workspace_id: str, in_use: Callable[[str], bool]) -> bool:
        """Let go of a workspace homed here for the replica that asked for it (False: a call works in it)."""
        ...


class Contents(Protocol):
    """How one host keeps its workspaces' files."""

    side_by_side: bool
    """Whether calls in one workspace may run at the same time (they share its files as they run)."""
    homed: Homing | None
    """How these contents keep each workspace on its home replica (None: on this host alone, or anywhere)."""
    folder: Path
    """Where the workspaces' files are (the store's folder, or a filesystem of its own under it)."""

    def shape(self, spec: SandboxSpec) -> SandboxSpec:
        """The container settings of a call in a kept workspace (what its warm containers are made with)."""

    def reserve(self, settings: WorkspaceSettings) -> int:
        """Bytes a new workspace takes of the host's cap as soon as it exists."""

    def begin(self, workspace_id: str, spec: SandboxSpec) -> SandboxSpec:
        """The spec of one call in the workspace, as its previous call left it."""

    def finish(self, workspace_id: str, result: ExecutionResult, settings: WorkspaceSettings, room: Room) -> str | None:
        """After a call: keep what it left; the problem, when the workspace could not be kept as it left it."""

    def held_bytes(self, workspace_id: str) -> int | None:
        """What the workspace's files take now, for a workspace whose calls write its files in place (counted at
        its whole size while a call works in it, since the call may fill it); None: counted at its save."""

    def states(self, workspace_id: str) -> dict[str, FileState]:
        """The regular files of a workspace and their states, for what a call changed."""

    def read_file(
        self, workspace_id: str, path: str, max_bytes: int, offset: int = 0, length: int | None = None
    ) -> tuple[int, bytes] | None:
        """A regular file's size and its bytes from `offset` (at most `length`); None when there is none; raises
        Refusal when the file is above max_bytes."""

    def kept_files(self, workspace_ids: list[str]) -> set[str]:
        """The names of the files in the store's folder that hold these workspaces."""

    def copy(self, source_id: str, target_id: str) -> None:
        """A new workspace holding what `source_id` holds now (its files and run_python's kept variables)."""

    def ready(self, workspace_id: str) -> None:
        """Make a new copy ready for its first call (a fork: its calls come soon)."""

    def release(self, workspace_id: str) -> bool:
        """Let go of what this process holds of a workspace (its mount), keeping its files: whether it held any."""

    def entries(self, workspace_id: str, add: Add) -> None:
        """Give `add` each of the workspace's entries as a launcher writes /workspace (relative names; a regular
        file's content), to export it."""

    def load(self, workspace_id: str, kept: Path, settings: WorkspaceSettings, user: str) -> int:
        """Make a new workspace of a kept archive (cleaned: entries under workspace/), the file then the
        workspace's or removed; the bytes it takes of the host's cap."""

    def remove(self, workspace_id: str, later: bool = False) -> None:
        """Delete a workspace's files (`later`: may finish after it returns; its id is never used again)."""

    def sweep(self) -> None:
        """Let go of what server processes that no longer run left behind."""

    def close(self) -> None:
        """The server is stopping: let go of what this process holds (the files stay)."""


class ArchivedContents:
    """Each workspace is the tar its last call's launcher wrote, cleaned on the host once, at save."""

    side_by_side = False
    """Each call starts from the last saved archive and saves its own: calls side by side would lose files."""
    homed: Homing | None = None

    def __init__(self, root: Path) -> None:
        self.root = self.folder = root

    def archive_path(self, workspace_id: str) -> Path:
        return self.root / f"{workspace_id}.tar"

    def kept_files(self, workspace_ids: list[str]) -> set[str]:
        return {self.archive_path(workspace_id).name for workspace_id in workspace_ids}

    def shape(self, spec: SandboxSpec) -> SandboxSpec:
        return spec

    def reserve(self, settings: WorkspaceSettings) -> int:
        return 0  # counted when saved, at its real size

    def held_bytes(self, workspace_id: str) -> int | None:
        return None  # a call's files are counted as its save keeps them (a save past a cap is refused)

    def begin(self, workspace_id: str, spec: SandboxSpec) -> SandboxSpec:
        path = self.archive_path(workspace_id)
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
        try:
            if problem is None:
                problem = self.keep(workspace_id, temporary)
        finally:
            temporary.unlink(missing_ok=True)
        return problem

    def keep(self, workspace_id: str, saved: Path) -> str | None:
        """Make a saved archive the workspace's, whole or not at all; the problem, when it could not."""
        os.replace(saved, self.archive_path(workspace_id))
        return None

    def _members(self, workspace_id: str) -> Iterator[tuple[str, tarfile.TarInfo, tarfile.TarFile]]:
        try:
            with open(self.archive_path(workspace_id), "rb") as kept:
                yield from kept_entries(kept)
        except FileNotFoundError:
            return

    def states(self, workspace_id: str) -> dict[str, FileState]:
        # An archive keeps no inode: a renamed file is one deleted and one created.
        return {name: (m.size, int(m.mtime) * 10**9, 0) for name, m, _ in self._members(workspace_id) if m.isreg()}

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

    def copy(self, source_id: str, target_id: str) -> None:
        """A new workspace holding what `source_id` holds now: a second name for its archive (a save replaces an
        archive with a new file, never writes into one, so the two part at their next saves)."""
        with contextlib.suppress(FileNotFoundError):  # none saved yet: the new one starts empty too
            os.link(self.archive_path(source_id), self.archive_path(target_id))

    def ready(self, workspace_id: str) -> None:
        pass  # an archive is carried into each call as it is

    def release(self, workspace_id: str) -> bool:
        return False  # between calls an archive is a file, held by nobody

    def entries(self, workspace_id: str, add: Add) -> None:
        for name, member, kept in self._members(workspace_id):
            entry = copy.copy(member)
            entry.name = name
            if entry.islnk():
                entry.linkname = entry.linkname.removeprefix(WORKSPACE_DIR + "/")
            add(entry, member_content(kept, member))

    def load(self, workspace_id: str, kept: Path, settings: WorkspaceSettings, user: str) -> int:
        size = kept.stat().st_size
        os.replace(kept, self.archive_path(workspace_id))
        return size

    def remove(self, workspace_id: str, later: bool = False) -> None:
        self.archive_path(workspace_id).unlink(missing_ok=True)

    def sweep(self) -> None:
        pass  # nothing outlives a process but the archives, which their records account for

    def close(self) -> None:
        pass
