"""Replicas as one server: a request for what lives on another replica is forwarded there.

With workspaces mounted on their home replica (`serve --state … --workspaces mounted`, state.homes), a workspace's
calls and its services' previews can be answered only where it lives. A replica given such a request (a
2026-07-28 `tools/call` naming a workspace, by the `Mcp-Param-Workspace` header the tools' schemas ask clients to
mirror or else by its arguments; a `/preview/<service>/…` request) while another live replica is the home sends
the request there as it came, bearer token and all, and streams the answer back: the home checks the caller as it
checks every request. The channel between replicas is authenticated: a forwarded request carries
`Sandbox-Forwarded: <replica>;<time>;<nonce>;<HMAC-SHA256>` over that replica, its time, a nonce, its method, path
and query, body, and the caller's credentials (its `Authorization` and `Cookie` headers), keyed with a secret the
replicas share in the database; a home runs a request so marked as its own even while it drains (it finishes the
work that lives there), and never forwards it again. A marked request whose signature does not hold, that is over
FORWARD_SKEW_S old, or whose nonce the home saw within that time (a captured request sent again, or with another
caller's token in it) is refused 403.

Requests of a handshake-era session are not forwarded: the session lives on the replica that began it, and the
load balancer keeps them there. A call whose home does not answer is an error result saying when to send it again
(whether it may have run); once the home is silent for the replicas' lost time, the next replica takes it over.
"""

from __future__ import annotations

import hashlib
import hmac
import http.cookiejar
import json
import logging
import secrets
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import anyio.to_thread

from sandbox_server.protocol.draining import FORWARDED, LIVES_HERE, read_body, refuse, refuse_call, replayed

if TYPE_CHECKING:
    from starlette.types import ASGIApp, Message, Receive, Scope, Send

    from sandbox_server.state.homes import Home, Homes

__all__ = ["Forwarding", "signature", "signed_credentials"]

log = logging.getLogger("sandbox_server")

HEADER = "sandbox-forwarded"
FORWARD_SKEW_S = 30.0
PREVIEW_BODY_BYTES = 16 * 1024 * 1024
HANDOVER_WAIT_S = 20.0
"""How long a call for a workspace whose home drains and stops answering waits for it to let go of it (it does once
its services have stopped), before it is answered 503."""
HANDOVER_POLL_S = 0.2
HOP_BY_HOP = frozenset(
    [b"connection", b"keep-alive", b"proxy-authenticate", b"proxy-authorization", b"te", b"trailer", b"trailers",
     b"transfer-encoding", b"upgrade", b"content-length", HEADER.encode()]
)  # fmt: skip
"""Not passed on. `Host` is: the home checks it as it checks a request the load balancer sent it (the client's host,
which it answers to), not the address its peer reached it at."""
HOME_RESPONSE = b"sandbox-workspace"
"""The answer's header naming the workspace its home served (a load balancer learns where it lives); dropped from a
forwarded answer, which would teach it the wrong replica."""
UNREACHED = "does not answer now; nothing of this request reached it: send it again in a moment"
LOST_WITH_IT = (
    "stopped answering while it had this request, which may have run there in whole or in part; what lives there "
    "moves to a replica that answers once its heartbeat is old: look at its files (a call in its workspace) first"
)


def signature(
    key: bytes, replica: str, stamp: str, nonce: str, method: str, target: str, body: bytes, credentials: bytes
) -> str:
    """The HMAC-SHA256 a replica signs a forwarded request with: who forwards it, when (and a nonce, used once),
    what it is (`target`: its path and query), and on whose behalf (its `credentials`, `signed_credentials`)."""
    digests = [hashlib.sha256(body).hexdigest(), hashlib.sha256(credentials).hexdigest()]
    said = "\n".join([replica, stamp, nonce, method, target, *digests])
    return hmac.new(key, said.encode(), hashlib.sha256).hexdigest()


def signed_by(key: bytes, me: str, method: str, target: str, body: bytes, headers: dict[bytes, bytes]) -> str:
    """The `Sandbox-Forwarded` value replica `me` sends a request with."""
    stamp, nonce = f"{time.time():.3f}", secrets.token_urlsafe(16)
    return f"{me};{stamp};{nonce};{signature(key, me, stamp, nonce, method, target, body, signed_credentials(headers))}"


def signed_credentials(headers: dict[bytes, bytes]) -> bytes:
    """What of a request says who sends it (its Authorization and Cookie headers), as a signature covers it."""
    return headers.get(b"authorization", b"") + b"\n" + headers.get(b"cookie", b"")


def _target(scope: Scope) -> str:
    query = scope.get("query_string", b"").decode("latin-1")
    return str(scope.get("path", "")) + (f"?{query}" if query else "")


class Forwarding:
    """Forward what lives on another replica there; mark and admit what a peer forwarded here."""

    def __init__(
        self,
        homes: Homes,
        key: bytes,
        here: Callable[[str], bool],
        runs_here: Callable[[str], bool],
        mcp_path: str = "/mcp",
        preview_prefix: str = "/preview/",
    ) -> None:
        self.homes, self.key = homes, key
        self.here = here
        """Whether a workspace (by its id) lives on this replica: its calls are run here without asking."""
        self.runs_here = runs_here
        """Whether a service (by its id) runs on this replica: its previews are served here without asking."""
        self.mcp_path, self.preview_prefix = mcp_path, preview_prefix
        self._client: Any = None
        self._seen: dict[str, float] = {}
        """The nonces of forwarded requests taken here, until their time is past FORWARD_SKEW_S (one seen again is
        a replay)."""

    def wrap(self, app: ASGIApp, body_bytes: int) -> ASGIApp:
        """The ASGI app behind the forwarding (requests read whole first, up to `body_bytes`)."""

        async def forwarding(scope: Scope, receive: Receive, send: Send) -> None:
            if scope.get("type") == "websocket":
                await self._socket(app, scope, receive, send)
                return
            if scope.get("type") != "http":
                await app(scope, receive, send)
                return
            headers = dict(scope.get("headers") or [])
            path, method = str(scope.get("path", "")), str(scope.get("method", ""))
            if HEADER.encode() in headers:
                body, whole = await read_body(receive, max(body_bytes, PREVIEW_BODY_BYTES))
                peer = self._signer(headers[HEADER.encode()], method, _target(scope), body, headers) if whole else None
                if peer is None:
                    await _answer(scope, receive, send, 403, "a forwarded request whose signature does not hold\n")
                    return
                await app({**scope, FORWARDED: peer}, replayed(body, True, receive), send)
                return
            home: Home | None = None
            body, whole, named = b"", True, ""
            given = receive  # the request's own receive, until part of its body is read here
            if path == self.mcp_path and method == "POST" and b"mcp-session-id" not in headers:
                body, whole = await read_body(receive, body_bytes)
                given = replayed(body, whole, receive)
                mirrored = headers.get(b"mcp-param-workspace", b"").decode("latin-1")
                named = mirrored or _named_workspace(body)
                if named and not mirrored and named.isascii() and named.isprintable() and named.strip() == named:
                    # a client that did not list the tool first mirrors nothing: the header the schema asks for
                    scope = {**scope, "headers": [*scope.get("headers", []), (b"mcp-param-workspace", named.encode())]}
                if named and whole and not self.here(named):
                    home = await anyio.to_thread.run_sync(self.homes.of_workspace, named)
                if home is None and whole:  # run here: the answer tells the load balancer where it lives
                    send = _teaching(send, named, self.here)
                    if named and self.here(named):
                        scope = {**scope, LIVES_HERE: True}
            elif service := self._service_of(path):
                home = await anyio.to_thread.run_sync(self.homes.of_service, service)
                if home is not None:
                    body, whole = await read_body(receive, PREVIEW_BODY_BYTES)
                    given = replayed(body, whole, receive)
            if home is None or not whole or not await self._forward(home, scope, body, send, receive, named):
                # here (its home let go of it meanwhile); a request whose body was not read here (a handshake-era
                # session's) keeps its own receive: an empty body replayed in its place read as "EOF" to the SDK
                await app(scope, given, send)

        return forwarding

    async def _socket(self, app: ASGIApp, scope: Scope, receive: Receive, send: Send) -> None:
        """A WebSocket through a preview (a dev server's hot reload): carried to the service's home replica when
        another one is, signed as a forwarded request is (over GET, its path and no body); a signed one admitted."""
        from starlette.websockets import WebSocket

        headers = dict(scope.get("headers") or [])
        path = str(scope.get("path", ""))
        said = headers.get(HEADER.encode())
        if said is not None:
            peer = self._signer(said, "GET", _target(scope), b"", headers)
            if peer is None:
                await WebSocket(scope, receive, send).close(code=1008)
                return
            await app({**scope, FORWARDED: peer}, receive, send)
            return
        service = self._service_of(path)
        home = await anyio.to_thread.run_sync(self.homes.of_service, service) if service else None
        if home is None:
            await app(scope, receive, send)
            return
        from websockets.exceptions import WebSocketException

        from sandbox_server.protocol.preview import relay

        websocket = WebSocket(scope, receive, send)
        try:
            upstream = await anyio.to_thread.run_sync(self._open_socket, home, scope)
        except (OSError, TimeoutError, ValueError, WebSocketException) as exc:  # no answer, or no upgrade
            log.info("a preview's WebSocket to replica %s did not open: %s", home.replica, exc)
            await websocket.close(code=1011)
            return
        await websocket.accept(subprotocol=upstream.subprotocol)
        await relay(websocket, upstream)

    def _open_socket(self, home: Home, scope: Scope) -> Any:
        """The WebSocket to the home, asked for as the browser asked (its host, cookies, origin and subprotocols)."""
        import socket
        from urllib.parse import urlsplit

        from websockets.sync.client import connect

        where = urlsplit(home.address)
        sock = socket.create_connection((where.hostname or "", where.port or 80), timeout=10)
        target = _target(scope)
        given = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        protocols = [p.strip() for p in given.get("sec-websocket-protocol", "").split(",") if p.strip()]
        passed = {k: v for k, v in given.items() if k in ("cookie", "authorization", "origin", "user-agent")}
        passed[HEADER] = self._signed("GET", target, b"", dict(scope["headers"]))
        return connect(
            f"ws://{given.get('host', where.netloc)}{target}", sock=sock,
            additional_headers=passed, subprotocols=protocols or None, open_timeout=10,
            max_size=PREVIEW_BODY_BYTES, origin=None,
        )  # fmt: skip

    def _service_of(self, path: str) -> str:
        """The service a preview path is for, when it runs on another replica ("": not a preview, or served here)."""
        service = path[len(self.preview_prefix) :].split("/", 1)[0] if path.startswith(self.preview_prefix) else ""
        return service if service and not self.runs_here(service) else ""

    def _signed(self, method: str, target: str, body: bytes, headers: dict[bytes, bytes]) -> str:
        return signed_by(self.key, self.homes.me, method, target, body, headers)

    def _signer(self, said: bytes, method: str, target: str, body: bytes, headers: dict[bytes, bytes]) -> str | None:
        """The peer replica that signed a forwarded request, when its signature holds over this request and these
        credentials, is fresh and its nonce was not seen before (else None)."""
        parts = said.decode("latin-1").split(";")
        if len(parts) != 4:
            return None
        replica, stamp, nonce, mac = parts
        now = time.time()
        try:
            fresh = abs(now - float(stamp)) <= FORWARD_SKEW_S
        except ValueError:
            return None
        expected = signature(self.key, replica, stamp, nonce, method, target, body, signed_credentials(headers))
        if not fresh or not hmac.compare_digest(mac, expected) or f"{replica};{nonce}" in self._seen:
            return None
        if len(self._seen) > 1000:
            self._seen = {seen: until for seen, until in self._seen.items() if until > now}
        self._seen[f"{replica};{nonce}"] = now + 2 * FORWARD_SKEW_S
        return replica

    async def _forward(
        self, home: Home, scope: Scope, body: bytes, send: Send, receive: Receive, named: str = ""
    ) -> bool:
        """Send the request to its home and its answer back: whether it was answered (False: a call for `named`,
        whose home drained and let go of it while this replica waited, is to run here)."""
        import httpx2

        from sandbox_server.state.database import BEAT_S, REPLICA_LOST_S  # psycopg's, as the homes are

        if self._client is None:
            # A jar that keeps no cookie: one caller's preview cookie must never ride along with another's request.
            keeps_none = http.cookiejar.CookieJar(policy=http.cookiejar.DefaultCookiePolicy(allowed_domains=[]))
            self._client = httpx2.AsyncClient(
                timeout=httpx2.Timeout(10.0, read=None), follow_redirects=False, cookies=keeps_none
            )
        method, path, target = str(scope["method"]), str(scope["path"]), _target(scope)
        headers = [(k.decode("latin-1"), v.decode("latin-1")) for k, v in scope["headers"] if k not in HOP_BY_HOP]
        headers.append((HEADER, self._signed(method, target, body, dict(scope["headers"]))))
        url = home.address.rstrip("/") + target
        request = self._client.build_request(method, url, headers=headers, content=body)
        try:
            answer = await self._client.send(request, stream=True)
            if (
                answer.status_code == 503
                and named
                and await anyio.to_thread.run_sync(self.homes.stopping, home.replica)
            ):
                await answer.aclose()  # a draining home hands over what lives there: wait for it, as below
                after = await self._handed_over(named, home)
                return False if after is None else await self._forward(after, scope, body, send, receive, named)
        except httpx2.HTTPError as exc:
            if named and await self._stopping(home):
                after = await self._handed_over(named, home)  # a draining home stops listening, then lets go
                if after is None:
                    return False
                if after != home:
                    return await self._forward(after, scope, body, send, receive, named)
            log.warning("replica %s, home of what %s %s asks for, did not answer: %s", home.replica, method, path, exc)
            unreached = isinstance(exc, (httpx2.ConnectError, httpx2.ConnectTimeout))  # else a call may have run
            message = f"the replica where this lives ({home.replica}) " + (UNREACHED if unreached else LOST_WITH_IT)
            retry_s = BEAT_S if unreached else REPLICA_LOST_S
            if path != self.mcp_path:
                await _answer(scope, receive, send, 503, message + "\n", {"retry-after": "1"})
            elif not await refuse_call(scope, receive, send, body, message, not unreached, retry_s):  # a call: a result
                await refuse(scope, receive, send, message)  # saying when to send it again; else the server's error
            return True
        try:
            kept = [
                (k.lower().encode("latin-1"), v.encode("latin-1"))
                for k, v in answer.headers.multi_items()
                if k.lower().encode("latin-1") not in HOP_BY_HOP and k.lower().encode("latin-1") != HOME_RESPONSE
            ]
            await send({"type": "http.response.start", "status": answer.status_code, "headers": kept})
            async for chunk in answer.aiter_raw():
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        finally:
            await answer.aclose()
        return True

    async def _stopping(self, home: Home) -> bool:
        stopping: bool = await anyio.to_thread.run_sync(self.homes.stopping, home.replica)
        return stopping

    async def _handed_over(self, named: str, home: Home) -> Home | None:
        """Where a workspace lives once its draining home has let go of it (None: nowhere else alive, so here), or
        that home still after HANDOVER_WAIT_S."""
        deadline = time.monotonic() + HANDOVER_WAIT_S
        while time.monotonic() < deadline:
            await anyio.sleep(HANDOVER_POLL_S)
            now = await anyio.to_thread.run_sync(self.homes.of_workspace, named)
            if now != home:
                return now
        return home

    async def aclose(self) -> None:
        if self._client is not None:
            await self._client.aclose()


def _teaching(send: Send, named: str, here: Callable[[str], bool]) -> Send:
    """The answer to a call run here, with `Sandbox-Workspace` naming the workspace it worked in when that lives
    here: the one it named, or (a call that made one) the one its result names, read from a JSON answer."""
    held: list[Message] = []

    async def taught(message: Message) -> None:
        if message["type"] == "http.response.start" and named:
            if here(named):
                message = {**message, "headers": [*message.get("headers", []), (HOME_RESPONSE, named.encode())]}
            await send(message)
            return
        if message["type"] == "http.response.start":
            kinds = [v for k, v in message.get("headers", []) if k.lower() == b"content-type"]
            if kinds and kinds[0].startswith(b"application/json"):
                held.append(message)  # sent with the body, once the body has said which workspace
                return
        if held and message["type"] == "http.response.body":
            held.append(message)
            if message.get("more_body", False):
                return
            start, *parts = held
            held.clear()
            body = b"".join(part.get("body", b"") for part in parts)
            made = _made_workspace(body)
            if made and here(made):
                start = {**start, "headers": [*start.get("headers", []), (HOME_RESPONSE, made.encode())]}
            await send(start)
            await send({"type": "http.response.body", "body": body, "more_body": False})
            return
        await send(message)

    return taught


def _made_workspace(body: bytes) -> str:
    """The workspace a JSON-RPC answer's result names ("" when none)."""
    try:
        answer = json.loads(body)
    except ValueError:
        return ""
    result = answer.get("result") if isinstance(answer, dict) else None
    structured = result.get("structuredContent") if isinstance(result, dict) else None
    made = structured.get("workspace") if isinstance(structured, dict) else None
    return made if isinstance(made, str) and len(made) <= 64 else ""


def _named_workspace(body: bytes) -> str:
    """The workspace a 2026-07-28 `tools/call` names in its arguments ("" for anything else)."""
    try:
        message = json.loads(body)
    except ValueError:
        return ""
    if not isinstance(message, dict) or message.get("method") != "tools/call":
        return ""
    params = message.get("params")
    arguments = params.get("arguments") if isinstance(params, dict) else None
    named = arguments.get("workspace") if isinstance(arguments, dict) else None
    return named if isinstance(named, str) else ""


async def _answer(
    scope: Scope, receive: Receive, send: Send, status: int, text: str, headers: dict[str, str] | None = None
) -> None:
    from starlette.responses import PlainTextResponse

    await PlainTextResponse(text, status_code=status, headers=headers)(scope, receive, send)
