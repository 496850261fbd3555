"""Kept variables: what a run_python cell costs beside 160 MB of variables an earlier cell kept.

    scripts/run bench kept_variables [--calls 10]

Rows, through the real MCP client over stdio, in one kept workspace per row (the default policy, workspaces
kept), each cell timed from the call to its answer, p50 and p95 of --calls cells:
- `1 + 1` with nothing kept (the baseline of the same run);
- `1 + 1` with 160 MB kept by an earlier cell (`big = np.random.rand(20_000_000)`, in a policy whose files and
  workspace hold it), untouched;
- `small += 1` beside the same 160 MB, untouched;
- a plotting cell followed by 5 plain cells: how many images came back in all.
Writes bench/results/kept_variables.json.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path
from typing import Any

import anyio
import mcp_types as types
from mcp import Client

from bench.common import print_table, write_results
from bench.measure import percentiles, timed_calls
from sandbox_server.cli.client import server_parameters

POLICY = """\
extends: default
defaults:
  limits: {file_size_mb: 512, memory_mb: 2048, max_timeout_s: 120}
workspace: {persist: true, size_mb: 1024, files: 20000}
"""
BIG = "import numpy as np\nbig = np.random.rand(20_000_000)\nsmall = 1"


async def _row(policy: Path, setup: str | None, cell: str, calls: int) -> dict[str, float]:
    async with Client(server_parameters(["--policy", str(policy)]), mode="legacy") as client:
        if setup is not None:
            made = await client.call_tool("run_python", {"code": setup})
            assert not made.is_error, made.content
        samples, failures = await timed_calls(client, "run_python", {"code": cell}, calls, 0.2)
    assert not failures, f"{failures} of the cells failed"
    return percentiles(samples)


async def _images(policy: Path) -> int:
    plot = "import matplotlib.pyplot as plt\nfig, ax = plt.subplots()\nax.plot([1, 3, 2])"
    images = 0
    async with Client(server_parameters(["--policy", str(policy)]), mode="legacy") as client:
        for code in [plot] + [f"n{i} = {i}" for i in range(5)]:
            result = await client.call_tool("run_python", {"code": code})
            images += sum(isinstance(block, types.ImageContent) for block in result.content)
    return images


async def run(calls: int) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as folder:
        policy = Path(folder) / "kept.yaml"
        policy.write_text(POLICY)
        nothing = await _row(policy, None, "1 + 1", calls)
        untouched = await _row(policy, BIG, "1 + 1", calls)
        beside = await _row(policy, BIG, "small += 1\nsmall", calls)
        images = await _images(policy)
    return {
        "calls": calls,
        "nothing_kept_ms": nothing,
        "160mb_kept_untouched_ms": untouched,
        "small_changed_beside_160mb_ms": beside,
        "untouched_over_nothing_p50": round(untouched["p50"] / nothing["p50"], 2),
        "beside_over_nothing_p50": round(beside["p50"] / nothing["p50"], 2),
        "images_for_a_plot_and_5_plain_cells": images,
    }


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="bench kept_variables")
    parser.add_argument("--calls", type=int, default=10)
    args = parser.parse_args(argv)
    document = anyio.run(run, args.calls)
    print_table(
        ["cell", "p50 ms", "p95 ms", "p50 / nothing kept"],
        [
            ["1 + 1, nothing kept", document["nothing_kept_ms"]["p50"], document["nothing_kept_ms"]["p95"], 1.0],
            ["1 + 1, 160 MB kept", *_pair(document["160mb_kept_untouched_ms"]), document["untouched_over_nothing_p50"]],
            [
                "small += 1 beside 160 MB",
                *_pair(document["small_changed_beside_160mb_ms"]),
                document["beside_over_nothing_p50"],
            ],
        ],
    )
    print(f"images for a plotting cell and 5 plain cells: {document['images_for_a_plot_and_5_plain_cells']}")
    print(f"written to {write_results('kept_variables', document)}")
    return 0


def _pair(row: dict[str, float]) -> list[float]:
    return [row["p50"], row["p95"]]


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
