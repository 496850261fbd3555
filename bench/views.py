"""What views cost: a call from a client that renders them against the same call from one that does not, and how long
each view takes to show its result in a real host.

    scripts/run bench views [--turns 30]

One server (the default policy, its warm pool) over Streamable HTTP. Turn by turn, in an order that alternates, the
same run_python cell (a 200-row DataFrame as its value, the case where a result carries the most for its view) is
called by the official Python client with and without the MCP Apps extension: p50 and p95 of each, and the ratio.
Then the test host (tests/apps_host: the official AppBridge in headless Chromium) opens each view several times:
analyze_csv of a file with 500 groups (the most a result holds), the cell, a command, the workspace's files and the
services; for each, the call's time and the time from the result's delivery to the view showing it.
Writes bench/results/views.json.
"""

from __future__ import annotations

import argparse
import random
import subprocess
import tempfile
import time
from typing import Any

import anyio

from bench.common import median, print_table, write_results
from bench.measure import percentiles
from sandbox_server.protocol.apps import VIEWS, page
from tests.mcp_harness import connect, http_server_process, upload
from tests.test_views import HOST, NODE, AppsSupport, Host

CELL = "import pandas as pd\npd.DataFrame({'n': range(200), 'sq': [i * i for i in range(200)]})"


def _groups_csv() -> bytes:
    rows = ["key,value"] + [f"k{i % 500:03d},{(i * 7919) % 1000 / 10}" for i in range(10_000)]
    return ("\n".join(rows) + "\n").encode()


async def _calls(url: str, turns: int) -> dict[str, list[float]]:
    samples: dict[str, list[float]] = {"without views": [], "with views": []}
    async with connect(url) as plain, connect(url, extensions=[AppsSupport()]) as apps:
        for client in (plain, apps):  # each session's workspace made, its interpreter warm
            await client.call_tool("run_python", {"code": CELL})
        for turn in range(turns):
            pair = [("without views", plain), ("with views", apps)]
            for label, client in pair if turn % 2 == 0 else pair[::-1]:
                started = time.perf_counter()
                result = await client.call_tool("run_python", {"code": CELL})
                samples[label].append(time.perf_counter() - started)
                assert not result.is_error
    return samples


def _renders(url: str, rounds: int) -> dict[str, dict[str, list[float]]]:
    if not (HOST / "node_modules" / "@modelcontextprotocol" / "ext-apps").is_dir() or not NODE.exists():
        subprocess.run(["npm", "ci", "--no-audit", "--no-fund"], cwd=HOST, check=True, capture_output=True)
    opens: list[tuple[str, str, dict[str, Any], str]] = [
        (
            "table (500 groups)",
            "analyze_csv",
            {"filepath": "g.csv", "operations": ["sum", "average", "max"], "group_by": ["key"], "max_groups": 500},
            "body[data-ready]",
        ),
        ("cell (200-row value)", "run_python", {"code": CELL}, "body[data-ready]"),
        ("task (a command)", "execute_command", {"command": "seq 1 2000"}, "body[data-state=completed]"),
        ("files", "workspaces", {"action": "list"}, "body[data-ready]"),
        ("service", "services", {"action": "list"}, "body[data-ready]"),
    ]
    found: dict[str, dict[str, list[float]]] = {label: {"call_ms": [], "render_ms": []} for label, *_ in opens}
    host = Host(url, 0)  # (a page on any free port: previews are not framed here)
    try:
        host("call", tool="execute_command", arguments={"command": "true", "files": upload("g.csv", _groups_csv())})
        for _ in range(rounds):
            for label, tool, arguments, ready in random.sample(opens, len(opens)):
                timings = host("open", tool=tool, arguments=arguments, ready=ready)["timings"]
                found[label]["call_ms"].append(timings["call_ms"])
                found[label]["render_ms"].append(timings["render_ms"])
        host.clean()
    finally:
        host.close()
    return found


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench views", description=__doc__)
    parser.add_argument("--turns", type=int, default=30, help="calls of each client (default 30)")
    parser.add_argument("--rounds", type=int, default=7, help="times each view is opened (default 7)")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as state, http_server_process("--state-dir", state) as server:
        samples = anyio.run(_calls, server.url, args.turns)
        renders = _renders(server.url, args.rounds)
    calls = {label: percentiles(values) for label, values in samples.items()}
    ratio = calls["with views"]["p50"] / calls["without views"]["p50"]
    print_table(
        ["run_python (200-row value)", "n", "p50 ms", "p95 ms"],
        [[label, len(samples[label]), f"{c['p50']:.1f}", f"{c['p95']:.1f}"] for label, c in calls.items()],
    )
    print(f"with views / without: {ratio:.2f}x (p50)")
    shown = {
        label: {"call_ms": median(t["call_ms"]), "render_ms": median(t["render_ms"]), "n": len(t["render_ms"])}
        for label, t in renders.items()
    }
    print_table(
        ["view", "n", "call p50 ms", "shown after p50 ms"],
        [[label, s["n"], f"{s['call_ms']:.0f}", f"{s['render_ms']:.0f}"] for label, s in shown.items()],
    )
    sizes = {view: len(page(view).encode()) for view in VIEWS}
    print("page sizes (bytes, script and style inlined):", ", ".join(f"{v} {n}" for v, n in sizes.items()))
    report = {"calls": calls, "ratio_p50": ratio, "views": shown, "page_bytes": sizes, "turns": args.turns}
    print(f"written: {write_results('views', report)}")
    return 0
