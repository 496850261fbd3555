"""Who makes a call's sandbox, the engine, runc itself, or a fork of a template (serve --sandboxes), measured through the real server
and the official client over stdio, on the default policy with its rate and host-load caps lifted (a benchmark's
calls would pass them; its 8 concurrent calls stay), in one run: each path's server in turn, twice over.

- spaced: execute_command `true`, calls 0.5 s apart (each meets a warm sandbox);
- back to back: 40 calls one after another (a session's first burst: calls outrun the pool's refill);
- burst: 100 `echo` calls at once in one session, once the server is idle (its pools refilled: how many sandboxes
  waited is recorded), as computesdk measures (every one answered? p50 and p99);
- run_python `1 + 1`, 40 back to back once the burst is over and the pools have refilled (3 s); and the same in a
  server with no sandbox waiting (`--no-pool`: each cell's sandbox made, or forked, when its call comes), once
  its first cells have been answered 1 s apart (a warm template is made at the first);
- memory (a third server per path, 40 calls at once admitted): the host's memory in use with the server idle and
  its pools refilled, against before it started; and at the peak of 40 run_python cells side by side, each using
  pandas then sleeping 5 s, against just before them; then 1,000 `echo` calls at once (every one answered? p99);
- on an allow list (a second server per path, execute_command given an allow list whose host is never asked
  for, its proxy going out by an internal network of the benchmark's own): `true` spaced, 40 back to back, and
  40 `true` at once, with the engine's CPU per call in the last two;
- the engine's CPU per call in those calls: all the host ran outside the sandboxes' own cgroups, the server's
  own CPU and this process's (dockerd, containerd, the shims, runc, a template, the kernel's work for them), read
  from cgroups; the sandboxes' own beside it (a forked sandbox's child builds its root inside its cgroup, so that
  work is counted there); and the server process's own CPU per call.

    scripts/run bench sandboxes [--rounds 2]

Prints a table and writes bench/results/sandboxes.json; ratios are between numbers of the same run.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path
from typing import Any

import anyio
import docker
import psutil
from mcp import Client

from bench.common import UNCAPPED, median, print_table, write_results
from bench.measure import own_cpu_s, percentiles, server_process, settled_containers, timed_calls
from bench.runtimes import EngineCpu
from sandbox_server.cli.client import server_parameters
from sandbox_server.sandbox.engine.services import remove_network

ALLOW_LISTED = """\
tools:
  execute_command:
    network: {allow: [web.test], egress_network: %s, hosts: {web.test: 192.0.2.1}}
"""
"""execute_command on an allow list (its host, from the documentation's own range, is never asked for)."""
ALLOW_LISTED_BURST = 40


async def _ready(client: Client) -> None:
    """Until a call is answered from a warm sandbox (the pools are filled at start)."""
    for _ in range(3):
        await client.call_tool("execute_command", {"command": "true"})
        await anyio.sleep(2)


async def _burst(client: Client, calls: int, command: str = "echo") -> tuple[list[float], int]:
    return await _burst_of(client, calls, "execute_command", {"command": command, "args": ["hello"]})


async def _execute_command_rows(client: Client, burst: int, command: str) -> dict[str, Any]:
    """execute_command `true` spaced and back to back, then `burst` calls of `command` at once, and the engine's and
    the sandboxes' CPU per call over the last two."""
    report: dict[str, Any] = {}
    server = server_process()
    await _ready(client)  # a policy's first call on an allow list starts its proxy; the pool fills on it after
    spaced, failed = await timed_calls(client, "execute_command", {"command": "true"}, 20, 0.5)
    report["spaced"] = {**percentiles(spaced), "failures": failed}
    await anyio.sleep(3)
    before, served_before = EngineCpu.now(server), own_cpu_s(server)
    back, failed = await timed_calls(client, "execute_command", {"command": "true"}, 40, 0)
    report["back_to_back"] = {**percentiles(back), "failures": failed}
    report["warm_before_burst"] = await settled_containers(server.pid)  # as a burst meets an idle server
    many, failed = await _burst(client, burst, command)
    report["burst"] = {**percentiles(many), "failures": failed, "answered": len(many)}
    await anyio.sleep(3)
    spent = EngineCpu.now(server).since(before)
    report["engine_cpu_ms_per_sandbox"] = round(spent.outside / (40 + burst) * 1000, 1)
    report["sandbox_cpu_ms_per_sandbox"] = round(spent.inside / (40 + burst) * 1000, 1)
    report["server_cpu_ms_per_call"] = round((own_cpu_s(server) - served_before) / (40 + burst) * 1000, 1)
    return report


async def _measure(path: str, burst: int, policy: Path) -> dict[str, Any]:
    async with Client(server_parameters(["--sandboxes", path, "--policy", str(policy)]), mode="legacy") as client:
        report = await _execute_command_rows(client, burst, "echo")
        await anyio.sleep(3)  # (the burst's sandboxes removed, the pools refilled: as a session's cells meet it)
        cells, failed = await timed_calls(client, "run_python", {"code": "1 + 1"}, CELLS, 0)
        report["run_python_back_to_back"] = {**percentiles(cells), "failures": failed}
    return report


CELLS = 40


async def _measure_unpooled(path: str, policy: Path) -> dict[str, Any]:
    """run_python `1 + 1` back to back with no sandbox waiting for the cells (the server's --no-pool)."""
    serve = ["--sandboxes", path, "--policy", str(policy), "--no-pool"]
    async with Client(server_parameters(serve), mode="legacy") as client:
        await timed_calls(client, "run_python", {"code": "1 + 1"}, 5, 1.0)
        cells, failed = await timed_calls(client, "run_python", {"code": "1 + 1"}, CELLS, 0)
    return {"run_python_back_to_back_unpooled": {**percentiles(cells), "failures": failed}}


SIDE_BY_SIDE = 40
SIDE_BY_SIDE_RATE = "rate: {calls_per_minute: 1000000, concurrent_calls: 40, queue_length: 2000, queue_wait_s: 600}"
THOUSAND = 1000
"""The big burst: `echo` calls at once in one session, on the same server (its queue holds them all)."""
NO_WORKSPACE = "workspace: {persist: false}\n"
"""(A session's calls in its kept workspace take turns.)"""
HOLDING = "import pandas as pd, time\ndf = pd.DataFrame({'x': range(100_000)})\ntime.sleep(5)\nint(df.x.sum())"
"""A cell that uses pandas, then holds its sandbox 5 s."""


def _in_use() -> int:
    """The host's memory in use: all but what it has available."""
    memory = psutil.virtual_memory()
    return int(memory.total - memory.available)


async def _measure_memory(path: str, policy: Path) -> dict[str, Any]:
    """The host's memory held by the server idle, its pools refilled (against before it started), and at the peak
    of 40 run_python cells side by side, each using pandas then sleeping 5 s (against just before them)."""
    before = _in_use()
    async with Client(server_parameters(["--sandboxes", path, "--policy", str(policy)]), mode="legacy") as client:
        await _ready(client)
        await settled_containers(server_process().pid)
        await anyio.sleep(5)  # (forked sandboxes are not the engine's containers: their pools' refill, awaited)
        idle = _in_use() - before
        start, peak, done = _in_use(), 0, anyio.Event()

        async def sample() -> None:
            nonlocal peak
            while not done.is_set():
                peak = max(peak, _in_use())
                await anyio.sleep(0.1)

        async with anyio.create_task_group() as group:
            group.start_soon(sample)
            cells, failed = await _burst_of(client, SIDE_BY_SIDE, "run_python", {"code": HOLDING})
            done.set()
        await anyio.sleep(3)
        many, many_failed = await _burst_of(client, THOUSAND, "execute_command", {"command": "echo"})
    return {"idle_server_mib": round(idle / 2**20), "side_by_side_40_mib": round((peak - start) / 2**20),
            "side_by_side_failures": failed + SIDE_BY_SIDE - len(cells),
            "burst_1000_p99_ms": percentiles(many)["p99"], "burst_1000_failures": many_failed + THOUSAND - len(many)}  # fmt: skip


async def _burst_of(client: Client, calls: int, tool: str, arguments: dict[str, Any]) -> tuple[list[float], int]:
    """`calls` calls at once: each one's seconds, and how many were errors."""
    times: list[float] = []
    failures = 0

    async def one() -> None:
        nonlocal failures
        began = time.perf_counter()
        result = await client.call_tool(tool, arguments)
        times.append(time.perf_counter() - began)
        failures += bool(result.is_error)

    async with anyio.create_task_group() as group:
        for _ in range(calls):
            group.start_soon(one)
    return times, failures


async def _measure_allow_listed(path: str, policy: Path) -> dict[str, Any]:
    async with Client(server_parameters(["--sandboxes", path, "--policy", str(policy)]), mode="legacy") as client:
        return await _execute_command_rows(client, ALLOW_LISTED_BURST, "true")


def _allow_listed_summary(reports: list[dict[str, Any]]) -> dict[str, float]:
    return {
        "allow_list_spaced_p50_ms": median([r["spaced"]["p50"] for r in reports]),
        "allow_list_back_to_back_p50_ms": median([r["back_to_back"]["p50"] for r in reports]),
        "allow_list_back_to_back_p95_ms": median([r["back_to_back"]["p95"] for r in reports]),
        "allow_list_burst_40_p99_ms": median([r["burst"]["p99"] for r in reports]),
        "allow_list_failures": sum(
            r["spaced"]["failures"]
            + r["back_to_back"]["failures"]
            + r["burst"]["failures"]
            + ALLOW_LISTED_BURST
            - r["burst"]["answered"]
            for r in reports
        ),  # fmt: skip
        "allow_list_engine_cpu_ms_per_sandbox": median([r["engine_cpu_ms_per_sandbox"] for r in reports]),
    }


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench sandboxes")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--burst", type=int, default=100)
    parser.add_argument("--paths", default="engine,runc,template", help="the servers' --sandboxes, in turn")
    options = parser.parse_args(argv)
    paths = options.paths.split(",")
    runs: dict[str, list[dict[str, Any]]] = {path: [] for path in paths}
    allow_listed: dict[str, list[dict[str, Any]]] = {path: [] for path in paths}
    api = docker.from_env().api
    network = f"sandbox-bench-upstream-{os.getpid()}"
    api.create_network(network, internal=True)
    try:
        with tempfile.TemporaryDirectory() as work_dir:
            policy, listed = Path(work_dir) / "bench.yaml", Path(work_dir) / "allow-listed.yaml"
            policy.write_text(UNCAPPED)
            listed.write_text(UNCAPPED + ALLOW_LISTED % network)
            side = Path(work_dir) / "side-by-side.yaml"
            side.write_text(UNCAPPED.replace("rate: {calls_per_minute: 1000000}", SIDE_BY_SIDE_RATE) + NO_WORKSPACE)
            for _ in range(options.rounds):
                for path in runs:
                    runs[path].append(anyio.run(_measure, path, options.burst, policy))
                    runs[path][-1] |= anyio.run(_measure_memory, path, side)
                    runs[path][-1] |= anyio.run(_measure_unpooled, path, policy)
                    allow_listed[path].append(anyio.run(_measure_allow_listed, path, listed))
    finally:
        remove_network(api, network)
        api.close()
    summary: dict[str, dict[str, float]] = {}
    for path, reports in runs.items():
        summary[path] = {
            "spaced_p50_ms": median([r["spaced"]["p50"] for r in reports]),
            "back_to_back_p50_ms": median([r["back_to_back"]["p50"] for r in reports]),
            "back_to_back_p95_ms": median([r["back_to_back"]["p95"] for r in reports]),
            "burst_p50_ms": median([r["burst"]["p50"] for r in reports]),
            "burst_p99_ms": median([r["burst"]["p99"] for r in reports]),
            "burst_failures": sum(r["burst"]["failures"] + options.burst - r["burst"]["answered"] for r in reports),
            "burst_met_warm": median([r["warm_before_burst"] for r in reports]),
            "run_python_back_to_back_p50_ms": median([r["run_python_back_to_back"]["p50"] for r in reports]),
            "run_python_unpooled_p50_ms": median([r["run_python_back_to_back_unpooled"]["p50"] for r in reports]),
            "run_python_failures": sum(
                r[row]["failures"]
                for r in reports
                for row in ("run_python_back_to_back", "run_python_back_to_back_unpooled")
            ),
            "engine_cpu_ms_per_sandbox": median([r["engine_cpu_ms_per_sandbox"] for r in reports]),
            "sandbox_cpu_ms_per_sandbox": median([r["sandbox_cpu_ms_per_sandbox"] for r in reports]),
            "server_cpu_ms_per_call": median([r["server_cpu_ms_per_call"] for r in reports]),
            "idle_server_mib": median([r["idle_server_mib"] for r in reports]),
            "side_by_side_40_mib": median([r["side_by_side_40_mib"] for r in reports]),
            "side_by_side_failures": sum(r["side_by_side_failures"] for r in reports),
            "burst_1000_p99_ms": median([r["burst_1000_p99_ms"] for r in reports]),
            "burst_1000_failures": sum(r["burst_1000_failures"] for r in reports),
        }
        summary[path]["back_to_back_p50_over_spaced"] = round(
            summary[path]["back_to_back_p50_ms"] / summary[path]["spaced_p50_ms"], 2
        )
        summary[path]["back_to_back_p95_over_spaced_p50"] = round(
            summary[path]["back_to_back_p95_ms"] / summary[path]["spaced_p50_ms"], 2
        )
        summary[path]["run_python_back_to_back_p50_over_spaced_true"] = round(
            summary[path]["run_python_back_to_back_p50_ms"] / summary[path]["spaced_p50_ms"], 2
        )
        summary[path]["run_python_unpooled_p50_over_spaced_true"] = round(
            summary[path]["run_python_unpooled_p50_ms"] / summary[path]["spaced_p50_ms"], 2
        )
        summary[path] |= _allow_listed_summary(allow_listed[path])
    rows = [[name, *(summary[path][name] for path in paths)] for name in summary[paths[0]]]
    print_table(["measure", *paths], rows)
    ratios: dict[str, float] = {}
    for path, over in (("runc", "engine"), ("template", "engine"), ("template", "runc")):
        if path in summary and over in summary:
            for key, measure in (
                ("cpu", "engine_cpu_ms_per_sandbox"),
                ("allow_list_cpu", "allow_list_engine_cpu_ms_per_sandbox"),
            ):
                ratios[f"{key}_{path}_over_{over}"] = round(summary[path][measure] / summary[over][measure], 2)
            for measure in (
                "spaced_p50_ms", "burst_p99_ms", "run_python_back_to_back_p50_ms", "idle_server_mib",
                "side_by_side_40_mib",
            ):  # fmt: skip
                ratios[f"{measure}_{path}_over_{over}"] = round(summary[path][measure] / summary[over][measure], 2)
    for name, ratio in ratios.items():
        print(f"{name}: {ratio}")
    written = write_results(
        "sandboxes", {"summary": summary, **ratios, "runs": runs, "allow_listed_runs": allow_listed}
    )
    print(f"wrote {written}")
    return 0
