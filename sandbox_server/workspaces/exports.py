"""Exports made through the `workspaces` tool: files in a folder of the store's own, each read by the caller that
made it, and by no one else, as a resource in parts (`sandbox://exports/<id>?offset=N`), for KEEP_S after it
was made. (On replicas an export is the replica's that made it.)"""

from __future__ import annotations

import json
import os
import re
import secrets
import time
from pathlib import Path

__all__ = ["EXPORT_PREFIX", "KEEP_S", "MIME", "Exports"]

EXPORT_PREFIX = "sandbox://exports/"
KEEP_S = 3600.0
"""How long an export is kept to be read."""
MIME = "application/zstd"
_ID = re.compile(r"ex-[A-Za-z0-9_-]{22}")


class Exports:
    """One folder of exports, each `<id>.tar.zst` beside `<id>.json` (whose it is)."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.folder.mkdir(mode=0o700, parents=True, exist_ok=True)

    def begin(self, tenant: str | None) -> tuple[str, Path]:
        """A new export of this caller's: its resource URI and the file to write it to."""
        export_id = f"ex-{secrets.token_urlsafe(16)}"
        (self.folder / f"{export_id}.json").write_text(json.dumps({"caller": tenant}))
        return EXPORT_PREFIX + export_id, self.folder / f"{export_id}.tar.zst"

    def read(self, uri: str, tenant: str | None, offset: int, length: int) -> tuple[str, int, bytes] | None:
        """(MIME type, its size, `length` bytes from `offset`) of an export this caller made; None for any other."""
        export_id = uri.removeprefix(EXPORT_PREFIX)
        if not _ID.fullmatch(export_id):
            return None
        try:
            whose = json.loads((self.folder / f"{export_id}.json").read_text())
            if not isinstance(whose, dict) or whose.get("caller") != tenant:
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
