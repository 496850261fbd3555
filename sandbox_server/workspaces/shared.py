"""Workspaces replicas share (`serve --state postgresql://…`): records are rows, and each workspace's files are
the archive its last call saved, kept in the database in chunks of a generation.

Why archives in the database rather than mounted images on a shared filesystem: an ext4 image may be mounted by
one kernel at a time, so a workspace continued on another node would have to be unmounted here first, and a
network filesystem under loop devices is slow and fragile; an archive is what a remote engine already carries in
and out of every call. A save writes the new generation's chunks and moves the record to it in one transaction:
a replica that dies mid-save leaves the previous generation whole, and no reader ever sees half of one. Archives
are streamed chunk by chunk both ways (never whole in memory), and each replica keeps the last generation it
read in its own folder, so consecutive calls on one replica read nothing from the database.

One call at a time works in a workspace, whichever replica it reaches: the call holds a PostgreSQL advisory lock
on its own connection, which the database lets go of if the replica dies.
"""

from __future__ import annotations

import contextlib
import json
import os
import threading
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import anyio.to_thread
import psycopg

from sandbox_server.errors import Refusal
from sandbox_server.sandbox.spec import SandboxSpec
from sandbox_server.state.database import Database, StateUnavailable, lock_key
from sandbox_server.workspaces.contents import ArchivedContents
from sandbox_server.workspaces.records import WorkspaceRecord, from_fields, to_fields

__all__ = ["SharedArchives", "SharedBook"]

CHUNK_BYTES = 1024 * 1024
CHUNKS_IN_FLIGHT = 8


class SharedBook:
    """Workspace records as rows of the shared state."""

    shared = True

    def __init__(self, database: Database) -> None:
        self.database = database
        self.held: set[str] = set()
        """The workspaces a call of this replica holds now (SharedArchives reads none of them again)."""

    def load(self) -> dict[str, WorkspaceRecord]:
        rows = self.database.run("SELECT record FROM workspaces")
        records = (from_fields(row[0]) for row in rows)
        return {record.id: record for record in records}

    def write(self, record: WorkspaceRecord) -> None:
        self.database.run(
            "INSERT INTO workspaces (id, client, session, record) VALUES (%s, %s, %s, %s) "
            "ON CONFLICT (id) DO UPDATE SET record = EXCLUDED.record",
            (record.id, record.client, record.session, json.dumps(to_fields(record))),
        )

    def delete(self, workspace_id: str) -> None:
        self.database.run("DELETE FROM workspaces WHERE id = %s", (workspace_id,))

    @contextlib.asynccontextmanager
    async def hold(self, workspace_id: str, wait_s: float) -> AsyncIterator[bool]:
        """An advisory lock on a connection of its own, held while the call runs (taken and let go of in one trip
        to a worker thread each)."""
        key = lock_key(f"workspace:{workspace_id}")
        stack = contextlib.ExitStack()
        holding: list[psycopg.Connection[Any]] = []

        def take() -> bool:
            holding.append(stack.enter_context(self.database.connection()))
            return _lock(holding[0], key, wait_s)

        def let_go(held: bool) -> None:
            try:
                if held:
                    with contextlib.suppress(psycopg.Error):
                        holding[0].execute("SELECT pg_advisory_unlock(%s)", (key,))
            finally:
                with contextlib.suppress(Refusal):
                    stack.close()

        held = False
        try:
            held = await anyio.to_thread.run_sync(take)
            if held:
                self.held.add(workspace_id)
            yield held
        finally:
            self.held.discard(workspace_id)
            with anyio.CancelScope(shield=True):
                await anyio.to_thread.run_sync(let_go, held)


def _lock(connection: psycopg.Connection[Any], key: int, wait_s: float) -> bool:
    """Take the lock: at once when nobody holds it (one round trip), else waiting up to `wait_s`."""
    row = connection.execute("SELECT pg_try_advisory_lock(%s)", (key,)).fetchone()
    if row is not None and row[0]:
        return True
    try:
        connection.execute(f"SET lock_timeout = {max(1, int(wait_s * 1000))}")
        connection.execute("SELECT pg_advisory_lock(%s)", (key,))
        return True
    except psycopg.errors.LockNotAvailable:
        return False
    finally:
        with contextlib.suppress(psycopg.Error):
            connection.execute("SET lock_timeout = 0")


class SharedArchives(ArchivedContents):
    """Archives kept in the database; this replica's folder caches the generation it last read of each."""

    def __init__(self, root: Path, database: Database, held: set[str] | None = None) -> None:
        super().__init__(root)
        self.database = database
        self.held = held if held is not None else set()
        """The workspaces a call of this replica holds now (SharedBook.held): no other replica writes them."""
        self._have: dict[str, int] = {}
        """The generation of each workspace whose archive this replica's folder holds."""
        self._lock = threading.Lock()

    def _fresh(self, workspace_id: str, always: bool = False) -> None:
        """Bring this replica's copy of the archive to the database's generation (asked unless a call of this
        replica holds the workspace and its copy is the one that call began from or saved)."""
        if not always and workspace_id in self.held and workspace_id in self._have:
            return
        rows = self.database.run("SELECT generation FROM workspaces WHERE id = %s", (workspace_id,))
        generation = rows[0][0] if rows else 0
        with self._lock:
            if self._have.get(workspace_id) == generation:
                return
            path = self._archive(workspace_id)
            if generation == 0:
                path.unlink(missing_ok=True)
            else:
                partial = self.root / f".{workspace_id}.tar.read"
                try:
                    with self.database.connection() as connection, connection.transaction(), open(partial, "wb") as out:
                        cursor = connection.cursor(name=f"read-{workspace_id}")
                        cursor.itersize = 4
                        cursor.execute(
                            "SELECT data FROM workspace_chunks WHERE workspace_id = %s AND generation = %s ORDER BY seq",
                            (workspace_id, generation),
                        )
                        for (data,) in cursor:
                            out.write(data)
                    os.replace(partial, path)
                finally:
                    partial.unlink(missing_ok=True)
            self._have[workspace_id] = generation

    def begin(self, workspace_id: str, spec: SandboxSpec) -> SandboxSpec:
        self._fresh(workspace_id, always=True)
        return super().begin(workspace_id, spec)

    def _members(self, workspace_id: str) -> Iterator[Any]:
        self._fresh(workspace_id)
        yield from super()._members(workspace_id)

    def _keep(self, workspace_id: str, saved: Path) -> str | None:
        try:
            with self.database.connection() as connection, connection.transaction():
                row = connection.execute(
                    "UPDATE workspaces SET generation = generation + 1 WHERE id = %s RETURNING generation",
                    (workspace_id,),
                ).fetchone()
                if row is None:
                    return "the workspace was removed while the call ran; nothing was saved"
                generation = row[0]
                # The chunks go as a pipeline (no round trip each), synced every few so that no more than those
                # wait in memory; the older generation goes in the same transaction.
                with open(saved, "rb") as archive, connection.pipeline() as pipeline, connection.cursor() as cursor:
                    seq = 0
                    while chunk := archive.read(CHUNK_BYTES):
                        cursor.execute(
                            "INSERT INTO workspace_chunks (workspace_id, generation, seq, data) VALUES (%s, %s, %s, %s)",
                            (workspace_id, generation, seq, chunk),
                        )
                        seq += 1
                        if seq % CHUNKS_IN_FLIGHT == 0:
                            pipeline.sync()
                    cursor.execute(
                        "DELETE FROM workspace_chunks WHERE workspace_id = %s AND generation < %s",
                        (workspace_id, generation),
                    )
        except StateUnavailable as exc:
            return f"the workspace was not saved ({exc}); it is as the previous call left it"
        with self._lock:
            os.replace(saved, self._archive(workspace_id))
            self._have[workspace_id] = generation
        return None

    def remove(self, workspace_id: str, later: bool = False) -> None:
        with self._lock:
            self._have.pop(workspace_id, None)
            super().remove(workspace_id, later)
