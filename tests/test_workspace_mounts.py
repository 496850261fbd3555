"""Kept workspaces as mounted filesystems: what the host mounts, it lets go of; what it never does."""

from __future__ import annotations

import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import pytest

from sandbox_server.sandbox import mounts
from sandbox_server.sandbox.engine.runtime import DockerRuntime
from sandbox_server.sandbox.spec import SandboxSpec
from tests.conftest import exec_in, images_of
from tests.mcp_harness import CheckedClient, connect, http_server_process, stdio_parameters, text_of

pytestmark = pytest.mark.anyio

KEEPING = "extends: default\nworkspace: {persist: true, size_mb: 16, files: 2000, idle_ttl_s: 600, max_per_client: 3}\n"


@pytest.fixture
def served(tmp_path: Path) -> Iterator[tuple[str, ...]]:
    """serve arguments of a server that mounts workspaces under tmp_path/state; nothing is left mounted after."""
    policy = tmp_path / "keeping.yaml"
    policy.write_text(KEEPING)
    state = tmp_path / "state"
    yield ("--policy", str(policy), "--state-dir", str(state), "--workspaces", "mounted")
    leftover = mounts.mounted(tmp_path)
    mounts.detach_under(tmp_path)
    assert not leftover, f"left mounted: {leftover}"


def _state(served: tuple[str, ...]) -> Path:
    return Path(served[served.index("--state-dir") + 1]) / "workspaces"


async def _call(session: CheckedClient, command: str, **extra: Any) -> dict[str, Any]:
    result = await session.call_tool("execute_command", {"command": command, **extra})
    assert result.structured_content is not None, text_of(result)
    return {**result.structured_content, "is_error": result.is_error, "text": text_of(result)}


async def test_a_sessions_disk_is_given_back_and_nothing_stays_mounted_when_it_ends(
    served: tuple[str, ...], runtime: DockerRuntime
) -> None:
    state = _state(served)
    async with connect(stdio_parameters(*served)) as session:
        bomb = await _call(session, "dd if=/dev/urandom of=big bs=1M count=64 2>&1")
        (image,) = images_of(state).glob("img-*.img")
        allocated = image.stat().st_blocks * 512
        during = mounts.mounted(state)
    assert "No space left on device" in bomb["stdout"]
    assert 15 * 2**20 <= allocated <= 24 * 2**20  # the bomb's 16 MiB and ext4's own, never more
    assert any("/ws/" in target for target in during) and any(t.endswith("/slots") for t in during)
    assert not list(state.glob("ws-*")) and not list(state.glob("img-*")) and not mounts.mounted(state)
    assert not (state / "run").exists() or not list((state / "run").iterdir())


async def test_a_killed_servers_mounts_are_swept_and_its_workspace_continues_in_the_next(
    served: tuple[str, ...], runtime: DockerRuntime
) -> None:
    state = _state(served)
    with http_server_process(*served) as first:
        async with connect(first.url, mode="2026-07-28") as session:
            made = await _call(session, "echo survived > s.txt")
        first.process.send_signal(signal.SIGKILL)
        first.process.wait()
    left = mounts.mounted(state)
    with http_server_process(*served) as second:
        async with connect(second.url, mode="2026-07-28") as session:
            continued = await _call(session, "cat s.txt", workspace=made["workspace"])
        now = mounts.mounted(state)
        spares = {path.parent for path in images_of(state).glob("spares/*/*.img")}
    assert left  # what the killed process had mounted
    assert continued["stdout"] == "survived\n"
    # Swept, and mounted again by the process that uses it now; the pool the images live in (where the host has
    # one) is found mounted, and used as it is.
    assert not set(left) & set(now) - {str(state.resolve() / "pool")}
    assert len(spares) <= 1  # the killed process's spare images went with its mounts


async def test_two_server_processes_never_mount_one_workspace_at_once(
    served: tuple[str, ...], runtime: DockerRuntime
) -> None:
    """A second server on the same state folder never starts, so it never mounts the first's workspace."""
    with http_server_process(*served) as first:
        async with connect(first.url, mode="2026-07-28") as session:
            made = await _call(session, "echo one > f.txt")
        second = subprocess.run(
            [sys.executable, "-m", "sandbox_server", "serve", *served],
            capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL,
        )  # fmt: skip
        assert second.returncode != 0 and "is in use by another sandbox-server" in second.stderr, second.stderr
        async with connect(first.url, mode="2026-07-28") as session:
            kept = await _call(session, "cat f.txt", workspace=made["workspace"])
    assert kept["stdout"] == "one\n", kept["text"]


def test_an_empty_slot_is_not_the_sandboxs_to_write(tmp_path: Path, runtime: DockerRuntime) -> None:
    slots = tmp_path / "slots"
    mounts.make_shared(slots)
    warm = None
    try:
        spec = SandboxSpec(image="sandbox-server/base:latest", argv=("true",), workspace_slots=str(slots))
        warm = runtime.prepare(spec)
        assert warm.slot is not None and Path(warm.slot).parent == slots
        said = exec_in(warm.container_id, ["sh", "-c", "touch /workspace/x 2>&1; id -u"])
        assert "Permission denied" in said and said.rstrip().endswith("1000")
        assert not list(Path(warm.slot).iterdir())
    finally:
        if warm is not None:
            runtime.discard(warm)
        mounts.detach_under(slots)
    assert warm is not None and not Path(warm.slot or "").exists()


async def test_a_workspace_is_created_with_its_policys_size_and_files(
    served: tuple[str, ...], runtime: DockerRuntime
) -> None:
    async with connect(stdio_parameters(*served)) as session:
        shape = await _call(session, "stat -f -c '%b %S %c' . ; stat -f -c %T .")
    blocks, block_size, inodes = map(int, shape["stdout"].split()[:3])
    assert 16 * 2**20 <= blocks * block_size <= 18 * 2**20 and 1950 <= inodes <= 2000
    assert shape["stdout"].split()[-1] == "ext2/ext3"  # stat's name for ext4


RENDEZVOUS = (
    "touch started-{index}; n=0; "
    "while [ $(ls started-* | wc -l) -lt 4 ] && [ $n -lt 200 ]; do sleep 0.1; n=$((n+1)); done; "
    "ls started-* | wc -l; echo {index} > kept-{index}; head -c {size} /dev/zero > out/mine.txt"
)
"""A call that says it started, then waits (at most 20 s) until all four have: only calls running side by side
all see four."""


async def test_parallel_calls_in_one_session_run_side_by_side_and_each_keeps_its_files_and_outputs(
    served: tuple[str, ...], runtime: DockerRuntime
) -> None:
    async with connect(stdio_parameters(*served)) as session:
        answers: dict[int, dict[str, Any]] = {}

        async def one(index: int) -> None:
            answers[index] = await _call(session, RENDEZVOUS.format(index=index, size=index + 1), timeout_s=30)

        async with anyio.create_task_group() as group:
            for index in range(4):
                group.start_soon(one, index)
        kept = await _call(session, "cat kept-*; ls out .sandbox/calls 2>&1")
    for index, answer in answers.items():
        assert not answer["is_error"], answer["text"]
        assert answer["stdout"] == "4\n", answer  # every call saw the four start while it waited
        (returned,) = answer["files"]  # its own output folder: only what it wrote there
        assert returned["path"] == "mine.txt" and returned["size"] == index + 1, returned
    assert kept["stdout"].split()[:4] == ["0", "1", "2", "3"], kept  # every call's file kept
    assert "mine.txt" not in kept["stdout"], kept  # no call's outputs stay in the workspace


async def test_cells_that_keep_variables_run_one_at_a_time_and_the_one_that_waited_says_so(
    served: tuple[str, ...], runtime: DockerRuntime
) -> None:
    async with connect(stdio_parameters(*served)) as session:
        answers = []

        async def cell(code: str) -> None:
            result = await session.call_tool("run_python", {"code": code, "timeout_s": 30})
            answers.append(result)

        async with anyio.create_task_group() as group:
            group.start_soon(cell, "import time\ntime.sleep(1.5)\na = 1")
            group.start_soon(cell, "import time\ntime.sleep(1.5)\nb = 2")
        both = await session.call_tool("run_python", {"code": "print(a + b)"})
    assert not any(answer.is_error for answer in answers), [text_of(a) for a in answers]
    waited = [answer for answer in answers if "waited" in text_of(answer)]
    assert len(waited) == 1, [text_of(a) for a in answers]
    assert "cells that keep their variables run one at a time" in text_of(waited[0])
    assert not both.is_error and (both.structured_content or {}).get("stdout") == "3\n", text_of(both)


async def _spares(state: Path, count: int) -> dict[int, Path]:
    """The spare images made ahead once there are `count` of them, by inode (bounded wait)."""
    with anyio.fail_after(30):
        while len(found := {path.stat().st_ino: path for path in images_of(state).glob("spares/*/*.img")}) < count:
            await anyio.sleep(0.05)
    return found


async def test_a_new_workspace_takes_a_filesystem_made_ahead_and_another_is_made_in_a_pause(
    served: tuple[str, ...], runtime: DockerRuntime
) -> None:
    state = _state(served)
    with http_server_process(*served) as server:
        async with connect(server.url, mode="2026-07-28") as session:
            spares = await _spares(state, 2)  # made from the start, with the first warm container's shape
            made = await _call(session, "echo new > n.txt; df -P . | tail -n 1")
            taken = [path for path in images_of(state).glob("img-*.img") if path.stat().st_ino in spares]
            refilled = await _spares(state, 2)
            continued = await _call(session, "cat n.txt", workspace=made["workspace"])
    assert not made["is_error"] and continued["stdout"] == "new\n", (made, continued)
    assert len(taken) == 1  # the workspace's image is a spare's, renamed: no filesystem was made on the call's path
    assert int(made["stdout"].split()[1]) * 1024 >= 15 * 2**20  # of the policy's size (16 MiB)
    assert set(refilled) - set(spares)  # a new spare replaced the one taken
