"""What shared state costs and gives: the latency a PostgreSQL database adds to a call that continues a kept
workspace, and the throughput of one replica against two behind HAProxy on this one machine.

Latency: a 2026-07-28 client over Streamable HTTP continues one workspace (`echo n >> /workspace/log`) on each
of three servers running at once, which take turns, spaced `--gap-s`: one keeping archived workspaces in local
files, one replica keeping them in PostgreSQL (the same archives, carried the same way: the difference is the
database), and one with the default mounted workspaces; the difference from local archives is taken turn by
turn. Then the database's part alone: the same call through the server's own stores, without an engine. Throughput: `--callers` clients each making `--calls` `true` calls at once (a policy
that keeps no workspace)
through HAProxy (deploy/haproxy.cfg) to one replica (both of its servers the same replica) and to two. The two
replicas share this machine's engine and its two cores, so no gain is expected here: the row shows what the
balancer and the second process cost. Writes bench/results/replicas.json.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import io
import tarfile
import tempfile
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import anyio
from mcp import Client

from bench.common import print_table, write_results
from bench.measure import percentiles
from sandbox_server.access.shared import SharedRate
from sandbox_server.policy import RateLimits, WorkspaceSettings
from sandbox_server.sandbox.spec import ExecutionResult, SandboxSpec
from sandbox_server.state.database import Database
from sandbox_server.workspaces.kept import KeptWorkspace
from sandbox_server.workspaces.shared import SharedArchives, SharedBook
from sandbox_server.workspaces.store import WorkspaceStore
from tests.replicas import Replica, haproxy, postgres, start_replica

POLICY = """\
extends: default
rate: {calls_per_minute: 100000, concurrent_calls: 8}
"""
STATELESS = """\
extends: default
rate: {calls_per_minute: 100000, concurrent_calls: 8}
workspace: {persist: false}
"""


async def continued(urls: dict[str, str], rounds: int, gap_s: float) -> dict[str, dict[str, float]]:
    """Calls continuing one workspace on each server, the servers taking turns (in a rotating order, so that none
    always follows another): each server's latency, and per turn each one's difference from the first server's."""
    samples: dict[str, list[float]] = {name: [] for name in urls}
    added: dict[str, list[float]] = {name: [] for name in urls}
    async with contextlib.AsyncExitStack() as stack:
        clients, workspaces = {}, {}
        for name, url in urls.items():
            clients[name] = await stack.enter_async_context(Client(url, mode="2026-07-28"))
            first = await clients[name].call_tool("execute_command", {"command": "echo 0 > /workspace/log"})
            workspaces[name] = (first.structured_content or {})["workspace"]
        names = list(urls)
        for turn in range(rounds + 2):
            took = {}
            for name in names[turn % len(names) :] + names[: turn % len(names)]:
                started = time.perf_counter()
                arguments = {"command": f"echo {turn} >> /workspace/log", "workspace": workspaces[name]}
                result = await clients[name].call_tool("execute_command", arguments)
                took[name] = time.perf_counter() - started
                assert not result.is_error, result.content
                await anyio.sleep(gap_s)
            if turn >= 2:  # the first two warm the path
                for name in names:
                    samples[name].append(took[name])
                    added[name].append(took[name] - took[names[0]])
    return {name: {**percentiles(samples[name]), "added_p50": percentiles(added[name])["p50"]} for name in names}


class Saving:
    """A runtime whose program appends a line to the workspace's one file: the workspace archive a sandbox would
    hand back, made without an engine, so that only the stores are measured."""

    def __init__(self) -> None:
        self.log = b""

    async def run(self, spec: SandboxSpec, hooks: object = None) -> ExecutionResult:
        self.log += b"workspace archive line\n" * 16
        archive = tempfile.TemporaryFile()
        with tarfile.open(fileobj=archive, mode="w") as tar:
            member = tarfile.TarInfo("log")
            member.size = len(self.log)
            tar.addfile(member, io.BytesIO(self.log))
        archive.seek(0)
        return ExecutionResult(exit_code=0, stdout=b"", stderr=b"", duration_ms=0, workspace=archive)


async def database_part(url: str, folder: Path, rounds: int) -> dict[str, Any]:
    """What the database adds to a call continuing an archived workspace: the same call through the server's own
    stores, in the same order and trips to worker threads as a call (the call counted and entered with its
    workspace read and locked, the workspace opened by its id, begun and saved, lock and call let go), once with
    local files and once with PostgreSQL, alternately; the median of the pairs' differences."""
    database = Database(url, "bench-database-part")
    await anyio.to_thread.run_sync(database.open)
    settings = WorkspaceSettings(persist=True)
    local = WorkspaceStore(folder / "local", settings, 1 << 30)
    book = SharedBook(database)
    shared = WorkspaceStore(folder / "shared", settings, 1 << 30, functools.partial(SharedArchives, book=book), book)
    rate, limits = SharedRate(database), RateLimits(calls_per_minute=100_000, concurrent_calls=8)
    spec = SandboxSpec(image="bench", argv=("true",))

    async def call(store: WorkspaceStore, runtime: Saving, workspace: str | None) -> tuple[float, str]:
        started = time.perf_counter()
        entered = None
        if store is shared:
            entered = await rate.admit("bench", limits, "bench", workspace)
        try:
            kept = await anyio.to_thread.run_sync(
                KeptWorkspace.open, runtime, store, workspace, None, "bench", None, entered
            )
            assert kept is not None
            result = await kept.run(spec)
            assert kept.saved, result
        finally:
            if entered is not None:
                await rate.leave(entered)
        return time.perf_counter() - started, kept.record.id

    try:
        runtimes = {local: Saving(), shared: Saving()}
        workspaces = {store: (await call(store, runtimes[store], None))[1] for store in (local, shared)}
        samples: dict[str, list[float]] = {"local": [], "shared": [], "added": []}
        for turn in range(rounds + 2):
            took = {store: (await call(store, runtimes[store], workspaces[store]))[0] for store in (local, shared)}
            if turn >= 2:  # the first two warm the path
                samples["local"].append(took[local])
                samples["shared"].append(took[shared])
                samples["added"].append(took[shared] - took[local])
    finally:
        shared.close()
        await anyio.to_thread.run_sync(book.delete, workspaces[shared])
        await database.aclose()
        await anyio.to_thread.run_sync(database.close)
    return {name: percentiles(values) for name, values in samples.items()}


async def flood(url: str, callers: int, calls: int) -> dict[str, Any]:
    """`callers` clients making `calls` stateless calls each at once: calls per second, and failures."""
    failed = 0

    async def caller() -> None:
        nonlocal failed
        async with Client(url, mode="2026-07-28") as client:
            for _ in range(calls):
                result = await client.call_tool("execute_command", {"command": "true"})
                failed += bool(result.is_error)

    started = time.perf_counter()
    async with anyio.create_task_group() as group:
        for _ in range(callers):
            group.start_soon(caller)
    elapsed = time.perf_counter() - started
    return {"calls_per_s": round(callers * calls / elapsed, 2), "seconds": round(elapsed, 2), "failed": failed}


@contextmanager
def replica(folder: Path, state_url: str | None, *args: str) -> Iterator[Replica]:
    served = start_replica(folder, state_url, *args)
    try:
        yield served
    finally:
        served.stop()


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench replicas", description=__doc__)
    parser.add_argument("--rounds", type=int, default=100, help="calls continuing one workspace (default 100)")
    parser.add_argument("--gap-s", type=float, default=0.2, help="pause between those calls (default 0.2 s)")
    parser.add_argument("--callers", type=int, default=8, help="clients at once for throughput (default 8)")
    parser.add_argument("--calls", type=int, default=10, help="calls each of them makes (default 10)")
    options = parser.parse_args(argv)
    throughput: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory(prefix="bench-replicas-") as name, ExitStack() as stack:
        folder = Path(name)
        policy = folder / "bench.yaml"
        policy.write_text(POLICY)
        stateless = folder / "stateless.yaml"
        stateless.write_text(STATELESS)
        args = ("--policy", str(policy))
        database = stack.enter_context(postgres())
        database_row = anyio.run(database_part, database.url, folder / "part", options.rounds * 5)
        servers = {
            "archived workspace, local files": (None, ("--workspaces", "archived")),
            "archived workspace, PostgreSQL (--state)": (database.url, ("--workspaces", "archived")),
            "mounted workspace, one server (the default)": (None, ()),
        }
        with ExitStack() as running:
            urls = {
                label: running.enter_context(replica(folder / f"latency-{number}", state, *args, *extra)).url
                for number, (label, (state, extra)) in enumerate(servers.items())
            }
            latency = anyio.run(continued, urls, options.rounds, options.gap_s)
        stateless_args = ("--policy", str(stateless), "--workspaces", "archived")
        with replica(folder / "one", database.url, *stateless_args) as one:
            with haproxy(folder, one, one) as url:
                throughput["1 replica behind HAProxy"] = anyio.run(flood, url, options.callers, options.calls)
            with replica(folder / "two", database.url, *stateless_args) as two, haproxy(folder, one, two) as url:
                throughput["2 replicas behind HAProxy"] = anyio.run(flood, url, options.callers, options.calls)
    print_table(
        ("a call continuing a workspace (servers taking turns)", "p50 ms", "p95 ms", "vs local archives, per turn"),
        [(name, row["p50"], row["p95"], f"{row['added_p50']:+.1f} ms") for name, row in latency.items()],
    )
    print()
    print_table(
        ("the stores' part of one such call", "p50 ms", "p95 ms"),
        [
            ("local files", database_row["local"]["p50"], database_row["local"]["p95"]),
            ("PostgreSQL", database_row["shared"]["p50"], database_row["shared"]["p95"]),
            (
                "added by PostgreSQL, pair by pair (target: p50 under 5 ms)",
                database_row["added"]["p50"],
                database_row["added"]["p95"],
            ),
        ],  # fmt: skip
    )
    print()
    print_table(
        ("stateless calls at once", "calls/s", "seconds", "failed"),
        [(name, row["calls_per_s"], row["seconds"], row["failed"]) for name, row in throughput.items()],
    )
    results = {"options": vars(options), "latency": latency, "database_part": database_row, "throughput": throughput}
    path = write_results("replicas", results)
    print(f"wrote {path}")
    return 0
