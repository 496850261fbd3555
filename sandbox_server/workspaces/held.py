"""Calls in a kept workspace: held one at a time or side by side, counted at its whole size while they may fill
it, and the workspace kept as each call left it. Part of the store (WorkspaceStore), which holds the records, their
lock and the caps."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import replace
from typing import TYPE_CHECKING

import anyio

from sandbox_server.errors import Refusal
from sandbox_server.sandbox.spec import ExecutionResult, SandboxSpec
from sandbox_server.workspaces.carried import CarriedWorkspaces
from sandbox_server.workspaces.records import RecordBook, WorkspaceRecord, over_cap

if TYPE_CHECKING:  # the PostgreSQL driver is imported only by a server given --state
    from sandbox_server.state.calls import SharedCall

__all__ = ["HeldWorkspaces"]

OPENING_S = 60.0
"""A new workspace is not removed to make room for this long after it was made here, until its first call begins
(between the opening and the run come the proxy and the scope)."""
RECORD_WRITE_S = 5.0
"""A workspace's last use reaches its record on disk at most this often (idle times are minutes)."""


class HeldWorkspaces(CarriedWorkspaces):
    """The store's side of a call in a workspace (the store makes the state below and writes the records)."""

    _lock: threading.Lock
    book: RecordBook
    _busy: dict[str, anyio.Lock]
    """Per workspace, for the calls that run one at a time in it."""
    _users: dict[str, int]
    """Per workspace, the calls working in it now."""
    _opening: dict[str, float]
    """New workspaces whose first call has not begun, since when."""
    _filling: set[str]
    """The workspaces in use whose whole size the caps were found to have room for (`_may_fill`)."""
    _written: dict[str, float]
    """When each record was last written to disk."""
    _write_record: Callable[[WorkspaceRecord], None]

    def _in_use(self, workspace_id: str, opening: bool = False) -> bool:
        """A call works in it (`opening`: or one opened it here lately and has not begun: OPENING_S)."""
        opened = self._opening.get(workspace_id) if opening else None
        return self._users.get(workspace_id, 0) > 0 or (opened is not None and time.monotonic() - opened < OPENING_S)

    def holds(self, workspace_id: str) -> int:
        """How many calls and services of this process hold the workspace now."""
        return self._users.get(workspace_id, 0)

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
        if not self.contents.reserve(self.settings):
            return
        with self._lock:
            current = self._records.get(record.id, record)
            most = self._at_most(current)
            if most <= current.size_bytes or record.id in self._filling:
                return
            what = (
                f"workspace {record.id} was not continued (it holds {current.size_bytes} bytes and its calls are "
                f"counted at {most} while they work, for what they may write)"
            )
            self._within_share(current.tenant, most, what, besides=record.id)
            self._within_host(most, what, busy=True, besides=record.id)
            self._filling.add(record.id)

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
