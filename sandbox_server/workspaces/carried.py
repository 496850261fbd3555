"""Workspaces carried out of a store and into one as single files (workspaces.transfer): an export written from
a workspace or snapshot, an import made a new workspace, bounded as a fork is. Part of the store."""

from __future__ import annotations

import secrets
import shutil
import tarfile
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any, BinaryIO

from sandbox_server.errors import Refusal
from sandbox_server.workspaces.pausing import PausedWorkspaces
from sandbox_server.workspaces.records import WorkspaceRecord
from sandbox_server.workspaces.transfer import (
    Bounds,
    ExportStopped,
    NotAnExport,
    TransferError,
    read_export,
    read_plain,
    write_export,
)

__all__ = ["CarriedWorkspaces"]


class CarriedWorkspaces(PausedWorkspaces):
    """The store's export and import, and what its workspaces take together (the store provides the records, their
    lock and the caps)."""

    def export(self, record: WorkspaceRecord, deadline: float) -> tuple[str, int, dict[str, Any]]:
        """An export of a workspace or snapshot to be read as a resource (its URI, size and manifest), counted in
        its caller's share and the host's cap: at the most its workspace may hold while it is written (a sparse
        file's zeros are written out), then at its own size. Refused, naming the field, past either, past the
        workspace's size in bytes of content or `deadline`; one that fails leaves no file behind."""
        with self._lock:
            current = self._current(record)
            most = self._at_most(current)
            self._within_share(current.tenant, most, "not exported")
            self._within_host(most, "not exported")
            uri, path = self.exports.begin(current.tenant, most)
        try:
            with open(path, "wb") as out:
                manifest = self.export_to(current, out, deadline)
            size = path.stat().st_size
        except BaseException as exc:
            self.exports.drop(uri)
            if isinstance(exc, ExportStopped):
                raise Refusal(f"refused: not exported: {exc.message}", exc.field) from None
            raise
        self.exports.finish(uri, size)
        return uri, size, manifest

    def export_to(self, record: WorkspaceRecord, out: BinaryIO, deadline: float | None = None) -> dict[str, Any]:
        """Write a workspace or snapshot as one file (workspaces.transfer): its manifest. Stopped (ExportStopped)
        past the workspace's size in bytes of content (a sparse file may claim more than its filesystem holds)
        and at `deadline` (time.monotonic())."""
        current = self.resolve(record.id, record.session, record.tenant)
        manifest = {
            "id": current.id, "name": current.name, "snapshot": current.snapshot, "origin": current.origin,
            "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(current.created)),
        }  # fmt: skip
        bounds = Bounds(self.settings.size_mb * 1024 * 1024, deadline)
        return write_export(out, manifest, lambda add: self.contents.entries(current.id, add), bounds)

    def import_from(
        self, archive: BinaryIO, tenant: str | None, holder: str, name: str | None, policy_name: str, user: str
    ) -> WorkspaceRecord:
        """A new workspace of an exported one, or of a plain tar of files (named if `name` is given), checked as
        any upload is: refused, saying why, when the file is not a whole export (or a readable tar) or holds more
        than this policy's workspace may, and bounded as a fork is (workspace.max_per_client or named_per_caller,
        the caller's share, the host's cap). Its temporary files are removed whatever happens."""
        settings = self.settings
        kept = self.root / f".import-{secrets.token_hex(8)}.tar"
        bounds = (settings.size_mb * 1024 * 1024, settings.files)
        try:
            try:
                with tempfile.TemporaryFile(dir=self.root) as spooled, open(kept, "wb") as cleaned:
                    shutil.copyfileobj(archive, spooled, 1 << 20)  # read twice when it is not an export
                    spooled.seek(0)
                    try:
                        manifest = read_export(spooled, *bounds, cleaned)
                    except NotAnExport:
                        spooled.seek(0)
                        cleaned.seek(0)
                        cleaned.truncate()
                        manifest = read_plain(spooled, *bounds, cleaned)
            except TransferError as exc:
                raise Refusal(f"refused: not imported: {exc}", "archive") from None
            made = self._begin_import(kept, manifest, tenant, holder, name, policy_name)
            try:
                size = self.contents.load(made.id, kept, settings, user)
            except BaseException as exc:
                with self._lock:
                    self._records.pop(made.id, None)
                    self._users.pop(made.id, None)
                if isinstance(exc, (OSError, tarfile.TarError)):
                    said = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)  # no host path
                    raise Refusal(
                        f"refused: not imported: its files could not be made a workspace ({type(exc).__name__}: "
                        f"{said[:200]})",
                        "archive",
                    ) from None
                raise
        finally:
            kept.unlink(missing_ok=True)
        with self._lock:
            self._users.pop(made.id, None)
            made = replace(made, size_bytes=size)
            self._records[made.id] = made
            self._write_record(made)
        return made

    def _begin_import(
        self, kept: Path, manifest: dict[str, Any], tenant: str | None, holder: str, name: str | None, policy: str
    ) -> WorkspaceRecord:
        """The record of an import, held (in use) while its files are made, counted at what it will take."""
        now = time.time()
        with self._lock:
            self._fresh()
            self._may_hold_new(tenant, holder, name, policy, "an import")
            size = max(kept.stat().st_size, self.contents.reserve(self.settings))
            self._within_share(tenant, size, "not imported")
            self._within_host(size, "not imported")
            made = WorkspaceRecord(
                f"ws-{secrets.token_urlsafe(16)}", None, holder, now, now, size, tenant, continued=True, name=name,
                origin=str(manifest.get("id") or "")[:64] or None,
            )  # fmt: skip
            self._records[made.id] = made
            self._users[made.id] = 1
        return made
