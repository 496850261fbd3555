"""What shared state costs and gives: the latency a PostgreSQL database adds to a call that continues a kept
workspace, and the throughput of one replica against two behind HAProxy on this one machine.

Latency: a 2026-07-28 client over Streamable HTTP continues one workspace (`echo n >> /workspace/log`), spaced
`--gap-s`, against one server keeping archived workspaces in local files and against one replica keeping them
in PostgreSQL (the same archives, carried the same way: the difference is the database), and beside both the
default mounted workspaces. Throughput: `--callers` clients each making `--calls` `true` calls at once (a policy
that keeps no workspace)
through HAProxy (deploy/haproxy.cfg) to one replica (both of its servers the same replica) and to two. The two
replicas share this machine's engine and its two cores, so no gain is expected here: the row shows what the
balancer and the second process cost. Writes bench/results/replicas.json.
"""

from __future__ import annotations

import argparse
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
from sandbox_server.policy import RateLimits
from sandbox_server.state.database import Database
from sandbox_server.workspaces.records import WorkspaceRecord
from sandbox_server.workspaces.shared import SharedArchives, SharedBook
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


async def continued(url: str, rounds: int, gap_s: float) -> dict[str, float]:
    """Calls continuing one workspace: their latency."""
    samples = []
    async with Client(url, mode="2026-07-28") as client:
        first = await client.call_tool("execute_command", {"command": "echo 0 > /workspace/log"})
        workspace = (first.structured_content or {})["workspace"]
        for turn in range(rounds + 2):
            started = time.perf_counter()
            result = await client.call_tool("execute_command", {"command": f"echo {turn} >> /workspace/log",
                                                                "workspace": workspace})  # fmt: skip
            if turn >= 2:  # the first two warm the path
                samples.append(time.perf_counter() - started)
            assert not result.is_error, result.content
            await anyio.sleep(gap_s)
    return percentiles(samples)


async def database_path(url: str, folder: Path, rounds: int) -> dict[str, float]:
    """What a replica asks of the database for one call continuing a workspace, in the order it asks, through
    the same stores and trips to worker threads as a call: the calls per minute and the calls running (counted, and let
    go), the workspace records (read at open, and again with the new size at save, which writes the record), the
    workspace's lock (taken and let go), its generation, and the save of a small archive (one chunk)."""
    database = Database(url, "bench-database-path")
    await anyio.to_thread.run_sync(database.open)
    rate, book = SharedRate(database), SharedBook(database)
    archives = SharedArchives(folder, database, book.held)
    limits = RateLimits(calls_per_minute=100_000, concurrent_calls=8)
    now = time.time()
    record = WorkspaceRecord(id="ws-bench-database-path", session=None, client="bench", created=now, last_used=now)
    await anyio.to_thread.run_sync(book.write, record)
    saved = folder / "saved.tar"
    samples = []
    try:
        for turn in range(rounds + 2):
            saved.write_bytes(b"workspace archive " * 512)  # a small workspace: one chunk
            started = time.perf_counter()
            await anyio.to_thread.run_sync(rate.count, "bench", limits, "bench")
            call = await anyio.to_thread.run_sync(rate.enter, "bench", limits, "bench")
            await anyio.to_thread.run_sync(book.load)
            async with book.hold(record.id, 5.0):
                await anyio.to_thread.run_sync(archives._fresh, record.id, True)  # as begin() asks, in its thread

                def finish() -> None:  # as the store's finish does, in one thread: room check, save, record
                    book.load()
                    archives._keep(record.id, saved)
                    book.write(record)

                await anyio.to_thread.run_sync(finish)
            await anyio.to_thread.run_sync(rate.leave, call)
            if turn >= 2:
                samples.append(time.perf_counter() - started)
    finally:
        await anyio.to_thread.run_sync(book.delete, record.id)
        await anyio.to_thread.run_sync(database.close)
    return percentiles(samples)


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
    parser.add_argument("--rounds", type=int, default=40, help="calls continuing one workspace (default 40)")
    parser.add_argument("--gap-s", type=float, default=0.2, help="pause between those calls (default 0.2 s)")
    parser.add_argument("--callers", type=int, default=8, help="clients at once for throughput (default 8)")
    parser.add_argument("--calls", type=int, default=10, help="calls each of them makes (default 10)")
    options = parser.parse_args(argv)
    latency: dict[str, dict[str, float]] = {}
    throughput: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory(prefix="bench-replicas-") as name, ExitStack() as stack:
        folder = Path(name)
        policy = folder / "bench.yaml"
        policy.write_text(POLICY)
        stateless = folder / "stateless.yaml"
        stateless.write_text(STATELESS)
        args = ("--policy", str(policy))
        database = stack.enter_context(postgres())
        (folder / "path").mkdir()
        database_row = anyio.run(database_path, database.url, folder / "path", options.rounds * 5)
        for number, (label, state, extra) in enumerate(
            (
                ("mounted workspace, one server (the default)", None, ()),
                ("archived workspace, local files", None, ("--workspaces", "archived")),
                ("archived workspace, PostgreSQL (--state)", database.url, ()),
            )
        ):
            with replica(folder / f"latency-{number}", state, *args, *extra) as one:
                latency[label] = anyio.run(continued, one.url, options.rounds, options.gap_s)
        args = ("--policy", str(stateless))
        with replica(folder / "one", database.url, *args) as one:
            with haproxy(folder, one, one) as url:
                throughput["1 replica behind HAProxy"] = anyio.run(flood, url, options.callers, options.calls)
            with replica(folder / "two", database.url, *args) as two, haproxy(folder, one, two) as url:
                throughput["2 replicas behind HAProxy"] = anyio.run(flood, url, options.callers, options.calls)
    local = latency["archived workspace, local files"]["p50"]
    print_table(
        ("a call continuing a workspace", "p50 ms", "p95 ms", "p50 - local archives"),
        [(name, row["p50"], row["p95"], f"{row['p50'] - local:+.1f} ms") for name, row in latency.items()],
    )
    print()
    print_table(
        ("the database's part of one such call", "p50 ms", "p95 ms"),
        [("count, hold, read, save, let go (target: p50 under 5 ms)", database_row["p50"], database_row["p95"])],
    )
    print()
    print_table(
        ("stateless calls at once", "calls/s", "seconds", "failed"),
        [(name, row["calls_per_s"], row["seconds"], row["failed"]) for name, row in throughput.items()],
    )
    results = {"options": vars(options), "latency": latency, "database_path": database_row, "throughput": throughput}
    path = write_results("replicas", results)
    print(f"wrote {path}")
    return 0
