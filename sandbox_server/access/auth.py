"""Who is calling over Streamable HTTP: bearer tokens checked through the SDK's resource-server support.

Two kinds of token: static ones of a tokens file (`StaticTokenVerifier`), and JWT access
tokens of an OAuth authorization server (`JwtVerifier`: signature against the issuer's
JWKS, issuer, audience = this server's resource URL, expiry; the caller's policy picked by
scope or claim). The SDK answers every request it cannot authenticate with a 401 saying
only "Authentication required". `ExplainedRefusals` wraps the HTTP app so that the 401's
`WWW-Authenticate` says why (no token, a malformed header, a token not known, revoked,
expired, for another audience, not signed by the issuer) and the server logs the same line,
with the client's address and never the token.
"""

from __future__ import annotations

import json
import logging
import re
import urllib.parse
import urllib.request
from collections.abc import Mapping
from contextvars import ContextVar
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import anyio.to_thread
import jwt
from mcp.server.auth.provider import AccessToken
from mcp.server.auth.settings import AuthSettings
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from sandbox_server.access.tokens import TOKEN_PREFIX, TokensFile
from sandbox_server.errors import UsageError

if TYPE_CHECKING:  # the PostgreSQL driver is imported only by a server given --state
    from sandbox_server.access.shared import SharedTokens

__all__ = [
    "JWT_ALGORITHMS",
    "Authentication",
    "POLICY_CLAIM",
    "CallerVerifier",
    "ExplainedRefusals",
    "JwtVerifier",
    "PolicyRule",
    "StaticTokenVerifier",
    "jwks_url_of",
]

log = logging.getLogger("sandbox_server")

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

    def __init__(self, tokens: TokensFile | SharedTokens) -> None:
        self.tokens = tokens

    async def verify_token(self, token: str) -> AccessToken | None:
        caller = await anyio.to_thread.run_sync(self.tokens.find, token)  # the shared callers are rows
        if caller is None:
            refuse("the token is not known here: revoked, or never issued by `sandbox-server token add`")
            return None
        return AccessToken(
            token=token, client_id=caller.name, scopes=[], subject=caller.name, claims={POLICY_CLAIM: caller.policy}
        )


JWT_ALGORITHMS = ("RS256", "RS384", "RS512", "PS256", "PS384", "PS512", "ES256", "ES384", "ES512", "EdDSA")
"""Signatures accepted on access tokens: an issuer's public keys only (never `none`, never a shared secret)."""
LEEWAY_S = 30
"""Clock skew allowed on `exp` and `nbf`."""


@dataclass(frozen=True, slots=True)
class PolicyRule:
    """A JWT caller's policy: when the token has `scope` (claim `scope`/`scp`), or its `claim` has `value`."""

    claim: str
    value: str
    policy: str

    @classmethod
    def parse(cls, text: str, by_scope: bool) -> PolicyRule:
        """`SCOPE=POLICY` (serve --scope-policy) or `CLAIM:VALUE=POLICY` (serve --claim-policy)."""
        condition, equals, policy = text.rpartition("=")
        claim, colon, value = ("scope", ":", condition) if by_scope else condition.partition(":")
        if not equals or not colon or not claim or not value or not policy:
            option, form = ("--scope-policy", "SCOPE=POLICY") if by_scope else ("--claim-policy", "CLAIM:VALUE=POLICY")
            raise UsageError(f"{option} {text!r}: expected {form}")
        return cls(claim, value, policy)

    def matches(self, claims: Mapping[str, Any], scopes: list[str]) -> bool:
        if self.claim == "scope":
            return self.value in scopes
        found = claims.get(self.claim)
        return found == self.value or isinstance(found, list) and self.value in found


def _scopes(claims: Mapping[str, Any]) -> list[str]:
    """A token's scopes: the space-separated `scope` claim (RFC 9068), or a `scp` list."""
    scope, scp = claims.get("scope"), claims.get("scp")
    if isinstance(scope, str):
        return scope.split()
    return [str(item) for item in scp] if isinstance(scp, list) else []


class JwtVerifier:
    """The SDK's TokenVerifier for JWT access tokens (RFC 9068) of one issuer, checked with PyJWT.

    The issuer's signing keys come from its JWKS (`jwks_uri` of its RFC 8414 metadata, or given),
    fetched by PyJWT's client, cached, and fetched again for an unknown key id at most every 30 s.
    """

    def __init__(self, issuer: str, audience: str, jwks_url: str, rules: list[PolicyRule]) -> None:
        self.issuer, self.audience, self.rules = issuer, audience, rules
        self.keys = jwt.PyJWKClient(jwks_url, cache_jwk_set=True, lifespan=300, timeout=10)

    async def verify_token(self, token: str) -> AccessToken | None:
        try:
            claims = await anyio.to_thread.run_sync(self._claims, token)
        except _Refused as refused:
            refuse(str(refused))
            return None
        scopes = _scopes(claims)
        subject = str(claims["sub"])
        policy = next((rule.policy for rule in self.rules if rule.matches(claims, scopes)), None)
        client = claims.get("client_id") or claims.get("azp") or subject
        return AccessToken(
            token=token,
            client_id=str(client),
            scopes=scopes,
            expires_at=int(claims["exp"]),
            resource=self.audience,
            subject=subject,
            claims={"iss": self.issuer, POLICY_CLAIM: policy},
        )

    def _claims(self, token: str) -> dict[str, Any]:
        """The checked claims of a token (raises _Refused saying why it is refused)."""
        try:
            header = jwt.get_unverified_header(token)
        except jwt.DecodeError:
            raise _Refused("malformed token: neither a token of this server's nor a JWT") from None
        algorithm = header.get("alg")
        if algorithm not in JWT_ALGORITHMS:
            raise _Refused(f"the token is signed with {algorithm!r}, not one of {', '.join(JWT_ALGORITHMS)}")
        try:
            key = self.keys.get_signing_key_from_jwt(token)
        except jwt.PyJWKClientConnectionError as exc:
            log.warning("could not fetch the signing keys of %s: %s", self.issuer, exc)
            raise _Refused("the issuer's signing keys could not be fetched; try again later") from None
        except jwt.PyJWKClientError:
            raise _Refused(f"the token's signing key (kid {header.get('kid')!r}) is not one of the issuer's") from None
        try:
            return jwt.decode(
                token,
                key,
                algorithms=[algorithm],
                audience=self.audience,
                issuer=self.issuer,
                leeway=LEEWAY_S,
                options={"require": ["exp", "iss", "aud", "sub"]},
            )
        except jwt.InvalidSignatureError:
            raise _Refused("the token's signature does not verify with the issuer's keys") from None
        except jwt.ExpiredSignatureError:
            raise _Refused("the token has expired") from None
        except jwt.ImmatureSignatureError:
            raise _Refused("the token is not valid yet (nbf)") from None
        except jwt.InvalidAudienceError:
            raise _Refused(f"the token is for another audience, not this server ({self.audience})") from None
        except jwt.InvalidIssuerError:
            raise _Refused(f"the token was issued by another issuer, not {self.issuer}") from None
        except jwt.MissingRequiredClaimError as exc:
            raise _Refused(f"the token has no {exc.claim!r} claim") from None
        except jwt.PyJWTError as exc:
            raise _Refused(f"the token is invalid: {exc}") from None


def jwks_url_of(issuer: str, timeout_s: float = 10) -> str:
    """The `jwks_uri` of an issuer's metadata (RFC 8414, then OpenID Connect discovery); UsageError when none."""
    parts = urllib.parse.urlsplit(issuer)
    candidates = [
        f"{parts.scheme}://{parts.netloc}/.well-known/oauth-authorization-server{parts.path.rstrip('/')}",
        f"{issuer.rstrip('/')}/.well-known/openid-configuration",
    ]
    problems = []
    for url in candidates:
        try:
            with urllib.request.urlopen(url, timeout=timeout_s) as answer:
                metadata = json.loads(answer.read(1_000_000))
        except (OSError, ValueError) as exc:
            problems.append(f"{url}: {exc}")
            continue
        if not isinstance(metadata, dict) or metadata.get("issuer") != issuer:
            problems.append(f"{url}: its issuer is {metadata.get('issuer') if isinstance(metadata, dict) else None!r}")
        elif not isinstance(metadata.get("jwks_uri"), str):
            problems.append(f"{url}: no jwks_uri")
        else:
            return str(metadata["jwks_uri"])
    raise UsageError(
        f"--issuer {issuer}: no usable authorization server metadata ({'; '.join(problems)}); "
        "give the issuer's key set with --jwks-url"
    )


class _Refused(Exception):
    """Why a JWT is refused."""


class CallerVerifier:
    """Static tokens (`sbx_…`) by the tokens file, any other by the issuer's JWT verifier."""

    def __init__(self, static: StaticTokenVerifier | None, issued: JwtVerifier | None) -> None:
        self.static, self.issued = static, issued

    def policies(self) -> list[str]:
        """Every policy a caller may have now: the tokens file's and the issuer rules'."""
        found = [caller.policy for caller in self.static.tokens.callers()] if self.static is not None else []
        found += [rule.policy for rule in self.issued.rules] if self.issued is not None else []
        return list(dict.fromkeys(found))

    async def verify_token(self, token: str) -> AccessToken | None:
        if self.static is not None and (self.issued is None or token.startswith(TOKEN_PREFIX)):
            return await self.static.verify_token(token)
        assert self.issued is not None
        return await self.issued.verify_token(token)


@dataclass(frozen=True, slots=True)
class Authentication:
    """The SDK's resource-server settings and the verifier of the callers' tokens."""

    settings: AuthSettings
    verifier: CallerVerifier

    @classmethod
    def of(
        cls, resource: str, static: StaticTokenVerifier | None, issued: JwtVerifier | None, required_scopes: list[str]
    ) -> Authentication:
        """Tokens for `resource`: an authorization server's, or (static tokens alone) the server's own."""
        # Static tokens are issued by this server's operator (`sandbox-server token add`): without an
        # authorization server, the server's own origin stands as their issuer.
        issuer = issued.issuer if issued is not None else "/".join(resource.split("/", 3)[:3])
        settings = AuthSettings.model_validate(  # from text, so a path-less issuer keeps its exact form
            {
                "issuer_url": issuer,
                "resource_server_url": resource,
                "required_scopes": required_scopes or None,
                "validate_token_resource": False,  # the verifiers check the audience themselves
            }
        )
        return cls(settings, CallerVerifier(static, issued))


def _why(scope: Scope, reasons: list[str]) -> str:
    header = dict(scope.get("headers") or []).get(b"authorization")
    if header is None:
        return "no bearer token: send Authorization: Bearer <token>"
    if not header[:7].lower() == b"bearer " or not header[7:].strip():
        return "malformed Authorization header: expected Bearer <token>"
    return reasons[-1] if reasons else "the token was refused"


UNAUTHORIZED = -32001
"""The JSON-RPC error code of a request refused for its token (in the range the specification leaves to servers)."""


class ExplainedRefusals:
    """Passes everything through; a 401 gets the reason in WWW-Authenticate and a log line, and, for a JSON-RPC
    request (a POST), a JSON-RPC error body saying it: the official clients show a non-2xx answer's JSON-RPC error
    as the request's error, where a bare 401 becomes "Server returned an error response" (-32603)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope.get("type") != "http":
            await self.app(scope, receive, send)
            return
        reasons: list[str] = []
        reset = _reasons.set(reasons)
        refused: dict[str, Any] = {}

        async def explained(message: Message) -> None:
            if message.get("type") == "http.response.start" and message.get("status") == 401:
                reason = _why(scope, reasons)
                headers = [
                    (name, _described(value, reason) if name.lower() == b"www-authenticate" else value)
                    for name, value in message.get("headers") or []
                ]
                client = (scope.get("client") or ("unknown",))[0]
                log.warning("refused an HTTP request from %s: %s", client, reason)
                if scope.get("method") == "POST":  # its body, the reason as a JSON-RPC error, is sent in its place
                    refused.update(start={**message, "headers": headers}, reason=reason)
                    return
                message = {**message, "headers": headers}
            elif refused and message.get("type") == "http.response.body":
                if message.get("more_body"):
                    return
                body = _rpc_refusal(str(refused["reason"]))
                kept = [
                    (n, v)
                    for n, v in refused["start"]["headers"]
                    if n.lower() not in (b"content-type", b"content-length")
                ]
                kept += [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
                await send({**refused["start"], "headers": kept})
                message = {"type": "http.response.body", "body": body}
            await send(message)

        try:
            await self.app(scope, receive, explained)
        finally:
            _reasons.reset(reset)


def _rpc_refusal(reason: str) -> bytes:
    """A 401's body: the reason as a JSON-RPC error (its id null: the request was refused before it was read)."""
    error = {
        "code": UNAUTHORIZED,
        "message": f"unauthorized (HTTP 401): {reason}",
        "data": {"error": "invalid_token", "error_description": reason},
    }
    return json.dumps({"jsonrpc": "2.0", "id": None, "error": error}).encode()


def _described(header: bytes, reason: str) -> bytes:
    """A WWW-Authenticate value with its error_description replaced by the reason."""
    text = header.decode("latin-1")
    described = f'error_description="{reason}"'
    if "error_description=" in text:
        text = re.sub(r'error_description="[^"]*"', lambda _: described, text)
    else:
        text = f"{text}, {described}"
    return text.encode("latin-1")
