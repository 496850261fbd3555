"""The server process's own CPU per call, against the MCP SDK's alone: what the transport, the types and the
dispatch cost (a bare server of the SDK with one tool that answers its argument) and what everything else costs
(the server on the `evaluation` policy running `echo` in a sandbox of its own per call).

    scripts/run bench sdk_floor [--calls 600] [--concurrency 8] [--rounds 3]

Both through the official client over stdio, in turn, `--calls` calls `--concurrency` at a time each round; the CPU
read is the server process's own (user and system, from the kernel, over the calls alone: its start and first
call left out), not its sandboxes' nor its templates'. Medians of the rounds. Writes bench/results/sdk_floor.json.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from typing import Any

import anyio
import psutil
from mcp import ClientSession, StdioServerParameters
from mcp.client.stdio import stdio_client

from bench.common import print_table, write_results

BARE = """
from mcp.server.mcpserver import MCPServer
app = MCPServer("bare")
@app.tool()
def echo(command: str) -> str:
    '''Answers its argument.'''
    return command
app.run("stdio")
"""
SERVERS = {
    "the SDK alone (a bare MCPServer, one tool)": (["-c", BARE], "echo"),
    "sandbox-server, evaluation policy, echo in a sandbox": (
        ["-m", "sandbox_server", "serve", "--policy", "evaluation"], "execute_command"
    ),
}  # fmt: skip


async def server_cpu_per_call(args: list[str], tool: str, calls: int, concurrency: int) -> tuple[float, float]:
    """The server process's CPU per call (ms) and the calls per second, over `calls` calls."""
    parameters = StdioServerParameters(command=sys.executable, args=args, env=dict(os.environ))
    async with stdio_client(parameters) as (read, write), ClientSession(read, write) as session:
        await session.initialize()
        [server] = psutil.Process().children()
        await session.call_tool(tool, {"command": "echo hi"})  # (its first: pools, templates, imports)
        limiter = anyio.CapacityLimiter(concurrency)

        async def one() -> None:
            async with limiter:
                result = await session.call_tool(tool, {"command": "echo hi"})
                assert not result.is_error, result

        before, started = sum(server.cpu_times()[:2]), time.perf_counter()
        async with anyio.create_task_group() as group:
            for _ in range(calls):
                group.start_soon(one)
        elapsed, cpu = time.perf_counter() - started, sum(server.cpu_times()[:2]) - before
    return cpu / calls * 1e3, calls / elapsed


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench sdk_floor")
    parser.add_argument("--calls", type=int, default=600)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=3)
    options = parser.parse_args(argv)
    runs: dict[str, list[tuple[float, float]]] = {name: [] for name in SERVERS}
    for _ in range(options.rounds):
        for name, (args, tool) in SERVERS.items():
            runs[name].append(anyio.run(server_cpu_per_call, args, tool, options.calls, options.concurrency))
    summary: dict[str, Any] = {
        name: {
            "server_cpu_ms_per_call": round(statistics.median(cpu for cpu, _ in measured), 2),
            "calls_per_s": round(statistics.median(rate for _, rate in measured), 1),
        }
        for name, measured in runs.items()
    }
    print(f"{options.calls} calls, {options.concurrency} at a time, {options.rounds} rounds (medians)")
    print_table(
        ["server", "server CPU ms/call", "calls/s"],
        [[name, s["server_cpu_ms_per_call"], s["calls_per_s"]] for name, s in summary.items()],
    )
    rounds = {name: [{"server_cpu_ms_per_call": round(c, 2), "calls_per_s": round(r, 1)} for c, r in measured]
              for name, measured in runs.items()}  # fmt: skip
    print(f"wrote {write_results('sdk_floor', {'summary': summary, 'runs': rounds})}")
    return 0
