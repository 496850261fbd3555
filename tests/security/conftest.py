"""The hostile-input battery's invariants: after every case the server answers, nothing of the
case's is left, and the host is back where it was."""

from __future__ import annotations

import contextlib
import os
import shutil
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import anyio
import psutil
import pytest
from mcp import Client

from sandbox_server.sandbox.engine.runtime import DockerRuntime
from sandbox_server.sandbox.runc.state import CGROUP_PARENT
from sandbox_server.sandbox.warm_container import sandbox_processes
from tests.conftest import command_lines, sandbox_inits
from tests.mcp_harness import connect, stdio_parameters

BATTERY_POLICY = os.environ.get("SANDBOX_BATTERY_POLICY", "default")
"""The policy the battery attacks (a shipped name or a file); the expected answers are the default's."""

WARM_FIRST = "sandbox_template"
"""In the command line of a warm template's processes: it, its helper, its sandboxes' first processes and programs."""
IDLE_LAUNCHER = ("docker-init", "sandbox-launch", "tar -x", "warm_python.py", WARM_FIRST)
"""What a warm container runs while it waits for its call: init, the launcher, tar reading stdin, and a warm
interpreter waiting for its program (read from the host's /proc: the engine's `top` cannot list bare command
lines); in a sandbox forked from a warm template, its first process and the process forked to become a cell's
program, named `sandbox-cell` while it waits (the program has the same command line)."""


@dataclass(frozen=True, slots=True)
class HostState:
    processes: int
    held_mb: float
    disk_free_mb: float

    @classmethod
    def now(cls) -> HostState:
        return cls(
            _host_processes(),
            _held_mb(),
            shutil.disk_usage("/var/lib/docker" if os.path.isdir("/var/lib/docker") else "/").free / 2**20,
        )


HELD = ("AnonPages", "Shmem", "SUnreclaim", "PageTables", "KernelStack")
"""What the host's processes and kernel hold (/proc/meminfo): their anonymous pages, tmpfs files, the kernel's
unreclaimable objects, page tables and stacks. A case that leaves memory behind leaves it there. (Not the free
memory: on a virtual machine the memory a process gives back may come back to it seconds later.)"""


def _held_mb() -> float:
    with open("/proc/meminfo") as info:
        sizes = {name: int(rest.split()[0]) for name, rest in (line.split(":", 1) for line in info)}
    return sum(sizes[name] for name in HELD) / 1024


def _host_processes() -> int:
    """Processes outside containers: a warm pool that grew under the case holds its own (each container's shim,
    or the `runc run` of a sandbox runc runs itself, and its processes), which busy_containers() accounts for;
    what is counted here is what a case could leak."""
    count = 0
    for process in psutil.process_iter(["name"]):
        try:
            if (process.info["name"] or "").startswith("containerd-shim") or process.info["name"] == "runc":
                continue
            with open(f"/proc/{process.pid}/cgroup") as groups:
                if any(f"/{parent}/" in line for line in groups for parent in ("docker", CGROUP_PARENT)):
                    continue
        except (OSError, psutil.Error):
            continue
        count += 1
    return count


def busy_containers() -> list[str]:
    """Our containers running anything beyond an idle warm launcher, or ended and not yet removed (of gVisor's,
    the ended ones alone)."""
    busy = []
    for container, first in sandbox_inits(running_only=False).items():
        said = command_lines(first)
        if any("runsc" in line for line in said):
            continue  # gVisor's: its programs run inside its own kernel, not as processes of the host's
        if not said or any(not any(idle in line for idle in IDLE_LAUNCHER) for line in said):
            busy.append(container)
        elif sum(WARM_FIRST in line for line in said) - _waiting_cells(first) > 1:  # a program forked by the warm
            busy.append(container)  # first process runs (not the one forked ahead, waiting to become a cell's)
    return busy


def _waiting_cells(first: int) -> int:
    """How many processes of the sandbox whose init is `first` wait to become a cell's program (`sandbox-cell`)."""
    waiting = 0
    for pid in sandbox_processes(first) if first > 0 else ():
        with contextlib.suppress(OSError):  # (ended meanwhile)
            waiting += Path(f"/proc/{pid}/comm").read_text().strip() == "sandbox-cell"
    return waiting


async def warm_pools_ready(count: int) -> None:
    """Wait until `count` of our sandboxes run, the engine's and those runc or runsc run (a new server's warm pools
    are full)."""
    with anyio.fail_after(60):
        while len(await anyio.to_thread.run_sync(sandbox_inits)) < count:
            await anyio.sleep(0.1)


@pytest.fixture(scope="module")
async def server(runtime: DockerRuntime) -> AsyncIterator[Client]:
    """One stdio session for a battery module, on the default policy or SANDBOX_BATTERY_POLICY."""
    async with connect(stdio_parameters("--policy", BATTERY_POLICY)) as session:
        yield session


@pytest.fixture(scope="module")
def plain_call() -> tuple[str, dict[str, object]]:
    """The call that must still answer after every case (a module whose policy has no shell overrides it)."""
    return "execute_command", {"command": "echo ok"}


@pytest.fixture
async def invariants(server: Client, plain_call: tuple[str, dict[str, object]]) -> AsyncIterator[None]:
    """After the case: a plain call answers within 5 s; no container of the case is left; the host recovered."""
    before = HostState.now()
    yield
    with anyio.fail_after(5):
        plain = await server.call_tool(*plain_call)
    assert not plain.is_error and plain.structured_content is not None
    assert plain.structured_content["stdout"] == "ok\n"
    if "workspace" in plain.structured_content:
        # The session's workspace is kept: empty it, so that the next case starts as a new session would
        # (and the host's disk is measured without what this case left there: a mounted workspace gives
        # its freed blocks back after the call, beside the next one).
        emptied = await server.call_tool(  # all but `out`, the call's own output folder (a mount point)
            "execute_command",
            {"command": "find", "args": ["/workspace", "-mindepth", "1", "!", "-path", "/workspace/out", "-delete"]},
        )
        assert not emptied.is_error, emptied.content
        settled = await server.call_tool(*plain_call)
        assert not settled.is_error, settled.content
    deadline = time.monotonic() + 15
    while busy_containers():
        assert time.monotonic() < deadline, f"containers of the case left behind: {busy_containers()}"
        await anyio.sleep(0.1)
    after = HostState.now()
    while after.disk_free_mb < before.disk_free_mb - 200 and time.monotonic() < deadline:
        await anyio.sleep(0.1)  # the freed blocks on their way back to the host's disk
        after = HostState.now()
    assert after.processes <= before.processes + 25, (before, after)
    # Generous: the server's allocator may keep arenas it freed (a 100 MB argument was parsed).
    assert after.held_mb <= before.held_mb + 1024, (before, after)
    assert after.disk_free_mb >= before.disk_free_mb - 200, (before, after)
