"""Calls that outlive their request, as MCP tasks, through the real server and engine.

A policy with short caps proves what the shipped ones do with long ones: calls may take 3 s in one request
(`limits.max_timeout_s`), and a call that asks for more runs as a task of up to 120 s (`limits.max_task_s`).
The 2026-07-28 era is driven with the official client and the tasks extension named in its capabilities; the
2025-11-25 era's `tools/call` with `task` is answered with a shape that client refuses to read (it checks every
tools/call answer of that era against CallToolResult), so those requests are sent as plain JSON-RPC over HTTP.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import anyio
import httpx2
import mcp_types as types
import pytest
from anyio.streams.buffered import BufferedByteReceiveStream
from mcp import Client
from mcp.client.streamable_http import streamable_http_client
from mcp.shared.exceptions import MCPError

from sandbox_server.protocol.tasks_client import TasksExtension, task_request
from sandbox_server.sandbox.engine.runtime import DockerRuntime
from tests.conftest import containers_of, run_cli
from tests.mcp_harness import (
    audit_records,
    first_sandboxes,
    http_server,
    http_server_process,
    stdio_parameters,
    text_of,
)

pytestmark = pytest.mark.anyio

EXTENSION = "io.modelcontextprotocol/tasks"
SHORT = """name: short-tasks
extends: default
defaults:
  limits: {timeout_s: 3, max_timeout_s: 3, max_task_s: 120}
tasks: {running: 3, running_per_caller: 2, per_caller: %(per_caller)d, ttl_s: 600, poll_interval_ms: 200}
"""
# Prints a numbered line every 0.2 s for about 5 s: longer than one request may take under the policy.
COUNTING = "for i in $(seq 1 25); do echo line $i; sleep 0.2; done; echo done > /workspace/long.txt"


def short_policy(tmp_path: Path, per_caller: int = 20) -> Path:
    policy = tmp_path / "short.yaml"
    policy.write_text(SHORT % {"per_caller": per_caller})
    return policy


async def request(client: Client, method: str, **params: Any) -> dict[str, Any]:
    """A tasks/* request through the official client's session (which stamps the era's _meta on it)."""
    return await task_request(client.session, method, **params)


@asynccontextmanager
async def tasks_client(target: Any) -> AsyncIterator[Client]:
    """A 2026-07-28 client that names the tasks extension in every request's capabilities."""
    async with Client(target, mode="2026-07-28", extensions=[TasksExtension()]) as client:
        yield client


async def start(client: Client, command: str, timeout_s: float = 60) -> dict[str, Any]:
    """A long execute_command call: the task it became."""
    answer = await client.session.call_tool(
        "execute_command", {"command": command, "timeout_s": timeout_s}, allow_claimed=True
    )
    created = answer.model_dump(by_alias=True, exclude_none=True)
    assert created.get("resultType") == "task", created
    return created


async def until(client: Client, task_id: str, done: Callable[[dict[str, Any]], bool]) -> dict[str, Any]:
    """Poll tasks/get at the interval the server asks for until `done` holds."""
    with anyio.fail_after(90):
        while True:
            task = await request(client, "tasks/get", taskId=task_id)
            if done(task):
                return task
            await anyio.sleep(task["pollIntervalMs"] / 1000)


async def test_2026_stdio_a_long_call_is_a_task_with_live_output_and_a_whole_result(
    tmp_path: Path, runtime: DockerRuntime
) -> None:
    policy = short_policy(tmp_path)
    params = stdio_parameters("--policy", str(policy), "--state-dir", str(tmp_path / "state"))
    async with tasks_client(params) as client:
        created = await start(client, COUNTING)
        assert created["status"] == "working" and created["pollIntervalMs"] == 200 and created["ttlMs"] == 600_000
        task_id = created["taskId"]
        working = await until(client, task_id, lambda t: "last line: line" in t.get("statusMessage", ""))
        assert working["status"] == "working", working
        uri = f"sandbox://tasks/{task_id}/output"
        so_far = await client.read_resource(uri)
        first = so_far.contents[0]
        assert isinstance(first, types.TextResourceContents) and first.text.startswith("line 1\n"), first
        # an ordinary call is served meanwhile, in one request
        quick = await client.call_tool("execute_command", {"command": "echo beside"})
        assert not quick.is_error and "beside" in text_of(quick)
        ended = await until(client, task_id, lambda t: t["status"] != "working")
        assert ended["status"] == "completed", ended
        result = ended["result"]
        stdout = result["structuredContent"]["stdout"]
        assert stdout.splitlines() == [f"line {i}" for i in range(1, 26)], stdout
        assert "long.txt" in json.dumps(result["structuredContent"]["changes"]), result["structuredContent"]
        whole = await client.read_resource(uri)
        assert isinstance(whole.contents[0], types.TextResourceContents)
        assert whole.contents[0].text.rstrip().endswith("line 25")


async def test_2026_a_task_through_the_python_extension_reports_its_progress_while_it_runs(
    tmp_path: Path, runtime: DockerRuntime
) -> None:
    """The SDK keeps a call's own progress callback from an extension: the extension takes one of its own, and
    hears every poll of the task (its seconds so far, its statusMessage) until it ends."""
    heard: list[tuple[float, float | None, str | None]] = []

    async def on_progress(progress: float, total: float | None, message: str | None) -> None:
        heard.append((progress, total, message))

    params = stdio_parameters("--policy", str(short_policy(tmp_path)), "--state-dir", str(tmp_path / "state"))
    async with Client(params, mode="2026-07-28", extensions=[TasksExtension(on_progress=on_progress)]) as client:
        result = await client.call_tool("execute_command", {"command": COUNTING, "timeout_s": 60})
    assert not result.is_error and "line 25" in text_of(result), text_of(result)
    assert len(heard) >= 5, heard  # about 5 s polled every 0.2 s (the policy's pollIntervalMs)
    assert [p for p, _, _ in heard] == sorted(p for p, _, _ in heard) and heard[-1][0] >= 3, heard
    assert any("last line: line" in (message or "") for _, _, message in heard), heard


def add_token(tokens: Path, name: str, policy: Path) -> str:
    done = run_cli("token", "add", name, "--policy", str(policy), "--tokens", str(tokens))
    assert done.returncode == 0, done.stderr
    return done.stdout.splitlines()[-1]


@asynccontextmanager
async def as_caller(url: str, token: str) -> AsyncIterator[Client]:
    headers = {"Authorization": f"Bearer {token}"}
    async with httpx2.AsyncClient(headers=headers, timeout=httpx2.Timeout(30, read=120)) as http:
        async with tasks_client(streamable_http_client(url, http_client=http)) as client:
            yield client


async def test_2026_http_tasks_outlive_their_client_are_their_callers_alone_and_survive_a_restart(
    tmp_path: Path, runtime: DockerRuntime
) -> None:
    tokens, state, policy = tmp_path / "tokens.json", tmp_path / "state", short_policy(tmp_path)
    alice, bob = add_token(tokens, "alice", policy), add_token(tokens, "bob", policy)
    serve = ("--policy", str(policy), "--tokens", str(tokens), "--no-pool", "--state-dir", str(state))
    with http_server_process(*serve, "--audit-log", str(tmp_path / "audit.jsonl")) as server:
        async with as_caller(server.url, alice) as client:
            sleeper = await start(client, "sleep 60")
            running = first_sandboxes(runtime.api, lambda: set(containers_of(server.process.pid)))
            counted = await start(client, COUNTING)
        # the client is gone; its tasks go on. A new connection of the same caller finds both.
        async with as_caller(server.url, alice) as client:
            listed = await request(client, "tasks/list")
            assert {t["taskId"] for t in listed["tasks"]} == {sleeper["taskId"], counted["taskId"]}
            await request(client, "tasks/cancel", taskId=sleeper["taskId"])
            cancelled = await request(client, "tasks/get", taskId=sleeper["taskId"])
            assert cancelled["status"] == "cancelled", cancelled
            assert not running & set(containers_of(server.process.pid)), "the cancelled task's container is there"
            ended = await until(client, counted["taskId"], lambda t: t["status"] != "working")
            assert ended["status"] == "completed" and "line 25" in ended["result"]["structuredContent"]["stdout"]
            stopped = await start(client, "sleep 60")
        async with as_caller(server.url, bob) as other:
            for task_id in (counted["taskId"], "0f0e0d0c-0b0a-4908-8706-050403020100", "../../etc/passwd"):
                with pytest.raises(MCPError) as refused:
                    await request(other, "tasks/get", taskId=task_id)
                assert refused.value.error.code == -32602
                assert refused.value.error.message.startswith("Failed to retrieve task: Task not found")
            assert (await request(other, "tasks/list"))["tasks"] == []
            with pytest.raises(MCPError):
                await other.read_resource(f"sandbox://tasks/{counted['taskId']}/output")
    audit = audit_records(tmp_path / "audit.jsonl")
    events = [(r["event"], r.get("status")) for r in audit if r.get("task") == counted["taskId"] and "event" in r]
    assert events == [("task_created", None), ("task_finished", "completed")], events
    assert ("task_cancelled", "cancelled") in [(r.get("event"), r.get("status")) for r in audit]
    with http_server(*serve) as url:  # a new server on the same state: the finished result is there
        async with as_caller(url, alice) as client:
            kept = await request(client, "tasks/get", taskId=counted["taskId"])
            assert kept["status"] == "completed" and kept["result"] == ended["result"]
            lost = await request(client, "tasks/get", taskId=stopped["taskId"])
            assert lost["status"] == "failed" and "server stopped" in lost["statusMessage"], lost


async def test_2026_a_long_call_without_the_extension_is_refused_as_a_result_naming_it_and_caps_are_kept(
    tmp_path: Path, runtime: DockerRuntime
) -> None:
    serve = ("--policy", str(short_policy(tmp_path, per_caller=3)), "--no-pool", "--state-dir", str(tmp_path / "s"))
    with http_server(*serve) as url:
        async with Client(url, mode="2026-07-28") as plain:
            refused = await plain.call_tool("execute_command", {"command": "true", "timeout_s": 10})
            assert refused.is_error and EXTENSION in text_of(refused), text_of(refused)
            assert (refused.structured_content or {})["error"]["field"] == "limits.max_timeout_s"
            quick = await plain.call_tool("execute_command", {"command": "echo short", "timeout_s": 3})
            assert not quick.is_error
        async with tasks_client(url) as client:
            first, second = await start(client, "sleep 30"), await start(client, "sleep 30")
            third = await client.session.call_tool("execute_command", {"command": "true", "timeout_s": 10})
            assert isinstance(third, types.CallToolResult) and third.is_error
            assert "tasks.running_per_caller" in text_of(third), text_of(third)
            for task in (first, second):
                await request(client, "tasks/cancel", taskId=task["taskId"])
            await start(client, "true")  # the caller's third task: held as long as it is kept
            fourth = await client.session.call_tool("execute_command", {"command": "true", "timeout_s": 10})
            assert isinstance(fourth, types.CallToolResult) and "tasks.per_caller" in text_of(fourth)


async def test_hostile_tasks_a_forked_child_and_endless_output_leave_nothing_running(
    tmp_path: Path, runtime: DockerRuntime
) -> None:
    serve = ("--policy", str(short_policy(tmp_path)), "--no-pool", "--state-dir", str(tmp_path / "s"))
    with http_server_process(*serve) as server:
        async with tasks_client(server.url) as client:
            forked = await start(client, "(setsid sleep 300 >/dev/null 2>&1 &); echo left a child")
            flood = await start(client, "yes 'all work and no play'")
            ended = await until(client, forked["taskId"], lambda t: t["status"] != "working")
            assert ended["status"] == "completed" and "left a child" in ended["result"]["structuredContent"]["stdout"]
            flooded = await until(client, flood["taskId"], lambda t: t["status"] != "working")
            assert flooded["status"] == "completed" and flooded["result"]["isError"], flooded
            output = await client.read_resource(f"sandbox://tasks/{flood['taskId']}/output")
            text = output.contents[0]
            assert isinstance(text, types.TextResourceContents)
            assert len(text.text) < 2 * 100_000 + 200 and "bytes not kept" in text.text
        with anyio.fail_after(30):
            while containers_of(server.process.pid):
                await anyio.sleep(0.2)


class Raw2025:
    """A 2025-11-25 session over Streamable HTTP, in plain JSON-RPC (see the module's docstring for why)."""

    def __init__(self, http: httpx2.AsyncClient, url: str) -> None:
        self.http, self.url, self.session, self.next_id = http, url, "", 0

    async def send(self, method: str, params: dict[str, Any], notify: bool = False) -> dict[str, Any]:
        headers = {"Accept": "application/json, text/event-stream", "MCP-Protocol-Version": "2025-11-25"}
        if self.session:
            headers["Mcp-Session-Id"] = self.session
        message: dict[str, Any] = {"jsonrpc": "2.0", "method": method, "params": params}
        if not notify:
            self.next_id += 1
            message["id"] = self.next_id
        answer = await self.http.post(self.url, json=message, headers=headers)
        self.session = answer.headers.get("mcp-session-id", self.session)
        if notify:
            return {}
        if answer.headers.get("content-type", "").startswith("text/event-stream"):
            for line in answer.text.splitlines():
                if line.startswith("data:") and (data := json.loads(line[5:])).get("id") == self.next_id:
                    return dict(data)
            raise AssertionError(f"no answer to {method}: {answer.text}")
        return dict(answer.json())

    async def open(self) -> None:
        hello = {
            "protocolVersion": "2025-11-25",
            "capabilities": {"tasks": {}},
            "clientInfo": {"name": "raw", "version": "1"},
        }
        started = await self.send("initialize", hello)
        assert started["result"]["capabilities"]["tasks"] == {
            "list": {},
            "cancel": {},
            "requests": {"tools": {"call": {}}},
        }, started
        await self.send("notifications/initialized", {}, notify=True)


async def test_2025_http_a_call_with_task_is_answered_create_task_result_and_served_by_tasks_methods(
    tmp_path: Path, runtime: DockerRuntime
) -> None:
    serve = ("--policy", str(short_policy(tmp_path)), "--no-pool", "--state-dir", str(tmp_path / "s"))
    with http_server(*serve) as url:
        async with httpx2.AsyncClient(timeout=httpx2.Timeout(30, read=120)) as http:
            raw = Raw2025(http, url)
            await raw.open()
            tools = (await raw.send("tools/list", {}))["result"]["tools"]
            assert {tool["execution"]["taskSupport"] for tool in tools} == {"optional"}
            arguments = {"command": COUNTING, "timeout_s": 60}
            created = await raw.send(
                "tools/call", {"name": "execute_command", "arguments": arguments, "task": {"ttl": 60_000}}
            )
            task = created["result"]["task"]
            assert task["status"] == "working" and task["ttl"] == 60_000 and task["pollInterval"] == 200, created
            got = await raw.send("tasks/get", {"taskId": task["taskId"]})
            assert got["result"]["taskId"] == task["taskId"] and got["result"]["status"] in ("working", "completed")
            listed = await raw.send("tasks/list", {})
            assert [t["taskId"] for t in listed["result"]["tasks"]] == [task["taskId"]]
            result = (await raw.send("tasks/result", {"taskId": task["taskId"]}))["result"]
            assert result["_meta"]["io.modelcontextprotocol/related-task"] == {"taskId": task["taskId"]}
            assert result["structuredContent"]["stdout"].splitlines()[-1] == "line 25" and not result["isError"]
            again = await raw.send("tasks/cancel", {"taskId": task["taskId"]})
            assert again["error"]["code"] == -32602 and "already ended (completed)" in again["error"]["message"]
            without = await raw.send("tools/call", {"name": "execute_command", "arguments": arguments})
            refusal = without["result"]["content"][0]["text"]
            assert without["result"]["isError"] and "limits.max_timeout_s" in refusal and "as a task" in refusal


def test_the_shell_runs_a_call_as_a_task_and_prints_its_progress_until_it_ends(
    tmp_path: Path, runtime: DockerRuntime
) -> None:
    done = run_cli(
        "call", "execute_command", "--policy", str(short_policy(tmp_path)), "--task",
        "--arg", "command=for i in 1 2 3 4 5; do echo step $i; sleep 1; done",
        env={"SANDBOX_STATE_DIR": str(tmp_path / "s")},
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert done.stdout.split("--- stdout ---")[1].split("\nnote: ")[0].split() == [
        "step",
        "1",
        "step",
        "2",
        "step",
        "3",
        "step",
        "4",
        "step",
        "5",
    ]
    progress = [line for line in done.stderr.splitlines() if line.startswith("task ")]
    assert any("last line: step 3" in line for line in progress), done.stderr
    assert progress[-1].split(": ", 2)[1] == "completed", progress


EXT_TASKS = Path(__file__).parent / "ext_tasks"
NODE = EXT_TASKS / "node_modules" / ".bin" / "node"
"""The Node.js the lock file pins (the SDK wants 20 or later, more than Debian's own), not the host's."""


@pytest.fixture(scope="module")
def ext_tasks_client() -> Path:
    """The official tasks client, the TypeScript SDK and Node.js, from the npm registry, as the lock file pins them."""
    if not (EXT_TASKS / "node_modules" / "@modelcontextprotocol" / "ext-tasks").is_dir() or not NODE.exists():
        done = subprocess.run(
            ["npm", "ci", "--no-audit", "--no-fund"], cwd=EXT_TASKS, capture_output=True, text=True, timeout=300
        )
        assert done.returncode == 0, done.stderr
    return EXT_TASKS / "call.mjs"


@pytest.mark.parametrize("era", ["2025-11-25", "2026-07-28"])
def test_the_official_ext_tasks_client_drives_a_task_in_both_eras(
    tmp_path: Path, runtime: DockerRuntime, ext_tasks_client: Path, era: str
) -> None:
    serve = ("--policy", str(short_policy(tmp_path)), "--no-pool", "--state-dir", str(tmp_path / "s"))
    arguments = {"command": "for i in 1 2 3 4; do echo step $i; sleep 1; done", "timeout_s": 60}
    with http_server(*serve) as url:
        done = subprocess.run(
            [str(NODE), str(ext_tasks_client), url, era, json.dumps(arguments)],
            capture_output=True,
            text=True,
            timeout=120,
        )
    assert done.returncode == 0, done.stderr
    seen = json.loads(done.stdout.splitlines()[-1])
    assert seen["era"] == ("modern" if era == "2026-07-28" else "legacy"), seen["era"]
    assert seen["kind"] == "task", seen
    assert seen["messages"][0].startswith("working") and seen["messages"][-1].startswith("completed"), seen
    assert any("last line: step" in message for message in seen["messages"]), seen["messages"]
    result = seen["result"]
    assert result["structuredContent"]["stdout"] == "step 1\nstep 2\nstep 3\nstep 4\n" and not result["isError"]
    if era == "2025-11-25":
        assert "io.modelcontextprotocol/related-task" in result["_meta"]


async def test_the_official_ext_tasks_client_over_stdio_runs_a_task_beside_a_cancelled_one_and_ordinary_calls(
    tmp_path: Path, runtime: DockerRuntime, ext_tasks_client: Path
) -> None:
    """2025-11-25 over stdio: the official client starts a task, starts and cancels another, calls meanwhile."""
    serve = [sys.executable, "-m", "sandbox_server", "serve", "--policy", str(short_policy(tmp_path)), "--no-pool"]
    serve += ["--state-dir", str(tmp_path / "s")]
    arguments = {"command": "for i in $(seq 1 8); do echo step $i; sleep 1; done", "timeout_s": 60}
    command = [str(NODE), str(ext_tasks_client), json.dumps(serve), "2025-11-25", json.dumps(arguments), "beside"]
    with anyio.fail_after(120):
        async with await anyio.open_process(command, stderr=subprocess.DEVNULL) as node:
            assert node.stdout is not None and node.stdin is not None
            lines = BufferedByteReceiveStream(node.stdout)
            midway = json.loads(await lines.receive_until(b"\n", 1 << 20))
            assert midway["cancelled"] == {"kind": "task", "status": "cancelled"}, midway
            # The cancelled task's container is gone; the first task's still runs (made once it was answered, so
            # on a busy machine it may be made a moment later).
            assert len(containers_of(midway["pid"])) <= 1
            with anyio.fail_after(30):
                while len(containers_of(midway["pid"])) != 1:
                    await anyio.sleep(0.1)
            await node.stdin.send(b"go\n")
            await node.stdin.aclose()
            story = json.loads(await lines.receive_until(b"\n", 1 << 22))
            assert await node.wait() == 0
    assert story["era"] == "legacy" and story["kind"] == "task", story
    assert story["ordinary"]["stdout"] == "ordinary\n"
    # The first task was still being followed after the ordinary call was answered.
    assert story["ordinary"]["messagesBefore"] < len(story["messages"]), story
    assert any("last line: step" in message for message in story["messages"]), story["messages"]
    assert story["messages"][-1].startswith("completed"), story["messages"]
    assert story["result"]["structuredContent"]["stdout"] == "".join(f"step {i}\n" for i in range(1, 9))


async def test_2026_a_branch_whose_calls_ask_for_long_is_a_task_and_each_call_may_take_a_tasks_time(
    tmp_path: Path, runtime: DockerRuntime
) -> None:
    policy = short_policy(tmp_path)  # one request may take 3 s; a task 120 s
    params = stdio_parameters("--policy", str(policy), "--state-dir", str(tmp_path / "state"))
    slow = {"command": "sleep 4; echo slow > s.txt; echo slow", "timeout_s": 10}
    calls = [
        {"tool": "execute_command", "arguments": slow},
        {"tool": "execute_command", "arguments": {"command": "echo quick"}},
    ]
    async with tasks_client(params) as client:
        base = await client.call_tool("execute_command", {"command": "echo a > f.txt"})
        workspace = (base.structured_content or {})["workspace"]
        answer = await client.session.call_tool(
            "workspaces", {"action": "branch", "workspace": workspace, "calls": calls}, allow_claimed=True
        )
        created = answer.model_dump(by_alias=True, exclude_none=True)
        assert created.get("resultType") == "task", created  # it lasts as long as its longest call asks
        ended = await until(client, created["taskId"], lambda t: t["status"] != "working")
    assert ended["status"] == "completed", ended
    long, quick = ended["result"]["structuredContent"]["branches"]
    assert (long["call"]["stdout"], long["files"]["created"]) == ("slow\n", ["s.txt"]), long  # past 3 s: a task's time
    assert quick["call"]["stdout"] == "quick\n" and not quick["call"]["is_error"], quick
