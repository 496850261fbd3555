"""What the server benchmarks measure with: percentiles, the server process, its warm pool, timed calls,
and the engine's own create/start/wait/remove cycle as the baseline beside them."""

from __future__ import annotations

import statistics
import time
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import anyio
import docker
import psutil
from mcp import Client

from sandbox_server.sandbox.engine.host_config import host_config_kwargs
from sandbox_server.sandbox.engine.removal import OWNER_LABEL
from sandbox_server.sandbox.runc.state import STATE, listed, owner_of
from sandbox_server.sandbox.spec import SANDBOX_LABEL, SandboxSpec

BASE = "sandbox-server/base:latest"


def percentiles(samples_s: list[float]) -> dict[str, float]:
    """p50/p95/p99 and mean in milliseconds."""
    ordered = sorted(samples_s)

    def at(fraction: float) -> float:
        return round(ordered[min(len(ordered) - 1, int(fraction * len(ordered)))] * 1000, 1)

    return {"p50": at(0.50), "p95": at(0.95), "p99": at(0.99), "mean": round(statistics.mean(ordered) * 1000, 1),
            "n": len(ordered)}  # fmt: skip


def server_process() -> psutil.Process:
    """The `sandbox-server serve` child the stdio client started."""
    for child in psutil.Process().children(recursive=True):
        if "serve" in child.cmdline():
            return child
    raise RuntimeError("the server process was not found")


def own_cpu_s(process: psutil.Process) -> float:
    """A server process's own CPU seconds (its threads; not its children: the templates are counted outside)."""
    times = process.cpu_times()
    return times.user + times.system


async def wait_for_pool(pid: int, expected: int) -> None:
    """Until the server has `expected` warm containers (bounded)."""
    api = docker.APIClient()
    with anyio.fail_after(60):
        while _containers_of(api, pid) < expected:
            await anyio.sleep(0.1)
    api.close()


def _containers_of(api: docker.APIClient, pid: int) -> int:
    """How many of our sandboxes the server process `pid` has (its owner label), warm or used: the engine's, and
    those runc or runsc run for it."""
    found = api.containers(filters={"label": SANDBOX_LABEL})
    by_engine = sum(f":{pid}:" in (item.get("Labels") or {}).get(OWNER_LABEL, "") for item in found)
    return by_engine + sum(f":{pid}:" in owner_of(name) for name in listed(STATE))


async def settled_containers(pid: int, still_s: float = 1.5) -> int:
    """Once the server's container count has not changed for `still_s` (its pools refilled, its used containers
    removed; bounded at 60 s): that count."""
    api = docker.APIClient()
    last, since = -1, time.monotonic()
    with anyio.move_on_after(60):
        while True:
            count = _containers_of(api, pid)
            if count != last:
                last, since = count, time.monotonic()
            elif time.monotonic() - since >= still_s:
                break
            await anyio.sleep(0.1)
    api.close()
    return last


async def timed_calls(
    client: Client,
    tool: str,
    arguments: dict[str, Any],
    calls: int,
    gap_s: float,
    before: Callable[[], Awaitable[None]] | None = None,
) -> tuple[list[float], int]:
    """`calls` calls of one tool, gap_s apart (0: back to back), each right after `before()` if given: each call's
    seconds, and how many were errors."""
    samples, failures = [], 0
    for _ in range(calls):
        if before is not None:
            await before()
        started = time.perf_counter()
        result = await client.call_tool(tool, arguments)
        samples.append(time.perf_counter() - started)
        failures += bool(result.is_error)
        if gap_s:
            await anyio.sleep(gap_s)
    return samples, failures


def spec_kwargs() -> dict[str, Any]:
    """The hardened settings our containers get, for the baselines."""
    return host_config_kwargs(SandboxSpec(image=BASE, argv=("true",)))


def sdk_cycle(api: docker.APIClient, host_config: dict[str, Any]) -> None:
    """One create/start/wait/remove of `true`."""
    created = api.create_container(BASE, command=["true"], host_config=host_config, user="1000:1000")
    api.start(created["Id"])
    api.wait(created["Id"])
    api.remove_container(created["Id"], force=True)


def engine_ceiling(concurrency: int, cycles: int) -> float:
    """Raw create/start/wait/remove cycles per second the engine sustains at this concurrency."""
    api = docker.APIClient()
    host_config = api.create_host_config(**spec_kwargs())
    started = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as workers:
        list(workers.map(lambda _: sdk_cycle(api, host_config), range(cycles)))
    elapsed = time.perf_counter() - started
    api.close()
    return cycles / elapsed
