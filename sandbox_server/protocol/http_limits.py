"""Bounds on what HTTP clients may hold before and around their MCP requests.

The SDK's Streamable HTTP app sees a request only once its headers are complete, so what
a client holds before that (an open connection that says nothing, a header sent a byte at
a time) is bounded here, in the HTTP server's own protocol: at most `max_connections`
connections in all and `max_per_address` from one address (more are answered `503` and
closed at once), `header_timeout_s` to send a request's headers (from the connection's
start, or the end of its previous answer) and `body_timeout_s` to send its body. Every
refusal says which `serve` option bounds it.

Around the app, `http_sessions.SessionCap` bounds the handshake-era sessions one caller keeps open.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import resource
from collections import defaultdict
from dataclasses import dataclass, field

from starlette.types import ASGIApp, Message, Receive, Scope, Send

__all__ = [
    "ConnectionLimits",
    "ExplainedBodyCap",
    "add_limit_arguments",
    "bounded_protocol",
    "plain_answer",
    "raise_open_files_limit",
]

log = logging.getLogger("sandbox_server")


@dataclass(frozen=True, slots=True)
class ConnectionLimits:
    """What HTTP clients may hold open (serve's --max-connections, --max-connections-per-address,
    --header-timeout-s, --body-timeout-s, --max-sessions-per-caller, --max-held-bytes[-per-caller])."""

    max_connections: int = 1000
    max_per_address: int = 200
    header_timeout_s: float = 10.0
    body_timeout_s: float = 60.0
    max_sessions_per_caller: int = 100
    max_held_bytes: int = 256 * 2**20
    max_held_bytes_per_caller: int = 64 * 2**20

    @classmethod
    def of(cls, args: argparse.Namespace) -> ConnectionLimits:
        """The limits `serve`'s options give (add_limit_arguments)."""
        return cls(
            args.max_connections, args.max_connections_per_address, args.header_timeout_s, args.body_timeout_s,
            args.max_sessions_per_caller, args.max_held_bytes, args.max_held_bytes_per_caller,
        )  # fmt: skip


def add_limit_arguments(serve: argparse.ArgumentParser) -> None:
    """`serve`'s options for what HTTP clients may hold, with ConnectionLimits' defaults."""
    bounds = ConnectionLimits()
    serve.add_argument(
        "--max-connections",
        type=_positive_int,
        default=bounds.max_connections,
        help=f"HTTP: connections held open at once, in all (default {bounds.max_connections}); more are answered 503",
    )
    serve.add_argument(
        "--max-connections-per-address",
        type=_positive_int,
        default=bounds.max_per_address,
        help=f"HTTP: connections one client address may hold open (default {bounds.max_per_address}); "
        "raise it behind a reverse proxy, where every client has the proxy's address",
    )
    serve.add_argument(
        "--header-timeout-s",
        type=_positive_float,
        default=bounds.header_timeout_s,
        help=f"HTTP: seconds a client has to send a request's headers (default {bounds.header_timeout_s:g}); "
        "idle and slow connections are closed",
    )
    serve.add_argument(
        "--body-timeout-s",
        type=_positive_float,
        default=bounds.body_timeout_s,
        help=f"HTTP: seconds a client has to send a request's body (default {bounds.body_timeout_s:g})",
    )
    serve.add_argument(
        "--max-sessions-per-caller",
        type=_positive_int,
        default=bounds.max_sessions_per_caller,
        help=f"HTTP: handshake-era sessions one caller may keep open (default {bounds.max_sessions_per_caller}; "
        "anonymous callers on loopback are one caller)",
    )
    serve.add_argument(
        "--max-held-bytes",
        type=_positive_int,
        default=bounds.max_held_bytes,
        help=f"HTTP: bytes of request bodies (call arguments) held by requests in flight, in all (default "
        f"{bounds.max_held_bytes}); past it a request is answered 503 before its body is read",
    )
    serve.add_argument(
        "--max-held-bytes-per-caller",
        type=_positive_int,
        default=bounds.max_held_bytes_per_caller,
        help=f"HTTP: as --max-held-bytes, for one caller's requests (default {bounds.max_held_bytes_per_caller})",
    )
    serve.add_argument(
        "--max-request-bytes",
        type=_positive_int,
        help="HTTP: the largest request body (default: the policy's limits.argument_bytes and 64 KiB for the "
        "JSON-RPC envelope)",
    )


def _positive_int(value: str) -> int:
    number = int(value)
    if number <= 0:
        raise argparse.ArgumentTypeError(f"{value!r} is not a positive whole number")
    return number


def _positive_float(value: str) -> float:
    number = float(value)
    if not number > 0 or number == float("inf"):
        raise argparse.ArgumentTypeError(f"{value!r} is not a positive number of seconds")
    return number


def raise_open_files_limit() -> int:
    """Raise this process's soft limit on open files to its hard limit; returns the limit now in force."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and soft < hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
        except (OSError, ValueError):
            pass
    return soft


def _refusal(status: str, text: str) -> bytes:
    body = text.encode("utf-8") + b"\n"
    head = (
        f"HTTP/1.1 {status}\r\ncontent-type: text/plain; charset=utf-8\r\nconnection: close\r\n"
        f"retry-after: 1\r\ncontent-length: {len(body)}\r\n\r\n"
    )
    return head.encode("ascii") + body


@dataclass(slots=True)
class _Connections:
    """The connections open now, in all and by address (one per server)."""

    total: int = 0
    by_address: defaultdict[str, int] = field(default_factory=lambda: defaultdict(int))

    def add(self, address: str) -> None:
        self.total += 1
        self.by_address[address] += 1

    def remove(self, address: str) -> None:
        self.total -= 1
        self.by_address[address] -= 1
        if self.by_address[address] <= 0:
            del self.by_address[address]


def bounded_protocol(limits: ConnectionLimits) -> type[asyncio.Protocol]:
    """uvicorn's h11 protocol with the connection caps and the header and body timeouts of `limits`."""
    import h11
    from uvicorn.protocols.http.h11_impl import H11Protocol

    open_now = _Connections()

    class BoundedH11Protocol(H11Protocol):
        """One HTTP connection, counted, and dropped when its client is too slow to send a request."""

        _address: str | None = None
        _deadline: asyncio.TimerHandle | None = None
        _waiting_for: str = ""

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            address = self.client[0] if self.client else "unknown"
            if open_now.total >= limits.max_connections:
                self._refuse(
                    f"too many connections: the server holds {open_now.total}, its most "
                    f"(serve --max-connections {limits.max_connections}); retry shortly"
                )
                return
            if open_now.by_address[address] >= limits.max_per_address:
                self._refuse(
                    f"too many connections from {address}: {open_now.by_address[address]} are open, the most one "
                    f"address may hold (serve --max-connections-per-address {limits.max_per_address}); "
                    "close some and retry"
                )
                return
            self._address = address
            open_now.add(address)
            self._expect("headers")

        def _refuse(self, text: str) -> None:
            log.warning("refused an HTTP connection: %s", text)
            transport = self.transport
            transport.write(_refusal("503 Service Unavailable", text))
            transport.close()

        def connection_lost(self, exc: Exception | None) -> None:
            self._stop_waiting()
            if self._address is not None:
                open_now.remove(self._address)
                self._address = None
            super().connection_lost(exc)

        def _expect(self, what: str) -> None:
            """Start the clock for the client's request headers or body."""
            self._stop_waiting()
            timeout = limits.header_timeout_s if what == "headers" else limits.body_timeout_s
            self._waiting_for = what
            self._deadline = self.loop.call_later(timeout, self._too_slow, timeout)

        def _stop_waiting(self) -> None:
            if self._deadline is not None:
                self._deadline.cancel()
                self._deadline = None
            self._waiting_for = ""

        def _too_slow(self, timeout: float) -> None:
            what, self._deadline = self._waiting_for, None
            option = "--header-timeout-s" if what == "headers" else "--body-timeout-s"
            log.info(
                "closed an HTTP connection from %s: no complete request %s within %g s (serve %s)",
                self._address,
                what,
                timeout,
                option,
            )
            if not self.transport.is_closing():
                if self.conn.their_state is h11.IDLE and self.conn.our_state is h11.IDLE:
                    self.transport.write(
                        _refusal("408 Request Timeout", f"no complete request {what} within {timeout:g} s ({option})")
                    )
                self.transport.close()

        def handle_events(self) -> None:
            super().handle_events()
            self._follow_request()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if not self.transport.is_closing():
                self._follow_request()

        def _follow_request(self) -> None:
            """Keep the clock running only while the client owes us part of a request."""
            if self._address is None or self.transport.is_closing():
                return
            state = self.conn.their_state
            if state is h11.IDLE and self.conn.our_state is h11.IDLE:
                if self._waiting_for != "headers":
                    self._expect("headers")
            elif state is h11.SEND_BODY:
                if self._waiting_for != "body":
                    self._expect("body")
            elif self._waiting_for:
                self._stop_waiting()

    return BoundedH11Protocol


class ExplainedBodyCap:
    """A request body above the HTTP cap gets a 413 that names the cap and the policy field it bounds."""

    def __init__(self, app: ASGIApp, max_bytes: int, policy_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.policy_bytes = policy_bytes

    def _text(self) -> str:
        return (
            f"request body too large: this server accepts at most {self.max_bytes} bytes in one HTTP request "
            f"(serve --max-request-bytes), which bounds tool arguments over HTTP as the policy field "
            f"limits.argument_bytes ({self.policy_bytes} bytes) does everywhere; send less, or raise both"
        )

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope.get("type") != "http":
            await self.app(scope, receive, send)
            return
        replacing = False

        async def explained(message: Message) -> None:
            nonlocal replacing
            if message.get("type") == "http.response.start" and message.get("status") == 413:
                replacing = True
                log.warning("refused an HTTP request body above %d bytes", self.max_bytes)
                await plain_answer(413, self._text(), scope, receive, send)
                return
            if replacing:
                return  # the SDK's own words for it
            await send(message)

        await self.app(scope, receive, explained)


async def plain_answer(status: int, text: str, scope: Scope, receive: Receive, send: Send) -> None:
    """A refusal in plain text that closes the connection (the request's body is not read, so the connection
    cannot carry another request)."""
    from starlette.responses import PlainTextResponse  # here: the command line imports this module's options

    headers = {"connection": "close", **({"retry-after": "1"} if status == 503 else {})}  # 503: it may pass
    await PlainTextResponse(text + "\n", status_code=status, headers=headers)(scope, receive, send)
