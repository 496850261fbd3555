"""Workspaces carried out of a store and into one as single files (workspaces.transfer): an export written from
a workspace or snapshot, an import made a new workspace, bounded as a fork is. Part of the store."""

from __future__ import annotations

import secrets
import time
from dataclasses import replace
from typing import Any, BinaryIO

from sandbox_server.errors import Refusal
from sandbox_server.workspaces.pausing import PausedWorkspaces
from sandbox_server.workspaces.records import WorkspaceRecord
from sandbox_server.workspaces.transfer import TransferError, read_export, write_export

__all__ = ["CarriedWorkspaces"]


class CarriedWorkspaces(PausedWorkspaces):
    """The store's export and import, and what its workspaces take together (the store provides the records, their
    lock and the caps)."""

    def export_to(self, record: WorkspaceRecord, out: BinaryIO) -> dict[str, Any]:
        """Write a workspace or snapshot as one file (workspaces.transfer); its manifest."""
        current = self.resolve(record.id, record.session, record.tenant)
        manifest = {
            "id": current.id, "name": current.name, "snapshot": current.snapshot, "origin": current.origin,
            "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(current.created)),
        }  # fmt: skip
        return write_export(out, manifest, lambda add: self.contents.entries(current.id, add))

    def import_from(
        self, archive: BinaryIO, tenant: str | None, holder: str, name: str | None, policy_name: str, user: str
    ) -> WorkspaceRecord:
        """A new workspace of an exported one (named if `name` is given), checked as any upload is: refused,
        saying why, when the file is not a whole export or holds more than this policy's workspace may, and
        bounded by the caller's caps as a fork is."""
        settings = self.settings
        kept = self.root / f".import-{secrets.token_hex(8)}.tar"
        try:
            with open(kept, "wb") as cleaned:
                manifest = read_export(archive, settings.size_mb * 1024 * 1024, settings.files, cleaned)
        except TransferError as exc:
            kept.unlink(missing_ok=True)
            raise Refusal(f"refused: not imported: {exc}", "archive") from None
        now = time.time()
        with self._lock:
            self._fresh()
            if name is not None:
                self._may_name(tenant, name, policy_name, None)
            size = kept.stat().st_size
            self._within_share(tenant, size, "not imported")
            made = WorkspaceRecord(
                f"ws-{secrets.token_urlsafe(16)}", None, holder, now, now, size, tenant, continued=True, name=name,
                origin=str(manifest.get("id") or "")[:64] or None,
            )  # fmt: skip
            self._records[made.id] = made
            self._users[made.id] = 1
        try:
            size = self.contents.load(made.id, kept, settings, user)
        except BaseException:
            with self._lock:
                self._records.pop(made.id, None)
                self._users.pop(made.id, None)
            kept.unlink(missing_ok=True)
            raise
        with self._lock:
            self._users.pop(made.id, None)
            made = replace(made, size_bytes=size)
            self._records[made.id] = made
            self._write_record(made)
        return made

    def total_bytes(self) -> int:
        """What all kept workspaces take on the host's disk."""
        with self._lock:
            self._fresh()
            return sum(r.size_bytes for r in self._records.values())
