"""A connection to a port inside one sandbox, made from the host through the sandbox's own network namespace.

No address of the sandbox is reached from the host's side, and no port is published: a thread of this process
enters the namespace of the sandbox's first process (`setns`), connects to the sandbox's loopback there, and
comes back; the socket stays where it was made. The thread is made for the one connection and ends with it, so
no other work ever runs in the sandbox's namespace. Root only, with the engine on this host.
"""

from __future__ import annotations

import ctypes
import http.client
import os
import socket
import threading

__all__ = ["NetnsUnavailable", "connect_inside", "status_inside", "unavailable"]

CLONE_NEWNET = 0x40000000
_libc = ctypes.CDLL(None, use_errno=True)


class NetnsUnavailable(OSError):
    """The sandbox's namespace cannot be entered here (not root, or its process is gone)."""


def unavailable() -> str | None:
    """Why this process cannot enter sandboxes' network namespaces (None: it can)."""
    if os.geteuid() != 0:
        return "the server is not running as root"
    if not os.path.exists("/proc/thread-self/ns/net"):
        return "this kernel does not show network namespaces"
    return None


def _setns(handle: int) -> None:
    if _libc.setns(handle, CLONE_NEWNET) != 0:
        error = ctypes.get_errno()
        raise NetnsUnavailable(error, f"cannot enter the network namespace: {os.strerror(error)}")


def connect_inside(pid: int, port: int, timeout_s: float = 5.0) -> socket.socket:
    """A TCP connection to 127.0.0.1:`port` in the network namespace of the host process `pid`."""
    made: list[socket.socket] = []
    failed: list[BaseException] = []

    def work() -> None:
        try:
            own = os.open("/proc/thread-self/ns/net", os.O_RDONLY | os.O_CLOEXEC)
        except OSError as exc:
            failed.append(NetnsUnavailable(exc.errno, f"cannot read this thread's network namespace: {exc}"))
            return
        try:
            try:
                target = os.open(f"/proc/{pid}/ns/net", os.O_RDONLY | os.O_CLOEXEC)
            except OSError as exc:
                raise NetnsUnavailable(exc.errno, "the sandbox's process is gone") from exc
            try:
                _setns(target)
                try:
                    made.append(socket.create_connection(("127.0.0.1", port), timeout=timeout_s))
                finally:
                    try:
                        _setns(own)
                    except OSError:  # never let this process go on in a sandbox's network
                        os._exit(70)
            finally:
                os.close(target)
        except BaseException as exc:
            failed.append(exc)
        finally:
            os.close(own)

    thread = threading.Thread(target=work, name="sandbox-netns", daemon=True)
    thread.start()
    thread.join()
    if failed:
        raise failed[0]
    return made[0]


def status_inside(pid: int, port: int, host: str, path: str, timeout_s: float = 2.0) -> int | None:
    """The HTTP status a GET of `path` gets from port `port` inside the namespace of `pid` (None: no answer)."""
    try:
        sock = connect_inside(pid, port, timeout_s)
    except OSError:
        return None
    connection = http.client.HTTPConnection(host, port, timeout=timeout_s)
    connection.sock = sock
    try:
        connection.request("GET", path, headers={"Host": f"{host}:{port}", "User-Agent": "sandbox-server readiness"})
        return connection.getresponse().status
    except (OSError, http.client.HTTPException):
        return None
    finally:
        connection.close()
