"""Session workspaces: /workspace kept between calls, while every call still gets a fresh container.

This module keeps the records (a small JSON file per workspace: who a workspace belongs to,
when it was last used, what it takes of the caps) and finds or makes the workspace a call
names; the calls in one are workspaces.held's, its end (room made, expired, swept)
workspaces.sweeping's. Where its files live is sandbox_server.workspaces.contents' concern
(a mounted ext4 image, or an archive). Ids are 128-bit random. In the handshake era a
workspace belongs to its session; in the 2026-07-28 era its id is the capability. Either
way a workspace made for an authenticated caller is that caller's alone. An id that does
not exist, has expired or belongs to another session or caller gets one and the same answer.
"""

from __future__ import annotations

import secrets
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

import anyio

from sandbox_server.errors import Refusal
from sandbox_server.policy import WorkspaceSettings
from sandbox_server.sandbox.host_files import FileState
from sandbox_server.sandbox.spec import SandboxSpec
from sandbox_server.workspaces.caps import bounded_reserve
from sandbox_server.workspaces.changes import LastChanges
from sandbox_server.workspaces.contents import ArchivedContents, Contents
from sandbox_server.workspaces.exports import Exports
from sandbox_server.workspaces.names import not_a_snapshot
from sandbox_server.workspaces.naming import ID_PATTERN, NAME_PATTERN
from sandbox_server.workspaces.records import FileBook, RecordBook, WorkspaceRecord, server_of
from sandbox_server.workspaces.sweeping import SweptWorkspaces

if TYPE_CHECKING:  # the PostgreSQL driver is imported only by a server given --state
    from sandbox_server.state.calls import SharedCall

__all__ = ["WorkspaceRecord", "WorkspaceStore"]


class WorkspaceStore(SweptWorkspaces):
    """The kept workspaces of this host, in one folder of the server's."""

    def __init__(
        self,
        root: Path,
        settings: WorkspaceSettings,
        storage_bytes: int,
        contents: Callable[[Path], Contents] = ArchivedContents,
        book: RecordBook | None = None,
        replica_alive: Callable[[str], bool] | None = None,
        callers_share_the_host: bool = False,
        names_elsewhere: Callable[[str, str | None], str | None] | None = None,
    ) -> None:
        self.root, self.callers_share_the_host = root, callers_share_the_host
        self.root.mkdir(parents=True, exist_ok=True, mode=0o700)
        self.settings = settings
        self.storage_bytes = storage_bytes
        self.contents = contents(root)
        self._lock = threading.Lock()
        # The state its sides declare and say (workspaces.held, workspaces.sweeping):
        self._busy: dict[str, anyio.Lock] = {}
        self._users: dict[str, int] = {}
        self._opening: dict[str, float] = {}
        self._filling: set[str] = set()
        self._records: dict[str, WorkspaceRecord] = {}
        self._written: dict[str, float] = {}
        self._evicted: OrderedDict[str, tuple[str | None, str]] = OrderedDict()
        self.book: RecordBook = book if book is not None else FileBook(root)
        self.exports = Exports(root / "exports")  # made through the `workspaces` tool, read as resources
        self.last_changes = LastChanges()  # what each workspace's last call here changed (for its view)
        self.names_elsewhere = names_elsewhere
        self.replica_alive = replica_alive
        """Replicas: whether the replica of a handshake session still runs (its workspace is adopted if not)."""
        self._records = self.book.load()

    def reconfigure(self, settings: WorkspaceSettings, storage_bytes: int) -> None:
        """New bounds for what happens from now on."""
        self.settings, self.storage_bytes = settings, storage_bytes

    # -- finding and making ------------------------------------------------------------

    @staticmethod
    def unknown(requested: str) -> Refusal:
        """The one answer for an id that does not exist, expired, or is someone else's."""
        shown = requested if len(requested) <= 40 else requested[:40] + "…"
        return Refusal(
            f"refused: unknown workspace {shown!r}: it does not exist, has expired, or is not this caller's; "
            "leave out `workspace` to get a new one",
            "workspace",
        )

    def open(
        self,
        requested: str | None,
        session: str | None,
        holder: str,
        tenant: str | None = None,
        shared: SharedCall | None = None,
        bookkeeping: bool = False,
    ) -> tuple[WorkspaceRecord, list[str]]:
        """The workspace a call works in, and notes for its answer; raises Refusal for an id it may not use.
        `shared` is the replicas' side of the call, which may have read the record with its admission;
        `bookkeeping`: a call that writes no files (listing, naming), never refused for storage."""
        now = time.time()
        with self._lock:
            if requested is not None and NAME_PATTERN.fullmatch(requested):
                record = self._named(requested, tenant, now)
                if record is None:
                    raise self._unknown_name(requested, tenant)
                return self._continued(not_a_snapshot(record, requested)), []
            if requested is not None:
                valid = ID_PATTERN.fullmatch(requested) is not None
                if valid:
                    self._fresh(requested, shared)
                record = self._records.get(requested) if valid else None
                if record is None and requested in self._evicted and self._evicted[requested][0] == tenant:
                    raise Refusal(self._evicted.pop(requested)[1], "workspace.max_per_client")
                if record is not None and self._adoptable(record, session, tenant):
                    record = replace(record, session=session)  # its replica died: this session continues it
                    self._records[record.id] = record
                    self._write_record(record)
                if record is None or not self._visible(record, session, tenant, now):
                    raise self.unknown(requested)
                return self._continued(not_a_snapshot(record, requested)), []
            self._fresh()
            if session is not None:
                mine = [
                    r
                    for r in self._records.values()
                    if r.session == session and not r.snapshot and self._visible(r, session, tenant, now)
                ]
                if mine:
                    return self._continued(max(mine, key=lambda r: r.last_used)), []
            notes = self._make_room(holder, now)
            reserved = bounded_reserve(self.contents.reserve(self.settings))  # its files take nothing yet
            if not bookkeeping:
                self._within_share(tenant, reserved, "no new workspace")
                self._within_host(reserved, "no new workspace", busy=True)
            record = WorkspaceRecord(f"ws-{secrets.token_urlsafe(16)}", session, holder, now, now, 0, tenant)
            self._opening[record.id] = time.monotonic()
            self._records[record.id] = record
            self._write_record(record)
        return record, notes

    def _continued(self, record: WorkspaceRecord) -> WorkspaceRecord:
        if not record.continued:
            record = replace(record, continued=True)
            self._records[record.id] = record
            self._write_record(record)
        return record

    def _adoptable(self, record: WorkspaceRecord, session: str | None, tenant: str | None) -> bool:
        """Replicas: a handshake session's workspace whose replica died may be continued by its id, by the same
        caller, from a session on another replica."""
        alive = self.replica_alive
        if alive is None or record.session is None or record.session == session or record.tenant != tenant:
            return False
        return not alive(server_of(record.session))

    def _visible(self, record: WorkspaceRecord, session: str | None, tenant: str | None, now: float) -> bool:
        """Live, made for this caller, and its session's, or (2026-07-28 era, or named) anyone's of theirs who holds
        the id or the name."""
        mine = record.tenant == tenant and (record.session in (None, session) or record.name is not None)
        return mine and not self._expired(record, now)

    def _expired(self, record: WorkspaceRecord, now: float) -> bool:
        lasts = self.settings.keep_s if record.name is not None or record.snapshot else self.settings.idle_ttl_s
        return now - record.last_used > lasts and not self._in_use(record.id)

    def find(self, workspace_id: str, session: str | None, tenant: str | None = None) -> WorkspaceRecord | None:
        """A live workspace or snapshot this caller may see, by its id or its name (the one answer, None, for
        every other case)."""
        with self._lock:
            if ID_PATTERN.fullmatch(workspace_id):
                self._fresh(workspace_id)
                record = self._records.get(workspace_id)
            else:
                record = (
                    self._named(workspace_id, tenant, time.time()) if NAME_PATTERN.fullmatch(workspace_id) else None
                )
        return record if record is not None and self._visible(record, session, tenant, time.time()) else None

    def of_session(self, session: str, tenant: str | None = None) -> WorkspaceRecord | None:
        """A handshake session's workspace, if it has one (made for this caller)."""
        with self._lock:
            self._fresh()
            mine = [r for r in self._records.values() if r.session == session and r.tenant == tenant]
        return max(mine, key=lambda r: r.last_used) if mine else None

    def states(self, record: WorkspaceRecord) -> dict[str, FileState]:
        """The regular files of a kept workspace and their states (size, modification time, inode)."""
        return self.contents.states(record.id)

    # -- contents ----------------------------------------------------------------------

    def shape(self, spec: SandboxSpec) -> SandboxSpec:
        """The container settings of calls in kept workspaces (so warm containers can be made for them)."""
        return self.contents.shape(spec)

    def close(self) -> None:
        """The server is stopping: let go of what it holds (kept workspaces stay for a later process)."""
        with self._lock:  # (shared records are written as they change: this process's copies may be stale)
            for record in self._records.values() if not self.book.shared else ():
                if record.last_used > self._written.get(record.id, 0.0):
                    self._write_record(record)
        self.contents.close()

    def _remove(self, workspace_id: str, later: bool = False, unless_held: bool = False) -> bool:
        """Forget a workspace, remove its files; `unless_held`: not when another process's call works in it."""
        if not self.book.delete(workspace_id, unless_held):
            return False
        self._records.pop(workspace_id, None)
        self._written.pop(workspace_id, None)
        self._busy.pop(workspace_id, None)
        self._opening.pop(workspace_id, None)
        self.contents.remove(workspace_id, later)
        return True

    def _write_record(self, record: WorkspaceRecord) -> None:
        self._written[record.id] = time.time()
        self.book.write(record)

    def _fresh(self, workspace_id: str | None = None, shared: SharedCall | None = None) -> None:
        """Read the records again where other processes change them too (under the lock): all of them, or the
        one a decision needs."""
        if not self.book.shared:
            return
        if workspace_id is None:
            self._records = self.book.load()
        elif (record := self.book.get(workspace_id, shared)) is not None:
            self._records[workspace_id] = record
        else:
            self._records.pop(workspace_id, None)
