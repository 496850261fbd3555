"""What a kept workspace costs a call: `execute_command true` on an empty kept workspace and on
one holding 50 MB in 200 files, against the same call with nothing kept; and a run_python cell
after one that made a 1 M-row DataFrame, whose variables are kept (saved and restored) or not.
Each kept row for both ways of keeping (a mounted filesystem, an archive). All in the same run.

Each row is one stdio session on its own policy (the warm pool on in all of them), calls
spaced apart as a model's are; medians of `--calls` calls. Writes
bench/results/workspaces.json.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path
from typing import Any

import anyio
from mcp import Client

from bench.common import median, print_table, write_results
from bench.measure import percentiles, server_process, wait_for_pool
from sandbox_server.cli.client import server_parameters

POLICY = "extends: default\nworkspace: {persist: %(persist)s, size_mb: 128, files: 20000}\n"
FILL = "for i in $(seq 1 200); do head -c 262144 /dev/urandom > f$i; done; du -sm . | cut -f1"
"""50 MiB in 200 files of random (incompressible) bytes."""
FRAME = (
    "import numpy as np, pandas as pd\ndf = pd.DataFrame({'a': np.arange(1_000_000), 'b': np.random.rand(1_000_000)})"
)
"""A 1 M-row DataFrame (16 MB of numbers), kept for the next cell when variables are kept."""
CELL = "import pandas as pd\nlen(globals().get('df', ()))"


async def session(
    work: Path, keeping: str | None, fill: bool, calls: int, gap_s: float, python: bool = False
) -> dict[str, Any]:
    """`calls` calls in one session: `true`, or with `python` a cell after a DataFrame cell; with `fill`,
    the workspace first gets 50 MB in 200 files. `keeping`: how workspaces are kept (serve --workspaces),
    None for nothing kept."""
    policy = work / f"persist-{keeping}-{fill}-{python}.yaml"
    policy.write_text(POLICY % {"persist": str(keeping is not None).lower()})
    arguments = ["--policy", str(policy), "--state-dir", str(work / "state"), "--workspaces", keeping or "auto"]
    async with Client(server_parameters(arguments), mode="legacy") as client:
        await wait_for_pool(server_process().pid, 4)
        if fill:
            filled = await client.call_tool("execute_command", {"command": FILL, "timeout_s": 60})
            assert not filled.is_error, filled.content
        samples, failures = [], 0
        for _ in range(calls):
            if python:  # the timed cell restores what this one kept (and keeps it again)
                await client.call_tool("run_python", {"code": FRAME})
            started = time.perf_counter()
            if python:
                result = await client.call_tool("run_python", {"code": CELL})
            else:
                result = await client.call_tool("execute_command", {"command": "true"})
            samples.append(time.perf_counter() - started)
            failures += bool(result.is_error)
            await anyio.sleep(gap_s)
    return {**percentiles(samples), "failures": failures, "median_ms": median([s * 1000 for s in samples])}


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench workspaces", description=__doc__)
    parser.add_argument("--calls", type=int, default=60, help="calls per row (default 60)")
    parser.add_argument("--gap-s", type=float, default=0.25, help="pause between calls (default 0.25 s)")
    parser.add_argument(
        "--keeping", nargs="+", default=["mounted", "archived"], choices=["mounted", "archived"],
        help="how workspaces are kept (serve --workspaces); default: both",
    )  # fmt: skip
    options = parser.parse_args(argv)

    async def run() -> dict[str, Any]:
        with tempfile.TemporaryDirectory(prefix="bench-workspaces-") as folder:
            work = Path(folder)
            rows = {"nothing kept": await session(work, None, False, options.calls, options.gap_s)}
            cells = {
                "run_python cell, nothing kept": await session(work, None, False, options.calls, options.gap_s, True)
            }
            for keeping in options.keeping:
                for fill, label in ((False, "empty"), (True, "50 MB in 200 files")):
                    rows[f"kept ({keeping}), {label}"] = await session(
                        work, keeping, fill, options.calls, options.gap_s
                    )
                cells[f"run_python cell, 1 M-row DataFrame kept ({keeping})"] = await session(
                    work, keeping, False, options.calls, options.gap_s, True
                )
        for group in (rows, cells):
            baseline = next(iter(group.values()))["p50"]
            for row in group.values():
                row["added_p50_ms"] = round(row["p50"] - baseline, 1)
        return {**rows, **cells}

    rows = anyio.run(run)
    print_table(
        ["call", "p50 ms", "p95 ms", "added p50 ms", "failures"],
        [[name, row["p50"], row["p95"], row["added_p50_ms"], row["failures"]] for name, row in rows.items()],
    )
    path = write_results("workspaces", {"calls": options.calls, "gap_s": options.gap_s, "rows": rows})
    print(f"\nwritten: {path}")
    return 0
