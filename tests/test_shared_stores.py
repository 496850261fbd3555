"""The shared state's stores against a real PostgreSQL, two replicas' worth in one process: the host's cap over
every replica's workspaces, a save that finds its workspace gone, a call counted against both of its limits
in one statement, and a call continuing a workspace that is counted, reads its record and takes its lock in that
same statement and lets go of lock and count together. The programs are a stand-in that hands back a workspace archive (the engine's part is proven
by test_replicas); everything the database does is real."""

from __future__ import annotations

import functools
import io
import os
import tarfile
import tempfile
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import anyio
import psycopg
import pytest

from sandbox_server.access.shared import SharedRate
from sandbox_server.errors import Refusal
from sandbox_server.policy import RateLimits, WorkspaceSettings
from sandbox_server.sandbox.runtime import NO_HOOKS, RunHooks
from sandbox_server.sandbox.spec import ExecutionResult, SandboxSpec
from sandbox_server.state.calls import workspace_lock
from sandbox_server.state.database import Database
from sandbox_server.workspaces.kept import KeptWorkspace
from sandbox_server.workspaces.shared import SharedArchives, SharedBook
from sandbox_server.workspaces.store import WorkspaceStore
from tests.replicas import Postgres, postgres

pytestmark = pytest.mark.anyio

CAP = 64 * 1024
LIMITS = RateLimits(calls_per_minute=1000, concurrent_calls=8)
SPEC = SandboxSpec(image="unused", argv=("true",))


@pytest.fixture(scope="module")
def database() -> Iterator[Postgres]:
    with postgres() as started:
        yield started


class Writes:
    """A program that leaves one file of `size` bytes in the workspace, as the sandbox hands it back."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.found: bytes | None = None

    async def run(self, spec: SandboxSpec, hooks: RunHooks = NO_HOOKS) -> ExecutionResult:
        if spec.saved_workspace:  # what the call found: the archive its workspace was restored from
            self.found = Path(spec.saved_workspace).read_bytes()
        archive = tempfile.TemporaryFile()
        with tarfile.open(fileobj=archive, mode="w") as tar:
            member = tarfile.TarInfo("data")
            member.size = self.size
            tar.addfile(member, io.BytesIO(b"x" * self.size))
        return ExecutionResult(exit_code=0, stdout=b"", stderr=b"", duration_ms=1, workspace=archive)


class Replica:
    def __init__(
        self, url: str, owner: str, root: Path, cap: int = CAP, settings: WorkspaceSettings | None = None
    ) -> None:
        self.ended_with_its_run = False
        self.database = Database(url, owner)
        self.database.open()
        self.book = SharedBook(self.database)
        contents = functools.partial(SharedArchives, book=self.book)
        self.store = WorkspaceStore(root, settings or WorkspaceSettings(persist=True), cap, contents, self.book)

    async def call(self, program: Writes, workspace: str | None) -> tuple[KeptWorkspace, str]:
        """The call's workspace, and why it was not saved ("" when it was)."""
        kept = await anyio.to_thread.run_sync(KeptWorkspace.open, program, self.store, workspace, None, "client")
        assert kept is not None
        result = await kept.run(SPEC)
        assert kept.saved == (result.workspace_problem is None)
        return kept, result.workspace_problem or ""

    async def admitted(
        self, program: Writes, workspace: str | None, tenant: str | None = None
    ) -> tuple[KeptWorkspace | None, str]:
        """A call as the server makes it with replicas: admitted naming its workspace, then run in it, then let go;
        its workspace (None when it was refused) and why it was not saved or was refused ("" when it was saved)."""
        rate = SharedRate(self.database)
        call = await rate.admit("client", LIMITS, "team", workspace)
        try:
            kept = await anyio.to_thread.run_sync(
                KeptWorkspace.open, program, self.store, workspace, None, "client", tenant, call
            )
            assert kept is not None
            result = await kept.run(SPEC)
            self.ended_with_its_run = call.ended
            return kept, result.workspace_problem or ""
        except Refusal as refused:
            return None, str(refused)
        finally:
            await rate.leave(call)

    def generation(self, workspace: str) -> int:
        return int(self.database.run("SELECT generation FROM workspaces WHERE id = %s", (workspace,))[0][0])


@pytest.fixture
async def replicas(database: Postgres, tmp_path: Path) -> AsyncIterator[tuple[Replica, Replica]]:
    one, two = Replica(database.url, "one", tmp_path / "one"), Replica(database.url, "two", tmp_path / "two")
    yield one, two
    database.query("DELETE FROM workspaces")
    for replica in (one, two):
        await replica.database.aclose()
        await anyio.to_thread.run_sync(replica.database.close)


async def test_the_host_cap_counts_every_replicas_workspaces_and_a_refused_save_keeps_the_one_before(
    replicas: tuple[Replica, Replica],
) -> None:
    one, two = replicas
    big, problem = await one.call(Writes(36 * 1024), None)
    assert big.saved, problem
    small, problem = await two.call(Writes(4 * 1024), None)
    assert small.saved and two.generation(small.record.id) == 1, problem

    grown, said = await two.call(Writes(30 * 1024), small.record.id)  # 36 KiB on the other replica + 30 KiB
    assert not grown.saved
    assert "above the host's cap of 65536" in said and "policy field host.workspace_storage_mb" in said, said
    assert two.generation(small.record.id) == 1  # nothing of the refused save was kept

    # Continued on the first replica, it finds the archive of the last save that was kept: 4 KiB.
    program = Writes(4 * 1024)
    again, problem = await one.call(program, small.record.id)
    assert again.saved and program.found is not None, problem
    with tarfile.open(fileobj=io.BytesIO(program.found)) as kept:
        sizes = {member.name: member.size for member in kept}
    assert sizes == {"workspace/data": 4 * 1024}, sizes
    assert one.generation(small.record.id) == 2


async def test_a_workspace_removed_on_another_replica_while_its_call_ran_is_not_saved(
    replicas: tuple[Replica, Replica],
) -> None:
    one, two = replicas
    first, _ = await one.call(Writes(1024), None)

    class RemovedMeanwhile(Writes):
        async def run(self, spec: SandboxSpec, hooks: RunHooks = NO_HOOKS) -> ExecutionResult:
            await anyio.to_thread.run_sync(two.book.delete, first.record.id)
            return await super().run(spec, hooks)

    during, problem = await one.call(RemovedMeanwhile(1024), first.record.id)
    assert not during.saved and "removed while the call ran" in problem, problem
    assert not one.database.run("SELECT 1 FROM workspace_chunks WHERE workspace_id = %s", (first.record.id,))


async def test_a_workspace_a_call_works_in_is_not_removed_to_make_room_on_another_replica(
    database: Postgres, tmp_path: Path
) -> None:
    """Room for one workspace per client and no protection of recent ones: while a call works in the one on the
    first replica, the second is asked for a new workspace of the same client. It cannot remove that one (the
    call holds its lock), so it refuses the new call as busy, and the call saves what it did."""
    settings = WorkspaceSettings(persist=True, max_per_client=1, protect_recent_s=0)
    one, two = (Replica(database.url, name, tmp_path / name, settings=settings) for name in ("one", "two"))
    try:
        first, _ = await one.call(Writes(1024), None)
        outcome: list[str] = []

        class Crowded(Writes):
            async def run(self, spec: SandboxSpec, hooks: RunHooks = NO_HOOKS) -> ExecutionResult:
                try:
                    await anyio.to_thread.run_sync(KeptWorkspace.open, Writes(1), two.store, None, None, "client")
                    outcome.append("a new workspace was made")
                except Refusal as refused:
                    outcome.append(f"{refused} ({refused.field})")
                return await super().run(spec, hooks)

        during, problem = await one.call(Crowded(2048), first.record.id)
        assert during.saved, problem
        assert outcome and "each is in use" in outcome[0] and "(workspace.max_per_client)" in outcome[0], outcome
    finally:
        database.query("DELETE FROM workspaces")
        for replica in (one, two):
            await replica.database.aclose()
            await anyio.to_thread.run_sync(replica.database.close)


async def test_a_call_is_counted_and_entered_in_one_statement_and_each_limit_names_its_field(
    replicas: tuple[Replica, Replica],
) -> None:
    one, two = replicas
    running = RateLimits(calls_per_minute=100, concurrent_calls=1)
    call = await SharedRate(one.database).admit("running-key", running, "team")
    with pytest.raises(Refusal) as busy:  # the other replica: the caller already runs as many as it may
        await SharedRate(two.database).admit("running-key", running, "team")
    assert busy.value.field == "rate.concurrent_calls" and "policy 'team'" in str(busy.value)
    await SharedRate(one.database).leave(call)
    await SharedRate(two.database).leave(await SharedRate(two.database).admit("running-key", running, "team"))

    per_minute = RateLimits(calls_per_minute=2, concurrent_calls=5)
    for replica in (one, two):
        await SharedRate(replica.database).leave(
            await SharedRate(replica.database).admit("minute-key", per_minute, "team")
        )
    with pytest.raises(Refusal) as limited:
        await SharedRate(one.database).admit("minute-key", per_minute, "team")
    assert limited.value.field == "rate.calls_per_minute" and "counted across every replica" in str(limited.value)
    # A call refused for its calls per minute is not entered as running.
    assert not one.database.run("SELECT 1 FROM running_calls WHERE key = 'minute-key'")


def held_elsewhere(database: Postgres, workspace: str) -> bool:
    """Whether some connection holds the workspace's lock (asked from a connection of the test's own)."""
    key = workspace_lock(workspace)
    taken = database.query(f"SELECT pg_try_advisory_lock({key})")[0][0]
    if taken:
        database.query(f"SELECT pg_advisory_unlock({key})")  # the test's own connection closes with it anyway
    return not taken


def waits_for_a_lock(database: Postgres) -> bool:
    """Whether a connection waits for an advisory lock (a call past its replica's turn in the workspace)."""
    return bool(database.query("SELECT 1 FROM pg_locks WHERE locktype = 'advisory' AND NOT granted"))


def running(database: Postgres) -> int:
    return int(database.query("SELECT count(*) FROM running_calls")[0][0])


async def test_a_call_continuing_a_workspace_is_admitted_read_and_locked_in_one_statement_and_let_go_in_one(
    database: Postgres, replicas: tuple[Replica, Replica]
) -> None:
    one, _ = replicas
    first, problem = await one.call(Writes(1024), None)
    workspace = first.record.id
    seen: dict[str, object] = {}

    class Watched(Writes):
        async def run(self, spec: SandboxSpec, hooks: RunHooks = NO_HOOKS) -> ExecutionResult:
            call = one.book.holders.get(workspace)  # the call holds its workspace with the lock its admission took
            assert call is not None and call.connection is not None
            seen["held"] = await anyio.to_thread.run_sync(held_elsewhere, database, workspace)
            seen["running"] = await anyio.to_thread.run_sync(running, database)
            return await super().run(spec, hooks)

    asked: list[str] = []
    run = one.database.run

    def noted(sql: str, params: Any = ()) -> list[tuple[Any, ...]]:
        asked.append(sql)
        return run(sql, params)

    one.database.run = noted  # type: ignore[method-assign]
    try:
        kept, problem = await one.admitted(Watched(2048), workspace)
    finally:
        del one.database.run
    assert kept is not None and kept.saved, problem
    assert seen == {"held": True, "running": 1}, seen
    assert one.ended_with_its_run  # lock and count let go of together, once its workspace was saved
    assert one.generation(workspace) == 2
    # The store took the record and generation the admission read: it asked the database for neither again.
    assert not [sql for sql in asked if "FROM workspaces" in sql], asked
    assert not held_elsewhere(database, workspace) and running(database) == 0


async def test_a_call_refused_its_workspace_after_its_admission_lets_go_of_the_lock_it_took(
    database: Postgres, replicas: tuple[Replica, Replica]
) -> None:
    one, two = replicas
    theirs, _ = await one.call(Writes(1024), None)  # made for no caller: another caller may not name it
    refused, said = await two.admitted(Writes(1024), theirs.record.id, tenant="mallory")
    assert refused is None and f"unknown workspace {theirs.record.id!r}" in said, said
    assert not held_elsewhere(database, theirs.record.id) and running(database) == 0
    with anyio.fail_after(10):  # its owner's next call finds it free at once
        again, problem = await one.admitted(Writes(1024), theirs.record.id)
    assert again is not None and again.saved, problem


async def test_a_call_that_locked_its_workspace_at_admission_never_waits_behind_one_of_its_own_replica(
    database: Postgres, replicas: tuple[Replica, Replica]
) -> None:
    """Call B took the workspace's lock with its admission; call A of the same replica, admitted after it and so
    without the lock, reached the workspace first and waits for the lock there. B must not then wait for A on the
    replica's own turn in the workspace: each would wait for the other until their time ran out. And B forgets
    that it holds the workspace before it lets go of the lock, so that A, which takes the lock then, neither finds
    B as its holder (and saves on B's connection while B still uses it) nor loses its own hold to B's leaving."""
    one, _ = replicas
    first, _ = await one.call(Writes(1024), None)
    workspace = first.record.id
    rate = SharedRate(one.database)
    b_call = await rate.admit("client", LIMITS, "team", workspace)
    assert b_call.connection is not None
    a_waits, b_done = anyio.Event(), anyio.Event()
    held_when: dict[str, bool] = {}
    saves_and_ends = b_call.save_and_end

    async def save_and_end(sql: str, params: tuple[Any, ...]) -> tuple[Any, ...] | None:
        held_when["B lets go"] = workspace in one.book.holders
        return await saves_and_ends(sql, params)

    b_call.save_and_end = save_and_end  # type: ignore[method-assign]

    class Noted(Writes):
        def __init__(self, size: int, name: str) -> None:
            super().__init__(size)
            self.name = name

        async def run(self, spec: SandboxSpec, hooks: RunHooks = NO_HOOKS) -> ExecutionResult:
            order.append(self.name)
            if self.name == "A":  # A holds the lock now; B has let go of it, and is leaving
                await b_done.wait()
                held_when["A runs"] = workspace in one.book.held
            return await super().run(spec, hooks)

    order: list[str] = []

    async def call_a() -> None:
        kept, problem = await one.admitted(Noted(1024, "A"), workspace)
        assert kept is not None and kept.saved, problem

    async def call_b() -> None:
        await a_waits.wait()
        try:
            kept = await anyio.to_thread.run_sync(
                KeptWorkspace.open, Noted(2048, "B"), one.store, workspace, None, "client", None, b_call
            )
            assert kept is not None
            await kept.run(SPEC)
            assert kept.saved
        finally:
            b_done.set()
            await rate.leave(b_call)

    with anyio.fail_after(60):  # each waiting for the other would wait until then; in order, a second or two
        async with anyio.create_task_group() as group:
            group.start_soon(call_a)
            while not await anyio.to_thread.run_sync(waits_for_a_lock, database):  # A took the replica's turn
                await anyio.sleep(0.01)
            a_waits.set()
            group.start_soon(call_b)
    assert order == ["B", "A"] and one.generation(workspace) == 3
    assert held_when == {"B lets go": False, "A runs": True}
    assert not held_elsewhere(database, workspace) and running(database) == 0


def archived_sizes(program: Writes) -> dict[str, int]:
    assert program.found is not None
    with tarfile.open(fileobj=io.BytesIO(program.found)) as kept:
        return {member.name: member.size for member in kept}


async def test_a_save_refused_in_the_trip_that_lets_go_leaves_the_workspace_as_it_was_on_every_replica(
    database: Postgres, replicas: tuple[Replica, Replica]
) -> None:
    """The save of a call that locked its workspace at admission goes with its letting go, so its replica's copy
    of the archive is written before the database answers: a refused save must not leave that copy in use."""
    one, two = replicas
    first, problem = await one.admitted(Writes(4 * 1024), None)
    assert first is not None and first.saved, problem
    workspace = first.record.id
    grown, said = await one.admitted(Writes(70 * 1024), workspace)  # past the host's cap of 64 KiB
    assert grown is not None and not grown.saved and "above the host's cap of 65536" in said, said
    assert one.ended_with_its_run and not held_elsewhere(database, workspace) and running(database) == 0
    assert one.generation(workspace) == 1
    for replica in (one, two):  # each finds the archive of the save that was kept
        program = Writes(1024)
        again, problem = await replica.admitted(program, workspace)
        assert again is not None and again.saved, problem
        assert archived_sizes(program) == {"workspace/data": 4 * 1024 if replica is one else 1024}


async def test_a_workspace_too_large_to_save_in_one_statement_is_saved_then_let_go(
    database: Postgres, tmp_path: Path
) -> None:
    big = Replica(database.url, "big", tmp_path / "big", cap=16 * 1024 * 1024)
    try:
        first, problem = await big.admitted(Writes(1024), None)
        assert first is not None and first.saved, problem
        large, problem = await big.admitted(Writes(3 * 1024 * 1024), first.record.id)
        assert large is not None and large.saved and big.ended_with_its_run, problem
        chunks = database.query(f"SELECT count(*) FROM workspace_chunks WHERE workspace_id = '{first.record.id}'")
        assert chunks[0][0] > 1 and big.generation(first.record.id) == 2  # saved in several statements
        assert not held_elsewhere(database, first.record.id) and running(database) == 0
        program = Writes(1024)
        again, problem = await big.admitted(program, first.record.id)
        assert again is not None and again.saved and archived_sizes(program) == {"workspace/data": 3 * 1024 * 1024}
    finally:
        database.query("DELETE FROM workspaces")
        await big.database.aclose()
        await anyio.to_thread.run_sync(big.database.close)


class WritesRandom(Writes):
    """Writes, with bytes of its own each time (no two chunks alike)."""

    async def run(self, spec: SandboxSpec, hooks: RunHooks = NO_HOOKS) -> ExecutionResult:
        if spec.saved_workspace:
            self.found = Path(spec.saved_workspace).read_bytes()
        archive = tempfile.TemporaryFile()
        with tarfile.open(fileobj=archive, mode="w") as tar:
            member = tarfile.TarInfo("data")
            member.size = self.size
            tar.addfile(member, io.BytesIO(os.urandom(self.size)))
        return ExecutionResult(exit_code=0, stdout=b"", stderr=b"", duration_ms=1, workspace=archive)


def count(database: Postgres, sql: str) -> int:
    return int(database.query(sql)[0][0])


BLOBS = "SELECT count(*) FROM workspace_blobs"
UNNAMED = (
    "SELECT count(*) FROM workspace_blobs b WHERE NOT EXISTS "
    "(SELECT 1 FROM workspace_chunks c WHERE c.digest = b.digest)"
)


async def test_a_fork_shares_its_chunks_until_it_saves_and_the_sweep_removes_what_no_generation_names(
    database: Postgres, tmp_path: Path
) -> None:
    big = Replica(database.url, "forks", tmp_path / "forks", cap=64 * 1024 * 1024)
    try:
        origin, problem = await big.call(WritesRandom(3 * 1024 * 1024), None)
        assert origin.saved, problem
        kept, chunks = count(database, BLOBS), count(database, "SELECT count(*) FROM workspace_chunks")
        fork = await anyio.to_thread.run_sync(big.store.fork, origin.record, None, "team")
        snapshot = await anyio.to_thread.run_sync(big.store.snapshot, origin.record, None, "team")
        # Two more workspaces naming the same chunks: not one byte of them kept again.
        assert count(database, BLOBS) == kept and count(database, "SELECT count(*) FROM workspace_chunks") == 3 * chunks
        program = WritesRandom(1024)
        continued, problem = await big.call(program, fork.id)  # the fork reads the chunks it shares
        assert continued.saved and archived_sizes(program) == {"workspace/data": 3 * 1024 * 1024}, problem
        assert count(database, BLOBS) > kept  # its own save: chunks of its own
        for record in (origin.record, fork, snapshot):
            big.store.forget(record)
        await anyio.to_thread.run_sync(big.store.close)  # the removals finish
        unnamed = count(database, UNNAMED)
        assert unnamed >= kept
        # Each marked used just now (as a save naming it would), not minutes ago on a host that stalled meanwhile.
        database.query("UPDATE workspace_blobs SET touched = now()")
        big.store.contents.sweep()
        assert count(database, UNNAMED) == unnamed  # within the grace period a save might be naming them
        database.query("UPDATE workspace_blobs SET touched = now() - interval '1 hour'")
        big.store.contents.sweep()
        assert count(database, UNNAMED) == 0
        dangling = (
            "SELECT count(*) FROM workspace_chunks c LEFT JOIN workspace_blobs b USING (digest) WHERE b.data IS NULL"
        )
        assert count(database, dangling) == 0  # every other workspace's chunks are all there
    finally:
        database.query("DELETE FROM workspaces")
        await big.database.aclose()
        await anyio.to_thread.run_sync(big.database.close)


def test_chunks_kept_before_they_were_kept_by_content_are_moved_over_once() -> None:
    from sandbox_server.state.schema import MIGRATIONS

    with postgres() as older:
        with psycopg.connect(older.url, autocommit=True) as connection, connection.transaction():
            connection.execute("CREATE TABLE schema_version (version integer NOT NULL)")
            for version in range(1, 7):  # the schema before chunks were kept by their content
                connection.execute(MIGRATIONS[version - 1])
                connection.execute("INSERT INTO schema_version (version) VALUES (%s)", (version,))
            connection.execute(
                "INSERT INTO workspaces (id, client, record, generation) VALUES ('ws-a', 'c', '{}', 1), "
                "('ws-b', 'c', '{}', 1)"
            )
            connection.execute(
                "INSERT INTO workspace_chunks (workspace_id, generation, seq, data) VALUES "
                "('ws-a', 1, 0, 'one'), ('ws-a', 1, 1, 'two'), ('ws-b', 1, 0, 'one')"
            )
        now = Database(older.url, "migrating")
        now.open(replica=False)  # migrates
        try:
            assert [row[0] for row in now.run("SELECT version FROM schema_version ORDER BY version")] == [
                *range(1, len(MIGRATIONS) + 1)
            ]
            read = now.run(
                "SELECT c.workspace_id, b.data FROM workspace_chunks c JOIN workspace_blobs b USING (digest) "
                "ORDER BY c.workspace_id, c.seq"
            )
            assert [(w, bytes(d)) for w, d in read] == [("ws-a", b"one"), ("ws-a", b"two"), ("ws-b", b"one")]
            assert count(older, BLOBS) == 2  # 'one' kept once
        finally:
            now.close()
