"""Previews: a person opens a service in a browser through the server's own HTTP routes, never a published port.

`/preview/<service id>/…` (HTTP, and WebSocket for a dev server's hot reload) is forwarded to the service's
port, inside the service's own network namespace (`sandbox.netns`), for the caller who started it alone: the
same bearer token as their MCP requests, or the signed link a service's answer gives. A link is good for a short
while and once: its first use gives that browser a session cookie for the one service and sends it on without
the link. Everyone else is answered 401 (no credentials) or 404 (another caller's, or no such service), the
same 404 as for an id that never existed.

Previews share the server's origin, so a page of another origin must not ride on a browser's cookie: a request
whose `Host` is not one the server answers to is refused (as /mcp refuses it, against DNS rebinding), and one
from another origin (its `Origin`, or a browser's `Sec-Fetch-Site` for anything but opening the page) is
refused for every method and for WebSocket upgrades. Even opening: another site's page (another port of this one
included) may open a preview with its link, never with the browser's cookie alone, which would carry a side effect
of the caller's; the link's own redirect is marked once, since a browser still says it comes from that site. A service's cookies are kept to its own prefix: their
`Domain` is dropped and their `Path` put below `/preview/<id>/`, and none may take a preview cookie's name. A
service that fails to answer, or answers what is not HTTP, gets a 502 that says so.
"""

from __future__ import annotations

import hashlib
import http.client
import logging
import secrets
import socket
import time
from collections.abc import Awaitable, Callable, Iterator, Sequence
from http.cookies import SimpleCookie
from typing import Any
from urllib.parse import parse_qsl, urlencode, urlsplit

import anyio
import anyio.to_thread
from mcp.server.auth.middleware.bearer_auth import AuthenticatedUser
from starlette.requests import HTTPConnection, Request
from starlette.responses import PlainTextResponse, RedirectResponse, Response, StreamingResponse
from starlette.routing import BaseRoute, Route, WebSocketRoute
from starlette.websockets import WebSocket, WebSocketDisconnect

from sandbox_server.access.identity import token_identity
from sandbox_server.errors import UsageError
from sandbox_server.sandbox.runc.netns import connect_inside
from sandbox_server.services.links import PREVIEW_PREFIX
from sandbox_server.services.manager import Service, Services

__all__ = ["Previews", "relay", "serve_previews"]

log = logging.getLogger("sandbox_server")

BROWSER_TTL_S = 8 * 3600.0
LANDING = "sandbox-landing"
"""The query parameter a redeemed link's redirect carries, once (the service never sees it)."""
LANDING_S = 30.0
OURS = ("grant", LANDING)
"""The query parameters of the server's own, left out of what a service is sent."""
"""A browser's preview session lasts this long at most (and no longer than its service)."""
MAX_BODY_BYTES = 16 * 1024 * 1024
HOP_BY_HOP = frozenset(
    ["connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te", "trailer", "trailers",
     "transfer-encoding", "upgrade", "host", "authorization", "content-length"]
)  # fmt: skip
METHODS = ["GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"]
UNKNOWN = "no such service\n"
COOKIE_PREFIX = "sbx-preview-"
"""The names of the browsers' preview cookies (a service may set none of these)."""


class Previews:
    """The preview routes of one HTTP server and its browsers' sessions (the links they open are the services'
    `links`)."""

    def __init__(self, services: Services, hosts: Sequence[str], frame_ancestors: Sequence[str] = ()) -> None:
        self.services = services
        self.framing = "frame-ancestors " + " ".join(["'self'", *(_origin_source(o) for o in frame_ancestors)])
        """Which pages may frame a preview (a Content-Security-Policy of its own on every answer): the server's, and
        the MCP hosts' named with `serve --frame-ancestor`; a service's own policy is enforced beside it."""
        self.hosts = tuple(hosts)
        """The Host headers the server answers to: a name, or `name:*` for that name on any port."""
        self._browsers: dict[str, tuple[str, str, float]] = {}
        """A browser's cookie -> (service id, caller, expiry)."""
        self._seen: set[tuple[str, str]] = set()
        self._landings: dict[str, tuple[str, float]] = {}
        """The mark on a redeemed link's redirect -> (service id, until when): that one request may come marked
        as another site's, as the link that began it did."""

    def routes(self) -> list[BaseRoute]:
        return [
            Route(PREVIEW_PREFIX + "/{service}", self._framed(self._to_folder), methods=METHODS),
            Route(PREVIEW_PREFIX + "/{service}/{path:path}", self._framed(self._http), methods=METHODS),
            WebSocketRoute(PREVIEW_PREFIX + "/{service}/{path:path}", self._websocket),
        ]

    def _framed(self, endpoint: Callable[[Request], Awaitable[Response]]) -> Callable[[Request], Awaitable[Response]]:
        """Every answer of a preview route carries who may frame it (another site's page may not: a page on another
        port of the same site would share the partitioned cookie of a framed preview)."""

        async def framed(request: Request) -> Response:
            response = await endpoint(request)
            response.raw_headers.append((b"content-security-policy", self.framing.encode("latin-1")))
            return response

        return framed

    # -- who may ---------------------------------------------------------------------------------

    def _cookie_name(self, service_id: str) -> str:
        return COOKIE_PREFIX + hashlib.sha256(service_id.encode()).hexdigest()[:12]

    async def _admit(self, connection: HTTPConnection) -> tuple[Service | None, int, str]:
        """The service a request may reach, else the status to answer (401: no credentials; 404: not theirs; 403:
        another origin or an unknown host)."""
        refused = self._foreign(connection)
        if refused:
            log.warning("refused a preview request: %s", refused)
            return None, 403, refused + "\n"
        service_id = connection.path_params["service"]
        service = self.services.get(service_id)
        if service is None or not service.settings.preview:
            return None, 404, UNKNOWN
        user = connection.scope.get("user")
        if isinstance(user, AuthenticatedUser):
            token = user.access_token
            holder = token_identity(token.subject or token.client_id, token.claims or {})
            if holder.limits_key != service.caller:
                return None, 404, UNKNOWN
            return await self._seen_by(service, holder.limits_key, "token"), 200, ""
        browser = self._browsers.get(connection.cookies.get(self._cookie_name(service.id), ""))
        if browser is not None and browser[:2] == (service.id, service.caller) and browser[2] > time.time():
            site = connection.headers.get("sec-fetch-site")
            if site in ("same-site", "cross-site") and not self._landed(connection, service):
                return (
                    None,
                    403,
                    (
                        f"a page of another site, or another port of this one, opened this preview (Sec-Fetch-Site: "
                        f"{site}): its cookie is not used so. Open the preview's link again, or this address from the "
                        "browser's address bar\n"
                    ),
                )
            return service, 200, ""
        return None, 401, "open the preview link this service's answer gave, or send your bearer token\n"

    def _landed(self, connection: HTTPConnection, service: Service) -> bool:
        """Whether this is the first request after a link was redeemed (once, within LANDING_S): the end of the
        redirect its link began, which a browser still marks as coming from the site that opened the link."""
        mark = connection.query_params.get(LANDING)
        landing = self._landings.pop(mark, None) if mark else None
        return landing is not None and landing[0] == service.id and landing[1] > time.time()

    def _foreign(self, connection: HTTPConnection) -> str:
        """Why a request comes from where it may not (an empty string when it does not)."""
        host = connection.headers.get("host", "")
        if not _host_allowed(host, self.hosts):
            return f"the Host header {host[:100]!r} is not one this server answers to"
        origin = connection.headers.get("origin")
        site = connection.headers.get("sec-fetch-site")
        navigating = connection.headers.get("sec-fetch-mode") == "navigate" and connection.scope["type"] == "http"
        opening = navigating and connection.scope.get("method") == "GET"
        if origin == "null" and opening:  # a frame in a sandboxed page (a view) opens it, as a link of any page may
            return ""
        if origin is not None and (origin == "null" or urlsplit(origin).netloc.lower() != host.lower()):
            return f"a page of another origin ({origin[:100]}) may not use a preview"
        if site in ("same-site", "cross-site") and not opening:
            return f"a {site} request may only open a preview, not use it (Sec-Fetch-Site: {site})"
        return ""

    async def _seen_by(self, service: Service, caller: str, how: str) -> Service:
        if (service.id, caller) not in self._seen:
            self._seen.add((service.id, caller))
            await self.services.audit_event("service_previewed", service, by=caller, by_means_of=how)
        return service

    async def _redeem(self, request: Request) -> Response | None:
        """A first visit with a link: a cookie for this browser, and the same address without the link."""
        grant = request.query_params.get("grant")
        service = self.services.get(request.path_params["service"])
        if grant is None or service is None:
            return None
        if not self.services.links.redeem(service, grant):
            return PlainTextResponse(
                "this preview link has expired or was used already: a link opens once, in one browser. For a new "
                'one, call the services tool with {"action": "list"}: each listing gives each service a fresh '
                "link\n",
                401,
            )
        cookie, now = secrets.token_urlsafe(24), time.time()
        self._browsers = {k: v for k, v in self._browsers.items() if v[2] > now}
        self._browsers[cookie] = (service.id, service.caller, now + BROWSER_TTL_S)
        await self._seen_by(service, service.caller, "link")
        kept = [(k, v) for k, v in parse_qsl(request.url.query, keep_blank_values=True) if k not in OURS]
        mark = secrets.token_urlsafe(16)
        self._landings = {k: v for k, v in self._landings.items() if v[1] > now}
        self._landings[mark] = (service.id, now + LANDING_S)
        response = RedirectResponse(request.url.path + "?" + urlencode([*kept, (LANDING, mark)]), 303)
        # Opened in a frame (a view beside a conversation, on another site): a cookie partitioned by that site, the
        # one a browser keeps for a frame; elsewhere one that no other site's page can carry.
        framed = request.headers.get("sec-fetch-dest") == "iframe"
        response.set_cookie(
            self._cookie_name(service.id), cookie, path=f"{PREVIEW_PREFIX}/{service.id}/", httponly=True,
            samesite="none" if framed else "lax", secure=framed,
        )  # fmt: skip
        if framed:  # (the standard library writes the Partitioned attribute from Python 3.14 on)
            header, value = response.raw_headers[-1]
            response.raw_headers[-1] = (header, value + b"; Partitioned")
        return response

    # -- forwarding ------------------------------------------------------------------------------

    def _target(self, connection: HTTPConnection, service: Service) -> str:
        """The request's path below the service's prefix, as the browser sent it (without a link)."""
        raw = connection.scope.get("raw_path") or connection.url.path.encode()
        path = raw.decode("latin-1").split(f"{PREVIEW_PREFIX}/{service.id}", 1)[-1] or "/"
        query = [(k, v) for k, v in parse_qsl(connection.url.query, keep_blank_values=True) if k not in OURS]
        return ("/" + path.lstrip("/")) + (f"?{urlencode(query)}" if query else "")

    def _headers(self, connection: HTTPConnection, service: Service) -> dict[str, str]:
        own = self._cookie_name(service.id)
        headers = {k: v for k, v in connection.headers.items() if k.lower() not in HOP_BY_HOP and k.lower() != "cookie"}
        others = [f"{k}={v}" for k, v in connection.cookies.items() if k != own]
        if others:
            headers["cookie"] = "; ".join(others)
        headers["host"] = f"{service.name}:{service.port}"
        headers["x-forwarded-prefix"] = f"{PREVIEW_PREFIX}/{service.id}"
        return headers

    async def _to_folder(self, request: Request) -> Response:
        query = f"?{request.url.query}" if request.url.query else ""
        return RedirectResponse(f"{request.url.path}/{query}", 308)

    async def _http(self, request: Request) -> Response:
        service, status, why = await self._admit(request)
        if "grant" in request.query_params and (service is not None or status != 403 or self._foreign(request) == ""):
            if service is not None:  # a browser that has its session already: the same address without the link
                kept = [(k, v) for k, v in parse_qsl(request.url.query, keep_blank_values=True) if k not in OURS]
                return RedirectResponse(request.url.path + (f"?{urlencode(kept)}" if kept else ""), 303)
            redeemed = await self._redeem(request)
            if redeemed is not None:
                return redeemed
        if service is None:
            return PlainTextResponse(why, status, headers={"WWW-Authenticate": "Bearer"} if status == 401 else None)
        service.last_used = time.monotonic()
        body = bytearray()
        async for chunk in request.stream():
            body += chunk
            if len(body) > MAX_BODY_BYTES:
                return PlainTextResponse(f"a preview request body is at most {MAX_BODY_BYTES} bytes\n", 413)
        target, headers = self._target(request, service), self._headers(request, service)
        try:
            connection, answer = await anyio.to_thread.run_sync(
                _forward, service, request.method, target, headers, bytes(body)
            )
        except (OSError, http.client.HTTPException) as exc:
            said = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
            return PlainTextResponse(f"service {service.name} did not answer on port {service.port}: {said}\n", 502)
        response = StreamingResponse(_body(connection, answer), status_code=answer.status)
        prefix = f"{PREVIEW_PREFIX}/{service.id}/"
        response.raw_headers = [
            (k.lower().encode("latin-1"), v.encode("latin-1"))
            for k, v in answer.getheaders()
            if k.lower() not in HOP_BY_HOP and k.lower() != "set-cookie"
        ]
        for name, value in answer.getheaders():
            if name.lower() == "set-cookie" and (cookie := _own_cookie(value, prefix)) is not None:
                response.raw_headers.append((b"set-cookie", cookie.encode("latin-1")))
        return response

    async def _websocket(self, websocket: WebSocket) -> None:
        service, _, _ = await self._admit(websocket)
        if service is None:
            await websocket.close(code=1008)
            return
        from websockets.exceptions import WebSocketException
        from websockets.sync.client import connect

        target = self._target(websocket, service)
        protocols = [p.strip() for p in websocket.headers.get("sec-websocket-protocol", "").split(",") if p.strip()]

        def open_upstream() -> Any:
            sock = connect_inside(service.pid, service.port)
            return connect(
                f"ws://{service.name}:{service.port}{target}", sock=sock, subprotocols=protocols or None,  # type: ignore[arg-type]
                open_timeout=10, max_size=MAX_BODY_BYTES,
            )  # fmt: skip

        try:
            upstream = await anyio.to_thread.run_sync(open_upstream)
        except (OSError, WebSocketException, TimeoutError) as exc:  # not listening, or it answers no upgrade
            log.info("preview of %s: its WebSocket did not open (%s)", service.id, exc)
            await websocket.close(code=1011)
            return
        await websocket.accept(subprotocol=upstream.subprotocol)

        def used() -> None:
            service.last_used = time.monotonic()

        await relay(websocket, upstream, used)


async def relay(websocket: WebSocket, upstream: Any, used: Callable[[], None] = lambda: None) -> None:
    """Carry a browser's accepted WebSocket and an open upstream one (a `websockets` sync client connection) both
    ways until either side ends, then close both; `used` hears each message from the browser."""
    from websockets.exceptions import ConnectionClosed

    async def to_service() -> None:
        try:
            while True:
                message = await websocket.receive()
                if message["type"] == "websocket.disconnect":
                    return
                data = message.get("bytes") if message.get("bytes") is not None else message.get("text")
                used()
                await anyio.to_thread.run_sync(upstream.send, data)
        except (WebSocketDisconnect, ConnectionClosed):
            return

    async def to_browser() -> None:
        try:
            while True:
                data = await anyio.to_thread.run_sync(upstream.recv, abandon_on_cancel=True)
                if isinstance(data, bytes):
                    await websocket.send_bytes(data)
                else:
                    await websocket.send_text(data)
        except (ConnectionClosed, WebSocketDisconnect, RuntimeError):
            return

    async with anyio.create_task_group() as group:

        async def until_one_ends(side: Any) -> None:
            await side()
            group.cancel_scope.cancel()

        group.start_soon(until_one_ends, to_service)
        group.start_soon(until_one_ends, to_browser)
    upstream.close()
    try:
        await websocket.close()
    except RuntimeError:
        pass  # the browser closed it


async def serve_previews(previews: Previews, listener: socket.socket) -> None:
    """Serve the preview routes alone on a loopback listener (a stdio server's `--preview-port`): links only, as
    no bearer token comes over stdio."""
    import uvicorn
    from starlette.applications import Starlette

    config = uvicorn.Config(Starlette(routes=previews.routes()), log_level="warning", lifespan="off")
    await uvicorn.Server(config).serve(sockets=[listener])


def _forward(
    service: Service, method: str, target: str, headers: dict[str, str], body: bytes
) -> tuple[http.client.HTTPConnection, http.client.HTTPResponse]:
    """Send one request to the service inside its namespace; its answer's head has arrived."""
    sock = connect_inside(service.pid, service.port)
    connection = http.client.HTTPConnection(service.name, service.port, timeout=60)
    connection.sock = sock
    try:
        connection.request(method, target, body=body or None, headers=headers)
        return connection, connection.getresponse()
    except BaseException:
        connection.close()
        raise


def _body(connection: http.client.HTTPConnection, answer: http.client.HTTPResponse) -> Iterator[bytes]:
    try:
        while chunk := answer.read1(64 * 1024):
            yield chunk
    except (OSError, http.client.HTTPException) as exc:  # the service broke off: the browser gets what came
        log.info("a preview's answer ended early: %r", exc)
    finally:
        connection.close()


def _origin_source(origin: str) -> str:
    """An origin as a CSP source (scheme://host[:port], `*` for any port); anything else refused."""
    parts = urlsplit(origin.strip().rstrip("/"))
    if parts.scheme not in ("http", "https") or not parts.hostname or parts.path or parts.query:
        raise UsageError(f"--frame-ancestor {origin!r} is not an origin (scheme://host[:port])")
    return f"{parts.scheme}://{parts.netloc}"


def _host_allowed(host: str, allowed: Sequence[str]) -> bool:
    """Whether a Host header is one of `allowed` (`name:*` allowing that name on any port)."""
    host = host.lower()
    name = host[: host.index("]") + 1] if host.startswith("[") and "]" in host else host.split(":", 1)[0]
    return any(host == pattern or (pattern.endswith(":*") and name == pattern[:-2]) for pattern in allowed)


def _own_cookie(header: str, prefix: str) -> str | None:
    """A service's Set-Cookie kept to its preview's prefix (its Path below it, no Domain); None to drop it (a
    preview cookie's name, or what does not parse)."""
    jar: SimpleCookie = SimpleCookie()
    try:
        jar.load(header)
    except Exception:  # http.cookies raises CookieError and others on what it cannot read
        return None
    if len(jar) != 1:
        return None
    ((name, morsel),) = jar.items()
    if name.startswith(COOKIE_PREFIX) or name.startswith(("__Host-", "__Secure-")):
        return None
    morsel["domain"] = ""
    morsel["path"] = prefix + str(morsel["path"] or "/").lstrip("/")
    return morsel.OutputString()
