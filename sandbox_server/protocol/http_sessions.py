"""Handshake-era Streamable HTTP sessions around the SDK's app: how many one caller keeps, and their end.

`SessionCap` bounds the sessions one caller keeps open, so that one caller cannot fill the SDK's table of
sessions and lock the others out, nor one client of a caller lock its other clients out for good.
`SessionEndWatcher` notices when a session is ended (a DELETE the MCP app answers with success; the SDK has
answered 404 for a session that does not exist, and refused one that is not the caller's), so that what belonged
to it can go.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable

from mcp.server.streamable_http import MCP_SESSION_ID_HEADER
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from sandbox_server.protocol.http_budget import caller_key
from sandbox_server.protocol.http_limits import plain_answer

__all__ = ["ROOM_AFTER_S", "SessionCap", "SessionEndWatcher"]

log = logging.getLogger("sandbox_server")

ROOM_AFTER_S = 10.0
"""A caller's session unused this long, and answering nothing, is ended when the caller opens one past its cap."""


class SessionEndWatcher:
    """Calls `on_end(session_id)` once a DELETE of a session succeeded, before the answer's last part is sent: a
    client that has its answer finds the session's workspace gone (after it, a metrics scrape still counted it);
    passes everything through."""

    def __init__(self, app: ASGIApp, on_end: Callable[[str], Awaitable[None]]) -> None:
        self.app = app
        self.on_end = on_end

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope.get("type") != "http" or scope.get("method") != "DELETE":
            await self.app(scope, receive, send)
            return
        session = dict(scope.get("headers") or []).get(MCP_SESSION_ID_HEADER.encode())
        status: list[int] = []
        ended: list[bool] = []

        async def end() -> None:
            if session and status and 200 <= status[0] < 300 and not ended:
                ended.append(True)
                await self.on_end(session.decode("latin-1"))

        async def watched(message: Message) -> None:
            if message.get("type") == "http.response.start":
                status.append(int(message.get("status", 500)))
            elif message.get("type") == "http.response.body" and not message.get("more_body", False):
                await end()
            await send(message)

        await self.app(scope, receive, watched)
        await end()  # (an answer that never said its last part)


class SessionCap:
    """At most `limit` open handshake-era sessions per caller (per credential; anonymous callers are one).

    A session is counted from the answer that opens it (its `mcp-session-id`) until its client ends it
    (DELETE), the SDK no longer knows it (404), or it has been idle as long as the SDK lets sessions
    idle. A request that would open one more ends the caller's session unused longest, when one answers no
    request now and has been unused `room_after_s` (one client's forgotten sessions do not lock the same
    caller's other clients out); when every one is in use, it is answered 503 naming the limit.
    """

    def __init__(
        self,
        app: ASGIApp,
        limit: int,
        idle_s: float,
        handshake_versions: frozenset[str],
        clock: Callable[[], float] = time.monotonic,
        room_after_s: float = ROOM_AFTER_S,
    ) -> None:
        # The SDK's header names, imported only by a server that serves HTTP (the command line starts without it).
        from mcp.server.streamable_http import MCP_SESSION_ID_HEADER
        from mcp.shared.inbound import MCP_PROTOCOL_VERSION_HEADER

        self._session_header = MCP_SESSION_ID_HEADER.encode()
        self._version_header = MCP_PROTOCOL_VERSION_HEADER.encode()
        self.app = app
        self.limit = limit
        self.handshake_versions = handshake_versions
        """Protocol versions whose requests may open a session (a later era's requests carry theirs and open none)."""
        self.idle_s = idle_s
        self._clock = clock
        self._sessions: dict[str, dict[str, float]] = {}
        """caller key -> session id -> when it was last used."""
        self._opening: dict[str, int] = {}
        """Requests that may open a session, being answered now, per caller key."""
        self._busy: dict[str, int] = {}
        """Requests being answered now, per session."""
        self.room_after_s = room_after_s

    def _open(self, caller: str) -> dict[str, float]:
        sessions = self._sessions.get(caller, {})
        now = self._clock()
        for session, used in list(sessions.items()):
            if now - used > self.idle_s:
                del sessions[session]
        if not sessions:
            self._sessions.pop(caller, None)
        return sessions

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope.get("type") != "http":
            await self.app(scope, receive, send)
            return
        caller = caller_key(scope)
        headers = dict(scope.get("headers") or [])
        requested = headers.get(self._session_header)
        version = headers.get(self._version_header)
        opening = (
            requested is None
            and scope.get("method") == "POST"
            and (version is None or version.decode("latin-1") in self.handshake_versions)
        )
        sessions = self._open(caller)
        ending: str | None = None
        if opening and len(sessions) + self._opening.get(caller, 0) >= self.limit:
            idle = self._idle_longest(sessions)
            if idle is None:
                text = (
                    f"too many open sessions for this caller: {len(sessions)}, the most one caller may keep "
                    f"(serve --max-sessions-per-caller {self.limit}), and each was used in the last "
                    f"{self.room_after_s:g} s or is answering a request; end one (DELETE) or retry shortly"
                )
                log.warning("refused a new MCP session: %s", text)
                await plain_answer(503, text, scope, receive, send)
                return
            # Its place is taken now, in the same step as the count (the end itself is awaited below).
            ending, idle_for = idle, self._clock() - sessions.pop(idle)
            log.warning(
                "ending a session idle for %.0f s to open another of the same caller (serve --max-sessions-per-caller "
                "%d)",
                idle_for,
                self.limit,
            )
        status: list[int] = []
        pending = [opening]
        """Whether this request still holds a place among the caller's sessions being opened."""

        def settle() -> None:
            if pending[0]:
                pending[0] = False
                self._opening[caller] -= 1
                if not self._opening[caller]:
                    del self._opening[caller]

        async def watched(message: Message) -> None:
            if message.get("type") == "http.response.start":
                status.append(int(message.get("status", 500)))
                if opening:  # counted from the answer that names it, before the client can ask for another
                    for name, value in message.get("headers") or []:
                        if name.lower() == self._session_header:
                            self._sessions.setdefault(caller, {})[value.decode("latin-1")] = self._clock()
                    settle()
                code = status[0]
                if session is not None and (code == 404 or (scope.get("method") == "DELETE" and 200 <= code < 300)):
                    known = self._sessions.get(caller)  # ended (or unknown to the SDK): room for another at once
                    if known is not None:
                        known.pop(session, None)
            await send(message)

        session = requested.decode("latin-1") if requested is not None else None
        if session is not None and session in sessions:
            sessions[session] = self._clock()
            self._busy[session] = self._busy.get(session, 0) + 1
        if opening:
            self._opening[caller] = self._opening.get(caller, 0) + 1
        try:
            if ending is not None:
                await self._end(scope, ending)
            await self.app(scope, receive, watched)
        finally:
            settle()
            if session is not None and session in self._busy:
                self._busy[session] -= 1
                if not self._busy[session]:
                    del self._busy[session]
                known = self._sessions.get(caller)
                if known is not None and session in known:
                    known[session] = self._clock()  # used until its answer ended (an event stream, a long call)

    def _idle_longest(self, sessions: dict[str, float]) -> str | None:
        """The caller's session unused longest, if it answers no request now and has been unused `room_after_s`."""
        now = self._clock()
        idle = [(used, s) for s, used in sessions.items() if not self._busy.get(s) and now - used >= self.room_after_s]
        return min(idle)[1] if idle else None

    async def _end(self, scope: Scope, session: str) -> None:
        """End a session as its client would (DELETE, with the opening request's credentials): the SDK forgets it
        and the server lets go of its workspace and services."""
        kept = {b"authorization", b"host", b"origin", self._version_header}
        headers = [(k, v) for k, v in scope.get("headers") or [] if k.lower() in kept]
        ending = {**scope, "method": "DELETE", "headers": [*headers, (self._session_header, session.encode("latin-1"))]}

        async def nothing() -> Message:
            return {"type": "http.request", "body": b"", "more_body": False}

        async def discard(message: Message) -> None:
            """The answer goes to no client: the SessionEndWatcher inside has heard the end."""

        await self.app(ending, nothing, discard)
