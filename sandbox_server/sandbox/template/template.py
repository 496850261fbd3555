"""The template: a process started once per seccomp filter (the server's own interpreter), or once per image and
preload list (a warm template: the image's, in a sandbox of its own), which never runs a caller's code. It waits
for the host's requests on its socket, each one message (the sandbox's config and where its root goes) with the
sandbox's descriptors, and forks a child for each (contain.child); a request for a warm template forks the child
that becomes one (warm.enter).

A warm template hands each request to its helper, a process it forked before its preload's imports: the helper
forks the sandbox's first process into a pid namespace made for it (contain.first), small, and says how it ended.
Once that process has made the sandbox, the helper hands it back (its pidfd), and the warm template forks into it
the process that becomes the call's program (contain.program), the one copy of its heap a call makes. A warm
template that preloads nothing has little to copy and no helper: it runs the helper's loop itself, and each first
process forks its program."""

from __future__ import annotations

import contextlib
import json
import os
import select
import signal
import socket
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

from . import contain, kernel, warm

MAX_REQUEST = 1 << 20
MAX_FDS = 32


def serve(
    control: int, host_root: int, seccomp: bytes, becoming: contain.Warm | None = None, given: bytes = b""
) -> None:
    """Until the host closes its end: a sandbox per request. It ends with the server, whose end of the socket closes
    as it dies (no parent-death signal: the kernel sends that when the thread that started it ends, and the server
    starts templates from threads that come and go)."""
    sock = socket.socket(fileno=control)
    if becoming is not None and becoming.helping:
        sock.close()  # (the host's socket is the warm template's)
        _serve_helper(socket.socket(fileno=becoming.helper), host_root, seccomp, becoming)
        return
    if becoming is not None and becoming.helper < 0:  # (it preloads nothing: no helper)
        _serve_helper(sock, host_root, seccomp, becoming)
        return
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
        pid = kernel.fork()
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


class Waiting(NamedTuple):
    """A request whose sandbox the helper is making: what its program's process is given once it is made."""

    message: bytes
    fds: list[int]
    """Its stdin, stdout, stderr, then `cgroup.procs` of each of its cgroups."""
    exits: int
    """The write end of its exits pipe (the program's pid and end, said to the first process)."""


def _serve_warm(sock: socket.socket, host_root: int, seccomp: bytes, warm: contain.Warm) -> None:
    """A warm template's loop: each request handed to its helper, each sandbox the helper made given its program's
    process, forked here, and each one's end said on its exits pipe as the template reaps it. Once the host closes
    its end, it ends when its helper has (once every sandbox has: its own end would end them all)."""
    woken, wake = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
    signal.set_wakeup_fd(wake)  # a process that ends wakes the wait below
    signal.signal(signal.SIGCHLD, lambda *_: None)
    pid_ns = os.open("proc/self/ns/pid", os.O_RDONLY | os.O_CLOEXEC, dir_fd=host_root)  # (the host's /proc)
    os.close(host_root)  # (its helper's to use: nothing it forks may have it)
    helper = socket.socket(fileno=warm.helper)
    waiting: dict[int, Waiting] = {}
    programs: dict[int, int] = {}
    """Each program's exits pipe, by its pid (in the template's pid namespace)."""
    control, helping, tag = sock.fileno(), True, 0
    while helping or programs:
        watched = [fd for fd in (control, helper.fileno() if helping else -1, woken) if fd >= 0]
        asked = select.select(watched, [], [])[0]
        if control in asked:
            message, fds, _, _ = socket.recv_fds(sock, MAX_REQUEST, MAX_FDS)
            if not message:
                sock.close()
                control = -1
                helper.shutdown(socket.SHUT_WR)  # it ends once its sandboxes have
            elif len(fds) > 3:  # (stdin, stdout, stderr, the report pipe, the cgroups)
                tag += 1
                _hand_over(helper, tag, message, fds, waiting)
            else:
                for fd in fds:
                    os.close(fd)
        if helping and helper.fileno() in asked:
            said, fds, _, _ = socket.recv_fds(helper, MAX_REQUEST, 1)
            if not said:
                helping = False
            else:
                _fork_program(json.loads(said), fds, waiting, programs, pid_ns, seccomp, warm)
        if woken in asked:
            _drain(woken)
        _reap(programs, lambda code: b"exit %d" % code)
        if not helping and control >= 0:  # its helper gone: no sandbox can be made here
            os._exit(125)


def _hand_over(helper: socket.socket, tag: int, message: bytes, fds: list[int], waiting: dict[int, Waiting]) -> None:
    """A request to the helper, with its exits pipe's read end (for the first process); what the program's process
    needs kept here. Its report pipe is the helper's alone."""
    stdin, stdout, stderr, report, *procs = fds
    exits, told = os.pipe2(os.O_CLOEXEC)
    try:
        socket.send_fds(helper, [b"%d\n" % tag + message], [stdin, stdout, stderr, report, exits, *procs])
    except OSError:  # (its helper gone: the report pipe's end tells the host)
        for fd in (*fds, told):
            os.close(fd)
    else:
        waiting[tag] = Waiting(message, [stdin, stdout, stderr, *procs], told)
        os.close(report)
    finally:
        os.close(exits)


def _fork_program(
    said: Mapping[str, Any], fds: list[int], waiting: dict[int, Waiting], programs: dict[int, int], pid_ns: int,
    seccomp: bytes, warm: contain.Warm,
) -> None:  # fmt: skip
    """The program's process of a sandbox the helper made (`fds`: its first process's pidfd), forked into that
    sandbox's pid namespace; nothing when the first process ended first ("gone")."""
    entry = waiting.pop(int(said["tag"]), None)
    sandbox = fds[0] if fds else -1
    pid = -1
    if entry is not None and sandbox >= 0:
        with contextlib.suppress(OSError):  # (its first process ended meanwhile: said below)
            pid = _forked_into(lambda: kernel.setns(sandbox, kernel.CLONE_NEWPID), pid_ns)
        if pid == 0:
            try:
                contain.close_all_but((*entry.fds, entry.exits, sandbox))
                signal.set_wakeup_fd(-1)
                config = json.loads(entry.message)["config"]
                contain.program(config, entry.fds, entry.exits, sandbox, seccomp, warm)
            finally:
                os._exit(125)
    for fd in (*fds, *(entry.fds if entry else ())):
        os.close(fd)
    if entry is None:
        return
    if pid > 0:
        programs[pid] = entry.exits
    else:  # (its first process says the program was not made)
        contain.say_line(entry.exits, b"exit 125")
        os.close(entry.exits)


def _serve_helper(sock: socket.socket, host_root: int, seccomp: bytes, warm: contain.Warm) -> None:
    """The helper's loop: each request's first process forked into a pid namespace made for it (below the
    template's own, of which the template is pid 1), handed back to the template once it has made its sandbox, and
    its end said on its report pipe as the helper reaps it. Once the template is done asking, it ends when the last
    of its sandboxes has. A warm template that preloads nothing runs this loop itself, asked by the host (`sock`),
    and hands nothing back: its sandboxes' first processes fork their programs."""
    woken, wake = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
    signal.set_wakeup_fd(wake)  # a sandbox that ends wakes the wait below
    signal.signal(signal.SIGCHLD, lambda *_: None)
    pid_ns = os.open("proc/self/ns/pid", os.O_RDONLY | os.O_CLOEXEC, dir_fd=host_root)  # (the host's /proc)
    reports: dict[int, int] = {}
    """Each sandbox's report pipe, by its first process's pid (in the template's pid namespace)."""
    readies: dict[int, tuple[int, int]] = {}
    """Each sandbox's ready pipe, until it is made: its tag and its first process's pidfd."""
    control, preloaded = sock.fileno(), warm.preloaded
    while control >= 0 or reports:
        asked = select.select([fd for fd in (control, woken, *readies) if fd >= 0], [], [])[0]
        if control in asked:
            message, fds, _, _ = socket.recv_fds(sock, MAX_REQUEST, MAX_FDS)
            if not message:
                control = -1
            elif not fds and warm.helper >= 0:  # what the preload said, once it is done
                preloaded = json.loads(message)["preloaded"]
            elif len(fds) > 3:  # (stdin, stdout, stderr, the report pipe, the cgroups; the helper's, its exits pipe)
                tag, _, request = message.partition(b"\n") if warm.helper >= 0 else (b"0", b"", message)
                forked = _fork_first(json.loads(request), preloaded, fds, reports, pid_ns, host_root, seccomp, warm)
                if forked is not None:
                    readies[forked[0]] = (int(tag), forked[1])
            else:
                for fd in fds:
                    os.close(fd)
        for ready in [fd for fd in asked if fd in readies]:
            number, pidfd = readies.pop(ready)
            said = os.read(ready, 1)  # (nothing: its first process ended before it made the sandbox)
            os.close(ready)
            with contextlib.suppress(OSError):  # (the template gone: so is every sandbox)
                socket.send_fds(sock, [json.dumps({"tag": number}).encode()], [pidfd] if said else [])
            os.close(pidfd)
        if woken in asked:
            _drain(woken)
        _reap(reports, lambda code: json.dumps({"exit": code}).encode())


def _fork_first(
    request: dict[str, Any], preloaded: str, fds: list[int], reports: dict[int, int], pid_ns: int, host_root: int,
    seccomp: bytes, warm: contain.Warm,
) -> tuple[int, int] | None:  # fmt: skip
    """One sandbox's first process, forked as pid 1 of a pid namespace of its own; its report pipe kept. By the
    helper (`fds`: the request's, its exits pipe's read end after the report pipe): its ready pipe's read end and
    pidfd returned. By a template that preloads nothing (the request's alone): None, its first process forking its
    program itself, as it does when it could not be forked."""
    helped = warm.helper >= 0
    report = fds[3]
    ready, readied = os.pipe2(os.O_CLOEXEC) if helped else (-1, -1)
    pid = -1
    try:
        pid = _forked_into(lambda: kernel.unshare(kernel.CLONE_NEWPID), pid_ns)
    except OSError as exc:
        contain.say(report, {"error": f"the sandbox could not be made: {exc}"})
    if pid == 0:
        try:
            contain.close_all_but((*fds, readied, host_root))
            signal.set_wakeup_fd(-1)
            request["preloaded"] = preloaded
            first_fds = [*fds[:5], readied, *fds[5:]] if helped else [*fds[:4], -1, -1, *fds[4:]]
            contain.first(request, first_fds, host_root, seccomp, warm)
        finally:
            os._exit(125)
    for fd in (readied, *(fd for fd in fds if fd != report)):
        if fd >= 0:
            os.close(fd)
    if pid < 0:
        os.close(report)
        if ready >= 0:
            os.close(ready)
        return None
    reports[pid] = report
    return (ready, os.pidfd_open(pid)) if helped else None


def _reap(pipes: dict[int, int], said: Callable[[int], bytes]) -> None:
    """The children that ended, each one's end (`said` of its exit code) on its pipe, by its pid; a child with no
    pipe (the helper, once it has ended) reaped too."""
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        pipe = pipes.pop(pid, None)
        if pipe is not None:
            contain.say_line(pipe, said(contain.exit_code(status)))
            os.close(pipe)


def _forked_into(enter: Callable[[], None], own_pid_ns: int) -> int:
    """fork(2) with the child in the pid namespace `enter` makes or enters, and this process's next child in its
    own again (`own_pid_ns`); raises OSError."""
    pid = -1
    enter()
    try:
        pid = kernel.fork()
    finally:
        if pid != 0:
            kernel.setns(own_pid_ns, kernel.CLONE_NEWPID)
    return pid


def _drain(fd: int) -> None:
    try:
        while os.read(fd, 64):
            pass
    except BlockingIOError:
        pass
