"""Workspaces replicas share (`serve --state postgresql://…`): records are rows, and each workspace's files are
the archive its last call saved, kept in the database in chunks of a generation.

Why archives in the database rather than mounted images on a shared filesystem: an ext4 image may be mounted by
one kernel at a time, so a workspace continued on another node would have to be unmounted here first, and a
network filesystem under loop devices is slow and fragile; an archive is what a remote engine already carries in
and out of every call. A save writes the new generation's chunks and moves the record to it in one transaction:
a replica that dies mid-save leaves the previous generation whole, and no reader ever sees half of one. Archives
are streamed chunk by chunk both ways (never whole in memory), and each replica keeps the last generation it
read in its own folder, so consecutive calls on one replica read nothing from the database.

A chunk is kept once, by its SHA-256 (`workspace_blobs`), and a generation names its chunks in order: a fork or
a snapshot copies those names in one transaction and shares every chunk with what it came from until one of
them saves, and chunks an unchanged part of an archive repeats are not kept twice. The sweep removes chunks no
generation names, after a grace period.

One call at a time works in a workspace, whichever replica it reaches: the call holds a PostgreSQL advisory lock
on its own connection, which the database lets go of if the replica dies.
"""

from __future__ import annotations

import contextlib
import json
import os
import threading
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any, BinaryIO

import anyio.from_thread
import anyio.to_thread
import psycopg

from sandbox_server.errors import Refusal
from sandbox_server.sandbox.spec import SandboxSpec
from sandbox_server.state.calls import SharedCall, workspace_lock
from sandbox_server.state.database import Database, StateUnavailable
from sandbox_server.workspaces.contents import ArchivedContents
from sandbox_server.workspaces.records import WorkspaceRecord, from_fields, over_cap, to_fields

__all__ = ["SharedArchives", "SharedBook"]

CHUNK_BYTES = 1024 * 1024
CHUNKS_IN_FLIGHT = 8
CHUNK_GRACE_S = 600.0
"""How long a chunk no workspace names is kept before the sweep removes it."""


class SharedBook:
    """Workspace records as rows of the shared state."""

    shared = True

    def __init__(self, database: Database) -> None:
        self.database = database
        self.held: dict[str, int] = {}
        """The workspaces a call of this replica holds now, and the generation of each as the hold found it or
        its call saved it (SharedArchives asks the database for none of them)."""
        self.owners: dict[str, object] = {}
        """Whose entry each of `held` is: a call, or the token of a hold taken after the call's admission."""
        self.holders: dict[str, SharedCall] = {}
        """The calls that hold their workspace with the lock their admission took (one call at a time works in a
        workspace): its save ends the call's count in the same statement."""
        self.sizing: dict[str, tuple[str, int]] = {}
        """Records with their workspace's new size, each written by that workspace's save, and the host's cap."""

    def load(self) -> dict[str, WorkspaceRecord]:
        rows = self.database.run("SELECT record FROM workspaces")
        records = (from_fields(row[0]) for row in rows)
        return {record.id: record for record in records}

    def get(self, workspace_id: str, call: SharedCall | None = None) -> WorkspaceRecord | None:
        if call is not None:  # the record the call's first statement read with its admission
            known, fields = call.take_record(workspace_id)
            if known:
                return from_fields(fields) if fields is not None else None
        rows = self.database.run("SELECT record FROM workspaces WHERE id = %s", (workspace_id,))
        return from_fields(rows[0][0]) if rows else None

    def write(self, record: WorkspaceRecord) -> None:
        self.database.run(
            "INSERT INTO workspaces (id, client, session, record) VALUES (%s, %s, %s, %s) "
            "ON CONFLICT (id) DO UPDATE SET record = EXCLUDED.record",
            (record.id, record.holder, record.session, json.dumps(to_fields(record))),
        )

    def resize(self, record: WorkspaceRecord, storage_bytes: int, others_bytes: int) -> bool:
        """Kept for the workspace's save (SharedArchives), which writes the record, counting the other
        workspaces against the cap in the same statement."""
        self.sizing[record.id] = (json.dumps(to_fields(record)), storage_bytes)
        return True

    def delete(self, workspace_id: str, unless_held: bool = False) -> bool:
        if not unless_held:
            self.database.run("DELETE FROM workspaces WHERE id = %s", (workspace_id,))
            return True
        # A call on any replica holds the workspace's advisory lock while it works there: the row goes only when
        # this transaction can take that lock (until its end), so no call is left working in a removed workspace.
        with self.database.connection() as connection, connection.transaction():
            free = connection.execute("SELECT pg_try_advisory_xact_lock(%s)", (workspace_lock(workspace_id),))
            row = free.fetchone()
            if not (row and row[0]):
                return False
            connection.execute("DELETE FROM workspaces WHERE id = %s", (workspace_id,))
        return True

    def prelocked(self, workspace_id: str, call: SharedCall | None = None) -> bool:
        """Whether the call took the workspace's lock with its admission (state.calls)."""
        return call is not None and call.locked(workspace_id)

    def let_go(self, workspace_id: str, owner: object) -> None:
        """Forget that `owner` (a call, or a hold's token) holds the workspace. Its lock may have been let go of
        already (a save lets go of it with the call's count), and another call of this replica have taken it
        since: that call's entries are its own, and stay."""
        if self.owners.get(workspace_id) is owner:
            del self.owners[workspace_id]
            self.held.pop(workspace_id, None)
            self.holders.pop(workspace_id, None)

    def saving(self, workspace_id: str, call: SharedCall) -> None:
        """The call's save is about to let go of the workspace's lock: from then on another call of this replica
        may take it, and must not find this one as its holder (its save would go out on this call's connection,
        which this call still uses)."""
        if self.holders.get(workspace_id) is call:
            del self.holders[workspace_id]

    @contextlib.asynccontextmanager
    async def hold(self, workspace_id: str, wait_s: float, call: SharedCall | None = None) -> AsyncIterator[bool]:
        """An advisory lock on a connection of its own, held while the call runs: taken with the call's admission
        when nobody held it then (and let go of with the call's count, in one statement), else taken here, with
        the workspace's generation, in one statement on the event loop, and let go of in another."""
        generation = call.take_lock(workspace_id) if call is not None else None
        if call is not None and generation is not None:
            self.held[workspace_id], self.owners[workspace_id] = generation, call
            self.holders[workspace_id] = call
            try:
                yield True
            finally:
                self.let_go(workspace_id, call)
                await call.end()
            return
        key, token = workspace_lock(workspace_id), object()
        stack = contextlib.AsyncExitStack()
        try:
            with anyio.CancelScope(shield=True):  # a lock taken is always let go of
                connection = await stack.enter_async_context(self.database.aconnection())
                generation = await _lock(connection, key, workspace_id, wait_s)
            if generation is None:
                yield False
                return
            self.held[workspace_id], self.owners[workspace_id] = generation, token
            try:
                yield True
            finally:
                self.let_go(workspace_id, token)
                with anyio.CancelScope(shield=True), contextlib.suppress(psycopg.Error):
                    await connection.execute("SELECT pg_advisory_unlock(%s)", (key,))
        finally:
            with anyio.CancelScope(shield=True), contextlib.suppress(Refusal):
                await stack.aclose()


async def _lock(connection: psycopg.AsyncConnection[Any], key: int, workspace_id: str, wait_s: float) -> int | None:
    """Take the lock: at once when nobody holds it (one round trip, which also reads the workspace's generation),
    else waiting up to `wait_s`. The generation then (0: none saved), or None when the lock was not had."""
    generation_of = "(SELECT generation FROM workspaces WHERE id = %s)"
    cursor = await connection.execute(f"SELECT pg_try_advisory_lock(%s), {generation_of}", (key, workspace_id))
    row = await cursor.fetchone()
    if row is not None and row[0]:
        return int(row[1] or 0)
    try:
        await connection.execute(f"SET lock_timeout = {max(1, int(wait_s * 1000))}")
        cursor = await connection.execute(f"SELECT pg_advisory_lock(%s), {generation_of}", (key, workspace_id))
        row = await cursor.fetchone()
        return int(row[1] or 0) if row is not None else 0
    except psycopg.errors.LockNotAvailable:
        return None
    finally:
        with contextlib.suppress(psycopg.Error):
            await connection.execute("SET lock_timeout = 0")


class SharedArchives(ArchivedContents):
    """Archives kept in the database; this replica's folder caches the generation it last read of each."""

    def __init__(self, root: Path, book: SharedBook) -> None:
        super().__init__(root)
        self.book, self.database = book, book.database
        self.held = book.held
        """The workspaces a call of this replica holds now, with their generation: no other replica writes them,
        so their generation is known without asking."""
        self._have: dict[str, int] = {}
        """The generation of each workspace whose archive this replica's folder holds."""
        self._lock = threading.Lock()

    def refresh(self, workspace_id: str) -> None:
        """Bring this replica's copy of the archive to the database's generation (known without asking while a
        call of this replica holds the workspace)."""
        generation = self.held.get(workspace_id)
        if generation is None:
            rows = self.database.run("SELECT generation FROM workspaces WHERE id = %s", (workspace_id,))
            generation = rows[0][0] if rows else 0
        with self._lock:
            if self._have.get(workspace_id) == generation:
                return
            path = self.archive_path(workspace_id)
            if generation == 0:
                path.unlink(missing_ok=True)
            else:
                partial = self.root / f".{workspace_id}.tar.read"
                try:
                    with self.database.connection() as connection, connection.transaction(), open(partial, "wb") as out:
                        with connection.cursor(name=f"read-{workspace_id}") as cursor:
                            cursor.itersize = 4
                            cursor.execute(
                                "SELECT b.data FROM workspace_chunks c JOIN workspace_blobs b ON b.digest = c.digest "
                                "WHERE c.workspace_id = %s AND c.generation = %s ORDER BY c.seq",
                                (workspace_id, generation),
                            )
                            for (data,) in cursor:
                                out.write(data)
                    os.replace(partial, path)
                finally:
                    partial.unlink(missing_ok=True)
            self._have[workspace_id] = generation

    def begin(self, workspace_id: str, spec: SandboxSpec) -> SandboxSpec:
        self.refresh(workspace_id)
        return super().begin(workspace_id, spec)

    def _members(self, workspace_id: str) -> Iterator[Any]:
        self.refresh(workspace_id)
        yield from super()._members(workspace_id)

    def keep(self, workspace_id: str, saved: Path) -> str | None:
        """One statement saves a small workspace whole: its record with its new size, when the host's cap has
        room for it, its new generation and its archive (a larger archive's other chunks follow in the same
        transaction)."""
        record, cap = self.book.sizing.pop(workspace_id, (None, None))
        call = self.book.holders.get(workspace_id)
        if call is not None and call.holds(workspace_id) and saved.stat().st_size <= CHUNK_BYTES:
            return self._keep_and_end(call, workspace_id, saved, record, cap)
        try:
            with self.database.connection() as connection, open(saved, "rb") as archive:
                whole = os.fstat(archive.fileno()).st_size <= CHUNK_BYTES
                with contextlib.nullcontext() if whole else connection.transaction():
                    first = archive.read(CHUNK_BYTES)
                    row = connection.execute(_SAVE, (workspace_id, first, record, cap)).fetchone()
                    generation, problem = _saved(row, cap)
                    if generation is None:
                        return problem
                    if not whole:
                        _add_chunks(connection, archive, workspace_id, generation)
        except StateUnavailable as exc:
            return f"the workspace was not saved ({exc}); it is as the previous call left it"
        with self._lock:
            os.replace(saved, self.archive_path(workspace_id))
            self._holding(workspace_id, generation)
        return None

    def _keep_and_end(
        self, call: SharedCall, workspace_id: str, saved: Path, record: str | None, cap: int | None
    ) -> str | None:
        """A small workspace saved by the call that holds it since its admission, in the same trip as the call lets
        go of it (state.calls). The lock is let go of as soon as the save commits, so this replica's copy is made
        first, and marked unsure until then: whoever finds it so reads the database's."""
        first = saved.read_bytes()
        path = self.archive_path(workspace_id)
        with self._lock:
            os.replace(saved, path)
            self._have.pop(workspace_id, None)
            mine = _identity(path)
        self.book.saving(workspace_id, call)
        try:
            row = anyio.from_thread.run(call.save_and_end, _SAVE, (workspace_id, first, record, cap))
        except StateUnavailable as exc:
            return f"the workspace was not saved ({exc}); it is as the previous call left it"
        generation, problem = _saved(row, cap)
        if generation is None:
            return problem
        with self._lock:  # unless a call of this replica took the lock since then, and made the copy its own
            if _identity(path) == mine:
                self._have[workspace_id] = generation
            if self.book.owners.get(workspace_id) is call:
                self.held[workspace_id] = generation
        return None

    def _holding(self, workspace_id: str, generation: int) -> None:
        """This replica's copy is the workspace's saved generation now (under `_lock`)."""
        self._have[workspace_id] = generation
        if workspace_id in self.held:
            self.held[workspace_id] = generation

    def copy(self, source_id: str, target_id: str) -> None:
        """A new workspace holding what `source_id` holds now, in one transaction: its row (a stand-in record, not
        named and just used, which the store then writes whole) and a copy of its saved generation's chunks under
        the same generation, so any replica reads the copy as it reads any workspace. Only the chunks' names are
        copied: the copy shares their content (kept once, by its SHA-256) until one of them saves."""
        with self.database.connection() as connection, connection.transaction():
            made = connection.execute(_COPY_ROW, {"source": source_id, "target": target_id, "now": time.time()})
            if made.fetchone() is None:
                raise Refusal(
                    "refused: on replicas sharing a database (serve --state) a snapshot is restored into a new "
                    'workspace, not into one that exists: leave out "replace"',
                    "replace",
                )
            connection.execute(_COPY_CHUNKS, {"source": source_id, "target": target_id})

    def remove(self, workspace_id: str, later: bool = False) -> None:
        with self._lock:
            self._have.pop(workspace_id, None)
            super().remove(workspace_id, later)

    def sweep(self) -> None:
        """Remove the chunks no generation of any workspace names, once unused for CHUNK_GRACE_S (a save names
        the chunks it puts, and marks each used as it does, in its own transaction)."""
        self.database.run(_SWEEP_CHUNKS, (CHUNK_GRACE_S,))


def _identity(path: Path) -> tuple[int, int] | None:
    """Which file `path` is now (None: none), to tell whether another replaced it since."""
    try:
        found = path.stat()
    except FileNotFoundError:
        return None
    return found.st_ino, found.st_mtime_ns


_SAVE = "SELECT * FROM sandbox_save_workspace(%s, %s, %s, %s)"
_SWEEP_CHUNKS = (
    "DELETE FROM workspace_blobs b WHERE b.touched < now() - make_interval(secs => %s) "
    "AND NOT EXISTS (SELECT 1 FROM workspace_chunks c WHERE c.digest = b.digest)"
)
_COPY_ROW = (
    "INSERT INTO workspaces (id, client, session, record, generation) "
    "SELECT %(target)s, client, NULL, jsonb_set(jsonb_set(jsonb_set(jsonb_set(record, '{id}', to_jsonb(%(target)s::text)), "
    "'{owner}', 'null'), '{name}', 'null'), '{last_used}', to_jsonb(%(now)s::float8)), generation "
    "FROM workspaces WHERE id = %(source)s FOR SHARE ON CONFLICT (id) DO NOTHING RETURNING id"
)
_COPY_CHUNKS = (
    "INSERT INTO workspace_chunks (workspace_id, generation, seq, digest) "
    "SELECT %(target)s, c.generation, c.seq, c.digest FROM workspace_chunks c JOIN workspaces w "
    "ON w.id = c.workspace_id AND w.generation = c.generation WHERE c.workspace_id = %(source)s"
)


def _saved(row: tuple[Any, ...] | None, cap: int | None) -> tuple[int | None, str | None]:
    """The generation a save made; else why it made none."""
    generation, taken = row if row is not None else (None, None)
    if generation is not None:
        return int(generation), None
    if taken is not None and cap is not None:
        return None, over_cap(taken, cap)
    return None, "the workspace was removed while the call ran; nothing was saved"


def _add_chunks(connection: psycopg.Connection[Any], archive: BinaryIO, workspace_id: str, generation: int) -> None:
    """The chunks after the first, as a pipeline (no round trip each), synced every few so that no more than those
    wait in memory."""
    with connection.pipeline() as pipeline, connection.cursor() as cursor:
        seq = 1
        while chunk := archive.read(CHUNK_BYTES):
            cursor.execute(
                "INSERT INTO workspace_chunks (workspace_id, generation, seq, digest) "
                "VALUES (%s, %s, %s, sandbox_put_chunk(%s))",
                (workspace_id, generation, seq, chunk),
            )
            seq += 1
            if seq % CHUNKS_IN_FLIGHT == 0:
                pipeline.sync()
