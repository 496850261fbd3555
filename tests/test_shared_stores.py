"""The shared state's stores against a real PostgreSQL, two replicas' worth in one process: the host's cap over
every replica's workspaces, a save that finds its workspace gone, and a call counted against both of its limits
in one statement. The programs are a stand-in that hands back a workspace archive (the engine's part is proven
by test_replicas); everything the database does is real."""

from __future__ import annotations

import functools
import io
import tarfile
import tempfile
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import anyio
import pytest

from sandbox_server.access.shared import SharedRate
from sandbox_server.errors import Refusal
from sandbox_server.policy import RateLimits, WorkspaceSettings
from sandbox_server.sandbox.spec import ExecutionResult, SandboxSpec
from sandbox_server.state.database import Database
from sandbox_server.workspaces.kept import KeptWorkspace
from sandbox_server.workspaces.shared import SharedArchives, SharedBook
from sandbox_server.workspaces.store import WorkspaceStore
from tests.replicas import Postgres, postgres

pytestmark = pytest.mark.anyio

CAP = 64 * 1024
SPEC = SandboxSpec(image="unused", argv=("true",))


@pytest.fixture(scope="module")
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(scope="module")
def database() -> Iterator[Postgres]:
    with postgres() as started:
        yield started


class Writes:
    """A program that leaves one file of `size` bytes in the workspace, as the sandbox hands it back."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.found: bytes | None = None

    async def run(self, spec: SandboxSpec, on_progress: object = None) -> ExecutionResult:
        if spec.saved_workspace:  # what the call found: the archive its workspace was restored from
            self.found = Path(spec.saved_workspace).read_bytes()
        archive = tempfile.TemporaryFile()
        with tarfile.open(fileobj=archive, mode="w") as tar:
            member = tarfile.TarInfo("data")
            member.size = self.size
            tar.addfile(member, io.BytesIO(b"x" * self.size))
        return ExecutionResult(exit_code=0, stdout=b"", stderr=b"", duration_ms=1, workspace=archive)


class Replica:
    def __init__(self, url: str, owner: str, root: Path) -> None:
        self.database = Database(url, owner)
        self.database.open()
        self.book = SharedBook(self.database)
        contents = functools.partial(SharedArchives, book=self.book)
        self.store = WorkspaceStore(root, WorkspaceSettings(persist=True), CAP, contents, self.book)

    async def call(self, program: Writes, workspace: str | None) -> tuple[KeptWorkspace, str]:
        """The call's workspace, and why it was not saved ("" when it was)."""
        kept = await anyio.to_thread.run_sync(KeptWorkspace.open, program, self.store, workspace, None, "client")
        assert kept is not None
        result = await kept.run(SPEC)
        assert kept.saved == (result.workspace_problem is None)
        return kept, result.workspace_problem or ""

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
        async def run(self, spec: SandboxSpec, on_progress: object = None) -> ExecutionResult:
            await anyio.to_thread.run_sync(two.book.delete, first.record.id)
            return await super().run(spec, on_progress)

    during, problem = await one.call(RemovedMeanwhile(1024), first.record.id)
    assert not during.saved and "removed while the call ran" in problem, problem
    assert not one.database.run("SELECT 1 FROM workspace_chunks WHERE workspace_id = %s", (first.record.id,))


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
