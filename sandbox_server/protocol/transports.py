"""The transports the server is served over: stdio, and Streamable HTTP with its bounds and its callers."""

from __future__ import annotations

from typing import TYPE_CHECKING

from mcp.server.stdio import stdio_server
from mcp.server.transport_security import TransportSecuritySettings
from mcp_types.version import HANDSHAKE_PROTOCOL_VERSIONS

from sandbox_server.access.auth import Authentication, ExplainedRefusals
from sandbox_server.protocol.http_limits import ConnectionLimits, ExplainedBodyCap, SessionCap, bounded_protocol
from sandbox_server.protocol.http_sessions import SessionEndWatcher

if TYPE_CHECKING:
    from sandbox_server.protocol.server import SandboxServer

__all__ = ["LOOPBACK_HOSTS", "serve_http", "serve_stdio"]

LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1")
"""Addresses to bind `serve --transport http` to that only this machine reaches."""
SESSION_IDLE_S = 1800.0
"""How long a handshake-era HTTP session may go unused before it ends (and stops counting for its caller)."""
REQUEST_ENVELOPE_BYTES = 64 * 1024
"""Room in an HTTP request body for the JSON-RPC envelope around the tool arguments."""


async def serve_stdio(app: SandboxServer) -> None:
    """Serve MCP over stdin/stdout until the client closes the stream."""
    async with stdio_server() as (read_stream, write_stream):
        await app.server.run(read_stream, write_stream, app.initialization_options())


async def serve_http(
    app: SandboxServer,
    host: str,
    port: int,
    authentication: Authentication | None = None,
    limits: ConnectionLimits | None = None,
    max_request_bytes: int | None = None,
) -> None:
    """Serve MCP over Streamable HTTP at http://HOST:PORT/mcp; with `authentication`, only to the callers it knows.

    Authentication is the SDK's resource server: every request to /mcp needs a bearer token the
    verifier knows, a 401 points at the protected-resource metadata (RFC 9728) at its well-known path.
    Connections, the time to send a request, sessions per caller and request bodies are bounded
    (`limits`, `max_request_bytes`: by default the policy's `limits.argument_bytes` and room for the
    JSON-RPC envelope).
    """
    import uvicorn

    loopback = ["127.0.0.1", "localhost", "[::1]"]
    names = loopback if host in LOOPBACK_HOSTS else [host, *loopback]
    auth = authentication.settings if authentication is not None else None
    public = auth.resource_server_url if auth is not None else None
    if public is not None and public.host is not None and public.host not in names:
        names.append(public.host)  # the name clients reach it by (serve --public-url), behind a proxy or not
    security = TransportSecuritySettings(
        enable_dns_rebinding_protection=True,
        allowed_hosts=[*names, *(f"{name}:*" for name in names)],
        allowed_origins=[
            f"{scheme}://{name}{port}" for scheme in ("http", "https") for name in names for port in ("", ":*")
        ],
    )
    verifier = authentication.verifier if authentication is not None else None
    limits = limits or ConnectionLimits()
    policy_bytes = app.largest_arguments()
    body_bytes = max_request_bytes or policy_bytes + REQUEST_ENVELOPE_BYTES
    starlette_app = app.server.streamable_http_app(
        host=host,
        transport_security=security,
        auth=auth,
        token_verifier=verifier,
        max_request_body_size=body_bytes,
        session_idle_timeout=SESSION_IDLE_S,
        max_sessions=None,  # bounded per caller instead (SessionCap), so one caller cannot lock the others out
    )
    watched = ExplainedRefusals(
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
    )
    config = uvicorn.Config(
        watched,
        host=host,
        port=port,
        log_level="warning",
        lifespan="on",
        http=bounded_protocol(limits),
        timeout_keep_alive=5,
    )
    await uvicorn.Server(config).serve()
