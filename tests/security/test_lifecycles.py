"""Holes in what calls, services and tasks hold over time: each attack in its own shape (concurrency, timing,
sizes), through the real server, the official client and the real engine; memory read from the server's RSS."""

from __future__ import annotations

import contextlib
import subprocess
import sys
import time
from contextlib import AsyncExitStack
from pathlib import Path
from typing import Any

import anyio
import httpx2
import mcp_types as types
import psutil
import pytest
from mcp.client.streamable_http import streamable_http_client
from mcp.shared.exceptions import MCPError

from sandbox_server.protocol.http_sessions import ROOM_AFTER_S
from sandbox_server.protocol.tasks_client import task_request
from sandbox_server.sandbox.engine.runtime import DockerRuntime
from tests.mcp_harness import CheckedClient, answer, connect, http_server_process, text_of
from tests.test_replicas import client_of
from tests.test_services import add_token, as_caller, services_of, short_policy, until_gone

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
    # Caps with room for every try: a start asked to stop counts until its task is past the engine's step it is in
    # (on a busy engine, longer than the next try takes), and this attack is about the session's end, not the caps.
    policy = short_policy(tmp_path)
    caps = policy.read_text()
    assert "per_caller: 3\n" in caps and "running: 4\n" in caps, caps
    policy.write_text(caps.replace("per_caller: 3\n", "per_caller: 10\n").replace("running: 4\n", "running: 10\n"))
    serve = ("--policy", str(policy), "--no-pool", "--state-dir", str(tmp_path / "s"))
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
                try:
                    async with connect(transport) as session, anyio.create_task_group() as group:

                        async def start() -> None:
                            service = {"name": "web", "port": 8000}
                            with contextlib.suppress(MCPError):  # the session's end may cut the answer short
                                answers.append(await answer(
                                    session, "execute_command", {"command": SLOW_START, "service": service}
                                ))  # fmt: skip

                        group.start_soon(start)
                        await anyio.sleep(delay_s)  # the attack's timing: the session ends somewhere in the start
                        async with httpx2.AsyncClient(timeout=30) as other:
                            ended = await other.delete(server.url, headers={"mcp-session-id": ids[0]})
                        assert ended.status_code == 200, ended.text
                        group.cancel_scope.cancel()
                except* anyio.BrokenResourceError:
                    pass  # the attacker's client, handed a reply for a call it gave up as its session ended

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
            clients = {name: await stack.enter_async_context(client_of(server.url, t)) for name, t in callers.items()}

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


# -- 3. calls waiting for a person, sent all at once with large arguments ----------------------------------------

ASKING = """\
extends: default
rate: {calls_per_minute: 100000, concurrent_calls: 4}
approval: {commands: ["rm *"]}
"""
MiB = 2**20


class ResetAsRefused(httpx2.AsyncBaseTransport):
    """A transport that answers a request whose connection the server reset 503, as the server did."""

    def __init__(self) -> None:
        self._inner = httpx2.AsyncHTTPTransport()

    async def handle_async_request(self, request: httpx2.Request) -> httpx2.Response:
        try:
            return await self._inner.handle_async_request(request)
        except (httpx2.WriteError, httpx2.ReadError, httpx2.RemoteProtocolError) as exc:
            return httpx2.Response(503, text=f"the server closed the connection: {exc!r}", request=request)

    async def aclose(self) -> None:
        await self._inner.aclose()


async def test_a_burst_of_large_calls_waiting_for_a_person_holds_a_bounded_share_and_gives_it_back(
    tmp_path: Path, runtime: DockerRuntime
) -> None:
    """The attack: one session sends 150 calls at once, each with 3 MB of stdin, under a policy that asks about
    `rm *`, and its client never answers; then it leaves. The server's RSS is read all along."""
    policy = tmp_path / "asking.yaml"
    policy.write_text(ASKING)
    never = anyio.Event()
    outcomes: list[str] = []

    async def silent_person(context: Any, params: types.ElicitRequestParams) -> types.ElicitResult:
        await never.wait()
        raise AssertionError("never answered")

    with http_server_process("--policy", str(policy), "--no-pool") as server:
        memory = psutil.Process(server.process.pid)
        async with connect(server.url) as warm:  # the server's own level, once it has served a call
            await _still_serving(warm)
        level = memory.memory_info().rss
        peak = level
        # The door's 503 goes out before the request's body is read, and closes the connection: a client still
        # sending its 3 MB may see the connection reset instead, which the SDK's transport does not survive. The
        # attacker's client takes such a reset as the refusal it stands for, so that its session lives on to
        # count the refusals that come after it.
        http = httpx2.AsyncClient(transport=ResetAsRefused(), timeout=httpx2.Timeout(30, read=300))
        try:  # the attacker's own client leaves with calls in flight on connections the server closed: its
            # transport may fail as it goes (httpx2.ReadError out of the SDK's task group); the server is judged
            transport = streamable_http_client(server.url, http_client=http)
            async with http, connect(transport, elicitation_callback=silent_person) as session:

                async def one() -> None:
                    try:
                        result = await session.call_tool(
                            "execute_command", {"command": "rm -f x", "stdin": "x" * 3_000_000}
                        )
                        outcomes.append(
                            result.structured_content["error"]["field"] if result.structured_content else "?"
                        )
                    except Exception as exc:  # refused at the door: a 503 that names the option
                        outcomes.append(type(exc).__name__)

                async with anyio.create_task_group() as group:
                    for _ in range(150):
                        group.start_soon(one)
                    with anyio.fail_after(120):  # every call is answered but those waiting for the person
                        while len(outcomes) < 146:
                            peak = max(peak, memory.memory_info().rss)
                            await anyio.sleep(0.05)
                    peak = max(peak, memory.memory_info().rss)
                    group.cancel_scope.cancel()  # the client leaves with four calls still waiting
        except* httpx2.TransportError:
            pass
        assert peak - level < 320 * MiB, (level // MiB, peak // MiB)  # not 150 calls' arguments held many times over
        with anyio.fail_after(30):  # and what it held goes back to the host once its calls are gone
            while memory.memory_info().rss - level > 48 * MiB:
                await anyio.sleep(0.1)
        assert outcomes.count("rate.concurrent_calls") >= 10, outcomes  # refused while four wait for the person
        log = "".join(server.lines)
        assert "serve --max-held-bytes-per-caller" in log, log[-2000:]  # the rest were refused at the door
        async with connect(server.url) as after:
            await _still_serving(after)


# -- 9. a flood of approval questions beside another client's pending one ---------------------------------------


async def test_a_flood_of_approval_questions_pushes_out_no_other_clients_pending_question(
    tmp_path: Path, runtime: DockerRuntime
) -> None:
    """The attack: while one client's question waits for its person, another client of the same (anonymous) caller
    has 150 questions asked and never answered; then the first person says yes, and that yes must count."""
    policy = tmp_path / "asking.yaml"
    policy.write_text(ASKING)
    flood_done, never = anyio.Event(), anyio.Event()
    asked: list[str] = []

    async def patient_person(context: Any, params: types.ElicitRequestParams) -> types.ElicitResult:
        asked.append(params.message)
        await flood_done.wait()
        return types.ElicitResult(action="accept", content={})

    async def silent_person(context: Any, params: types.ElicitRequestParams) -> types.ElicitResult:
        asked.append(params.message)
        await never.wait()
        raise AssertionError("never answered")

    with http_server_process("--policy", str(policy), "--no-pool") as server:
        async with (
            connect(server.url, mode="2026-07-28", elicitation_callback=patient_person) as first,
            connect(server.url, mode="2026-07-28", elicitation_callback=silent_person) as flooder,
            anyio.create_task_group() as group,
        ):
            results: list[dict[str, Any]] = []

            async def approved_call() -> None:
                results.append(await answer(first, "execute_command", {"command": "rm -f nothing && echo removed"}))

            group.start_soon(approved_call)
            with anyio.fail_after(30):
                while not asked:
                    await anyio.sleep(0.01)
            for number in range(150):
                group.start_soon(flooder.call_tool, "execute_command", {"command": f"rm -f file{number}"})
            with anyio.fail_after(60):
                while len(asked) < 151:
                    await anyio.sleep(0.02)
            flood_done.set()
            with anyio.fail_after(30):
                while not results:
                    await anyio.sleep(0.02)
            group.cancel_scope.cancel()
        (approved,) = results
        assert not approved["is_error"] and approved["stdout"] == "removed\n", approved["text"]
        assert len(asked) == 151  # the yes was taken at once: its person was not asked again


# -- 10. one client of a caller opening every session that caller may keep --------------------------------------


async def test_one_client_holding_every_session_of_its_caller_locks_the_callers_other_clients_out_only_briefly(
    tmp_path: Path, runtime: DockerRuntime
) -> None:
    """The attack: one client opens the 100 sessions its caller may keep (--max-sessions-per-caller) and leaves them
    open; the same caller's honest client then gets in once the longest idle one may be ended for it."""
    tokens = tmp_path / "tokens.json"
    token = add_token(tokens, "alice", short_policy(tmp_path))
    initialize = {
        "jsonrpc": "2.0", "id": 1, "method": "initialize",
        "params": {"protocolVersion": "2025-06-18", "capabilities": {}, "clientInfo": {"name": "x", "version": "1"}},
    }  # fmt: skip
    headers = {
        "Accept": "application/json, text/event-stream",
        "Content-Type": "application/json",
        "Authorization": f"Bearer {token}",
    }
    with http_server_process("--tokens", str(tokens), "--no-pool", "--state-dir", str(tmp_path / "s")) as server:
        async with httpx2.AsyncClient(headers=headers, timeout=30) as flooder:
            opened = [(await flooder.post(server.url, json=initialize)).headers["mcp-session-id"]]
            started = time.monotonic()  # the oldest session's last use: the room comes once it has idled long enough
            opened += [(await flooder.post(server.url, json=initialize)).headers["mcp-session-id"] for _ in range(99)]
            refused = await flooder.post(server.url, json=initialize)  # all of them just used: none is ended yet
            assert refused.status_code == 503 and "serve --max-sessions-per-caller 100" in refused.text, refused.text
            with anyio.fail_after(ROOM_AFTER_S + 20):
                while True:
                    try:
                        async with as_caller(server.url, token) as honest:
                            await _still_serving(honest)
                        break
                    except Exception:  # 503 until the flooder's oldest session has idled long enough
                        await anyio.sleep(0.5)
            assert time.monotonic() - started >= ROOM_AFTER_S - 1
            ping = {"jsonrpc": "2.0", "id": 2, "method": "ping"}
            first = await flooder.post(server.url, json=ping, headers={"mcp-session-id": opened[0]})
            last = await flooder.post(server.url, json=ping, headers={"mcp-session-id": opened[-1]})
            assert first.status_code == 404 and last.status_code == 200  # the one idle longest was ended
        assert "ending a session idle for" in "".join(server.lines)


# -- 11. servers sharing a state folder, and anonymous clients sharing one caller --------------------------------

KEEPING = """\
extends: default
workspace: {persist: true, size_mb: 64, files: 20000, idle_ttl_s: 600, max_per_client: 2, protect_recent_s: 0}
"""


async def _new_workspace(url: str) -> dict[str, Any]:
    """A 2026-07-28 anonymous call that makes a new workspace: its answer."""
    async with connect(url, mode="2026-07-28") as client:
        made = await answer(client, "execute_command", {"command": "echo mine > mine.txt"})
    assert not made["is_error"], made["text"]
    return made


async def test_two_servers_never_manage_each_others_workspaces_and_anonymous_sessions_keep_apart(
    tmp_path: Path, runtime: DockerRuntime
) -> None:
    policy = tmp_path / "keeping.yaml"
    policy.write_text(KEEPING)
    folder = tmp_path / "state"
    with http_server_process("--policy", str(policy), "--state-dir", str(folder), "--no-pool") as first:
        # A folder named on purpose that another server holds: refused at start, naming that server.
        refused = subprocess.run(
            [sys.executable, "-m", "sandbox_server", "serve", "--policy", str(policy), "--state-dir", str(folder)],
            capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL,
        )  # fmt: skip
        assert refused.returncode != 0, refused.stderr
        said = f"the state folder {folder} is in use by another sandbox-server (process {first.process.pid})"
        assert said in refused.stderr and "serve --state-dir" in refused.stderr, refused.stderr
        # Anonymous handshake sessions are one caller for the limits, but each counts its own workspaces.
        async with as_caller(first.url) as one, as_caller(first.url) as two, as_caller(first.url) as three:
            for number, session in enumerate((one, two, three)):
                wrote = await answer(session, "execute_command", {"command": f"echo {number} > mine.txt"})
                assert "removed to make room" not in wrote["text"], wrote["text"]
            kept = await answer(one, "execute_command", {"command": "cat mine.txt"})
            assert kept["stdout"] == "0\n", kept["text"]
    # The default folder, which every server on a host shares unless told otherwise: the second takes its own.
    with (
        http_server_process("--policy", str(policy), "--no-pool") as first,
        http_server_process("--policy", str(policy), "--no-pool") as second,
    ):
        # One workspace on the first: the host's default folder may hold this anonymous caller's workspaces from
        # earlier runs, and a second one made here could rightly make room by removing the first (never continued).
        first_made = await _new_workspace(first.url)
        assert second.wait_for_line("this one keeps its state in", timeout_s=30)
        for _ in range(3):  # (a workspace its own earlier run left may go to make room, never the first's)
            made = await _new_workspace(second.url)
            assert first_made["workspace"] not in made["text"], made["text"]
        async with connect(first.url, mode="2026-07-28") as client:
            again = await answer(
                client, "execute_command", {"command": "cat mine.txt", "workspace": first_made["workspace"]}
            )
        assert again["stdout"] == "mine\n", again["text"]
