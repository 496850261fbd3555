"""What services cost: starting one (`python3 -m http.server`, answered once it listens) and stopping it, a call
that reaches it by name, the same session's `true` while a service runs (its calls join the services' network,
so they take no warm container) against `true` with none, a page through the preview (a loopback preview
port, the link's cookie held), and pausing the workspace then resuming it (answered once the service listens
again) against starting the service fresh. All in one stdio session on the default policy, the warm pool on; medians of
`--rounds`. The same rounds run once per `--sandboxes` path (runc making the calls' sandboxes, beside services
too, then the engine making them all), one after the other. Writes bench/results/services.json.
"""

from __future__ import annotations

import argparse
import socket
import tempfile
import time
from pathlib import Path
from typing import Any

import anyio
import httpx2
from mcp import Client

from bench.common import print_table, write_results
from bench.measure import percentiles, server_process, wait_for_pool
from sandbox_server.cli.client import server_parameters

SERVE = "exec python3 -m http.server 8000"


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


async def measure(rounds: int, gap_s: float, work: Path, sandboxes: str) -> dict[str, dict[str, Any]]:
    arguments = ["--state-dir", str(work / sandboxes), "--preview-port", str(_free_port()), "--sandboxes", sandboxes]
    samples: dict[str, list[float]] = {
        name: [] for name in ("true, no service", "start a service", "true beside a service", "curl the service",
                              "preview page", "pause the workspace", "resume it (service listens)",
                              "stop the service")
    }  # fmt: skip

    async def timed(name: str, tool: str, arguments: dict[str, Any]) -> Any:
        started = time.perf_counter()
        result = await client.call_tool(tool, arguments)
        samples[name].append(time.perf_counter() - started)
        assert not result.is_error, result.content
        await anyio.sleep(gap_s)
        return result

    async with Client(server_parameters(arguments), mode="legacy") as client:
        await wait_for_pool(server_process().pid, 4)
        async with httpx2.AsyncClient(follow_redirects=True, timeout=30) as browser:
            for _ in range(rounds):
                await timed("true, no service", "execute_command", {"command": "true"})
                start = {"command": SERVE, "service": {"name": "web", "port": 8000}}
                started = await timed("start a service", "execute_command", start)
                await timed("true beside a service", "execute_command", {"command": "true"})
                await timed("curl the service", "execute_command", {"command": "curl -s -o /dev/null http://web:8000/"})
                link = started.structured_content["service"]["preview"]
                await browser.get(link)  # the link's one use: the cookie for the timed pages
                page = link.split("?", 1)[0]
                for _ in range(5):
                    began = time.perf_counter()
                    assert (await browser.get(page)).status_code == 200
                    samples["preview page"].append(time.perf_counter() - began)
                await timed("pause the workspace", "workspaces", {"action": "pause"})
                resumed = await timed("resume it (service listens)", "workspaces", {"action": "resume"})
                assert "service web started again" in str(resumed.content), resumed.content
                await timed("stop the service", "services", {"action": "stop", "name": "web"})
    return {name: percentiles(values) for name, values in samples.items()}


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench services", description=__doc__)
    parser.add_argument("--rounds", type=int, default=15, help="rounds of start, calls, preview, stop (default 15)")
    parser.add_argument("--gap-s", type=float, default=0.25, help="pause between calls (default 0.25 s)")
    parser.add_argument(
        "--sandboxes", default="runc,engine", help="the paths to measure, comma-separated (default runc,engine)"
    )
    options = parser.parse_args(argv)
    paths: dict[str, dict[str, dict[str, Any]]] = {}
    with tempfile.TemporaryDirectory(prefix="bench-services-") as folder:
        for sandboxes in options.sandboxes.split(","):
            paths[sandboxes] = rows = anyio.run(measure, options.rounds, options.gap_s, Path(folder), sandboxes)
            base = rows["true, no service"]["p50"]
            table = [(name, r["p50"], r["p95"], f"{r['p50'] / base:.1f}x") for name, r in rows.items()]
            print(f"\n--sandboxes {sandboxes}")
            print_table(("what", "p50 ms", "p95 ms", "p50 / true"), table)
    first = next(iter(paths.values()))
    resume = first["resume it (service listens)"]["p50"] / first["start a service"]["p50"]
    print(f"resume of a paused workspace / a fresh start of its service: {resume:.2f}x (p50)")
    if {"runc", "engine"} <= set(paths):
        for row in ("true beside a service", "curl the service"):
            runc, engine = paths["runc"][row]["p50"], paths["engine"][row]["p50"]
            print(f"{row}: runc {runc} ms, the engine {engine} ms (p50): {runc / engine:.2f}x")
    path = write_results(
        "services",
        {"rounds": options.rounds, "gap_s": options.gap_s, "rows": first, "paths": paths, "resume_over_start": resume},
    )
    print(f"wrote {path}")
    return 0
