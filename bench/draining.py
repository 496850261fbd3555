"""A rolling restart of two replicas under load: what callers see while each replica drains and comes back.

    scripts/run bench draining [--callers 8] [--before-s 15] [--homes]

Two replicas share a PostgreSQL of their own behind HAProxy (deploy/haproxy.cfg), on this machine's engine. `--callers`
2026-07-28 clients make `execute_command echo` calls back to back through HAProxy (a policy that keeps no workspace,
and lets the host's load pass its default guard: 8 callers and two replicas with no warm pool load 2 cores past it),
and one long task (`sleep 12`) is started through it. After `--before-s` seconds of that, each replica in turn is
sent SIGTERM, waited for (it drains: new calls go to the other, running ones finish), started again on its port,
and waited for until HAProxy sends it calls again. The calls go on for as long again after the second replica is
back. Every call is timed from its start to its answer: p50 and p95 before the restart and during it (from the
first SIGTERM to the second replica back), how many failed, and how the task ended.
With `--homes`, the replicas keep each workspace mounted on its home and each caller continues one of its own: a
call fails also when it does not see every line the caller's calls before it appended.
Writes bench/results/draining.json (draining-homes.json with --homes).
"""

from __future__ import annotations

import argparse
import functools
import signal
import tempfile
import time
from pathlib import Path
from typing import Any

import anyio
import anyio.to_thread
from mcp import Client

from bench.common import print_table, write_results
from bench.measure import percentiles
from sandbox_server.protocol.tasks_client import TasksExtension
from tests.replicas import haproxy, postgres, start_replica, start_replicas
from tests.test_tasks import request

POLICY = """\
extends: default
defaults:
  limits: {timeout_s: 20, max_timeout_s: 20, max_task_s: 120}
rate: {calls_per_minute: 100000, concurrent_calls: 16}
workspace: {persist: false}
host: {max_load_per_cpu: 100}
tasks: {running: 4, running_per_caller: 4, per_caller: 20, ttl_s: 600, poll_interval_ms: 200}
"""


HOMES = POLICY.replace("workspace: {persist: false}", "workspace: {max_per_client: 64}")
"""With homes: each caller continues a workspace of its own, which lives on one replica or the other."""


async def run(folder: Path, callers: int, before_s: float, homes: bool = False) -> dict[str, Any]:
    policy = folder / "policy.yaml"
    policy.write_text(HOMES if homes else POLICY)
    args = ("--policy", str(policy), "--no-pool", "--grace-s", "30", "--workspaces", "mounted" if homes else "archived")
    timed: list[tuple[float, float, bool]] = []
    """Each call: when it started, how long it took, whether it failed."""
    reasons: list[str] = []
    with postgres() as database:
        replicas = await start_replicas(folder, database.url, *args)
        try:
            with haproxy(folder, replicas["one"], replicas["two"]) as url:
                stop = anyio.Event()

                async def caller(number: int) -> None:
                    async with Client(url, mode="2026-07-28") as client:
                        arguments: dict[str, Any] = {"command": f"echo {number}"}
                        line = 0
                        if homes:  # a file of its own workspace, a line a call: each call sees every line before it
                            made = await client.call_tool("execute_command", {"command": "echo 0 > lines.txt"})
                            arguments["workspace"] = (made.structured_content or {})["workspace"]
                        while not stop.is_set():
                            started = time.monotonic()
                            line += 1
                            if homes:
                                arguments["command"] = f"echo {line} >> lines.txt; wc -l < lines.txt"
                            try:
                                result = await client.call_tool("execute_command", arguments)
                                said = (result.structured_content or {}).get("stdout", "").strip()
                                failed = bool(result.is_error) or (homes and said != str(line + 1))
                                if failed:
                                    reasons.append(str(result.content[0])[:300])
                            except Exception as exc:  # a call lost on the way
                                failed = True
                                reasons.append(repr(exc)[:300])
                            timed.append((started, time.monotonic() - started, failed))

                async with Client(url, mode="2026-07-28", extensions=[TasksExtension()]) as tasks:
                    created = await tasks.session.call_tool(
                        "execute_command", {"command": "sleep 12; echo done", "timeout_s": 60}, allow_claimed=True
                    )
                    task_id = created.model_dump(by_alias=True, exclude_none=True)["taskId"]
                    async with anyio.create_task_group() as group:
                        for number in range(callers):
                            group.start_soon(caller, number)
                        await anyio.sleep(before_s)
                        restart_began = time.monotonic()
                        for name in ("one", "two"):
                            old = replicas[name]
                            served = len(old.audit())
                            old.process.send_signal(signal.SIGTERM)
                            await anyio.to_thread.run_sync(old.process.wait, 60)
                            old.stop()
                            replicas[name] = await anyio.to_thread.run_sync(
                                functools.partial(start_replica, folder / name, database.url, *args, port=old.port)
                            )
                            while len(replicas[name].audit()) == served:  # back in service behind HAProxy
                                await anyio.sleep(0.2)
                        restart_ended = time.monotonic()
                        await anyio.sleep(before_s)
                        stop.set()
                    ended = await request(tasks, "tasks/get", taskId=task_id)
                    while ended["status"] == "working":
                        await anyio.sleep(0.5)
                        ended = await request(tasks, "tasks/get", taskId=task_id)
        finally:
            for replica in replicas.values():
                replica.stop()
    before = [seconds for at, seconds, _ in timed if at < restart_began]
    during = [seconds for at, seconds, _ in timed if restart_began <= at < restart_ended]
    return {
        "homes": homes,
        "callers": callers,
        "calls": len(timed),
        "failed": sum(1 for _, _, failed in timed if failed),
        "before_ms": percentiles(before),
        "during_restart_ms": percentiles(during),
        "restart_s": round(restart_ended - restart_began, 1),
        "p95_during_over_before": round(percentiles(during)["p95"] / percentiles(before)["p95"], 2),
        "task": ended["status"],
        "failures": sorted(set(reasons))[:10],
    }


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench draining", description=__doc__)
    parser.add_argument("--callers", type=int, default=8, help="clients making calls back to back (default 8)")
    parser.add_argument("--before-s", type=float, default=15.0, help="seconds of calls before the restart, and after")
    parser.add_argument(
        "--homes", action="store_true",
        help="replicas with homes (--workspaces mounted): each caller continues a workspace of its own, and checks "
        "that each call sees every line the ones before it wrote",
    )  # fmt: skip
    options = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="bench-draining-") as name:
        report = anyio.run(run, Path(name), options.callers, options.before_s, options.homes)
    print_table(
        ["", "calls", "p50 ms", "p95 ms"],
        [["before the restart", report["before_ms"]["n"], report["before_ms"]["p50"], report["before_ms"]["p95"]],
         ["during it", report["during_restart_ms"]["n"], report["during_restart_ms"]["p50"],
          report["during_restart_ms"]["p95"]]],
    )  # fmt: skip
    print(
        f"{report['calls']} calls, {report['failed']} failed; the restart of both replicas took {report['restart_s']} s; "
        f"p95 during it {report['p95_during_over_before']}x before; the long task: {report['task']}"
    )
    print(f"written: {write_results('draining-homes' if options.homes else 'draining', report)}")
    return 0
