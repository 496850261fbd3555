"""What HTTP requests in flight may hold, in bytes of their bodies, per caller and in all.

A request's body (a call's arguments) is held from the moment it arrives until its answer has gone: while the call
waits for a slot, for a person's approval, or runs. So the bytes of the requests in flight are counted against a
budget per caller and one for the server (`serve --max-held-bytes-per-caller`, `--max-held-bytes`); a request that
would go past either is answered 503 before its body is read, naming the option, and nothing of it is kept. The
count goes down when the request's answer has gone (a refusal included), so a client that leaves frees its share.
"""

from __future__ import annotations

import hashlib
import logging
from collections import defaultdict

from starlette.types import ASGIApp, Receive, Scope, Send

from sandbox_server.protocol.http_limits import plain_answer

__all__ = ["HeldBytes", "caller_key"]

log = logging.getLogger("sandbox_server")


def caller_key(scope: Scope) -> str:
    """Whose request it is, for counting what it holds: its credential (hashed), else the anonymous caller."""
    headers = dict(scope.get("headers") or [])
    credential = headers.get(b"authorization")
    return "anonymous" if not credential else hashlib.sha256(credential).hexdigest()


class HeldBytes:
    """At most `per_caller` bytes of request bodies in flight for one caller and `in_all` for the server."""

    def __init__(self, app: ASGIApp, in_all: int, per_caller: int, largest_body: int) -> None:
        self.app = app
        self.in_all, self.per_caller = in_all, per_caller
        self.largest_body = largest_body
        """What a body of no stated length is counted as (the most the server reads of one)."""
        self.held = 0
        self.by_caller: defaultdict[str, int] = defaultdict(int)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope.get("type") != "http" or scope.get("method") != "POST":
            await self.app(scope, receive, send)
            return
        caller = caller_key(scope)
        size = self._size(scope)
        refusal = self._refusal(caller, size)
        if refusal is not None:
            log.warning("refused an HTTP request: %s", refusal)
            await plain_answer(503, refusal, scope, receive, send)
            return
        self.held += size
        self.by_caller[caller] += size
        try:
            await self.app(scope, receive, send)
        finally:
            self.held -= size
            self.by_caller[caller] -= size
            if self.by_caller[caller] <= 0:
                del self.by_caller[caller]

    def _size(self, scope: Scope) -> int:
        for name, value in scope.get("headers") or []:
            if name.lower() == b"content-length":
                try:
                    return max(0, min(int(value), self.largest_body))
                except ValueError:
                    break
        return self.largest_body

    def _refusal(self, caller: str, size: int) -> str | None:
        mine = self.by_caller.get(caller, 0)
        if mine and mine + size > self.per_caller:
            return (
                f"busy: this caller's requests in flight hold {mine} bytes of arguments, and this one's {size} would "
                f"pass its share (serve --max-held-bytes-per-caller {self.per_caller}); retry when some are answered"
            )
        if self.held and self.held + size > self.in_all:
            return (
                f"busy: requests in flight hold {self.held} bytes of arguments, and this one's {size} would pass "
                f"the server's budget (serve --max-held-bytes {self.in_all}); retry shortly"
            )
        return None
