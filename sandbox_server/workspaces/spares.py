"""The work beside the calls of mounted workspaces (`workspaces.mounted`), done in the pauses between them: spare
workspaces made and mounted ahead of the calls that start one, as warm containers are, of the shape the last new
workspace had; and what calls deleted given back to the host's disk after their answers."""

from __future__ import annotations

import contextlib
import fcntl
import os
import secrets
import threading
from collections.abc import Callable
from pathlib import Path

from sandbox_server.sandbox import mounts
from sandbox_server.sandbox.activity import Activity
from sandbox_server.workspaces.image_files import Held, Shape, remove_spares

__all__ = ["SPARES", "GivingBack", "Spares", "let_go"]

SPARES = 2
"""New workspaces kept made and mounted ahead, of the shape the last new one had."""


class Spares:
    """One server process's spare workspaces, made in a thread of their own in the pauses between calls."""

    def __init__(self, images: Path, mounted_at: Path, activity: Activity, defer_s: float) -> None:
        self.images = images
        """The folder of this process's spare images (the workspaces' own folder's `spares/<process>`)."""
        self.mounted_at = mounted_at
        self.shape: Shape | None = None
        """The shape spares are made in: the last new workspace's (None: none was asked for yet)."""
        self._activity, self._defer_s = activity, defer_s
        self._lock = threading.Lock()
        self._ready: list[Held] = []
        self._making: threading.Thread | None = None
        """The thread making spares, while it runs."""
        self._closed = False

    def want(self, shape: Shape) -> None:
        """Keep SPARES new workspaces of this shape made ahead; spares of another shape are let go of."""
        with self._lock:
            if self._closed:
                return
            stale = [] if shape == self.shape else self._ready
            if stale:
                self._ready = []
            self.shape = shape
            if self._making is not None or len(self._ready) >= SPARES:
                making = None
            else:
                making = self._making = threading.Thread(target=self._loop, daemon=True)
        for spare in stale:
            let_go(spare)
        if making is not None:
            making.start()

    def take(self, shape: Shape) -> Held | None:
        """A spare of this shape, now the caller's (None: none is ready)."""
        with self._lock:
            return self._ready.pop(0) if shape == self.shape and self._ready else None

    def put_back(self, spare: Held) -> None:
        """A spare taken but not used."""
        with self._lock:
            self._ready.insert(0, spare)

    def close(self) -> None:
        """Stop making spares (after the one being made) and let go of every one."""
        with self._lock:
            self.shape, self._closed, making = None, True, self._making
        self._activity.changed()
        if making is not None:
            making.join()
        with self._lock:
            spares, self._ready = self._ready, []
        for spare in spares:
            let_go(spare)
        remove_spares(self.images)

    def _loop(self) -> None:
        try:
            while True:
                self._activity.wait_for_pause(self._defer_s, unless=lambda: not self._ready or self._closed)
                with self._lock:
                    shape = self.shape
                    if shape is None or len(self._ready) >= SPARES:
                        return
                spare = self._new(shape)
                with self._lock:
                    keep = shape == self.shape and len(self._ready) < SPARES
                    if keep:
                        self._ready.append(spare)
                if not keep:
                    let_go(spare)
        except OSError:
            return  # the host cannot make one now (its disk is full?): calls make their own
        finally:
            with self._lock:
                self._making = None

    def _new(self, shape: Shape) -> Held:
        name = secrets.token_hex(16)
        image, where = self.images / f"{name}.img", self.mounted_at / name
        image.parent.parent.mkdir(mode=0o700, exist_ok=True)
        image.parent.mkdir(mode=0o700, exist_ok=True)
        handle = -1
        try:
            mounts.make_image(image, shape.size_mb, shape.files, shape.user)
            handle = os.open(image, os.O_RDONLY | os.O_CLOEXEC)
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
            mounts.mount_image(image, where, shape.executable)
        except BaseException:
            let_go(Held(image, where, handle))
            raise
        return Held(image, where, handle)


def let_go(held: Held) -> None:
    """Unmount an image, let go of its lock and delete it; never raises."""
    mounts.detach(str(held.where))
    with contextlib.suppress(OSError):
        held.where.rmdir()
    if held.handle >= 0:
        os.close(held.handle)
    held.image.unlink(missing_ok=True)


class GivingBack:
    """What the calls of mounted workspaces deleted, given back to the host's disk after their answers, in the
    pauses between calls: one thread per workspace, which goes round again when calls ended while it worked."""

    def __init__(self, activity: Activity, defer_s: float, where: Callable[[str], Path]) -> None:
        self._activity, self._defer_s, self._where = activity, defer_s, where
        self._lock = threading.Lock()
        self._threads: dict[str, threading.Thread] = {}
        self._again: set[str] = set()
        """Workspaces whose calls ended while their blocks were being given back: once more, then."""

    def after_call(self, workspace_id: str) -> None:
        with self._lock:
            if workspace_id in self._threads:
                self._again.add(workspace_id)
                return
            thread = self._threads[workspace_id] = threading.Thread(target=self._run, args=(workspace_id,), daemon=True)
        thread.start()

    def settle(self, workspace_id: str) -> None:
        """Wait until what the workspace's calls freed is back with the host (before it is let go of)."""
        with self._lock:
            self._again.discard(workspace_id)
            thread = self._threads.get(workspace_id)
        if thread is not None:
            thread.join()

    def settle_all(self) -> None:
        with self._lock:
            workspace_ids = list(self._threads)
        for workspace_id in workspace_ids:
            self.settle(workspace_id)

    def _run(self, workspace_id: str) -> None:
        while True:
            self._activity.wait_for_pause(self._defer_s)
            mounts.give_back(str(self._where(workspace_id)))
            with self._lock:
                if workspace_id not in self._again:
                    self._threads.pop(workspace_id, None)
                    return
                self._again.discard(workspace_id)
