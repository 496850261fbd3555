"""Session workspaces: /workspace kept between calls, while every call still gets a fresh container.

This module keeps the records (a small JSON file per workspace): who a workspace belongs
to, when it was last used, what it takes of the host's cap, and that one call at a time
works in it. Where its files live is sandbox_server.workspaces.contents' concern (a mounted
ext4 image, or an archive). Ids are 128-bit random. In the handshake era a workspace
belongs to its session; in the 2026-07-28 era its id is the capability. Either way a
workspace made for an authenticated caller is that caller's alone. An id that does not
exist, has expired or belongs to another session or caller gets one and the same answer.
"""

from __future__ import annotations

import contextlib
import secrets
import threading
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

import anyio

from sandbox_server.errors import Refusal
from sandbox_server.policy import WorkspaceSettings
from sandbox_server.sandbox.spec import ExecutionResult, SandboxSpec
from sandbox_server.workspaces.carried import CarriedWorkspaces
from sandbox_server.workspaces.changes import LastChanges
from sandbox_server.workspaces.contents import ArchivedContents, Contents
from sandbox_server.workspaces.exports import Exports
from sandbox_server.workspaces.files import FileState
from sandbox_server.workspaces.names import counted, not_a_snapshot
from sandbox_server.workspaces.naming import ID_PATTERN, NAME_PATTERN
from sandbox_server.workspaces.records import FileBook, RecordBook, WorkspaceRecord, over_cap

if TYPE_CHECKING:  # the PostgreSQL driver is imported only by a server given --state
    from sandbox_server.state.calls import SharedCall

__all__ = ["WorkspaceRecord", "WorkspaceStore", "session_key"]

EVICTED_KEPT = 1000
"""Removed workspaces remembered to tell their callers why (the oldest forgotten first)."""
OPENING_S = 60.0
"""A new workspace is not removed to make room for this long after it was made here, until its first call begins
(between the opening and the run come the proxy and the scope)."""
SESSION_PREFIX = "session:"
RECORD_WRITE_S = 5.0
"""A workspace's last use reaches its record on disk at most this often (idle times are minutes)."""


class WorkspaceStore(CarriedWorkspaces):
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
        self._busy: dict[str, anyio.Lock] = {}
        """Per workspace, for the calls that run one at a time in it."""
        self._users: dict[str, int] = {}
        """Per workspace, the calls working in it now."""
        self._opening: dict[str, float] = {}  # new workspaces whose first call has not begun, since when
        self._filling: set[str] = set()
        """The workspaces in use whose whole size the caps were found to have room for (`_may_fill`)."""
        self._records: dict[str, WorkspaceRecord] = {}
        self._written: dict[str, float] = {}
        """When each record was last written to disk."""
        self._evicted: OrderedDict[str, tuple[str | None, str]] = OrderedDict()
        """Workspaces removed to make room, by id: their tenant, and what a call naming one is told."""
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
    ) -> tuple[WorkspaceRecord, list[str]]:
        """The workspace a call works in, and notes for its answer; raises Refusal for an id it may not use.
        `shared` is the replicas' side of the call, which may have read the record with its admission."""
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
            reserved = self.contents.reserve(self.settings)
            self._within_share(tenant, reserved, "no new workspace")
            self._within_host(reserved, "no new workspace", busy=True)
            record = WorkspaceRecord(f"ws-{secrets.token_urlsafe(16)}", session, holder, now, now, reserved, tenant)
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

    def _make_room(self, holder: str, now: float) -> list[str]:
        """Remove this holder's idle workspaces until it may make one more: first those no call continued (a
        stateless client's, oldest first), then the least recently used of the others, but never one continued
        within `protect_recent_s`, nor one whose first call is on its way to it: someone is working in it, so the
        new call is refused instead."""
        most, recent = self.settings.max_per_client, self.settings.protect_recent_s
        theirs = [r for r in self._records.values() if r.holder == holder and counted(r)]  # named: kept apart
        idle = [r for r in theirs if not self._in_use(r.id, opening=True)]
        removable = sorted((r for r in idle if not r.continued or now - r.last_used >= recent),
                           key=lambda r: (r.continued, r.last_used))  # fmt: skip
        notes = []
        while len(theirs) >= most:
            if not removable:
                raise Refusal(
                    f"refused: this client holds {len(theirs)} workspaces, the most it may (policy field "
                    f"workspace.max_per_client: {most}), and each is in use or was continued in the last "
                    f"{recent:g} s (workspace.protect_recent_s), so none is removed to make room; continue one "
                    "by passing its `workspace` id, or retry later",
                    "workspace.max_per_client",
                    kind="busy",
                    retry_after_s=max(1.0, min(recent, 60.0)),
                )
            oldest = removable.pop(0)
            if not self._remove(oldest.id, later=True, unless_held=True):  # its files go off this call's path
                continue  # a call of another replica works in it
            theirs.remove(oldest)
            why = "no call continued it" if not oldest.continued else "least recently used"
            notes.append(
                f"workspace {oldest.id} ({why}) was removed to make room (policy field workspace.max_per_client: "
                f"{most})"
            )
            self._evicted[oldest.id] = (
                oldest.tenant,
                f"refused: workspace {oldest.id} was removed to make room for a newer one of this client ({why}; "
                f"policy field workspace.max_per_client: {most}); its files are gone: leave out `workspace` to "
                "get a new one",
            )
            while len(self._evicted) > EVICTED_KEPT:
                self._evicted.popitem(last=False)
        return notes

    def _adoptable(self, record: WorkspaceRecord, session: str | None, tenant: str | None) -> bool:
        """Replicas: a handshake session's workspace whose replica died may be continued by its id, by the same
        caller, from a session on another replica."""
        alive = self.replica_alive
        if alive is None or record.session is None or record.session == session or record.tenant != tenant:
            return False
        return not alive(_server_of(record.session))

    def _visible(self, record: WorkspaceRecord, session: str | None, tenant: str | None, now: float) -> bool:
        """Live, made for this caller, and its session's, or (2026-07-28 era, or named) anyone's of theirs who holds
        the id or the name."""
        mine = record.tenant == tenant and (record.session in (None, session) or record.name is not None)
        return mine and not self._expired(record, now)

    def _expired(self, record: WorkspaceRecord, now: float) -> bool:
        lasts = self.settings.keep_s if record.name is not None or record.snapshot else self.settings.idle_ttl_s
        return now - record.last_used > lasts and not self._in_use(record.id)

    def _in_use(self, workspace_id: str, opening: bool = False) -> bool:
        """A call works in it (`opening`: or one opened it here lately and has not begun: OPENING_S)."""
        opened = self._opening.get(workspace_id) if opening else None
        return self._users.get(workspace_id, 0) > 0 or (opened is not None and time.monotonic() - opened < OPENING_S)

    # -- calls in a workspace ----------------------------------------------------------

    @contextlib.asynccontextmanager
    async def using(
        self, record: WorkspaceRecord, wait_s: float, alone: bool = False, shared: SharedCall | None = None
    ) -> AsyncIterator[float]:
        """Hold the workspace for one call, yielding how long it waited. Calls run side by side in a mounted
        workspace; a call that must run `alone` there (a cell with kept variables), and every call in an
        archived one, waits up to `wait_s` for the one before it, then is answered busy."""
        self._users[record.id] = self._users.get(record.id, 0) + 1
        self._opening.pop(record.id, None)
        stack = contextlib.AsyncExitStack()
        try:
            if self.contents.side_by_side and not alone:
                yield 0.0
                return
            if self.book.prelocked(record.id, shared):  # held against every call already, this process's included
                async with self.book.hold(record.id, wait_s, shared):
                    yield 0.0
                return
            busy = self._busy.setdefault(record.id, anyio.Lock())
            started = time.monotonic()
            acquired = False
            with anyio.move_on_after(wait_s):
                await busy.acquire()
                acquired = True
            if acquired:  # then every other process's calls (replicas sharing the records)
                left = max(0.0, wait_s - (time.monotonic() - started))
                try:
                    held = await stack.enter_async_context(self.book.hold(record.id, left, shared))
                except BaseException:
                    busy.release()
                    raise
                if not held:
                    await stack.aclose()
                    busy.release()
                    acquired = False
            if not acquired:
                raise Refusal(
                    f"busy: another call is working in workspace {record.id} and did not finish within "
                    f"{wait_s:g} s; retry, or leave out `workspace` for a new one",
                    "workspace",
                    kind="busy",
                    retry_after_s=1,
                )
            try:
                yield time.monotonic() - started
            finally:
                with anyio.CancelScope(shield=True):
                    await stack.aclose()
                busy.release()
        finally:
            self._users[record.id] -= 1
            if not self._users[record.id]:
                del self._users[record.id]
                self._filling.discard(record.id)

    def _may_fill(self, record: WorkspaceRecord) -> None:
        """A workspace whose calls write its files in place counts at its whole size while a call works in it
        (`using`), as the call may fill it: the first of its calls to begin is refused when the caps have no room
        for that (busy for the host's cap)."""
        whole = self.contents.reserve(self.settings)
        if not whole:
            return
        with self._lock:
            current = self._records.get(record.id, record)
            if whole <= current.size_bytes or record.id in self._filling:
                return
            what = f"workspace {record.id} was not continued (a call may fill it to its whole size, {whole} bytes)"
            self._within_share(current.tenant, whole, what, besides=record.id)
            self._within_host(whole, what, busy=True, besides=record.id)
            self._filling.add(record.id)

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

    def begin(self, record: WorkspaceRecord, spec: SandboxSpec) -> SandboxSpec:
        """The spec of one call in the workspace as its previous call left it (in `using`); refused when the caps
        have no room for what it may write (`_may_fill`)."""
        self._may_fill(record)
        return self.contents.begin(record.id, spec)

    def finish(self, record: WorkspaceRecord, result: ExecutionResult) -> str | None:
        """Keep the workspace as its call left it; the problem, when it could not be kept."""
        problem = self.contents.finish(record.id, result, self.settings, self._grow)
        held = self.contents.held_bytes(record.id)
        if held is not None:  # what its files take now (counted whole while a call works in it)
            with self._lock:
                current = self._records.get(record.id)
                if current is not None:
                    self._records[record.id] = replace(current, size_bytes=held)
        self.touch(record)
        return problem

    def close(self) -> None:
        """The server is stopping: let go of what it holds (kept workspaces stay for a later process)."""
        with self._lock:  # (shared records are written as they change: this process's copies may be stale)
            for record in self._records.values() if not self.book.shared else ():
                if record.last_used > self._written.get(record.id, 0.0):
                    self._write_record(record)
        self.contents.close()

    def _grow(self, workspace_id: str, size: int) -> str | None:
        """Record a workspace's new size when the host's cap has room for it."""
        with self._lock:
            current = self._records.get(workspace_id)
            if current is None:
                return "the workspace was removed while the call ran; nothing was saved"
            record = replace(current, last_used=time.time(), size_bytes=size)
            try:
                self._within_share(current.tenant, size, "the workspace was not saved", besides=workspace_id)
            except Refusal as refused:
                return f"{refused.message.removeprefix('refused: ')}; it is as the previous call left it"
            others = self._held_bytes(besides=workspace_id)
            if not self.book.resize(record, self.storage_bytes, others):
                return over_cap(others + size, self.storage_bytes)
            self._records[workspace_id] = record
            self._written[workspace_id] = time.time()
        return None

    def touch(self, record: WorkspaceRecord) -> None:
        """Count a call as use, so the workspace does not expire under it (on disk at most every few seconds)."""
        with self._lock:
            current = self._records.get(record.id)
            if current is not None:
                now = time.time()
                self._records[record.id] = replace(current, last_used=now)
                if now - self._written.get(record.id, 0.0) > RECORD_WRITE_S:
                    self._write_record(self._records[record.id])

    # -- ending ------------------------------------------------------------------------

    def sweep(self, server_alive: Callable[[str], bool]) -> int:
        """Remove expired workspaces and those of handshake sessions whose server is gone; returns how many."""
        now = time.time()
        removed = 0
        with self._lock:
            self._fresh()
            for record in list(self._records.values()):
                # A dead replica's sessions' workspaces wait to be continued elsewhere by id, until they expire.
                orphaned = (
                    record.session is not None
                    and record.name is None  # a named one outlives its session
                    and not self.book.shared
                    and not server_alive(_server_of(record.session))
                )
                if (self._expired(record, now) or orphaned) and not self._in_use(record.id):
                    self._remove(record.id)
                    removed += 1
            # Files whose record is gone (another process's workspaces have their records in the book too).
            recorded = list(self._records) if self.book.shared else list(self.book.load())
            kept = self.contents.kept_files(recorded) | {f"{workspace_id}.json" for workspace_id in recorded}
            for path in [*self.root.glob("ws-*"), *self.root.glob("img-*"), *self.contents.folder.glob("img-*")]:
                if path.name not in kept:
                    path.unlink(missing_ok=True)
        self.contents.sweep()
        self.exports.sweep()
        return removed

    def end_sessions(self, server: str) -> int:
        """Remove the workspaces of every handshake session this server held (it is shutting down)."""
        return self._end(lambda session: _server_of(session) == server)

    def end_session(self, session: str) -> int:
        """Remove the workspaces of one handshake session that ended."""
        return self._end(lambda other: other == session)

    def _end(self, ended_session: Callable[[str], bool]) -> int:
        with self._lock:
            self._fresh()
            ended = [
                r.id
                for r in self._records.values()
                if r.session is not None and r.name is None and ended_session(r.session)
            ]
            for workspace_id in ended:
                self._remove(workspace_id)
        return len(ended)

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


def session_key(server: str, session: str) -> str:
    """A handshake session as kept workspaces name it: its server process and its session id."""
    return f"{SESSION_PREFIX}{server}|{session}"


def _server_of(session: str) -> str:
    return session.removeprefix(SESSION_PREFIX).split("|", 1)[0]
