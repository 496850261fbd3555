"""What an MCP request says about itself: its era, its HTTP session, its client, and who sent it."""

from __future__ import annotations

from typing import Any

from mcp.server import ServerRequestContext
from mcp.server.auth.middleware.bearer_auth import AuthenticatedUser
from mcp.server.streamable_http import MCP_SESSION_ID_HEADER
from mcp_types.version import HANDSHAKE_PROTOCOL_VERSIONS
from starlette.requests import HTTPConnection

from sandbox_server.access.identity import Identity, anonymous, local_user, token_identity
from sandbox_server.protocol.draining import FORWARDED
from sandbox_server.workspaces.records import session_key

__all__ = ["Context", "client_name", "handshake_era", "http_session", "identity_of", "session_of"]

Context = ServerRequestContext[Any, Any]


def handshake_era(ctx: Context) -> bool:
    """Whether the request comes from a client of the handshake era (an `initialize` began its session)."""
    return ctx.protocol_version in HANDSHAKE_PROTOCOL_VERSIONS


def http_session(ctx: Context) -> str | None:
    """The Streamable HTTP session of a handshake-era request; None over stdio or without one."""
    request = ctx.request  # the HTTP request, when the transport has one
    return request.headers.get(MCP_SESSION_ID_HEADER) if isinstance(request, HTTPConnection) else None


def identity_of(ctx: Context) -> Identity:
    """Who calls: a checked token's holder; over stdio the local user running the server; over HTTP without
    tokens (loopback) the anonymous caller, whose files are its session's (handshake era) or the caller's."""
    user = ctx.request.scope.get("user") if isinstance(ctx.request, HTTPConnection) else None
    if isinstance(user, AuthenticatedUser):
        token = user.access_token
        return token_identity(token.subject or token.client_id, token.claims or {})
    if ctx.request is None:
        return local_user()
    return anonymous(http_session(ctx) if handshake_era(ctx) else None)


def client_name(ctx: Context) -> str:
    """The client as it names itself, with its HTTP session's first characters: for the audit record only."""
    params = ctx.session.client_params
    info = params.client_info if params is not None else None
    name = f"{info.name}/{info.version}" if info is not None else "unknown-client"
    session_id = http_session(ctx)
    named = f"{name}@{session_id[:8]}" if session_id else name
    via = (
        ctx.request.scope.get(FORWARDED) if isinstance(ctx.request, HTTPConnection) else None
    )  # a peer replica sent it here, where its work lives
    return f"{named} via replica {via}" if via else named


def session_of(ctx: Context, instance: str) -> str | None:
    """The session whose workspace a request continues: over stdio the connection's, in either era (one process
    serves one client); over HTTP the handshake session's; None for HTTP in the 2026-07-28 era, where a result's
    `workspace` id is passed back instead."""
    if ctx.request is None:
        return session_key(instance, "stdio")
    if not handshake_era(ctx):
        return None
    return session_key(instance, http_session(ctx) or "stdio")
