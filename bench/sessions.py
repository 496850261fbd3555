"""What keeping workspaces costs the calls that do not need it, each row beside its reference in the
same run (medians; these machines are noisy, so the ratios are what to compare):

- a 2026-07-28 client over Streamable HTTP that never passes a `workspace` id, `true` spaced 0.4 s
  apart, against the same calls on a policy that keeps nothing (`workspace.persist: false`);
- 40 calls back to back in one handshake session, the server's first burst, against the same session's calls
  spaced 0.4 s before it; the same on a pool without `ahead` (what demand alone gives a first burst), and a
  later burst of 40 on a server whose pool an earlier burst grew;
- 4 parallel `sleep 1` calls in one session, each leaving a file, against 1 s;
- `strict` (gVisor) `execute_command id` against `default`, and strict run_python `print(1)`, on the server's
  default path (runsc makes gVisor's sandboxes where it can), and strict `id` with the engine making them.

    scripts/run bench sessions [--calls 40] [--rows idless back-to-back parallel strict]

Writes bench/results/sessions.json.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path
from typing import Any

import anyio
from mcp import Client

from bench.common import print_table, write_results
from bench.measure import percentiles, server_process, settled_containers, timed_calls, wait_for_pool
from sandbox_server.cli.client import server_parameters
from tests.mcp_harness import http_server_process

GAP_S = 0.4
NOTHING_KEPT = "extends: default\nworkspace: {persist: false}\n"
DEMAND_ALONE = "extends: default\ntools: {execute_command: {pool: {ahead: 0}}}\n"
ROWS = ("idless", "back-to-back", "parallel", "strict")


def ratio(row: dict[str, Any], reference: dict[str, Any], key: str = "p50") -> float:
    return round(float(row[key]) / float(reference["p50"]), 2)


async def idless(url: str, calls: int) -> dict[str, Any]:
    """`true` from a 2026-07-28 client that never passes an id, spaced apart."""
    async with Client(url) as client:
        await client.call_tool("execute_command", {"command": "true"})  # the first call may start a proxy-less pool
        samples, failures = await timed_calls(client, "execute_command", {"command": "true"}, calls, GAP_S)
    return {**percentiles(samples), "failures": failures}


def idless_rows(work: Path, calls: int) -> dict[str, Any]:
    rows = {}
    nothing_kept = work / "nothing-kept.yaml"
    nothing_kept.write_text(NOTHING_KEPT)
    for name, arguments in (
        ("id-less 2026 `true`, nothing kept (reference)", ["--policy", str(nothing_kept)]),
        ("id-less 2026 `true`, default (a workspace each)", []),
    ):
        with http_server_process(*arguments, "--state-dir", str(work / "state")) as server:
            server.wait_for_line("warm pool ready")
            rows[name] = anyio.run(idless, server.url, calls)
    reference, row = rows.values()
    row["p50_ratio"], row["p95_over_own_p50"] = ratio(row, reference), round(row["p95"] / row["p50"], 2)
    return rows


async def in_session(work: Path, calls: int, policy: str = "default") -> dict[str, Any]:
    """One handshake session over stdio: spaced calls, then back to back, then 4 parallel ones."""
    serve = ["--policy", policy, "--state-dir", str(work / f"state-{Path(policy).stem}")]
    async with Client(server_parameters(serve), mode="legacy") as client:
        await wait_for_pool(server_process().pid, 2)
        await client.call_tool("execute_command", {"command": "true"})
        spaced, failed_spaced = await timed_calls(client, "execute_command", {"command": "true"}, calls, GAP_S)
        await anyio.sleep(1)
        back, failed_back = await timed_calls(client, "execute_command", {"command": "true"}, calls, 0)
        await anyio.sleep(2)
        finished: list[float] = []
        errors = 0

        async def one(index: int) -> None:
            nonlocal errors
            result = await client.call_tool("execute_command", {"command": f"sleep 1; echo {index} > par-{index}"})
            errors += bool(result.is_error)
            finished.append(time.perf_counter())

        started = time.perf_counter()
        async with anyio.create_task_group() as group:
            for index in range(4):
                group.start_soon(one, index)
        listed = await client.call_tool("execute_command", {"command": "cat par-*"})
        kept = str((listed.structured_content or {}).get("stdout", "")).split()
    spaced_row = {**percentiles(spaced), "failures": failed_spaced}
    back_row = {**percentiles(back), "failures": failed_back}
    back_row["p50_ratio"], back_row["p95_ratio"] = ratio(back_row, spaced_row), ratio(back_row, spaced_row, "p95")
    parallel = {"total_s": round(max(finished) - started, 2), "failures": errors, "files_kept": len(kept)}
    return {"spaced 0.4 s (reference)": spaced_row, "40 back to back": back_row, "4 parallel sleep 1": parallel}


async def later_burst(work: Path, calls: int) -> dict[str, Any]:
    """Back to back again, once an earlier burst grew the pool and the pool refilled in the pause after it."""
    async with Client(server_parameters(["--state-dir", str(work / "later")]), mode="legacy") as client:
        pid = server_process().pid
        await wait_for_pool(pid, 2)
        await client.call_tool("execute_command", {"command": "true"})
        await timed_calls(client, "execute_command", {"command": "true"}, calls, 0)  # grows the pool
        held = await settled_containers(pid)
        back, failures = await timed_calls(client, "execute_command", {"command": "true"}, calls, 0)
    return {**percentiles(back), "failures": failures, "containers_before": held}


async def back_to_back_nothing_kept(work: Path, calls: int) -> dict[str, Any]:
    """The same back-to-back calls on a policy that keeps nothing and fills no pool ahead: what the engine's pace
    alone costs."""
    policy = work / "nothing-kept-demand-alone.yaml"
    policy.write_text(NOTHING_KEPT + "tools: {execute_command: {pool: {ahead: 0}}}\n")
    async with Client(server_parameters(["--policy", str(policy)]), mode="legacy") as client:
        await wait_for_pool(server_process().pid, 2)
        await client.call_tool("execute_command", {"command": "true"})
        await anyio.sleep(1)
        back, failures = await timed_calls(client, "execute_command", {"command": "true"}, calls, 0)
    return {**percentiles(back), "failures": failures}


async def policy_calls(
    policy: str, work: Path, tool: str, arguments: dict[str, Any], calls: int, sandboxes: str = "auto"
) -> dict[str, Any]:
    serve = ["--policy", policy, "--state-dir", str(work / "state"), "--sandboxes", sandboxes]
    async with Client(server_parameters(serve), mode="legacy") as client:
        await wait_for_pool(server_process().pid, 2)
        await client.call_tool(tool, arguments)
        samples, failures = await timed_calls(client, tool, arguments, calls, GAP_S)
    return {**percentiles(samples), "p90": round(sorted(samples)[int(0.9 * len(samples))] * 1000, 1),
            "failures": failures}  # fmt: skip


STRICT = "extends: strict\nrate: {calls_per_minute: 100000}\n"
"""strict as it is, but for its rate (30 calls a minute), which a benchmark's calls would pass."""


def strict_rows(work: Path, calls: int) -> dict[str, Any]:
    strict = str(work / "strict.yaml")
    Path(strict).write_text(STRICT)
    command = {"command": "id", "args": []}
    cell = {"code": "print(1)"}
    rows = {
        "default `id` (reference)": anyio.run(policy_calls, "default", work, "execute_command", command, calls),
        "strict `id`": anyio.run(policy_calls, strict, work, "execute_command", command, calls),
        "strict run_python print(1)": anyio.run(policy_calls, strict, work, "run_python", cell, calls),
        "strict `id`, the engine making its sandboxes": anyio.run(
            policy_calls, strict, work, "execute_command", command, calls, "engine"
        ),
    }
    for name in ("strict `id`", "strict `id`, the engine making its sandboxes"):
        rows[name]["p50_ratio"] = ratio(rows[name], rows["default `id` (reference)"])
    return rows


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench sessions", description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=40, help="calls per row (default 40)")
    parser.add_argument("--rows", nargs="+", default=list(ROWS), choices=ROWS)
    options = parser.parse_args(argv)
    report: dict[str, Any] = {"calls": options.calls, "gap_s": GAP_S}
    with tempfile.TemporaryDirectory(prefix="bench-sessions-") as folder:
        work = Path(folder)
        if "idless" in options.rows:
            report["idless"] = idless_rows(work, options.calls)
        if {"back-to-back", "parallel"} & set(options.rows):
            report["session"] = anyio.run(in_session, work, options.calls)
            session = report["session"]
            demand = work / "demand-alone.yaml"
            demand.write_text(DEMAND_ALONE)
            alone = anyio.run(in_session, work, options.calls, str(demand))
            session["spaced 0.4 s, pool.ahead 0"] = alone["spaced 0.4 s (reference)"]
            session["40 back to back, pool.ahead 0 (demand alone)"] = alone["40 back to back"]
            session["40 back to back, nothing kept, pool.ahead 0"] = anyio.run(
                back_to_back_nothing_kept, work, options.calls
            )
            later = session["40 back to back, a later burst"] = anyio.run(later_burst, work, options.calls)
            reference = session["spaced 0.4 s (reference)"]
            later["p50_ratio"], later["p95_ratio"] = ratio(later, reference), ratio(later, reference, "p95")
        if "strict" in options.rows:
            report["strict"] = strict_rows(work, options.calls)
    table = []
    for section in ("idless", "session", "strict"):
        for name, row in report.get(section, {}).items():
            shown = {key: value for key, value in row.items() if key not in {"n", "mean", "p99"}}
            table.append([name, ", ".join(f"{key} {value}" for key, value in shown.items())])
    print()
    print_table(["row", "numbers (ms unless said)"], table)
    path = write_results("sessions", report)
    print(f"\nwritten: {path}")
    return 0
