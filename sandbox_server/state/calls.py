"""A call's own trips to the shared state, as few as its answer can wait for.

A call that continues a workspace needs four things of the database before it runs: to be counted against its
caller's limits, its workspace's record, the workspace's lock, and the generation of its files; and two after:
the lock let go of and the call no longer counted. Each trip costs this machine's two cores more than the
statement (0.6 to 1.5 ms with the database's process woken from idle, against 0.2 ms back to back), so they are
made as two: the call is counted, its workspace read and locked in one statement, on a connection it keeps while
it holds the lock; and its workspace's save, the lock let go of and the call's count in another, sent together on
that connection (a workspace too large to save in one statement lets go in a trip of its own once saved). The
stores take what the first statement read (`take_record`, `take_lock`) instead of asking again: the pipeline
hands the call's SharedCall to its kept workspace, which hands it to the store.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import anyio

from sandbox_server.errors import Refusal

if TYPE_CHECKING:  # the driver is imported by a server given --state alone; this module by every call's path
    import psycopg

    from sandbox_server.state.database import Database

__all__ = ["SharedCall", "workspace_lock"]


def workspace_lock(workspace_id: str) -> int:
    """The advisory lock key that holds a workspace for one call, on every replica."""
    from sandbox_server.state.database import lock_key

    return lock_key(f"workspace:{workspace_id}")


@dataclass(eq=False)
class SharedCall:
    """One call counted as running across the replicas, and what its first statement read of the workspace it
    names."""

    id: str
    database: Database
    workspace_id: str | None = None
    record: Any = None
    """The workspace's record as that statement read it (JSON fields), None when there is no such workspace."""
    generation: int = 0
    connection: psycopg.AsyncConnection[Any] | None = None
    """The connection holding the workspace's lock, while the call holds it."""
    _release: contextlib.AsyncExitStack = field(default_factory=contextlib.AsyncExitStack)
    _record_taken: bool = False
    _lock_taken: bool = False
    ended: bool = False

    def keep(self, connection: psycopg.AsyncConnection[Any], release: contextlib.AsyncExitStack) -> None:
        """Keep the connection that took the workspace's lock, and what gives it back to its pool, until `end`."""
        self.connection, self._release = connection, release

    def take_record(self, workspace_id: str) -> tuple[bool, Any]:
        """(True, the record or None) the first time the store asks for the workspace this call named; (False,
        None) for any other, or after that: the store asks the database then."""
        if self.workspace_id != workspace_id or self._record_taken:
            return False, None
        self._record_taken = True
        return True, self.record

    def take_lock(self, workspace_id: str) -> int | None:
        """The workspace's generation when this call's first statement locked it (once); None when it did not."""
        if not self.locked(workspace_id):
            return None
        self._lock_taken = True
        return self.generation

    def holds(self, workspace_id: str) -> bool:
        """Whether the store holds the workspace for this call by the lock its admission took (so that `save_and_end`
        may let go of it)."""
        return self.workspace_id == workspace_id and self.connection is not None and self._lock_taken

    def locked(self, workspace_id: str) -> bool:
        """Whether this call holds the workspace's lock from its first statement, not yet taken by its store."""
        return self.workspace_id == workspace_id and self.connection is not None and not self._lock_taken

    async def save_and_end(self, sql: str, params: tuple[Any, ...]) -> tuple[Any, ...] | None:
        """A statement saving the workspace this call holds, and the one `end` makes, sent together as one trip
        (a pipeline: the save commits before the lock is let go of); the save's row. StateUnavailable when the
        database does not answer or the pipeline failed: nothing of it is taken as done, and `end` lets go of
        what is left."""
        import psycopg

        from sandbox_server.state.database import StateUnavailable

        connection, workspace_id = self.connection, self.workspace_id
        assert connection is not None and workspace_id is not None
        with anyio.CancelScope(shield=True):
            try:
                async with connection.pipeline() as pipeline:
                    saving = await connection.execute(sql, params)
                    await connection.execute(_END, (workspace_lock(workspace_id), self.id))
                    await pipeline.sync()
                    row = await saving.fetchone()
            except psycopg.Error as exc:
                raise StateUnavailable(self.database.where, exc) from exc
            self.ended, self.connection = True, None
            with contextlib.suppress(Refusal):
                await self._release.aclose()
        return row

    async def end(self) -> None:
        """Let go of what the call still holds, in one statement: the workspace's lock (its files were saved before)
        and its count as running. Safe to call again."""
        import psycopg

        if self.ended:
            return
        self.ended = True
        with anyio.CancelScope(shield=True):
            try:
                if self.connection is not None and self.workspace_id is not None:
                    await self.connection.execute(_END, (workspace_lock(self.workspace_id), self.id))
                else:
                    await self.database.arun(_LEAVE, (self.id,))
            except psycopg.Error:  # the connection broke, and the database let go of its lock with it
                with contextlib.suppress(Refusal):
                    await self.database.arun(_LEAVE, (self.id,))
            finally:
                self.connection = None
                with contextlib.suppress(Refusal):
                    await self._release.aclose()


_LEAVE = "SELECT sandbox_leave_call(%s)"
_END = "SELECT pg_advisory_unlock(%s), sandbox_leave_call(%s)"
