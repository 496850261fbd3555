"""Callers past the concurrency cap: 12 callers over Streamable HTTP make 3 calls each of a
half-second `sleep`, under a policy that runs 4 at once. With the admission queue (the default,
`rate.queue_wait_s: 30`) beside the same flood answered at once (`rate.queue_wait_s: 0`), in the
same run: how many calls were refused, how long the whole work took, and the calls' latency.

    scripts/run bench queue [--callers 12] [--calls 3] [--sleep-s 0.5]

Writes bench/results/queue.json.
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
from bench.measure import percentiles
from tests.mcp_harness import http_server_process

POLICY = "extends: default\nrate: {calls_per_minute: 100000, concurrent_calls: 4, queue_wait_s: %(wait)s}\n"


async def flood(url: str, callers: int, calls: int, sleep_s: float) -> dict[str, Any]:
    """Every caller in its own session, its calls one after another; all callers at once."""
    latencies: list[float] = []
    refused: list[str] = []

    async def caller() -> None:
        async with Client(url) as client:
            for _ in range(calls):
                started = time.perf_counter()
                result = await client.call_tool("execute_command", {"command": f"sleep {sleep_s}"})
                latencies.append(time.perf_counter() - started)
                if result.is_error:
                    refused.append(str((result.structured_content or {}).get("error", {}).get("field")))

    started = time.perf_counter()
    async with anyio.create_task_group() as group:
        for _ in range(callers):
            group.start_soon(caller)
    return {
        "calls": callers * calls,
        "refused": len(refused),
        "refused_fields": sorted(set(refused)),
        "total_s": round(time.perf_counter() - started, 2),
        "latency_ms": percentiles(latencies),
    }


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench queue", description=__doc__.split("\n\n")[0])
    parser.add_argument("--callers", type=int, default=12)
    parser.add_argument("--calls", type=int, default=3)
    parser.add_argument("--sleep-s", type=float, default=0.5)
    options = parser.parse_args(argv)
    report: dict[str, Any] = {"callers": options.callers, "calls_each": options.calls, "sleep_s": options.sleep_s}
    with tempfile.TemporaryDirectory() as work_dir:
        for name, wait in (("queued", 30), ("answered at once", 0)):
            policy = Path(work_dir) / f"wait-{wait}.yaml"
            policy.write_text(POLICY % {"wait": wait})
            with http_server_process("--policy", str(policy), "--state-dir", str(Path(work_dir) / "state")) as server:
                server.wait_for_line("warm pool ready")
                print(f"{name} ...", flush=True)
                report[name] = anyio.run(flood, server.url, options.callers, options.calls, options.sleep_s)
    ideal = options.callers * options.calls * options.sleep_s / 4
    report["ideal_total_s"] = round(ideal, 2)
    print()
    print_table(
        ["4 slots", "calls", "refused", "total s", "p50 ms", "p95 ms"],
        [
            [name, report[name]["calls"], report[name]["refused"], report[name]["total_s"],
             report[name]["latency_ms"]["p50"], report[name]["latency_ms"]["p95"]]
            for name in ("queued", "answered at once")
        ],
    )  # fmt: skip
    print(
        f"\nthe work itself, {options.callers * options.calls} calls of {options.sleep_s} s on 4 slots: {ideal:.1f} s"
    )
    path = write_results("queue", report)
    print(f"written: {path}")
    return 0
