"""A kept workspace's end: removed to make room for a client's next one, expired, orphaned by its server, or ended
with its handshake session. Part of the store (WorkspaceStore), which holds the records and their lock."""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable

from sandbox_server.errors import Refusal
from sandbox_server.workspaces.held import HeldWorkspaces
from sandbox_server.workspaces.names import counted
from sandbox_server.workspaces.records import WorkspaceRecord, server_of

__all__ = ["SweptWorkspaces"]

EVICTED_KEPT = 1000
"""Removed workspaces remembered to tell their callers why (the oldest forgotten first)."""


class SweptWorkspaces(HeldWorkspaces):
    """The store's side of a workspace's end (the store removes one: `_remove`)."""

    _evicted: OrderedDict[str, tuple[str | None, str]]
    """Workspaces removed to make room, by id: their tenant, and what a call naming one is told."""
    _expired: Callable[[WorkspaceRecord, float], bool]

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
                    and not server_alive(server_of(record.session))
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
        return self._end(lambda session: server_of(session) == server)

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
