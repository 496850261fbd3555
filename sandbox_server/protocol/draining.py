"""A replica taken out of service without losing work: it stops taking new work, lets what runs finish within a
grace period, and says so to the load balancer before it exits.

Draining begins on SIGTERM (a rolling update, `systemctl stop`) or when an operator asks for it through the shared
state (`sandbox-server replicas drain`). From then on:

- `/healthz` answers 503 with `"serving": "draining since …"`, so the load balancer's next health checks take the replica out;
- a request that would start new work here (a `tools/call` outside a handshake-era session living here, or an
  `initialize`) is answered 503 with `Retry-After: 1` before any of it runs, and the load balancer sends it again
  to another replica (deploy/haproxy.cfg's `retry-on`); reads (listing tools, a task's status or result, a
  resource) are answered as usual;
- a request of a handshake-era session living here is still served (that session cannot move), as is every
  request already under way;
- once no request is under way and no task runs here, or the grace period has passed, the server stops as before:
  tasks still running then fail saying why, and their callers run them again.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import anyio

if TYPE_CHECKING:
    from starlette.types import ASGIApp, Message, Receive, Scope, Send

    from sandbox_server.errors import RefusalKind

__all__ = ["FORWARDED", "LIVES_HERE", "Drain", "read_body", "refuse", "refuse_call", "replayed"]

NEW_WORK = frozenset({"tools/call", "initialize"})
FORWARDED = "sandbox_server.forwarded"
"""In the ASGI scope of a request a peer replica forwarded, signed (protocol.forwarding): that replica's name. Such
a request is for work that lives here, run even while this replica drains."""
LIVES_HERE = "sandbox_server.lives_here"
"""In the ASGI scope of a call for a workspace homed on this replica (protocol.forwarding): run while it drains, as
a forwarded one is, until the load balancer sends its calls elsewhere."""
"""What a draining replica answers 503: the requests that would start work, or a session, here. Everything else
(listing tools, reading a task, a resource or a prompt) is answered as usual: it ends at once.
"""
OUT_OF_SERVICE_S = 4.0
"""A draining replica with homes (protocol.forwarding) keeps listening at least this long, however soon what runs here ends: a load balancer's
health checks take it out of service within it (deploy/haproxy.cfg checks every second and takes a replica out
after two failures; the DaemonSet's readiness probe likewise), and until they do, calls for workspaces homed here
still come straight here, and are run."""
SETTLE_POLL_S = 0.1
"""How often a draining replica looks whether its requests and tasks have ended."""


class Drain:
    """This replica's way out of service: whether it is draining, and the requests under way here."""

    def __init__(self, grace_s: float, peers: Callable[[ASGIApp, int], ASGIApp] | None = None) -> None:
        self.grace_s = grace_s
        self.since: float | None = None
        self.why = ""
        self.under_way = 0
        self.forwarded = 0
        """Of the requests under way, those for work that lives here (forwarded by a peer, or sent here by the load
        balancer until it takes this replica out)."""
        self.closing = False
        """Set once the requests of this replica's own callers and its tasks have ended: a forwarded request is then
        refused too, and its replica waits until this one has let go of what it is for (protocol.forwarding)."""
        self.began = anyio.Event()
        self.stopping = anyio.Event()
        """Set once the server is to stop: then it stops as uvicorn stops (no new connection, the open ones given a
        few seconds, the application's lifespan ended in order)."""
        self.peers = peers
        """Replicas with homes: the forwarding to peers, in front of the draining (protocol.forwarding)."""

    @property
    def active(self) -> bool:
        return self.since is not None

    def begin(self, why: str) -> bool:
        """Start draining (False when it already had)."""
        if self.since is not None:
            return False
        self.since, self.why = time.monotonic(), why
        self.began.set()
        return True

    def problem(self) -> str | None:
        """What /healthz says of this replica: None while it serves."""
        if self.since is None:
            return None
        return f"draining since {time.monotonic() - self.since:.0f} s ({self.why}): it takes no new work"

    async def settled(self, tasks_running: Callable[[], int]) -> tuple[int, int]:
        """Wait until no request is under way and no task runs here, or the grace period has passed since draining
        began: the requests and tasks left then."""
        assert self.since is not None, "settled() is for a draining replica"
        with anyio.move_on_after(max(0.0, self.since + self.grace_s - time.monotonic())):
            out = self.since + min(OUT_OF_SERVICE_S, self.grace_s)
            while (
                self.under_way - self.forwarded
                or tasks_running()
                or (self.peers is not None and time.monotonic() < out)
            ):
                await anyio.sleep(SETTLE_POLL_S)
            self.closing = True  # peers keep forwarding calls for what lives here: from now on they wait for it
            while self.under_way:
                await anyio.sleep(SETTLE_POLL_S)
        self.closing = True
        return self.under_way, tasks_running()

    def wrap(self, app: ASGIApp, body_bytes: int) -> ASGIApp:
        """The ASGI app counting its requests to /mcp, and, while draining, answering 503 to those that would start
        work here (read whole first, up to `body_bytes`: what the app itself accepts)."""

        async def drained(scope: Scope, receive: Receive, send: Send) -> None:
            if scope.get("type") != "http" or scope.get("method") != "POST" or scope.get("path") != "/mcp":
                await app(scope, receive, send)
                return
            peer = scope.get(FORWARDED) or scope.get(LIVES_HERE)
            if peer and self.closing:
                message = (
                    f"this replica is stopping ({self.why}) and hands over what lives here; nothing of this request "
                    "ran: send it again"
                )
                await refuse(scope, receive, send, message)
                return
            if self.since is not None and not _of_a_session(scope) and not peer:
                body, whole = await read_body(receive, body_bytes)
                if whole and _starts_work(body):
                    message = (
                        f"this replica is stopping ({self.why}) and takes no new work; nothing of this request ran: "
                        "send it again, another replica takes it"
                    )
                    await refuse(scope, receive, send, message)
                    return
                receive = replayed(body, whole, receive)
            self.under_way += 1
            self.forwarded += bool(peer)
            try:
                await app(scope, receive, send)
            finally:
                self.under_way -= 1
                self.forwarded -= bool(peer)

        return self.peers(drained, body_bytes) if self.peers is not None else drained


async def read_body(receive: Receive, limit: int) -> tuple[bytes, bool]:
    """The request's body as far as `limit`, and whether that is all of it."""
    parts: list[bytes] = []
    size, more = 0, True
    while more and size <= limit:
        message = await receive()
        if message["type"] != "http.request":
            return b"".join(parts), False
        part = message.get("body", b"")
        parts.append(part)
        size += len(part)
        more = bool(message.get("more_body", False))
    return b"".join(parts), not more


def replayed(body: bytes, whole: bool, receive: Receive) -> Receive:
    """A receive that gives the body read ahead, then what is left of the request."""
    given = False

    async def replay() -> Message:
        nonlocal given
        if not given:
            given = True
            return {"type": "http.request", "body": body, "more_body": not whole}
        return await receive()

    return replay


def _starts_work(body: bytes) -> bool:
    """Whether a JSON-RPC message (or batch) would start work here: a tool call, or a new handshake-era session.
    What is not JSON is left for the app to refuse."""
    try:
        found = json.loads(body)
    except ValueError:
        return False
    messages = found if isinstance(found, list) else [found]
    return any(isinstance(m, dict) and m.get("method") in NEW_WORK for m in messages)


def _of_a_session(scope: Scope) -> bool:
    """Whether a request continues a handshake-era session (one that lives here: a load balancer sends a session's
    requests where it began; the SDK answers 404 to one it does not know)."""
    return any(name == b"mcp-session-id" for name, _ in scope.get("headers") or [])


async def refuse(scope: Scope, receive: Receive, send: Send, message: str) -> None:
    """A JSON-RPC error (the client's SDK reads it as the server's word) with the 503 that a load balancer sends
    elsewhere, as the other refusals before a request is read: `Retry-After`, and the connection closed."""
    from starlette.responses import JSONResponse  # here: the command line imports this module without Starlette

    error = {"jsonrpc": "2.0", "id": None, "error": {"code": -32000, "message": message}}
    await JSONResponse(error, status_code=503, headers={"connection": "close", "retry-after": "1"})(
        scope, receive, send
    )


async def refuse_call(
    scope: Scope, receive: Receive, send: Send, body: bytes, message: str, may_have_run: bool, retry_after_s: float
) -> bool:
    """Answer a `tools/call` as its tool answers a call that could not run: an error result the model reads and
    acts on (`engine_error` when it `may_have_run`, else `engine_unavailable`, and `retry_after_s`), where a
    JSON-RPC error would be raised to the client's code instead; whether `body` was such a call (else nothing is
    sent)."""
    from starlette.responses import JSONResponse

    from sandbox_server.tools.base import ToolOutcome

    try:
        found = json.loads(body)
    except ValueError:
        return False
    if not (isinstance(found, dict) and found.get("method") == "tools/call" and "id" in found):
        return False
    kind: RefusalKind = "engine_error" if may_have_run else "engine_unavailable"
    structured = dict(ToolOutcome.failed(kind, message, retry_after_s=retry_after_s).structured or {})
    result = {
        "content": [{"type": "text", "text": message}, {"type": "text", "text": json.dumps(structured)}],
        "structuredContent": structured,
        "isError": True,
        "resultType": "complete",  # required from 2026-07-28 on; a client of an earlier era reads past it
    }
    await JSONResponse({"jsonrpc": "2.0", "id": found["id"], "result": result})(scope, receive, send)
    return True
