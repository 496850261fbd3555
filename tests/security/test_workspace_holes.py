"""Copies, branches and the app-only tool attacked through the real server: copies of one workspace side by side
each answer (its freeze taken in turn), a branch the caller's rate has no room for makes no fork, a branch run
as a task counts each of its calls against the task caps, and the `tasks` tool has a limit of its own."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import anyio
import pytest

from sandbox_server.sandbox.engine.runtime import DockerRuntime
from tests.mcp_harness import (
    CheckedClient,
    ServerProcess,
    connect,
    free_port,
    http_server,
    stdio_parameters,
    stop_server,
    text_of,
)
from tests.security.test_holes import as_caller, tokens_file
from tests.test_tasks import tasks_client
from tests.test_views import AppsSupport

pytestmark = pytest.mark.anyio

KEEPING = "extends: default\nworkspace: {persist: true, size_mb: 16, files: 2000}\n"


async def _call(session: CheckedClient, tool: str, **arguments: Any) -> dict[str, Any]:
    result = await session.call_tool(tool, arguments)
    assert result.structured_content is not None, text_of(result)
    return {**result.structured_content, "is_error": result.is_error, "text": text_of(result)}


async def test_sixteen_copies_of_one_workspace_side_by_side_each_answer(tmp_path: Path, runtime: DockerRuntime) -> None:
    policy = tmp_path / "keeping.yaml"
    policy.write_text(KEEPING)
    answers: list[dict[str, Any]] = []
    async with connect(stdio_parameters("--policy", str(policy), "--state-dir", str(tmp_path / "state"))) as session:
        await _call(session, "execute_command", command="head -c 4000000 /dev/urandom > data.bin")

        async def copy(index: int) -> None:
            answers.append(await _call(session, "workspaces", action="snapshot", name=f"s{index}"))

        async with anyio.create_task_group() as group:
            for index in range(16):
                group.start_soon(copy, index)
        restored = await _call(session, "workspaces", action="restore", snapshot="s7", name="back")
        same = await _call(
            session, "execute_command", command="cmp data.bin data.bin && ls -l data.bin", workspace="back"
        )
    assert [each["is_error"] for each in answers] == [False] * 16, [
        each["text"] for each in answers if each["is_error"]
    ]
    assert not restored["is_error"] and "4000000" in same["stdout"], same["text"]


async def test_a_branch_the_callers_rate_has_no_room_for_makes_no_fork(tmp_path: Path, runtime: DockerRuntime) -> None:
    policy = tmp_path / "slow.yaml"
    policy.write_text(KEEPING + "rate: {calls_per_minute: 5}\n")
    async with connect(stdio_parameters("--policy", str(policy), "--state-dir", str(tmp_path / "state"))) as session:
        await _call(session, "execute_command", command="echo base > f.txt")  # 1 of 5
        calls = [{"tool": "execute_command", "arguments": {"command": f"echo {i} >> f.txt"}} for i in range(5)]
        refused = await _call(session, "workspaces", action="branch", calls=calls)  # 1 + 5 of 5
        listed = await _call(session, "workspaces", action="list")  # 2 of 5
        ran = await _call(session, "workspaces", action="branch", calls=calls[:3])  # 2 + 3 of 5
    assert refused["is_error"] and refused["error"]["field"] == "rate.calls_per_minute", refused["text"]
    assert "5 calls need 5 of the 5 calls/min" in refused["text"], refused["text"]
    assert len(listed["workspaces"]) == 1, listed["text"]  # no fork was made for it
    assert not ran["is_error"] and len(ran["branches"]) == 3, ran["text"]


SHORT_TASKS = """\
extends: default
workspace: {persist: true, size_mb: 16, files: 2000}
defaults:
  limits: {timeout_s: 3, max_timeout_s: 3, max_task_s: 60}
tasks: {running: 6, running_per_caller: 2, per_caller: 20, ttl_s: 600, poll_interval_ms: 200}
"""


async def test_a_branch_run_as_a_task_counts_each_of_its_calls_against_the_task_caps(
    tmp_path: Path, runtime: DockerRuntime
) -> None:
    policy = tmp_path / "short.yaml"
    policy.write_text(SHORT_TASKS)
    call = {"tool": "execute_command", "arguments": {"command": "sleep 4; echo done", "timeout_s": 30}}
    params = stdio_parameters("--policy", str(policy), "--state-dir", str(tmp_path / "state"))
    async with tasks_client(params) as client:
        await client.call_tool("execute_command", {"command": "true"})
        three = await client.session.call_tool(
            "workspaces", {"action": "branch", "calls": [call] * 3}, allow_claimed=True
        )
        two = await client.session.call_tool(
            "workspaces", {"action": "branch", "calls": [call] * 2}, allow_claimed=True
        )
        beside = await client.session.call_tool(
            "execute_command", {"command": "sleep 4", "timeout_s": 30}, allow_claimed=True
        )
    refused = three.model_dump(by_alias=True, exclude_none=True)
    assert refused.get("isError") and refused["structuredContent"]["error"]["field"] == "tasks.running_per_caller"
    assert "this one runs 3 calls side by side, each counted" in refused["content"][0]["text"], refused
    assert two.model_dump(by_alias=True, exclude_none=True).get("resultType") == "task"
    busy = beside.model_dump(by_alias=True, exclude_none=True)  # the branch's two calls hold both task slots
    assert busy.get("isError") and busy["structuredContent"]["error"]["field"] == "tasks.running_per_caller", busy


async def test_the_app_only_tasks_tool_has_a_limit_of_its_own(tmp_path: Path, runtime: DockerRuntime) -> None:
    policy = tmp_path / "slow.yaml"
    policy.write_text("extends: default\nrate: {calls_per_minute: 5}\n")
    params = stdio_parameters("--policy", str(policy), "--state-dir", str(tmp_path / "state"))
    async with connect(params, extensions=[AppsSupport()]) as apps:
        answers = [await apps.call_tool("tasks", {"action": "list"}) for _ in range(125)]
    refused = [each for each in answers if each.is_error]
    assert len(refused) == 5 and not any(each.is_error for each in answers[:120]), len(refused)
    assert "rate limited: the tasks tool answers a caller 120 times a minute" in text_of(refused[0])
    assert "rate.calls_per_minute" in text_of(refused[0])


def _mounts_under(folder: Path) -> list[str]:
    where = str(folder.resolve())
    return [
        line.split()[4] for line in Path("/proc/self/mountinfo").read_text().splitlines() if where in line.split()[4]
    ]


@pytest.mark.parametrize("moment", ["listening", "workspaces are kept as sized filesystems", "audit trail:"])
def test_a_server_stopped_as_it_starts_leaves_no_mount_behind(
    moment: str, tmp_path: Path, runtime: DockerRuntime
) -> None:
    """SIGTERM at each step of a start (its port open, its workspaces' filesystems mounted, its audit trail
    opened): the server undoes what it began, its pool's and its slots' mounts included."""
    state, port = tmp_path / "state", free_port()
    process = subprocess.Popen(
        [sys.executable, "-m", "sandbox_server", "serve", "--transport", "http", "--port", str(port),
         "--state-dir", str(state), "--workspaces", "mounted"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
    )  # fmt: skip
    server = ServerProcess(f"http://127.0.0.1:{port}/mcp", process)
    try:
        if moment == "listening":
            while True:
                try:
                    socket.create_connection(("127.0.0.1", port), timeout=5).close()
                    break
                except ConnectionRefusedError:
                    assert process.poll() is None, server.lines
                    time.sleep(0.01)  # (the port opens without a line to wait for)
        else:
            server.wait_for_line(moment, timeout_s=60)
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=60) == 0, server.lines
    finally:
        stop_server(process)
        server.reader.join(timeout=10)
        if process.stderr is not None:
            process.stderr.close()
    assert _mounts_under(state) == [], (_mounts_under(state), server.lines)


async def test_callers_by_token_with_no_share_of_their_own_have_half_the_host(
    tmp_path: Path, runtime: DockerRuntime
) -> None:
    """One caller's forks fill no more than half the host's cap when its policy names no share, so another caller
    still gets a workspace."""
    policy = tmp_path / "shared.yaml"
    policy.write_text(
        "extends: default\nworkspace: {persist: true, size_mb: 32, files: 2000}\nhost: {workspace_storage_mb: 120}\n"
    )  # a share is 60 MiB; a workspace counts at what it holds (20 MiB here), at 38.2 MiB while a call works in it
    tokens, (ada, bob) = tokens_file(tmp_path, "ada", "bob", policy=str(policy))
    serve = ("--policy", str(policy), "--tokens", str(tokens), "--state-dir", str(tmp_path / "state"))
    with http_server(*serve) as url:
        async with as_caller(url, ada) as first:
            await _call(first, "execute_command", command="head -c 20M /dev/urandom > data")
            forked = await _call(first, "workspaces", action="fork")
            past = await _call(first, "workspaces", action="fork")
            async with as_caller(url, bob) as second:
                other = await _call(second, "execute_command", command="echo mine > f.txt && cat f.txt")
    assert not forked["is_error"], forked["text"]
    assert past["is_error"] and past["error"]["field"] == "workspace.storage_per_caller_mb", past["text"]
    assert "its share of 62914560 (policy field workspace.storage_per_caller_mb is 0: half of" in past["text"]
    assert not other["is_error"] and other["stdout"] == "mine\n", other["text"]
