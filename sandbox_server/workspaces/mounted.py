"""Kept workspaces as mounted filesystems: a sized ext4 image per workspace, mounted by the server process
that holds its lock, and bound into each call's container through its slot (sandbox_server.sandbox.mounts).

New workspaces are made ahead of the calls that need them, as warm containers are: a few
spare images of the shape the last new workspace had, made and mounted in the background
(`workspaces.spares`), so a call that starts a workspace takes one instead of making a
filesystem on its path; what calls delete goes back to the host's disk after their answers.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import threading
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

from sandbox_server.errors import Refusal
from sandbox_server.policy import WorkspaceSettings
from sandbox_server.sandbox import mounts, reflinks
from sandbox_server.sandbox.activity import Activity
from sandbox_server.sandbox.archive import OUTPUT_LEAF
from sandbox_server.sandbox.host_files import FileState, file_states, open_regular
from sandbox_server.sandbox.spec import ExecutionResult, SandboxSpec
from sandbox_server.workspaces.contents import Add, Homing, Room, too_large
from sandbox_server.workspaces.image_files import (
    ImageNames,
    Shape,
    create_image,
    fill_folder,
    folder_entries,
    image_key,
    move_image,
    remove_run_folder,
    remove_spares,
)
from sandbox_server.workspaces.spares import GivingBack, Spares

__all__ = ["MountedContents", "let_go_of_run"]

NOT_ITS_FILES = (OUTPUT_LEAF, "/".join(mounts.CALLS))
"""A mounted workspace's folders that are the calls' and not its files: the output folder, and each running call's
own output folder (one for each call running or just ended, removed in a pause after its answer), never walked."""

IMAGE_KEY = "image-key"
"""The state folder's key for naming workspace images (32 random bytes, mode 0600)."""
DEFER_S = 2.0
"""The longest work beside the calls (spares, freed blocks, removals) waits for a pause between them."""


def let_go_of_run(root: Path, process: str) -> None:
    """Detach what the server `process` (gone) mounted under the workspaces' `root`, and remove its run folder and
    spares: its workspaces are then free for another server to mount (the reaper does this as it ends)."""
    folder = root / "run" / process.replace("/", "_")
    mounts.detach_under(folder)
    remove_run_folder(folder)
    for images in (root, root / reflinks.POOL_FOLDER):  # where images clone; the pool is never mounted for this
        remove_spares(images / "spares" / folder.name)


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
    homed: Homing | None = None
    """Replicas with homes: these contents themselves (workspaces.homed); None on a server alone."""

    def __init__(
        self, root: Path, process: str, process_alive: Callable[[str], bool], activity: Activity | None = None
    ) -> None:
        self.root = root
        self._activity = activity or Activity()
        """The calls running now: the work beside them waits for a pause between them."""
        self._process_alive = process_alive
        self._lock = threading.Lock()
        self._held: dict[str, int] = {}
        """Workspaces this process has mounted, with the open image whose lock says so."""
        self._executable: dict[str, bool] = {}
        """Whether each held workspace is mounted to let programs run from it."""
        self._places: dict[str, Path] = {}
        """Where held workspaces made as spares are mounted (the others at _where's keyed name)."""
        self._closed = False
        self._removing: list[threading.Thread] = []
        """Workspaces being removed off a call's path."""
        self._making: dict[str, threading.Lock] = {}
        """Per workspace: held while it is made and mounted."""
        self.run = root / "run" / process.replace("/", "_")
        found = reflinks.pool(root)
        self.folder = found if found is not None else root
        """Where the images live: where they clone (a fork or a snapshot is a reflink), else the state folder."""
        self.names = ImageNames(image_key(root / IMAGE_KEY), self.folder, self.run / "ws")
        self.reflinks = found is not None
        self.giving_back = GivingBack(self._activity, DEFER_S, self._where)
        """After a call, off its answer's path: the workspace's freed blocks go back to the host."""
        self.spares = Spares(self.folder / "spares" / self.run.name, self.run / "ws", self._activity, DEFER_S)
        self.sweep()
        for old in root.glob("ws-*.img"):  # named by their id before names were keyed
            with contextlib.suppress(OSError):
                os.replace(old, self.root / f"img-{self.names.name(old.name.removesuffix('.img'))}.img")
        if self.folder != root:  # images kept before the pool: moved into it
            for old in root.glob("img-*.img"):
                move_image(old, self.folder / old.name)
        self.slots = self.run / "slots"
        mounts.make_shared(self.slots)

    def sweep(self) -> None:
        """Let go of what server processes that no longer run left mounted, and their spares."""
        for folder in (self.root / "run").glob("*"):
            if folder != self.run and not self._process_alive(folder.name):
                let_go_of_run(self.root, folder.name)

    def kept_files(self, workspace_ids: list[str]) -> set[str]:
        """The names of the files in the store's folder that hold these workspaces."""
        return {self.names.image(workspace_id).name for workspace_id in workspace_ids}

    def _where(self, workspace_id: str) -> Path:
        return self._places.get(workspace_id) or self.names.mount_point(workspace_id)

    def shape(self, spec: SandboxSpec) -> SandboxSpec:
        if self.spares.shape is None:  # the first warm container's: spares from the start
            self.spares.want(Shape.of(spec))
        return replace(spec, workspace_slots=str(self.slots))

    def reserve(self, settings: WorkspaceSettings) -> int:
        return mounts.image_bytes(settings.size_mb, settings.files)

    def _take_spare(self, workspace_id: str, shape: Shape) -> bool:
        """Make a spare the new workspace: its image renamed to the workspace's, held and mounted as it is."""
        spare = self.spares.take(shape)
        if spare is None:
            return False
        try:
            os.rename(spare.image, self.names.image(workspace_id))
        except OSError:
            self.spares.put_back(spare)
            return False
        with self._lock:
            self._held[workspace_id] = spare.handle
            self._executable[workspace_id] = shape.executable
            self._places[workspace_id] = spare.where
        return True

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
            handle = os.open(self.names.image(workspace_id), os.O_RDONLY | os.O_CLOEXEC)
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
                mounts.mount_image(self.names.image(workspace_id), where, bool(executable))
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
        self._activity.stir()  # the work beside calls waits until this one has run
        with self._lock:
            making = self._making.setdefault(workspace_id, threading.Lock())
        with making:  # calls side by side in a new workspace: the first makes it, the others wait for it
            if not self.names.image(workspace_id).exists():
                shape = Shape.of(spec)
                if not self._take_spare(workspace_id, shape):
                    create_image(self.names.image(workspace_id), spec.limits, spec.user)
                self.spares.want(shape)
            where = self._mounted(workspace_id, spec.limits.workspace_exec)
        return replace(self.shape(spec), mounted_workspace=str(where))

    def finish(self, workspace_id: str, result: ExecutionResult, settings: WorkspaceSettings, room: Room) -> str | None:
        # The filesystem is the workspace: whatever the program did is kept already. What it deleted goes
        # back to the host's disk after the answer, beside whatever the workspace's next call does.
        self.giving_back.after_call(workspace_id)
        return None

    def held_bytes(self, workspace_id: str) -> int | None:
        if not self.names.image(workspace_id).exists():
            return 0
        return mounts.used_bytes(self._mounted(workspace_id))

    def states(self, workspace_id: str) -> dict[str, FileState]:
        if not self.names.image(workspace_id).exists():
            return {}
        return dict(file_states(mounts.open_folder(self._mounted(workspace_id)), skip=NOT_ITS_FILES))

    def read_file(
        self, workspace_id: str, path: str, max_bytes: int, offset: int = 0, length: int | None = None
    ) -> tuple[int, bytes] | None:
        if not self.names.image(workspace_id).exists() or path.split("/", 1)[0] == OUTPUT_LEAF:
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

    def remove(self, workspace_id: str, later: bool = False) -> None:
        """Let go of a workspace and delete its image; `later`: in a thread of its own, off a call's path (its
        id is never used again)."""
        if later:
            self._activity.stir()

            def in_a_pause() -> None:
                self._activity.wait_for_pause(DEFER_S, unless=lambda: self._closed)
                self.remove(workspace_id)

            removing = threading.Thread(target=in_a_pause, daemon=True)
            with self._lock:
                self._removing = [thread for thread in self._removing if thread.is_alive()] + [removing]
            removing.start()
            return
        self.release(workspace_id)
        with self._lock:
            self._making.pop(workspace_id, None)
            self.names.image(workspace_id).unlink(missing_ok=True)

    def copy(self, source_id: str, target_id: str) -> None:
        """A new workspace holding what `source_id` holds now: its image copied while its writes are held (a
        consistent filesystem), holes left holes. Mounted when its first call comes."""
        with self._lock:
            held_here = source_id in self._held
        source, target = self.names.image(source_id), self.names.image(target_id)
        if not source.exists():  # no call has made it yet: the fork starts as empty as it is
            return
        copy = reflinks.clone if self.reflinks else mounts.copy_sparse
        if held_here:
            with mounts.frozen(self._where(source_id)):
                copy(source, target)
            return
        handle = os.open(source, os.O_RDONLY | os.O_CLOEXEC)  # held by no process: hold it against one opening it
        try:
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                raise Refusal(
                    f"busy: workspace {source_id} is open in another sandbox-server process on this host; retry "
                    "when that process has let it go",
                    "workspace",
                    kind="busy",
                    retry_after_s=5,
                ) from None
            copy(source, target)
        finally:
            os.close(handle)

    def ready(self, workspace_id: str) -> None:
        """Mount a new copy now rather than on its first call's path (loop device and ext4 mount: ~15 ms), and
        read its files' states once, as each call does before it runs: a new mount's are not yet in memory.
        Mounted as the policy's new workspaces are (programs may run from it, or not), so its first call does not
        mount it again."""
        if self.names.image(workspace_id).exists():
            shape = self.spares.shape
            self._mounted(workspace_id, shape.executable if shape is not None else None)
            self.states(workspace_id)

    def release(self, workspace_id: str) -> bool:
        """Unmount a workspace and let go of its image's lock, the image kept (a later call mounts it again)."""
        self.giving_back.settle(workspace_id)
        with self._lock:
            handle = self._held.pop(workspace_id, None)
            if handle is None:
                return False
            self._executable.pop(workspace_id, None)
            where = self._where(workspace_id)
            self._places.pop(workspace_id, None)
            mounts.detach(str(where))
            with contextlib.suppress(OSError):
                where.rmdir()
            os.close(handle)
        return True

    def entries(self, workspace_id: str, add: Add) -> None:
        if self.names.image(workspace_id).exists():
            folder_entries(self._mounted(workspace_id), add, NOT_ITS_FILES)

    def load(self, workspace_id: str, kept: Path, settings: WorkspaceSettings, user: str) -> int:
        try:
            mounts.make_image(self.names.image(workspace_id), settings.size_mb, settings.files, user)
            fill_folder(self._mounted(workspace_id), kept, user)
            return mounts.used_bytes(self._mounted(workspace_id))
        except BaseException:
            self.remove(workspace_id)
            raise
        finally:
            kept.unlink(missing_ok=True)

    def close(self) -> None:
        with self._lock:
            self._closed, removing = True, self._removing
        self._activity.changed()
        for thread in removing:
            thread.join()
        self.giving_back.settle_all()
        self.spares.close()
        with self._lock:
            mounts.detach_under(self.run)
            for handle in self._held.values():
                os.close(handle)
            self._held.clear()
        remove_run_folder(self.run)
        if self.folder != self.root:
            reflinks.let_go_of_pool(self.root)
