"""Who is calling over Streamable HTTP: bearer tokens checked through the SDK's resource-server support.

The SDK answers every request it cannot authenticate with a 401 saying only "Authentication
required". `ExplainedRefusals` wraps the HTTP app so that the 401's `WWW-Authenticate`
says why (no token, a malformed header, a token not known or revoked) and the server logs
the same line, with the client's address and never the token.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Awaitable, Callable, MutableMapping
from contextvars import ContextVar
from typing import Any

from mcp.server.auth.provider import AccessToken

from sandbox_server.tokens import TokensFile

__all__ = ["POLICY_CLAIM", "ExplainedRefusals", "StaticTokenVerifier"]

log = logging.getLogger("sandbox_server")

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

POLICY_CLAIM = "sandbox_policy"
"""The claim of an access token that names the policy its caller's calls run under."""

_reasons: ContextVar[list[str] | None] = ContextVar("sandbox_server_auth_reasons", default=None)
"""Why the request being answered was not authenticated (set by a verifier, read by ExplainedRefusals)."""


def refuse(reason: str) -> None:
    """Say why the token of the request being answered is refused (no quotes: it goes into a header)."""
    reasons = _reasons.get()
    if reasons is not None:
        reasons.append(reason.replace('"', "'"))


class StaticTokenVerifier:
    """The SDK's TokenVerifier over a tokens file: a known token is its caller, with its policy."""

    def __init__(self, tokens: TokensFile) -> None:
        self.tokens = tokens

    async def verify_token(self, token: str) -> AccessToken | None:
        caller = self.tokens.find(token)
        if caller is None:
            refuse("the token is not known here: revoked, or never issued by `sandbox-server token add`")
            return None
        return AccessToken(
            token=token, client_id=caller.name, scopes=[], subject=caller.name, claims={POLICY_CLAIM: caller.policy}
        )


def _why(scope: Scope, reasons: list[str]) -> str:
    header = dict(scope.get("headers") or []).get(b"authorization")
    if header is None:
        return "no bearer token: send Authorization: Bearer <token>"
    if not header[:7].lower() == b"bearer " or not header[7:].strip():
        return "malformed Authorization header: expected Bearer <token>"
    return reasons[-1] if reasons else "the token was refused"


class ExplainedRefusals:
    """Passes everything through; a 401 gets the reason in WWW-Authenticate, and a log line."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope.get("type") != "http":
            await self.app(scope, receive, send)
            return
        reasons: list[str] = []
        reset = _reasons.set(reasons)

        async def explained(message: Message) -> None:
            if message.get("type") == "http.response.start" and message.get("status") == 401:
                reason = _why(scope, reasons)
                headers = [
                    (name, _described(value, reason) if name.lower() == b"www-authenticate" else value)
                    for name, value in message.get("headers") or []
                ]
                message = {**message, "headers": headers}
                client = (scope.get("client") or ("unknown",))[0]
                log.warning("refused an HTTP request from %s: %s", client, reason)
            await send(message)

        try:
            await self.app(scope, receive, explained)
        finally:
            _reasons.reset(reset)


def _described(header: bytes, reason: str) -> bytes:
    """A WWW-Authenticate value with its error_description replaced by the reason."""
    text = header.decode("latin-1")
    described = f'error_description="{reason}"'
    if "error_description=" in text:
        text = re.sub(r'error_description="[^"]*"', lambda _: described, text)
    else:
        text = f"{text}, {described}"
    return text.encode("latin-1")
