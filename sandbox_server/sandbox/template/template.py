"""The template: a process started once per image in the image's own root and interpreter, which never runs
a caller's code. It waits for the host's requests on its socket, each one message (the sandbox's config and
where its root goes) with the sandbox's descriptors, and forks a child for each (contain.child)."""

from __future__ import annotations

import json
import os
import signal
import socket

from . import contain, warm

MAX_REQUEST = 1 << 20
MAX_FDS = 32


def serve(control: int, host_root: int, seccomp: bytes, becoming: contain.Becoming | None = None) -> None:
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
                if "warm" in request:  # a warm template of this image (its socket, its report pipe)
                    own_root, first = warm.become(request["warm"], host_root, fds[1])
                    serve(fds[0], own_root, seccomp, first)
                else:
                    contain.child(request, fds, host_root, seccomp, becoming)
            finally:
                os._exit(125)
        for fd in fds:
            os.close(fd)
