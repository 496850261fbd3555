"""Holes in what calls, services and tasks hold over time: each attack in its own shape (concurrency, timing,
sizes), through the real server, the official client and the real engine; memory read from the server's RSS."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from pathlib import Path
from typing import Any

import anyio
import httpx2
import mcp_types as types
import pytest
from mcp import Client
from mcp.client.streamable_http import streamable_http_client
from mcp.shared.exceptions import MCPError

from sandbox_server.protocol.tasks_client import TasksExtension, task_request
from sandbox_server.sandbox.docker_runtime import DockerRuntime
from tests.mcp_harness import CheckedClient, answer, connect, http_server_process, text_of
from tests.test_services import add_token, services_of, short_policy, until_gone

pytestmark = pytest.mark.anyio


async def _still_serving(session: CheckedClient) -> None:
    with anyio.fail_after(15):
        plain = await answer(session, "execute_command", {"command": "echo ok"})
    assert not plain["is_error"] and plain["stdout"] == "ok\n", plain["text"]


# -- 1. a session that ends while its service starts ------------------------------------------------------------

SLOW_START = "sleep 1.5; exec python3 -m http.server 8000"


async def test_a_session_ended_while_its_service_starts_leaves_no_container_behind(
    tmp_path: Path, runtime: DockerRuntime
) -> None:
    """The attack: DELETE the session while a service is still starting, ten times over, side by side."""
    serve = ("--policy", str(short_policy(tmp_path)), "--no-pool", "--state-dir", str(tmp_path / "s"))
    with http_server_process(*serve) as server:
        pid = server.process.pid
        answers: list[dict[str, Any]] = []

        async def one_try(delay_s: float) -> None:
            ids: list[str] = []

            async def keep_id(response: httpx2.Response) -> None:
                if "mcp-session-id" in response.headers:
                    ids.append(response.headers["mcp-session-id"])

            async with httpx2.AsyncClient(timeout=60, event_hooks={"response": [keep_id]}) as http:
                transport = streamable_http_client(server.url, http_client=http, terminate_on_close=False)
                async with connect(transport) as session, anyio.create_task_group() as group:

                    async def start() -> None:
                        service = {"name": "web", "port": 8000}
                        with contextlib.suppress(MCPError):  # the session's end may cut the answer short
                            answers.append(
                                await answer(session, "execute_command", {"command": SLOW_START, "service": service})
                            )

                    group.start_soon(start)
                    await anyio.sleep(delay_s)  # the attack's timing: the session ends somewhere in the start
                    async with httpx2.AsyncClient(timeout=30) as other:
                        ended = await other.delete(server.url, headers={"mcp-session-id": ids[0]})
                    assert ended.status_code == 200, ended.text
                    group.cancel_scope.cancel()

        for attempt in range(10):
            await one_try(0.05 + attempt * 0.1)
        # Nothing the server made runs on: every service container is gone, none left untracked.
        await until_gone(pid, within_s=30)
        assert not services_of(pid)
        for started in answers:  # an answer that came before the session ended says why it stopped
            assert started["is_error"] and "stopped while it started" in started["text"], started["text"]
        async with connect(server.url) as session:
            await _still_serving(session)


# -- 2. a burst of task calls against the task caps -------------------------------------------------------------

TASKS = """\
extends: default
tasks: {running: 4, running_per_caller: 2}
rate: {calls_per_minute: 1000, concurrent_calls: 16}
"""


@asynccontextmanager
async def tasks_caller(url: str, token: str) -> AsyncIterator[Client]:
    """A 2026-07-28 client of the caller holding `token`, naming the tasks extension."""
    async with httpx2.AsyncClient(headers={"Authorization": f"Bearer {token}"}, timeout=60) as http:
        transport = streamable_http_client(url, http_client=http)
        async with Client(transport, mode="2026-07-28", extensions=[TasksExtension()]) as client:
            yield client


async def test_a_burst_of_task_calls_gets_exactly_the_caps_and_clear_refusals_for_the_rest(
    tmp_path: Path, runtime: DockerRuntime
) -> None:
    """The attack: ten long calls at once from each of three callers; the caps are 2 a caller and 4 in all."""
    policy = tmp_path / "tasks.yaml"
    policy.write_text(TASKS)
    tokens = tmp_path / "tokens.json"
    callers = {name: add_token(tokens, name, policy) for name in ("ann", "ben", "cat")}
    serve = ("--policy", str(policy), "--tokens", str(tokens), "--no-pool", "--state-dir", str(tmp_path / "s"))
    with http_server_process(*serve) as server:
        created: dict[str, list[str]] = {name: [] for name in callers}
        refused: list[str] = []
        async with AsyncExitStack() as stack:
            clients = {
                name: await stack.enter_async_context(tasks_caller(server.url, t)) for name, t in callers.items()
            }

            async def one(name: str) -> None:
                arguments = {"command": "sleep 100", "timeout_s": 200}
                sent = await clients[name].session.call_tool("execute_command", arguments, allow_claimed=True)
                if isinstance(sent, types.CallToolResult):
                    assert sent.is_error and sent.structured_content is not None, sent
                    refused.append(sent.structured_content["error"]["field"])
                    assert "busy" in text_of(sent), text_of(sent)
                else:
                    created[name].append(sent.model_dump(by_alias=True)["taskId"])

            async with anyio.create_task_group() as group:
                for _ in range(10):
                    for name in callers:
                        group.start_soon(one, name)
            assert sum(len(ids) for ids in created.values()) == 4, created
            assert all(len(ids) <= 2 for ids in created.values()), created
            assert len(refused) == 26 and set(refused) <= {"tasks.running", "tasks.running_per_caller"}, refused
            for name, ids in created.items():
                for task_id in ids:
                    await task_request(clients[name].session, "tasks/cancel", taskId=task_id)
            # Once they ended, the caps are free again, exactly.
            again = await clients["cat"].session.call_tool(
                "execute_command", {"command": "true", "timeout_s": 200}, allow_claimed=True
            )
            assert not isinstance(again, types.CallToolResult), again
