"""The template: a process started once per seccomp filter (the server's own interpreter), or once per image and
preload list (a warm template: the image's, in a sandbox of its own), which never runs a caller's code. It waits
for the host's requests on its socket, each one message (the sandbox's config and where its root goes) with the
sandbox's descriptors, and forks a child for each (contain.child); a request for a warm template forks the child
that becomes one (warm.enter)."""

from __future__ import annotations

import json
import os
import signal
import socket

from . import contain, warm

MAX_REQUEST = 1 << 20
MAX_FDS = 32


def serve(
    control: int, host_root: int, seccomp: bytes, becoming: contain.Becoming | None = None, given: bytes = b""
) -> None:
    """Until the host closes its end: a sandbox per request. It ends with the server, whose end of the socket closes
    as it dies (no parent-death signal: the kernel sends that when the thread that started it ends, and the server
    starts templates from threads that come and go)."""
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # the children reaped by the kernel as they end
    sock = socket.socket(fileno=control)
    while True:
        try:
            message, fds, _, _ = socket.recv_fds(sock, MAX_REQUEST, MAX_FDS)
        except InterruptedError:
            continue
        if not message:
            return
        pid = os.fork()
        if pid == 0:
            sock.close()
            try:
                request = json.loads(message)
                if "warm" in request:  # a warm template of an image (its socket, its report pipe)
                    warm.enter(request["warm"], host_root, fds, given)
                else:
                    contain.child(request, fds, host_root, seccomp, becoming)
            finally:
                os._exit(125)
        for fd in fds:
            os.close(fd)
