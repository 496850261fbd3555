"""Exports made through the `workspaces` tool: files in a folder of the store's own, each read by the caller that
made it, and by no one else, as a resource in parts (`sandbox://exports/<id>?offset=N`), for KEEP_S after it
was made, and counted while they live: each takes its bytes of its caller's share and of the host's cap, as a
workspace does (reserved at what it may hold while it is written, then at its size). (On replicas an export is
the replica's that made it, counted there.)"""

from __future__ import annotations

import json
import os
import re
import secrets
import threading
import time
from pathlib import Path

__all__ = ["EXPORT_PREFIX", "KEEP_S", "MIME", "Exports"]

EXPORT_PREFIX = "sandbox://exports/"
KEEP_S = 3600.0
"""How long an export is kept to be read."""
MIME = "application/zstd"
_ID = re.compile(r"ex-[A-Za-z0-9_-]{22}")


class Exports:
    """One folder of exports, each `<id>.tar.zst` beside `<id>.json` (whose it is), and what each takes."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.folder.mkdir(mode=0o700, parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self._taken: dict[str, tuple[str | None, int, float]] = {}
        """Per export id: its caller, the bytes it takes (reserved while written), when it was made."""
        for whose in self.folder.glob("ex-*.json"):  # an earlier process's, still readable
            export_id = whose.name.removesuffix(".json")
            try:
                caller = json.loads(whose.read_text()).get("caller")
                made = whose.stat().st_mtime
                size = (self.folder / f"{export_id}.tar.zst").stat().st_size
            except (OSError, ValueError, AttributeError):
                continue
            self._taken[export_id] = (caller, size, made)

    def held_by(self, tenant: str | None) -> int:
        """The bytes this caller's live exports take."""
        with self._lock:
            return sum(size for caller, size, _ in self._taken.values() if caller == tenant)

    def total(self) -> int:
        """The bytes all live exports take."""
        with self._lock:
            return sum(size for _, size, _ in self._taken.values())

    def begin(self, tenant: str | None, reserved: int) -> tuple[str, Path]:
        """A new export of this caller's, counted at `reserved` bytes until it is finished: its resource URI and the
        file to write it to. (The caller checks the room for it under the store's lock.)"""
        export_id = f"ex-{secrets.token_urlsafe(16)}"
        with self._lock:
            self._taken[export_id] = (tenant, reserved, time.time())
        (self.folder / f"{export_id}.json").write_text(json.dumps({"caller": tenant}))
        return EXPORT_PREFIX + export_id, self.folder / f"{export_id}.tar.zst"

    def finish(self, uri: str, size: int) -> None:
        """A written export, counted from now on at its size."""
        export_id = uri.removeprefix(EXPORT_PREFIX)
        with self._lock:
            caller, _, made = self._taken[export_id]
            self._taken[export_id] = (caller, size, made)

    def drop(self, uri: str) -> None:
        """Remove an export (one that failed, or is past its time) and what it counted."""
        export_id = uri.removeprefix(EXPORT_PREFIX)
        with self._lock:
            self._taken.pop(export_id, None)
        for suffix in (".tar.zst", ".json"):
            (self.folder / f"{export_id}{suffix}").unlink(missing_ok=True)

    def read(self, uri: str, tenant: str | None, offset: int, length: int) -> tuple[str, int, bytes] | None:
        """(MIME type, its size, `length` bytes from `offset`) of a live export this caller made; None for any
        other (one past KEEP_S is removed as it is asked for, not served until the next sweep)."""
        export_id = uri.removeprefix(EXPORT_PREFIX)
        if not _ID.fullmatch(export_id):
            return None
        try:
            whose = self.folder / f"{export_id}.json"
            if whose.stat().st_mtime < time.time() - KEEP_S:
                self.drop(uri)
                return None
            fields = json.loads(whose.read_text())
            if not isinstance(fields, dict) or fields.get("caller") != tenant:
                return None
            with open(self.folder / f"{export_id}.tar.zst", "rb") as export:
                size = os.fstat(export.fileno()).st_size
                return MIME, size, os.pread(export.fileno(), length, offset) if length else b""
        except (OSError, ValueError):
            return None

    def sweep(self) -> None:
        """Remove the exports made more than KEEP_S ago."""
        oldest = time.time() - KEEP_S
        for path in self.folder.glob("ex-*"):
            try:
                if path.stat().st_mtime < oldest:
                    path.unlink()
            except OSError:
                continue
        with self._lock:
            for export_id in [key for key, (_, _, made) in self._taken.items() if made < oldest]:
                del self._taken[export_id]
