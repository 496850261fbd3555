"""What the coding agent's shell costs a call, measured through the real server and the official client over
stdio, on the default policy (its rate caps lifted), in one session on one kept workspace:

- the session's shell: `execute_command true` (run in bash, sourcing the state the previous call left and
  writing the state it leaves), interleaved with the same `true` through `/bin/sh -c` given as `args` (no
  session: the shell a call ran before); once on a fresh session, once after the session holds 20 exported
  variables, 10 functions, 5 aliases and 3 options;
- the files tool on a workspace of 10,000 files: `read` (200 lines of a file), `edit` (one line, back and
  forth) and `grep` (a word in every file, 500 matches shown), each interleaved with `execute_command true`.

    scripts/run bench agent_shell [--calls 30]

Prints a table and writes bench/results/agent_shell.json; ratios are between p50s of the same run.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path
from typing import Any

import anyio
from mcp import Client

from bench.common import UNCAPPED, median, print_table, write_results
from bench.measure import percentiles
from sandbox_server.cli.client import server_parameters

STATE = (
    "for i in $(seq 1 20); do export VAR_$i=value_$i; done; "
    + "; ".join(f'f{i}() {{ echo {i} "$@"; }}' for i in range(10))
    + "; alias ll='ls -l' la='ls -a' l1='ls -1' g='git' m='make'; set -o pipefail; shopt -s extglob globstar"
)
FILL = (
    "python3 -c \"import os\nfor d in range(100):\n    os.makedirs(f'src/d{d}', exist_ok=True)\n"
    "    for f in range(100):\n        open(f'src/d{d}/f{f}.py', 'w').write('import os\\n' * 20 + f'# file {f}\\n')\"; "
    "seq 1 200 | sed 's/^/line /' > big.txt; find src -type f | wc -l"
)
"""10,000 files of 21 lines each under src/, and a 200-line file."""
GAP_S = 0.2


async def _timed(client: Client, tool: str, arguments: dict[str, Any]) -> float:
    started = time.perf_counter()
    result = await client.call_tool(tool, arguments)
    elapsed = time.perf_counter() - started
    if result.is_error:
        raise RuntimeError(f"{tool} {arguments}: {result.content}")
    return elapsed


async def _pairs(client: Client, first: tuple[str, dict[str, Any]], second: tuple[str, dict[str, Any]], calls: int
                 ) -> tuple[list[float], list[float]]:  # fmt: skip
    """`calls` of each, alternating, GAP_S apart (as a model's calls come): the seconds of each."""
    ones, others = [], []
    for _ in range(calls):
        ones.append(await _timed(client, *first))
        await anyio.sleep(GAP_S)
        others.append(await _timed(client, *second))
        await anyio.sleep(GAP_S)
    return ones, others


async def measure(calls: int) -> dict[str, Any]:
    true = ("execute_command", {"command": "true"})
    plain = ("execute_command", {"command": "/bin/sh", "args": ["-c", "true"]})
    rows: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="bench-agent-") as work:
        policy = Path(work) / "bench.yaml"
        policy.write_text(UNCAPPED)
        serve = ["--policy", str(policy), "--state-dir", str(Path(work) / "state")]
        async with Client(server_parameters(serve)) as client:
            for _ in range(5):  # the pools filled, the workspace made
                await _timed(client, *true)
            session, before = await _pairs(client, true, plain, calls)
            rows["shell, empty state"] = (session, before)
            await _timed(client, "execute_command", {"command": STATE})
            session, before = await _pairs(client, true, plain, calls)
            rows["shell, 20 variables, 10 functions, 5 aliases"] = (session, before)
            await _timed(client, "execute_command", {"command": FILL, "timeout_s": 120, "reset": True})
            edits = iter([("line 100", "LINE 100"), ("LINE 100", "line 100")] * calls)
            read = ("files", {"action": "read", "path": "big.txt"})
            grep = ("files", {"action": "grep", "pattern": "file 7$"})
            for label, action in (("files read (200 lines)", read), ("files grep (10,000 files)", grep)):
                rows[label] = await _pairs(client, action, true, calls)
            edited, baseline = [], []
            for _ in range(calls):
                old, new = next(edits)
                edited.append(
                    await _timed(client, "files", {"action": "edit", "path": "big.txt", "old": old, "new": new})
                )
                await anyio.sleep(GAP_S)
                baseline.append(await _timed(client, *true))
                await anyio.sleep(GAP_S)
            rows["files edit (one line)"] = (edited, baseline)
    return {
        label: {
            "p50_ms": percentiles(measured)["p50"],
            "baseline_p50_ms": percentiles(baseline)["p50"],
            "added_ms": round(percentiles(measured)["p50"] - percentiles(baseline)["p50"], 1),
            "ratio": round(median(measured) / median(baseline), 2),
        }
        for label, (measured, baseline) in rows.items()
    }


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench agent_shell", description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=30, help="calls of each kind (default 30)")
    args = parser.parse_args(argv)
    summary = anyio.run(measure, args.calls)
    print_table(
        ["calls", "p50 ms", "baseline p50 ms", "added ms", "ratio"],
        [
            [label, row["p50_ms"], row["baseline_p50_ms"], row["added_ms"], row["ratio"]]
            for label, row in summary.items()
        ],
    )
    print("baselines: the shell rows against `/bin/sh -c true` with no session; the files rows against `true`")
    print(f"wrote {write_results('agent_shell', {'calls': args.calls, 'summary': summary})}")
    return 0
