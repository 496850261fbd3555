"""Warm interpreters: a realistic data call, beside the same work in an interpreter that is already warm.

    scripts/run bench warm [--calls 20] [--gap-s 0.5]

(`scripts/run bench performance` runs it too, with its defaults.)

Rows, through the real MCP client over stdio (calls spaced --gap-s apart, as a model's):
- run_python `import pandas, sklearn, matplotlib; df.plot(); df.sum()` (3 rows) and analyze_csv on
  200 rows (sum by group with a bar plot), with the warm pool and preloaded interpreters
  (the shipped default), with the pool but nothing preloaded, and cold (`--no-pool`);
- the anchors: the same cell, and the same DuckDB query, timed inside one python-data container
  whose interpreter has already imported the libraries (what a call costs once nothing needs
  importing), sampled right before each call (the machine's speed drifts; the ratios compare
  work done at the same moments);
- analyze_csv as the first call of a fresh server, made as soon as its session is up (7 servers), against
  the warm p50 above;
- the resident memory of a warm container of each image, read from the host;
- the pool following demand: `execute_command true` spaced, then a burst of 10 back to
  back after 5 s idle (an earlier burst let the pool grow), then 200 back to back, beside
  the engine's own create/start/wait/remove ceiling measured in the same run (three
  bursts, each after 5 s idle; p95 over their 30 calls).
Writes the "warm" section of bench/results/performance.json.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import anyio
import psutil
from mcp import Client

from bench.common import print_table, update_results
from bench.measure import engine_ceiling, percentiles, server_process, timed_calls, wait_for_pool
from sandbox_server.cli.client import server_parameters
from sandbox_server.errors import SandboxServerError
from sandbox_server.sandbox.engine.removal import OWNER_LABEL
from sandbox_server.sandbox.engine.runtime import DockerRuntime
from sandbox_server.sandbox.spec import SANDBOX_LABEL, SandboxSpec

DATA = "sandbox-server/python-data:latest"
CELL = (
    "import pandas as pd, sklearn, matplotlib.pyplot as plt\n"
    "df = pd.DataFrame({'a': [1, 2, 3], 'b': [4.0, 5.5, 6.25]})\n"
    "df.plot()\n"
    "df.sum()"
)
CSV = "region,amount\n" + "".join(f"r{i % 5},{i * 1.5}\n" for i in range(200))
ANALYSIS = {
    "filepath": "s.csv",
    "operations": ["sum"],
    "columns": ["amount"],
    "group_by": ["region"],
    "plot": {"kind": "bar", "y": "amount"},
    "files": [{"path": "s.csv", "content": CSV}],
}
QUERY = "SELECT region, sum(amount) FROM read_csv_auto('/tmp/s.csv') GROUP BY region ORDER BY region"
POLICY = """
name: bench-warm
extends: default
defaults:
  pool: {min: 2, max: 12}
workspace: {persist: false}
rate: {calls_per_minute: 1000000, concurrent_calls: 12}
host: {min_available_memory_mb: 64, max_load_per_cpu: 1000}
%(tools)s
"""
NOTHING_PRELOADED = "tools:\n  run_python: {preload: []}\n  analyze_csv: {preload: []}\n"
ANCHOR = r"""
import json, sys, time
import numpy, pandas, duckdb, sklearn, matplotlib.pyplot as plt
open('/tmp/s.csv', 'w').write(sys.argv[3])
cell, query = compile(sys.argv[1], '<cell>', 'exec'), sys.argv[2]
plt.figure().canvas.draw(); plt.close('all')
for line in sys.stdin:  # one sample per line asked for, timed in this already-warm interpreter
    started = time.perf_counter()
    exec(cell, {'__name__': '__main__'})
    for number in plt.get_fignums():
        plt.figure(number).savefig('/tmp/f.png')
    plt.close('all')
    cell_s = time.perf_counter() - started
    started = time.perf_counter()
    if line.strip() == 'query':
        duckdb.connect().execute(query).fetchall()
    print(json.dumps({'cell': cell_s * 1000, 'query': (time.perf_counter() - started) * 1000}), flush=True)
"""


class Anchor:
    """The same work in one python-data container whose interpreter imported everything first (what a call
    costs once nothing needs importing), sampled right before each call: this machine's speed drifts by 1.7x
    from one second to the next, so a call is compared with work done at the same moment. Run with the
    sandbox's CPU, memory and user, as a call's container is."""

    def __init__(self) -> None:
        limits = SandboxSpec(image=DATA, argv=("true",)).limits
        self.process = subprocess.Popen(
            ["docker", "run", "-i", "--rm", "--network", "none", "--user", "1000:1000", "--workdir", "/tmp",
             "--cpus", str(limits.cpus), "--memory", f"{limits.memory_mb}m", "--security-opt", "no-new-privileges",
             DATA, "python3", "-c", ANCHOR, CELL, QUERY, CSV],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
        )  # fmt: skip
        self.samples: dict[str, list[float]] = {"cell": [], "query": []}
        self.sample(query=True)  # the first, warming it, is not kept
        self.samples = {"cell": [], "query": []}

    def sample(self, query: bool) -> float:
        """The cell (and the DuckDB query with it when `query`) once now, in ms; kept for p50()."""
        assert self.process.stdin is not None and self.process.stdout is not None
        self.process.stdin.write("query\n" if query else "cell\n")
        self.process.stdin.flush()
        said = json.loads(self.process.stdout.readline())
        self.samples["cell"].append(said["cell"] / 1000)
        if query:
            self.samples["query"].append(said["query"] / 1000)
        return float(said["cell"] + (said["query"] if query else 0))

    def p50(self) -> dict[str, float]:
        return {kind: percentiles(samples)["p50"] for kind, samples in self.samples.items()}

    def close(self) -> None:
        assert self.process.stdin is not None
        self.process.stdin.close()
        self.process.wait(timeout=30)


async def latency(
    work: Path, label: str, tools: str, pooled: bool, calls: int, gap_s: float, anchor: Anchor
) -> dict[str, Any]:
    """The two data calls `calls` times each in one session, each right after the anchor's sample of the same work."""
    policy = work / f"{label}.yaml"
    policy.write_text(POLICY % {"tools": tools})
    arguments = ["--policy", str(policy)] + ([] if pooled else ["--no-pool"])
    report: dict[str, Any] = {}
    async with Client(server_parameters(arguments), mode="legacy") as client:
        if pooled:
            await wait_for_pool(server_process().pid, 4)
            await anyio.sleep(3)  # preloading is done off the call's path: let it finish, as between a model's calls
            report["pool_before_calls"] = pool_memory(server_process().pid)
        calls_made: dict[str, dict[str, Any]] = {"run_python": {"code": CELL}, "analyze_csv": ANALYSIS}
        for tool, arguments_ in calls_made.items():
            anchored: list[float] = []

            async def before(into: list[float] = anchored, query: bool = tool == "analyze_csv") -> None:
                into.append(await anyio.to_thread.run_sync(anchor.sample, query) / 1000)

            samples, failures = await timed_calls(client, tool, arguments_, calls, gap_s, before)
            ratios = [call / work_ for call, work_ in zip(samples, anchored, strict=True)]
            report[tool] = {
                **percentiles(samples), "failures": failures, "anchor_p50": percentiles(anchored)["p50"],
                "ratio_to_anchor": round(percentiles(samples)["p50"] / percentiles(anchored)["p50"], 2),
                "ratio_p50_call_by_call": round(sorted(ratios)[len(ratios) // 2], 2),
            }  # fmt: skip
    return report


async def first_calls(work: Path, servers: int) -> dict[str, Any]:
    """analyze_csv as the first call of a server, made as soon as its session is up (a one-shot `call`, a client
    that asks at once), on `servers` servers one after another; and how long each took to be up."""
    policy = work / "first.yaml"
    policy.write_text(POLICY % {"tools": ""})
    firsts, ups = [], []
    for _ in range(servers):
        started = time.perf_counter()
        async with Client(server_parameters(["--policy", str(policy)]), mode="legacy") as client:
            ups.append(time.perf_counter() - started)
            samples, failures = await timed_calls(client, "analyze_csv", ANALYSIS, 1, 0)
            assert not failures, "the first call failed"
            firsts += samples
    return {"first_call": percentiles(firsts), "session_up": percentiles(ups)}


async def demand(work: Path, spaced_calls: int) -> dict[str, Any]:
    """The pool under a burst after idle time, and under a long run of back-to-back calls."""
    policy = work / "demand.yaml"
    policy.write_text(POLICY % {"tools": ""})
    true = {"command": "true"}
    async with Client(server_parameters(["--policy", str(policy)]), mode="legacy") as client:
        await wait_for_pool(server_process().pid, 4)

        async def timed(count: int, gap_s: float) -> list[float]:
            return (await timed_calls(client, "execute_command", true, count, gap_s))[0]

        spaced = await timed(spaced_calls, 0.25)
        await timed(10, 0)  # the first burst: the pool grows for the next
        burst = []
        for _ in range(BURSTS):
            await anyio.sleep(5)
            burst += await timed(10, 0)
        grown = pool_memory(server_process().pid)
        started = time.perf_counter()
        run = await timed(200, 0)
        elapsed = time.perf_counter() - started
    ceiling = engine_ceiling(1, 30)
    return {
        "spaced": percentiles(spaced),
        "bursts_after_5s_idle": BURSTS,
        "burst_after_5s_idle": percentiles(burst),
        "burst_p95_over_spaced_p50": round(percentiles(burst)["p95"] / percentiles(spaced)["p50"], 2),
        "pool_after_the_bursts": grown,
        "200_back_to_back": {**percentiles(run), "calls_per_s": round(200 / elapsed, 1)},
        "engine_ceiling_per_s": round(ceiling, 1),
    }


def pool_memory(pid: int) -> dict[str, float]:
    """How many containers the server `pid` holds now (waiting ones, and used ones not yet removed) and their
    resident memory together, read from the host."""
    runtime = DockerRuntime.connect()
    count, held = 0, 0
    try:
        for item in runtime.api.containers(filters={"label": SANDBOX_LABEL}):
            if f":{pid}:" in (item.get("Labels") or {}).get(OWNER_LABEL, ""):
                with contextlib.suppress(SandboxServerError):  # removed meanwhile
                    pids = runtime.host_pids(item["Id"])
                    count += 1
                    for host_pid in pids:
                        with contextlib.suppress(psutil.Error):
                            held += psutil.Process(host_pid).memory_info().rss
    finally:
        runtime.close()
    return {"containers": count, "rss_mb": round(held / 2**20, 1)}


def warm_memory() -> dict[str, float]:
    """RSS (MiB) of one warm container of each image, preloaded as the default policy does."""
    runtime = DockerRuntime.connect()
    sizes = {}
    try:
        for name, spec in {
            "base": SandboxSpec(image="sandbox-server/base:latest", argv=("true",)),
            "python-data, preloaded": SandboxSpec(
                image=DATA, argv=("true",), env=(("SANDBOX_PRELOAD", "numpy pandas matplotlib.pyplot duckdb sklearn"),)
            ),
            "python-data, nothing preloaded": SandboxSpec(image=DATA, argv=("true",)),
        }.items():
            warm = runtime.prepare(spec)
            try:
                time.sleep(4)  # the interpreter's imports
                pids = runtime.host_pids(warm.container_id)
                sizes[name] = round(sum(psutil.Process(pid).memory_info().rss for pid in pids) / 2**20, 1)
            finally:
                runtime.discard(warm)
    finally:
        runtime.close()
    return sizes


CALLS = 20
FIRST_SERVERS = 7
BURSTS = 3
"""Bursts of 10 after 5 s idle; their p95 is over all their calls (one burst's p95 is its slowest call)."""
GAP_S = 0.5


def measure(calls: int = CALLS, gap_s: float = GAP_S) -> dict[str, Any]:
    """Every row, printed; returns the report."""
    report: dict[str, Any] = {"calls": calls, "gap_s": gap_s}
    anchor = Anchor()
    with tempfile.TemporaryDirectory(prefix="sandbox-bench-warm-") as folder:
        work = Path(folder)
        rows = {
            "warm pool, preloaded": (work, "preloaded", "", True),
            "warm pool, nothing preloaded": (work, "plain", NOTHING_PRELOADED, True),
            "cold (--no-pool)": (work, "cold", "", False),
        }
        for label, row in rows.items():
            print(f"{label} ...", flush=True)
            report[label] = anyio.run(latency, *row, calls, gap_s, anchor)
        report["anchors_ms"] = anchor.p50()
        anchor.close()
        print("first calls of a server ...", flush=True)
        report["first analyze_csv of a server"] = anyio.run(first_calls, work, FIRST_SERVERS)
    print("warm container memory ...", flush=True)
    report["warm_container_rss_mb"] = warm_memory()
    print("the pool under demand ...", flush=True)
    with tempfile.TemporaryDirectory(prefix="sandbox-bench-demand-") as folder:
        report["demand"] = anyio.run(demand, Path(folder), calls * 2)
    cell, query = report["anchors_ms"]["cell"], report["anchors_ms"]["query"]
    table = []
    for label in rows:
        for tool in ("run_python", "analyze_csv"):
            entry = report[label][tool]
            table.append([f"{tool}, {label}", entry["p50"], entry["p95"], entry["anchor_p50"], entry["ratio_to_anchor"],
                          entry["ratio_p50_call_by_call"], entry["failures"]])  # fmt: skip
    first = report["first analyze_csv of a server"]
    warm_p50 = report["warm pool, preloaded"]["analyze_csv"]["p50"]
    first["p50_over_warm_p50"] = round(first["first_call"]["p50"] / warm_p50, 2)
    table.append([f"analyze_csv, first call of {FIRST_SERVERS} servers", first["first_call"]["p50"],
                  first["first_call"]["p95"], "", f"{first['p50_over_warm_p50']}x the warm p50", "", 0])  # fmt: skip
    print()
    print_table(["call", "p50 ms", "p95 ms", "anchor p50 ms", "p50 / anchor p50", "p50 of call / anchor", "failures"],
                table)  # fmt: skip
    print(f"a server's session up in p50 {first['session_up']['p50']} ms")
    print(f"\nanchors (already-warm interpreter, sampled before each call): cell {cell} ms, DuckDB query {query} ms")
    print("warm container RSS (MiB): " + ", ".join(f"{k} {v}" for k, v in report["warm_container_rss_mb"].items()))
    before = report["warm pool, preloaded"]["pool_before_calls"]
    grown = report["demand"]["pool_after_the_bursts"]
    print(
        f"the pools' containers: {before['containers']} holding {before['rss_mb']} MiB before the data calls (default "
        f"sizes); {grown['containers']} holding {grown['rss_mb']} MiB after the bursts of execute_command"
    )
    pool = report["demand"]
    print(
        f"execute_command true: spaced p50 {pool['spaced']['p50']} ms; bursts of 10 after 5 s idle p95 "
        f"{pool['burst_after_5s_idle']['p95']} ms ({pool['burst_p95_over_spaced_p50']}x); 200 back to back "
        f"p50 {pool['200_back_to_back']['p50']} / p95 {pool['200_back_to_back']['p95']} ms, "
        f"{pool['200_back_to_back']['calls_per_s']} calls/s (engine ceiling {pool['engine_ceiling_per_s']}/s)"
    )
    return report


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench warm", description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=CALLS, help=f"calls per row (default {CALLS})")
    parser.add_argument("--gap-s", type=float, default=GAP_S, help=f"pause between calls (default {GAP_S} s)")
    parser.add_argument(
        "--preloaded-only", action="store_true", help="only the preloaded warm row, printed and not written"
    )
    options = parser.parse_args(argv)
    if options.preloaded_only:
        anchor = Anchor()
        with tempfile.TemporaryDirectory(prefix="sandbox-bench-warm-") as folder:
            row = anyio.run(latency, Path(folder), "preloaded", "", True, options.calls, options.gap_s, anchor)
        anchor.close()
        for tool in ("run_python", "analyze_csv"):
            entry = row[tool]
            print(f"{tool}: p50 {entry['p50']} ms, p95 {entry['p95']} ms, anchor p50 {entry['anchor_p50']} ms, "
                  f"ratio {entry['ratio_to_anchor']} (call by call {entry['ratio_p50_call_by_call']})")  # fmt: skip
        return 0
    path = update_results("performance", "warm", measure(options.calls, options.gap_s))
    print(f"\nwritten: the warm section of {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
