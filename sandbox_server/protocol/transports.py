"""The transports the server is served over: stdio, and Streamable HTTP with its bounds and its callers."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from typing import TYPE_CHECKING, cast

import anyio
from mcp.server.stdio import stdio_server
from mcp.server.transport_security import TransportSecuritySettings
from mcp_types.version import HANDSHAKE_PROTOCOL_VERSIONS

from sandbox_server.access.auth import Authentication, ExplainedRefusals
from sandbox_server.protocol.addresses import allowed_hosts, host_names
from sandbox_server.protocol.http_budget import HeldBytes
from sandbox_server.protocol.http_limits import ConnectionLimits, ExplainedBodyCap
from sandbox_server.protocol.http_sessions import SessionCap, SessionEndWatcher
from sandbox_server.protocol.stdio_errors import AnsweringMalformed

if TYPE_CHECKING:
    from starlette.routing import BaseRoute, Route
    from starlette.types import ASGIApp

    from sandbox_server.protocol.draining import Drain
    from sandbox_server.protocol.server import SandboxServer

__all__ = ["serve_http", "serve_stdio"]

SESSION_IDLE_S = 1800.0
"""How long a handshake-era HTTP session may go unused before it ends (and stops counting for its caller)."""
STOP_GRACE_S = 3
"""How long open HTTP connections (a client's event stream, a call's answer) are given to end when the server
stops."""
REQUEST_ENVELOPE_BYTES = 64 * 1024
"""Room in an HTTP request body for the JSON-RPC envelope around the tool arguments."""


async def serve_stdio(app: SandboxServer) -> None:
    """Serve MCP over stdin/stdout until the client closes the stream."""
    async with stdio_server() as (read_stream, write_stream):
        answering = AnsweringMalformed(read_stream, write_stream)  # a line it cannot read is answered, not dropped
        await app.server.run(answering, write_stream, app.initialization_options())


async def serve_http(
    app: SandboxServer,
    host: str,
    listener: socket.socket,
    authentication: Authentication | None = None,
    limits: ConnectionLimits | None = None,
    max_request_bytes: int | None = None,
    routes: list[BaseRoute] | None = None,
    drain: Drain | None = None,
) -> None:
    """Serve MCP over Streamable HTTP on `listener` (bound to `host` as given, a name included: the Host headers
    allowed follow it); with `authentication`, only to the callers it knows.

    Authentication is the SDK's resource server: every request to /mcp needs a bearer token the
    verifier knows, a 401 points at the protected-resource metadata (RFC 9728) at its well-known path.
    Connections, the time to send a request, sessions per caller and request bodies are bounded
    (`limits`, `max_request_bytes`: by default the policy's `limits.argument_bytes` and room for the
    JSON-RPC envelope). `routes` are served beside /mcp (previews). While `drain` drains, new work is answered
    503 for another replica to take (protocol/draining.py); once its `stopping` is set, the server stops as
    uvicorn stops: no new connections, the open ones given STOP_GRACE_S to finish, the application's lifespan
    ended in order.
    """
    import uvicorn

    from sandbox_server.protocol.http_connections import bounded_protocol  # uvicorn's, as uvicorn is, over HTTP alone

    limits = limits or ConnectionLimits()
    body_bytes = max_request_bytes or app.largest_arguments() + REQUEST_ENVELOPE_BYTES
    watched = _bounded_app(app, host, authentication, limits, body_bytes, routes)
    config = uvicorn.Config(
        drain.wrap(watched, body_bytes) if drain is not None else watched,
        host=host,
        port=listener.getsockname()[1],
        log_level="warning",
        lifespan="on",
        http=bounded_protocol(limits),
        timeout_keep_alive=5,
        timeout_graceful_shutdown=STOP_GRACE_S,
    )
    server = _server_class()(config)
    async with anyio.create_task_group() as group:
        if drain is not None:

            async def stop_when_asked() -> None:
                await drain.stopping.wait()
                server.should_exit = True

            group.start_soon(stop_when_asked)
        await server.serve(sockets=[listener])
        group.cancel_scope.cancel()


def _bounded_app(
    app: SandboxServer,
    host: str,
    authentication: Authentication | None,
    limits: ConnectionLimits,
    body_bytes: int,
    routes: list[BaseRoute] | None,
) -> ASGIApp:
    """The SDK's Streamable HTTP app for `host`, behind its callers' check and the bounds on sessions, bodies
    and held bytes, each refusal explained."""
    auth = authentication.settings if authentication is not None else None
    public = auth.resource_server_url if auth is not None else None
    names = host_names(host, public.host if public is not None else None)
    security = TransportSecuritySettings(
        enable_dns_rebinding_protection=True,
        allowed_hosts=allowed_hosts(names),
        allowed_origins=[
            f"{scheme}://{name}{port}" for scheme in ("http", "https") for name in names for port in ("", ":*")
        ],
    )
    verifier = authentication.verifier if authentication is not None else None
    policy_bytes = app.largest_arguments()
    starlette_app = app.server.streamable_http_app(
        host=host,
        transport_security=security,
        auth=auth,
        token_verifier=verifier,
        max_request_body_size=body_bytes,
        session_idle_timeout=SESSION_IDLE_S,
        max_sessions=None,  # bounded per caller instead (SessionCap), so one caller cannot lock the others out
        custom_starlette_routes=cast("list[Route]", routes or []),
    )
    return HeldBytes(
        ExplainedRefusals(
            ExplainedBodyCap(
                SessionCap(
                    SessionEndWatcher(starlette_app, app.session_ended),
                    limits.max_sessions_per_caller,
                    SESSION_IDLE_S,
                    frozenset(HANDSHAKE_PROTOCOL_VERSIONS),
                ),
                body_bytes,
                policy_bytes,
            )
        ),
        limits.max_held_bytes,
        limits.max_held_bytes_per_caller,
        body_bytes,
    )


def _server_class() -> type:
    import contextlib

    import uvicorn

    class Server(uvicorn.Server):
        """uvicorn's server, leaving SIGTERM and SIGINT to `serve` (which drains first, then sets `should_exit`):
        uvicorn's own handlers would close the listener at the first signal."""

        @contextlib.contextmanager
        def capture_signals(self) -> Iterator[None]:
            yield

    return Server
