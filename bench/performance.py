"""Latency and throughput of the server, beside what the engine allows, measured in one run.

    scripts/run bench performance [--calls 100] [--throughput-calls 300] [--gap-s 0.25]

Through the real MCP client over stdio:
- latency (p50/p95/p99) of execute_command `true` and `echo`, run_python `print(1)` and
  analyze_csv on a small file, with the warm pool and without (`serve --no-pool`);
  calls are spaced --gap-s apart, as a model's calls are (back to back, calls outrun
  the pool's refill and the throughput section measures that regime);
- the ways people run a container without us, same image and hardened settings:
  `docker run --rm` (CLI), the Docker SDK's create/start/wait/remove per run (the
  epicbox way), and an exec into a running container (the floor the engine allows);
- throughput of execute_command `true` with 1, 4 and 16 concurrent callers, beside the
  engine's raw create/start/remove ceiling at the same concurrency, with failures and
  leaked containers counted; and with more callers than the policy admits, how fast
  the extra calls hear "busy";
- the server's RSS, idle and under load;
- data calls with warm interpreters and the pool under demand (bench/warm.py, also run
  alone as `scripts/run bench warm`).
Prints a table, writes bench/results/performance.json and bench/results/performance.png.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import anyio
import docker
import psutil
from mcp import Client

from bench import warm
from bench.common import RESULTS, print_table, write_results
from bench.measure import (
    BASE,
    engine_ceiling,
    percentiles,
    sdk_cycle,
    server_process,
    spec_kwargs,
    timed_calls,
    wait_for_pool,
)
from sandbox_server.cli.client import server_parameters
from sandbox_server.sandbox.spec import SANDBOX_LABEL

POLICY = """
name: bench-performance
extends: default
defaults:
  pool: {size: %(pool)d}
rate: {calls_per_minute: 1000000, concurrent_calls: %(concurrent)d}
host: {min_available_memory_mb: 64, max_load_per_cpu: 1000}
"""
SMALL_CSV = "region,amount\n" + "".join(f"r{i % 5},{i * 1.5}\n" for i in range(200))
CALLS: dict[str, tuple[str, dict[str, Any]]] = {
    "execute_command true": ("execute_command", {"command": "true"}),
    "execute_command echo": ("execute_command", {"command": "echo", "args": ["hello"]}),
    "run_python print(1)": ("run_python", {"code": "print(1)"}),
    "analyze_csv small": (
        "analyze_csv",
        {"filepath": "s.csv", "operations": ["sum", "count"], "files": [{"path": "s.csv", "content": SMALL_CSV}]},
    ),
}


async def latency(policy: Path, pooled: bool, calls: int, gap_s: float) -> dict[str, Any]:
    """Each call kind `calls` times in one session, spaced gap_s apart."""
    arguments = ["--policy", str(policy)] + ([] if pooled else ["--no-pool"])
    report: dict[str, Any] = {}
    async with Client(server_parameters(arguments), mode="legacy") as client:
        process = server_process()
        if pooled:
            await wait_for_pool(process.pid, 4)
        idle_rss = process.memory_info().rss
        for name, (tool, args) in CALLS.items():
            samples, failures = await timed_calls(client, tool, args, calls, gap_s)
            report[name] = {
                **percentiles(samples),
                "failures": failures,
                "samples_ms": [round(sample * 1000, 2) for sample in samples],
            }
        report["server_rss_idle_mb"] = round(idle_rss / 2**20, 1)
    return report


def baselines(calls: int) -> dict[str, Any]:
    """Running `true` the ways people do without this server."""
    client = docker.from_env()
    api = client.api
    host_config = api.create_host_config(**spec_kwargs())
    report: dict[str, Any] = {}

    cli = []
    for _ in range(calls):
        started = time.perf_counter()
        subprocess.run(["docker", "run", "--rm", "--network", "none", "--read-only", "--cap-drop", "ALL",
                        "--security-opt", "no-new-privileges", "--memory", "512m", "--pids-limit", "128",
                        "--user", "1000:1000", BASE, "true"], check=True, capture_output=True)  # fmt: skip
        cli.append(time.perf_counter() - started)
    report["docker run --rm (CLI)"] = percentiles(cli)

    sdk = []
    for _ in range(calls):
        started = time.perf_counter()
        sdk_cycle(api, host_config)
        sdk.append(time.perf_counter() - started)
    report["SDK create/start/wait/remove"] = percentiles(sdk)

    running = api.create_container(BASE, command=["sleep", "infinity"], host_config=host_config, user="1000:1000")
    api.start(running["Id"])
    try:
        execs = []
        for _ in range(calls):
            started = time.perf_counter()
            exec_id = api.exec_create(running["Id"], ["true"])["Id"]
            api.exec_start(exec_id)
            execs.append(time.perf_counter() - started)
        report["exec into a running container (SDK)"] = percentiles(execs)
    finally:
        api.remove_container(running["Id"], force=True)
    client.close()
    return report


class RssSampler:
    """Samples a process's RSS in a thread until stopped."""

    def __init__(self, process: psutil.Process) -> None:
        self.process, self.peak, self._stop = process, 0, threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(0.05):
            try:
                self.peak = max(self.peak, self.process.memory_info().rss)
            except psutil.Error:
                return

    def stop(self) -> int:
        self._stop.set()
        self._thread.join()
        return self.peak


async def concurrent_calls(client: Client, callers: int, total: int) -> tuple[float, int, list[float], int]:
    """`total` calls of `true` from `callers` concurrent callers: (seconds, failures, latencies, busy answers)."""
    remaining = iter(range(total))
    latencies: list[float] = []
    failures = busy = 0

    async def caller() -> None:
        nonlocal failures, busy
        for _ in remaining:
            started = time.perf_counter()
            try:
                result = await client.call_tool("execute_command", {"command": "true"})
            except Exception:
                failures += 1
                continue
            latencies.append(time.perf_counter() - started)
            text = getattr(result.content[0], "text", "")
            if result.is_error and text.startswith("busy:"):
                busy += 1
            elif result.is_error:
                failures += 1

    started = time.perf_counter()
    async with anyio.create_task_group() as group:
        for _ in range(callers):
            group.start_soon(caller)
    return time.perf_counter() - started, failures, latencies, busy


def our_containers() -> set[str]:
    """Every container carrying our label now."""
    api = docker.APIClient()
    found = {item["Id"] for item in api.containers(all=True, filters={"label": SANDBOX_LABEL})}
    api.close()
    return found


async def throughput(work: Path, total: int) -> dict[str, Any]:
    """Calls per second at 1, 4 and 16 callers beside the engine's ceiling; then more callers than admitted."""
    report: dict[str, Any] = {}
    before = our_containers()
    policy = work / "throughput.yaml"
    policy.write_text(POLICY % {"pool": 2, "concurrent": 16})
    for callers in (1, 4, 16):
        async with Client(server_parameters(["--policy", str(policy)]), mode="legacy") as client:
            process = server_process()
            await wait_for_pool(process.pid, 4)
            sampler = RssSampler(process)
            elapsed, failures, latencies, busy = await concurrent_calls(client, callers, total)
            peak_rss = sampler.stop()
        ceiling = await anyio.to_thread.run_sync(engine_ceiling, callers, max(60, total // 3))
        report[f"{callers} callers"] = {
            "calls_per_s": round(total / elapsed, 2),
            "engine_ceiling_per_s": round(ceiling, 2),
            "ratio_to_ceiling": round(total / elapsed / ceiling, 3),
            "failures": failures + busy,
            "latency_ms": percentiles(latencies),
            "server_rss_peak_mb": round(peak_rss / 2**20, 1),
        }
    limited = work / "limited.yaml"
    limited.write_text(POLICY % {"pool": 2, "concurrent": 4})
    async with Client(server_parameters(["--policy", str(limited)]), mode="legacy") as client:
        await wait_for_pool(server_process().pid, 4)
        elapsed, failures, latencies, busy = await concurrent_calls(client, 16, 160)
    report["16 callers, 4 admitted"] = {
        "busy_answers": busy,
        "failures": failures,
        "latency_ms": percentiles(latencies),
    }
    report["leaked_containers"] = len(our_containers() - before)
    return report


def draw(report: dict[str, Any], path: Path) -> None:
    """Latency distributions (pool on/off) and throughput beside the engine's ceiling, as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (left, right) = plt.subplots(1, 2, figsize=(13, 5))
    names = list(CALLS)
    data, labels = [], []
    for name in names:
        for mode in ("pool", "cold"):
            data.append(report["latency"][mode][name]["samples_ms"])
            labels.append(f"{name}\n({mode})")
    left.boxplot(data, showfliers=False)
    left.set_xticks(range(1, len(labels) + 1), labels)
    left.set_yscale("log")
    left.set_ylabel("ms (log)")
    left.set_title("Latency through MCP over stdio")
    left.tick_params(axis="x", labelrotation=70, labelsize=7)
    levels = ["1 callers", "4 callers", "16 callers"]
    ours = [report["throughput"][level]["calls_per_s"] for level in levels]
    ceiling = [report["throughput"][level]["engine_ceiling_per_s"] for level in levels]
    positions = range(len(levels))
    right.bar([p - 0.2 for p in positions], ours, width=0.4, label="sandbox-server calls/s")
    right.bar([p + 0.2 for p in positions], ceiling, width=0.4, label="engine create/start/remove /s")
    right.set_xticks(list(positions), levels)
    right.set_title("Throughput")
    right.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=100)


def main(argv: list[str]) -> int:
    """Run every section, print the tables, write the JSON and the PNG."""
    parser = argparse.ArgumentParser(prog="python -m bench performance", description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=100, help="calls per latency measurement (default 100)")
    parser.add_argument("--throughput-calls", type=int, default=300, help="calls per concurrency level (default 300)")
    parser.add_argument("--gap-s", type=float, default=0.25, help="pause between latency calls (default 0.25)")
    options = parser.parse_args(argv)
    report: dict[str, Any] = {"calls": options.calls, "gap_s": options.gap_s}
    with tempfile.TemporaryDirectory(prefix="sandbox-bench-") as work_dir:
        work = Path(work_dir)
        policy = work / "latency.yaml"
        policy.write_text(POLICY % {"pool": 2, "concurrent": 8})
        print("latency with the warm pool ...", flush=True)
        pool = anyio.run(latency, policy, True, options.calls, options.gap_s)
        print("latency without it ...", flush=True)
        cold = anyio.run(latency, policy, False, options.calls, options.gap_s)
        report["latency"] = {"pool": pool, "cold": cold}
        print("baselines ...", flush=True)
        report["baselines"] = baselines(options.calls)
        print("throughput ...", flush=True)
        report["throughput"] = anyio.run(throughput, work, options.throughput_calls)
    print("warm interpreters and the pool under demand ...", flush=True)
    report["warm"] = warm.measure()
    true_p50 = pool["execute_command true"]["p50"]
    sdk_p50 = report["baselines"]["SDK create/start/wait/remove"]["p50"]
    report["summary"] = {
        "execute_command_true_p50_ms": true_p50,
        "sdk_cycle_p50_ms": sdk_p50,
        "speedup_over_sdk_cycle": round(sdk_p50 / true_p50, 2),
        "server_rss_peak_mb": max(level["server_rss_peak_mb"] for key, level in report["throughput"].items()
                                  if key.endswith("callers")),
    }  # fmt: skip
    print()
    rows = []
    for name in CALLS:
        for mode in ("pool", "cold"):
            entry = report["latency"][mode][name]
            rows.append([f"{name} ({mode})", entry["p50"], entry["p95"], entry["p99"], entry["failures"]])
    for name, entry in report["baselines"].items():
        rows.append([name, entry["p50"], entry["p95"], entry["p99"], "-"])
    print_table(["latency, ms", "p50", "p95", "p99", "failures"], rows)
    print()
    rows = []
    for level in ("1 callers", "4 callers", "16 callers"):
        entry = report["throughput"][level]
        rows.append([level, entry["calls_per_s"], entry["engine_ceiling_per_s"], entry["ratio_to_ceiling"],
                     entry["failures"], entry["latency_ms"]["p50"], entry["server_rss_peak_mb"]])  # fmt: skip
    print_table(["throughput", "calls/s", "engine/s", "ratio", "failures", "p50 ms", "server RSS MiB"], rows)
    limited = report["throughput"]["16 callers, 4 admitted"]
    print(f"\n16 callers, 4 admitted: {limited['busy_answers']} busy answers, p50 {limited['latency_ms']['p50']} ms; "
          f"leaked containers: {report['throughput']['leaked_containers']}")  # fmt: skip
    summary = ", ".join(f"{key} {value}" for key, value in report["summary"].items())
    print(f"idle server RSS {pool['server_rss_idle_mb']} MiB; {summary}")
    path = write_results("performance", report)
    RESULTS.mkdir(exist_ok=True)
    draw(report, RESULTS / "performance.png")
    print(f"\nwritten: {path} and {RESULTS / 'performance.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
