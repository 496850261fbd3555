"""The template: a process started once per seccomp filter (the server's own interpreter), or once per image and
preload list (a warm template: the image's, in a sandbox of its own), which never runs a caller's code. It waits
for the host's requests on its socket, each one message (the sandbox's config and where its root goes) with the
sandbox's descriptors, and forks a child for each (contain.child); a request for a warm template forks the child
that becomes one (warm.enter). A warm template forks each sandbox's first process itself, into a pid namespace
made for it (contain.first), and says how each ended."""

from __future__ import annotations

import json
import os
import select
import signal
import socket

from . import contain, kernel, warm

MAX_REQUEST = 1 << 20
MAX_FDS = 32


def serve(
    control: int, host_root: int, seccomp: bytes, becoming: contain.Becoming | None = None, given: bytes = b""
) -> None:
    """Until the host closes its end: a sandbox per request. It ends with the server, whose end of the socket closes
    as it dies (no parent-death signal: the kernel sends that when the thread that started it ends, and the server
    starts templates from threads that come and go)."""
    sock = socket.socket(fileno=control)
    if becoming is not None:
        _serve_warm(sock, host_root, seccomp, becoming)
        return
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # the children reaped by the kernel as they end
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
                    contain.child(request, fds, host_root, seccomp)
            finally:
                os._exit(125)
        for fd in fds:
            os.close(fd)


def _serve_warm(sock: socket.socket, host_root: int, seccomp: bytes, becoming: contain.Becoming) -> None:
    """A warm template's loop: each request's first process forked into a pid namespace made for it (below the
    template's own, of which it is pid 1), and each one's end said on its report pipe as the template reaps it.
    Once the host closes its end, it ends when the last of its sandboxes has: its own end would end them all."""
    woken, wake = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
    signal.set_wakeup_fd(wake)  # a sandbox that ends wakes the wait below
    signal.signal(signal.SIGCHLD, lambda *_: None)
    pid_ns = os.open("proc/self/ns/pid", os.O_RDONLY | os.O_CLOEXEC, dir_fd=host_root)  # (the host's /proc)
    reports: dict[int, int] = {}
    """Each sandbox's report pipe, by its first process's pid (in the template's pid namespace)."""
    control = sock.fileno()
    while True:
        asked = select.select([control, woken] if control >= 0 else [woken], [], [])[0]
        if control in asked:
            message, fds, _, _ = socket.recv_fds(sock, MAX_REQUEST, MAX_FDS)
            if not message:
                sock.close()
                control = -1
            elif len(fds) > 3:  # (stdin, stdout, stderr, the report pipe, the cgroups)
                held = (control, woken, wake, pid_ns, *reports.values())
                _fork_first(message, fds, reports, held, pid_ns, host_root, seccomp, becoming)
            else:
                for fd in fds:
                    os.close(fd)
        if woken in asked:
            _drain(woken)
        _reap(reports)
        if control < 0 and not reports:
            return


def _fork_first(
    message: bytes, fds: list[int], reports: dict[int, int], held: tuple[int, ...], pid_ns: int, host_root: int,
    seccomp: bytes, becoming: contain.Becoming,
) -> None:  # fmt: skip
    """One sandbox's first process, forked as pid 1 of a pid namespace of its own; its report pipe kept. `held`:
    the template's descriptors and the other sandboxes' report pipes, none of which the sandbox may have."""
    report = fds[3]
    pid = -1
    try:
        kernel.unshare(kernel.CLONE_NEWPID)
        try:
            pid = os.fork()
        finally:
            if pid != 0:  # its next child in its own pid namespace again, for the next unshare
                kernel.setns(pid_ns, kernel.CLONE_NEWPID)
    except OSError as exc:
        contain.say(report, {"error": f"the sandbox could not be made: {exc}"})
    if pid == 0:
        try:
            for fd in held:
                os.close(fd)
            signal.set_wakeup_fd(-1)
            contain.first(json.loads(message), fds, host_root, seccomp, becoming)
        finally:
            os._exit(125)
    for fd in fds:
        if fd != report:
            os.close(fd)
    if pid > 0:
        reports[pid] = report
    else:
        os.close(report)


def _reap(reports: dict[int, int]) -> None:
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        report = reports.pop(pid, None)
        if report is not None:
            contain.say(report, {"exit": contain.exit_code(status)})
            os.close(report)


def _drain(fd: int) -> None:
    try:
        while os.read(fd, 64):
            pass
    except BlockingIOError:
        pass
