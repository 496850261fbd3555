"""A handshake session's end over HTTP (SessionEndWatcher): its workspace is gone before its client has the answer
to its DELETE, never after."""

from __future__ import annotations

from collections.abc import MutableMapping
from typing import Any

import anyio
from mcp.server.streamable_http import MCP_SESSION_ID_HEADER

from sandbox_server.protocol.http_sessions import SessionEndWatcher


def _deleted(status: int) -> list[str]:
    """What happened, in order, as the watcher passed a DELETE of session `s1` answered `status` in two parts."""
    seen: list[str] = []

    async def app(scope: Any, receive: Any, send: Any) -> None:
        await send({"type": "http.response.start", "status": status, "headers": []})
        await send({"type": "http.response.body", "body": b"", "more_body": True})
        await send({"type": "http.response.body", "body": b""})

    async def ended(session: str) -> None:
        seen.append(f"ended {session}")

    async def send(message: MutableMapping[str, Any]) -> None:
        seen.append(f"{message['type']}{' (more)' if message.get('more_body') else ''}")

    async def receive() -> MutableMapping[str, Any]:
        return {"type": "http.request", "body": b""}

    scope: dict[str, Any] = {"type": "http", "method": "DELETE", "headers": [(MCP_SESSION_ID_HEADER.encode(), b"s1")]}
    watcher = SessionEndWatcher(app, ended)

    async def delete() -> None:
        await watcher(scope, receive, send)

    anyio.run(delete)
    return seen


def test_the_session_ends_before_the_last_part_of_its_deletes_answer() -> None:
    assert _deleted(200) == [
        "http.response.start", "http.response.body (more)", "ended s1", "http.response.body",
    ]  # fmt: skip


def test_a_refused_delete_ends_nothing() -> None:
    assert "ended s1" not in _deleted(404)
