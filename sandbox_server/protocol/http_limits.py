"""Bounds on what HTTP clients may hold before and around their MCP requests.

The SDK's Streamable HTTP app sees a request only once its headers are complete, so what
a client holds before that (an open connection that says nothing, a header sent a byte at
a time) is bounded in the HTTP server's own protocol (`http_connections`): at most `max_connections`
connections in all and `max_per_address` from one address (more are answered `503` and
closed at once), `header_timeout_s` to send a request's headers (from the connection's
start, or the end of its previous answer) and `body_timeout_s` to send its body. Every
refusal says which `serve` option bounds it.

Around the app, `http_sessions.SessionCap` bounds the handshake-era sessions one caller keeps open.
"""

from __future__ import annotations

import argparse
import logging
import resource
from dataclasses import dataclass

from starlette.types import ASGIApp, Message, Receive, Scope, Send

__all__ = [
    "ConnectionLimits",
    "ExplainedBodyCap",
    "add_limit_arguments",
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
