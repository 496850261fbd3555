"""A draining replica's front door, in process: what it answers 503 (new work), what it still serves with the body
it read ahead given back whole, and how it counts the requests under way."""

from __future__ import annotations

import json
from typing import Any

import anyio
import pytest

from sandbox_server.protocol.draining import Drain

pytestmark = pytest.mark.anyio


async def _post(
    drain: Drain, message: Any, headers: tuple[tuple[bytes, bytes], ...] = ()
) -> tuple[int, bytes, list[bytes]]:
    """POST /mcp through the drain to an app that echoes the body it got: the status, the body sent back, and what
    the app read."""
    read: list[bytes] = []
    body = json.dumps(message).encode()
    parts = [body[:10], body[10:]]  # in two parts, as a client may send it

    async def receive() -> dict[str, Any]:
        part = parts.pop(0)
        return {"type": "http.request", "body": part, "more_body": bool(parts)}

    async def app(scope: Any, receive: Any, send: Any) -> None:
        more = True
        while more:
            message = await receive()
            read.append(message.get("body", b""))
            more = message.get("more_body", False)
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"served"})

    sent: list[dict[str, Any]] = []

    async def send(message: Any) -> None:
        sent.append(message)

    scope = {"type": "http", "method": "POST", "path": "/mcp", "headers": list(headers)}
    await drain.wrap(app, 1 << 20)(scope, receive, send)
    return sent[0]["status"], sent[1]["body"], read


async def test_new_work_is_refused_while_draining_and_reads_and_sessions_are_served() -> None:
    drain = Drain(grace_s=5)
    call = {"jsonrpc": "2.0", "id": 1, "method": "tools/call", "params": {"name": "execute_command"}}
    assert (await _post(drain, call))[:2] == (200, b"served")
    assert drain.problem() is None and drain.begin("SIGTERM") and not drain.begin("again")
    status, body, read = await _post(drain, call)
    assert status == 503 and read == [] and b"takes no new work; nothing of this request ran" in body
    assert (await _post(drain, {"jsonrpc": "2.0", "id": 2, "method": "initialize"}))[0] == 503
    assert (await _post(drain, [{"jsonrpc": "2.0", "id": 3, "method": "ping"}, call]))[0] == 503  # a batch
    listed = {"jsonrpc": "2.0", "id": 4, "method": "tools/list"}
    status, _, read = await _post(drain, listed)
    assert status == 200 and b"".join(read) == json.dumps(listed).encode()  # the body read ahead, given back whole
    session = ((b"mcp-session-id", b"abc"),)  # a handshake-era session living here goes on
    assert (await _post(drain, call, session))[0] == 200
    assert "draining since" in (drain.problem() or "")


async def test_settling_waits_for_requests_and_tasks_or_the_grace_period() -> None:
    drain = Drain(grace_s=0.3)
    drain.begin("SIGTERM")
    tasks = [1]
    with anyio.fail_after(5):
        assert await drain.settled(lambda: tasks[0]) == (0, 1)  # the grace period ran out with a task running
    drain = Drain(grace_s=30)
    drain.begin("SIGTERM")
    drain.under_way = 1

    async def finish() -> None:
        await anyio.sleep(0.2)
        drain.under_way = 0

    with anyio.fail_after(5):
        async with anyio.create_task_group() as group:
            group.start_soon(finish)
            assert await drain.settled(lambda: 0) == (0, 0)


async def test_work_that_lives_here_is_run_while_draining_until_the_replicas_own_callers_are_done() -> None:
    """A call a peer forwarded (or one for a workspace homed here) is run while draining; once this replica's own
    requests and tasks have ended, such calls are refused too (their replica waits for the hand-over), and the drain
    settles when the last of them ends."""
    from sandbox_server.protocol.draining import FORWARDED, LIVES_HERE

    drain = Drain(grace_s=5)
    call = {"jsonrpc": "2.0", "id": 1, "method": "tools/call", "params": {"name": "execute_command"}}
    release = anyio.Event()

    async def slow(scope: Any, receive: Any, send: Any) -> None:
        await release.wait()
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"served"})

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": json.dumps(call).encode(), "more_body": False}

    sent: list[dict[str, Any]] = []

    async def send(message: Any) -> None:
        sent.append(message)

    drain.begin("SIGTERM")
    forwarded: dict[str, Any] = {"type": "http", "method": "POST", "path": "/mcp", "headers": [], FORWARDED: "b"}
    homed: dict[str, Any] = {"type": "http", "method": "POST", "path": "/mcp", "headers": [], LIVES_HERE: True}
    wrapped: Any = drain.wrap(slow, 1 << 20)
    async with anyio.create_task_group() as group:
        group.start_soon(wrapped, forwarded, receive, send)
        group.start_soon(wrapped, homed, receive, send)
        with anyio.fail_after(5):
            while drain.under_way < 2:
                await anyio.sleep(0.01)
        assert drain.forwarded == 2
        settled: list[tuple[int, int]] = []

        async def settle() -> None:
            settled.append(await drain.settled(lambda: 0))

        group.start_soon(settle)
        with anyio.fail_after(5):  # the replica's own callers are done: calls for what lives here now wait
            while not drain.closing:
                await anyio.sleep(0.01)
        refused: list[dict[str, Any]] = []

        async def keep(message: Any) -> None:
            refused.append(message)

        await drain.wrap(slow, 1 << 20)(dict(forwarded), receive, keep)
        assert refused[0]["status"] == 503 and b"hands over what lives here" in refused[1]["body"]
        assert not settled  # the two under way are waited for
        release.set()
    assert settled == [(0, 0)] and [m["status"] for m in sent if "status" in m] == [200, 200]
