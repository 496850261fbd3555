"""What reaching a workspace's service through the other replica costs, against reaching it through its home.

    scripts/run bench homes [--turns 40]

Two replicas (serve --state … --workspaces mounted) share a PostgreSQL of their own, on this machine's engine, each
with its warm pool. A workspace made through replica one runs the service `web` (`python3 -m http.server`) there.
Then, turn by turn, the same call is made through replica one (its home) and through replica two (which forwards it
to one): `execute_command` reading the service's page by its name over bash's /dev/tcp, then `echo` in another
workspace homed on one that runs no service (its calls take warm containers: the hop's cost shows). And the same preview page
is fetched through each, with the caller's token. Each turn takes both in an order that alternates, so the machine's
load falls on both alike. Reports p50 and p95 of each, the ratio, and whether the goals hold: a call through the
other replica within 1.5x + 5 ms of its home's, a preview within 2x.
Writes bench/results/homes.json.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path
from typing import Any

import anyio
import anyio.to_thread
import httpx2

from bench.common import print_table, write_results
from bench.measure import percentiles
from tests.replicas import one_caller, postgres, start_replicas
from tests.test_replicas import client_of

POLICY = """\
extends: default
rate: {calls_per_minute: 100000}
services:
  tools: [execute_command]
  memory_mb: 96
  start_timeout_s: 10
  idle_s: 600
  max_lifetime_s: 3600
"""
READ = """exec bash -c 'exec 3<>/dev/tcp/web/8000; printf "GET /page.txt HTTP/1.0\\r\\n\\r\\n" >&3; tail -n 1 <&3'"""


async def run(folder: Path, turns: int) -> dict[str, Any]:
    policy, tokens, token = one_caller(folder, POLICY, "bench")
    args = ("--policy", str(policy), "--tokens", str(tokens), "--workspaces", "mounted")
    calls: dict[str, list[float]] = {"home": [], "other": []}
    plain: dict[str, list[float]] = {"home": [], "other": []}
    pages: dict[str, list[float]] = {"home": [], "other": []}
    with postgres() as database:
        replicas = await start_replicas(folder, database.url, *args)
        try:
            one, two = replicas["one"], replicas["two"]
            async with (
                client_of(one.url, token, checked=False) as home,
                client_of(two.url, token, checked=False) as other,
            ):
                made = await home.call_tool("execute_command", {"command": "echo served > page.txt"})
                workspace = (made.structured_content or {})["workspace"]
                started = await home.call_tool(
                    "execute_command",
                    {"command": "exec python3 -m http.server 8000", "workspace": workspace,
                     "service": {"name": "web", "port": 8000}},
                )  # fmt: skip
                service = (started.structured_content or {})["service"]["id"]
                quiet = await home.call_tool("execute_command", {"command": "echo made"})
                no_service = {"command": "echo hi", "workspace": (quiet.structured_content or {})["workspace"]}
                through = {"home": home, "other": other}
                arguments = {"command": READ, "workspace": workspace}
                for name in through:  # each client's first call lists the tools; the pools warm up
                    await through[name].call_tool("execute_command", arguments)
                    await through[name].call_tool("execute_command", no_service)

                async def plain_call(name: str) -> None:
                    begun = time.perf_counter()
                    result = await through[name].call_tool("execute_command", no_service)
                    seconds = time.perf_counter() - begun
                    assert not result.is_error, (name, result.content)
                    plain[name].append(seconds)

                async def call(name: str) -> None:
                    begun = time.perf_counter()
                    result = await through[name].call_tool("execute_command", arguments)
                    seconds = time.perf_counter() - begun
                    said = (result.structured_content or {}).get("stdout", "")
                    assert not result.is_error and said.strip() == "served", (name, result.content)
                    calls[name].append(seconds)

                headers = {"Authorization": f"Bearer {token}"}
                async with httpx2.AsyncClient(headers=headers, timeout=30) as http:
                    address = {"home": one.address, "other": two.address}

                    async def page(name: str) -> None:
                        begun = time.perf_counter()
                        answer = await http.get(f"http://{address[name]}/preview/{service}/page.txt")
                        seconds = time.perf_counter() - begun
                        assert answer.status_code == 200 and answer.text.strip() == "served", (name, answer.text)
                        pages[name].append(seconds)

                    for name in address:  # connections opened before the timing
                        await page(name)
                    for samples in pages.values():
                        samples.clear()
                    for turn in range(turns):
                        order = ("home", "other") if turn % 2 == 0 else ("other", "home")
                        for name in order:
                            await call(name)
                        for name in order:
                            await plain_call(name)
                        for _ in range(5):
                            for name in order:
                                await page(name)
        finally:
            for replica in replicas.values():
                replica.stop()
    call_ms = {name: percentiles(samples) for name, samples in calls.items()}
    page_ms = {name: percentiles(samples) for name, samples in pages.items()}
    plain_ms = {name: percentiles(samples) for name, samples in plain.items()}
    call_allowed = round(1.5 * call_ms["home"]["p50"] + 5, 1)
    return {
        "turns": turns,
        "call_ms": call_ms,
        "call_p50_other_over_home": round(call_ms["other"]["p50"] / call_ms["home"]["p50"], 2),
        "call_p50_added_ms": round(call_ms["other"]["p50"] - call_ms["home"]["p50"], 1),
        "call_goal_ms": call_allowed,
        "call_goal_met": call_ms["other"]["p50"] <= call_allowed,
        "plain_call_ms": plain_ms,
        "plain_call_p50_added_ms": round(plain_ms["other"]["p50"] - plain_ms["home"]["p50"], 1),
        "preview_ms": page_ms,
        "preview_p50_other_over_home": round(page_ms["other"]["p50"] / page_ms["home"]["p50"], 2),
        "preview_goal_met": page_ms["other"]["p50"] <= 2 * page_ms["home"]["p50"],
    }


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench homes", description=__doc__)
    parser.add_argument("--turns", type=int, default=40, help="calls through each replica (default 40)")
    options = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="bench-homes-") as name:
        report = anyio.run(run, Path(name), options.turns)
    rows = [
        [what, where, report[key][where]["n"], report[key][where]["p50"], report[key][where]["p95"]]
        for what, key in (
            ("call reaching the service", "call_ms"),
            ("call in a workspace without one", "plain_call_ms"),
            ("preview page", "preview_ms"),
        )  # fmt: skip
        for where in ("home", "other")
    ]
    print_table(["", "through", "n", "p50 ms", "p95 ms"], rows)
    print(
        f"a call through the other replica: {report['call_p50_other_over_home']}x its home's p50 "
        f"(+{report['call_p50_added_ms']} ms; goal: within 1.5x + 5 ms = {report['call_goal_ms']} ms: "
        f"{'met' if report['call_goal_met'] else 'NOT met'}); a preview page: {report['preview_p50_other_over_home']}x "
        f"(goal 2x: {'met' if report['preview_goal_met'] else 'NOT met'})"
    )
    print(f"written: {write_results('homes', report)}")
    return 0
