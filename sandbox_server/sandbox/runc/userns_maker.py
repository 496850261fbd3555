"""The user namespaces of sandboxes with host ids of their own (sandbox.runc.host_ids), each made by a process that
runs as its range's first host id, so that the namespace is that id's: its maker.

The maker is one small process per server (the server's own interpreter, isolated, its standard library alone),
started at the first namespace and ending when the server's end of its socket closes. Per namespace it forks a
child, which drops its groups, becomes the range's first id, makes a user namespace and says its pid; the server
writes the namespace's maps, binds it on its file and closes its end of the child's socket, and the child ends.
Each namespace used to be made by a helper the server started (`setpriv`, which executed `unshare`, which
executed `sh`): three programs loaded per sandbox, about 1.5 ms more of the machine's CPU and 2 ms more of wall
time than a fork of the maker (`bench userns`)."""

from __future__ import annotations

import contextlib
import errno
import socket
import subprocess
import sys
import threading
from pathlib import Path

from sandbox_server.sandbox import mounts
from sandbox_server.sandbox.runc.oci import SPAN

__all__ = ["UsernsError", "close", "hold", "make"]

WAIT_S = 10.0
MAKER = r"""
import ctypes, os, signal, socket, sys
CLONE_NEWUSER = 0x10000000
libc = ctypes.CDLL(None, use_errno=True)
signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # its children reaped by the kernel as they end
asked = socket.socket(fileno=int(sys.argv[1]))
while True:
    try:
        message, fds, _, _ = socket.recv_fds(asked, 64, 1)
    except InterruptedError:
        continue
    if not message:  # the server's end closed: it stopped, or died
        break
    if fds and os.fork() == 0:
        try:
            asked.close()
            answer = socket.socket(fileno=fds[0])
            try:
                first = int(message)
                os.setgroups([])
                os.setresgid(first, first, first)
                os.setresuid(first, first, first)
                if libc.unshare(CLONE_NEWUSER) != 0:
                    raise OSError(ctypes.get_errno(), os.strerror(ctypes.get_errno()))
                answer.send(b"%d" % os.getpid())
                answer.recv(1)  # until the server has mapped and bound it (its end closes)
            except Exception as exc:
                answer.send(("error: " + str(exc)).encode())
        finally:
            os._exit(0)
    for fd in fds:
        os.close(fd)
"""
"""What the maker runs: a child per namespace asked for (a message: the range's first host id, with the socket the
child answers on)."""


class UsernsError(OSError):
    """A user namespace the host could not make."""


class _Maker:
    def __init__(self) -> None:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            self.process = subprocess.Popen(
                [sys.executable, "-I", "-S", "-c", MAKER, str(theirs.fileno())],
                pass_fds=[theirs.fileno()],
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                cwd="/",
                env={},
                start_new_session=True,
            )  # (nothing of it reaches the server's stdout, which may be its MCP channel)
        except BaseException:
            ours.close()
            raise
        finally:
            theirs.close()
        self.socket = ours

    def close(self) -> None:
        self.socket.close()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.process.wait(timeout=WAIT_S)


_maker: _Maker | None = None
_lock = threading.Lock()


def _asked(first: int) -> socket.socket:
    """The socket a child of the maker answers on, once asked for a namespace of `first` (a maker that ended is
    started again)."""
    global _maker
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        with _lock:
            for attempt in range(2):
                if _maker is not None and _maker.process.poll() is not None:
                    _maker.close()
                    _maker = None
                if _maker is None:
                    _maker = _Maker()
                try:
                    socket.send_fds(_maker.socket, [b"%d" % first], [theirs.fileno()])
                    break
                except OSError:
                    if attempt:
                        raise
                    _maker.close()
                    _maker = None
    except BaseException:
        ours.close()
        raise
    finally:
        theirs.close()
    return ours


def make(held: Path, first: int) -> None:
    """A user namespace owned by host id `first`, mapping ids 0-65535 onto `first` up, held by a bind of its file on
    `held` (made here); raises UsernsError (OSError)."""
    answer = _asked(first)
    try:
        answer.settimeout(WAIT_S)
        try:
            said = answer.recv(256)
        except TimeoutError:
            said = b"error: no answer within %d s" % WAIT_S
        if not said.isdigit():
            reason = said.decode(errors="replace") or "error: the maker ended"
            raise UsernsError(errno.EPERM, f"could not make a user namespace ({reason})")
        hold(int(said), first, held)
    finally:
        answer.close()


def hold(pid: int, first: int, held: Path) -> None:
    """The user namespace process `pid` made, its ids 0-65535 mapped onto host ids `first` up, held by a bind of its
    file on `held` (made here): it outlives the process."""
    for kind in ("uid_map", "gid_map"):
        with open(f"/proc/{pid}/{kind}", "w", encoding="ascii") as mapping:
            mapping.write(f"0 {first} {SPAN}\n")
    held.touch(mode=0o600)
    mounts.bind(f"/proc/{pid}/ns/user", str(held))


def close() -> None:
    """The maker ended (it would end with the server anyway); never raises."""
    global _maker
    with _lock:
        if _maker is not None:
            with contextlib.suppress(OSError):
                _maker.close()
            _maker = None
