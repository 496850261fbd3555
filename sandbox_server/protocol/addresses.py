"""Where an HTTP server listens and the names it answers to: apart from the transports, so that a server binds its
port (and its warm containers start) before the MCP SDK is imported."""

from __future__ import annotations

import errno
import socket

from sandbox_server.errors import SandboxServerError

__all__ = ["LOOPBACK_HOSTS", "allowed_hosts", "host_names", "listen", "url_of"]

LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1")
"""Addresses to bind `serve --transport http` to that only this machine reaches."""


def listen(host: str, port: int) -> socket.socket:
    """A listening socket at HOST:PORT, bound before anything else starts; a port that is taken (or an address
    this host does not have) is said in one line, naming the option to change."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
        listener = socket.socket(family, kind, proto)
    except OSError as exc:
        raise SandboxServerError(f"cannot listen on {host}:{port}: {exc.strerror or exc} (--host)") from None
    try:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(address)
        listener.listen(2048)
    except OSError as exc:
        listener.close()
        taken = " (another process listens there; choose another with --port)" if exc.errno == errno.EADDRINUSE else ""
        raise SandboxServerError(f"cannot listen on {host}:{port}: {exc.strerror or exc}{taken}") from None
    return listener


def host_names(host: str, public_host: str | None = None) -> list[str]:
    """The names a server bound to `host` is reached by: loopback's, the host's, and the public URL's (serve
    --public-url, behind a proxy or not)."""
    loopback = ["127.0.0.1", "localhost", "[::1]"]
    names = loopback if host in LOOPBACK_HOSTS else [host, *loopback]
    if public_host is not None and public_host not in names:
        names.append(public_host)
    return names


def allowed_hosts(names: list[str]) -> list[str]:
    """The Host headers a server reached by `names` answers to (each name, on any port): for /mcp and previews."""
    return [*names, *(f"{name}:*" for name in names)]


def url_of(listener: socket.socket) -> str:
    """The URL clients reach a listening socket's /mcp at."""
    host, port = listener.getsockname()[:2]
    return f"http://[{host}]:{port}/mcp" if ":" in host else f"http://{host}:{port}/mcp"
