"""The user namespaces of the server's warm templates: one per image and preload list, on a range of host ids of its
own (sandbox.host_ids), made at its first sandbox and held in the state folder while the server runs. A warm
template made again (spent, or dead) enters the same one, so the views of sandboxes made ahead stay right."""

from __future__ import annotations

import contextlib
import logging
import shutil
import threading
from collections.abc import Callable
from pathlib import Path

from sandbox_server.sandbox import mounts
from sandbox_server.sandbox.runc import host_ids, views

__all__ = ["FOLDER", "WarmNamespaces", "remove_left"]

FOLDER = "templates"
"""The state folder's folder of warm templates' namespaces: one folder each, named as a sandbox of its server is."""
VIEW = "rootfs"
BUNDLES_MB = 256
"""The size of the bundles' tmpfs: a bundle holds its config (about 25 kB) and a few small files, so a few
thousand sandboxes at once fit; it takes memory only for what it holds."""

log = logging.getLogger("sandbox_server")


class WarmNamespaces:
    def __init__(self, state: Path, name: Callable[[], str]) -> None:
        """`name`: a new name, as the server names its sandboxes (what a server left is found by it)."""
        self.state, self._name = state, name
        self._made: dict[str, tuple[Path, int, Path]] = {}
        self._lock = threading.Lock()
        self._shared: bool | None = None

    def of(self, key: str, rootfs: Path) -> tuple[Path, int, Path]:
        """The namespace of warm template `key` (its held file and its range's first host id), made at first, and
        the view of the image's root its template imports from: idmapped for it and read-only (the images' folder
        is root's alone, and what the template runs may write nothing there)."""
        with self._lock:
            if key not in self._made:
                name = self._name()
                folder = self.state / FOLDER / name
                folder.mkdir(parents=True, mode=0o711)
                index = host_ids.take(self.state, name)
                try:
                    (folder / host_ids.IDS).write_text(str(index))
                    host_ids.make_namespace(folder / host_ids.NAMESPACE, host_ids.first_id(index))
                    views.view(rootfs, folder / VIEW, folder / host_ids.NAMESPACE, read_only=True)
                except BaseException:
                    _remove(self.state, folder)
                    raise
                self._made[key] = (folder / host_ids.NAMESPACE, host_ids.first_id(index), folder / VIEW)
            return self._made[key]

    def share_bundles(self) -> bool:
        """Whether the bundles folder is a shared mount (bound on itself), so that the views of sandboxes made
        after a warm template reach its mount namespace: made so before this server's first sandbox. False (said
        once) where something was mounted under it before: a bind would hide those mounts from their removal."""
        with self._lock:
            if self._shared is None:
                bundles = self.state / "bundles"
                bundles.mkdir(parents=True, exist_ok=True)
                under = mounts.mounted(bundles)
                self._shared = not under or str(bundles.resolve()) in under
                if self._shared:
                    mounts.share_in_place(bundles, BUNDLES_MB)
                else:
                    log.warning("sandboxes are forked without warm templates: %d mounts were left under %s by an "
                                "earlier server (warm templates come back at a start that finds none)", len(under), bundles)  # fmt: skip
            return self._shared

    def close(self) -> None:
        """Every namespace let go and its range given back (its templates ended first); never raises."""
        with self._lock:
            for held, _, _ in self._made.values():
                _remove(self.state, held.parent)
            self._made.clear()


def remove_left(state: Path, left_by: Callable[[str], bool]) -> None:
    """The namespaces a server left (by their names, as `left_by` tells them) let go; never raises."""
    with contextlib.suppress(OSError):
        for folder in (state / FOLDER).iterdir():
            if left_by(folder.name):
                _remove(state, folder)


def _remove(state: Path, folder: Path) -> None:
    mounts.detach(str(folder / VIEW))
    mounts.detach(str(folder / host_ids.NAMESPACE))
    index = host_ids.range_of(folder)
    if index is not None:
        host_ids.give_back(state, index, folder.name)
    if not any((folder / name).is_mount() for name in (host_ids.NAMESPACE, VIEW)):
        shutil.rmtree(folder, ignore_errors=True)
