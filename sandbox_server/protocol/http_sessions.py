"""Notice when a Streamable HTTP session is ended by its client, so what belonged to it can go.

A plain ASGI wrapper: a DELETE that the MCP app answers with success ended the session
named by its `mcp-session-id` header (the SDK has answered 404 for a session that does not
exist, and refused one that is not the caller's).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from mcp.server.streamable_http import MCP_SESSION_ID_HEADER
from starlette.types import ASGIApp, Message, Receive, Scope, Send

__all__ = ["SessionEndWatcher"]


class SessionEndWatcher:
    """Calls `on_end(session_id)` after a DELETE of a session succeeded; passes everything through."""

    def __init__(self, app: ASGIApp, on_end: Callable[[str], Awaitable[None]]) -> None:
        self.app = app
        self.on_end = on_end

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope.get("type") != "http" or scope.get("method") != "DELETE":
            await self.app(scope, receive, send)
            return
        session = dict(scope.get("headers") or []).get(MCP_SESSION_ID_HEADER.encode())
        status: list[int] = []

        async def watched(message: Message) -> None:
            if message.get("type") == "http.response.start":
                status.append(int(message.get("status", 500)))
            await send(message)

        await self.app(scope, receive, watched)
        if session and status and 200 <= status[0] < 300:
            await self.on_end(session.decode("latin-1"))
