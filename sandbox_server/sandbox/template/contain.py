"""A child of the template made into a call's sandbox: one ordered list of steps, each a function of its own
module (nsjail's containProc is the model), then the config's program.

The template forks a child for each sandbox. The child joins the call's cgroup, goes back to the host's tree
(the template's own root is the image's, where its interpreter lives), makes its namespaces, and forks the
sandbox's first process: pid 1 of the new pid namespace, which takes the steps below and becomes the program.
The child stays to wait for it and to tell the host its pid and how it ended, on the report pipe.

A warm template's sandboxes are made by two processes, so that a call copies the template's heap once. Its helper,
forked before the preload's imports, forks each sandbox's first process (`first`) into a pid namespace made for
it: pid 1 there, small, it takes the sandbox's steps and its process's, says its pid and starts the launcher. The
warm template itself then forks the process that becomes the call's program (`program`) into that pid namespace:
it enters the first process's other namespaces and cgroups and takes the process's steps alone. (A warm template
that preloads nothing forks the first processes itself, and each forks its program.)"""

from __future__ import annotations

import contextlib
import json
import os
import signal
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, NamedTuple

from . import caps, cgroup, kernel, limits, mnt, net


class Warm(NamedTuple):
    """What a warm template's sandboxes become, and the socket between the template and its helper."""

    first: Callable[[Mapping[str, Any], dict[str, str], str, int, int], None]
    """What a first process becomes (its process, environment, the preload's words, its ready and exits pipes)."""
    program: Callable[[int], None]
    """What the process forked to become the program becomes (its end of the exits pipe)."""
    helper: int
    """The socket between the warm template and its helper (each process's own end); -1 for a template that
    preloads nothing, which forks its sandboxes' first processes itself, each forking its program."""
    helping: bool
    """Whether this process is the helper."""
    preloaded: str
    """What the preload said (the helper is told it once the template has imported it)."""


NAMESPACES = (
    kernel.CLONE_NEWNS | kernel.CLONE_NEWUTS | kernel.CLONE_NEWIPC | kernel.CLONE_NEWNET | kernel.CLONE_NEWCGROUP
    | kernel.CLONE_NEWPID
)  # fmt: skip
"""Everything a sandbox has of its own but its user namespace: that one the host made ahead and maps onto a range of
host ids of the sandbox's own (sandbox.host_ids), entered first (else the host's, its ids the sandbox user's)."""


def steps(config: Mapping[str, Any], new_root: str, seccomp: bytes) -> list[tuple[str, Callable[[], None]]]:
    """What the sandbox's first process does, in order, before it becomes the program."""
    return [
        ("its filesystem", lambda: mnt.root(config, new_root)),
        ("its /proc", lambda: mnt.proc(config, new_root)),
        ("its root", lambda: mnt.pivot(new_root, bool(config["root"].get("readonly")))),
        ("its host name", lambda: kernel.sethostname(config.get("hostname", "sandbox"))),
        ("its loopback", net.loopback_up),
        *process_steps(config, seccomp),
        ("its request's folders", mnt.request_folders),
    ]


def process_steps(config: Mapping[str, Any], seccomp: bytes) -> list[tuple[str, Callable[[], None]]]:
    """What each process the template forks into the sandbox does, in order, once it is in the sandbox's namespaces
    and cgroups: the first process, and a warm template's program."""
    process = config["process"]
    return [
        ("its limits", lambda: limits.rlimits(process.get("rlimits", []))),
        ("no capabilities", caps.drop_bounding),
        ("its user", lambda: caps.become(process["user"])),
        ("no new privileges", caps.no_new_privileges),
        ("its working folder", lambda: os.chdir(process.get("cwd", "/"))),
        ("its system calls", lambda: kernel.load_seccomp(seccomp) if seccomp else None),
    ]


def child(request: Mapping[str, Any], fds: Sequence[int], host_root: int, seccomp: bytes) -> None:
    """The template's child for one sandbox (never returns). `fds`: the sandbox's stdin, stdout and stderr, the
    report pipe, then `cgroup.procs` of each of the call's cgroups. Its first process executes the config's program
    once every step is taken (a warm template's first processes become its warm interpreter: `first`)."""
    stdin, stdout, stderr, report, *procs = fds
    config, new_root = request["config"], request["root"]
    _default_signals()
    try:
        cgroup.join(procs)
        _to_host_root(host_root)
        if request.get("userns"):  # the sandbox's own ids: its namespaces are made inside its user namespace
            held = os.open(request["userns"], os.O_RDONLY | os.O_CLOEXEC)
            kernel.setns(held, kernel.CLONE_NEWUSER)
            os.close(held)
            os.setresgid(0, 0, 0)  # its root (the host's is not mapped there: what it makes must be owned)
            os.setresuid(0, 0, 0)
        kernel.unshare(NAMESPACES)
        _stdio(stdin, stdout, stderr)
        ready, readied = os.pipe2(os.O_CLOEXEC)
        first = kernel.fork()
    except BaseException as exc:  # said on the report pipe, whatever it is
        say(report, {"error": f"the sandbox could not be made: {exc}"})
        os._exit(125)
    if first == 0:
        os.close(ready)
        _first(config, new_root, seccomp, report, lambda: os.write(readied, b"1"))
    os.close(readied)
    os.read(ready, 1)  # its every step taken (or it failed one, and said so): the host may look at it now
    os.close(ready)
    say(report, {"pid": first})
    _, status = os.waitpid(first, 0)
    say(report, {"exit": exit_code(status)})
    os._exit(0)


def first(request: Mapping[str, Any], fds: Sequence[int], host_root: int, seccomp: bytes, becoming: Warm) -> None:
    """A warm template's sandbox (never returns): its first process, forked by the template's helper into a pid
    namespace made for it, as pid 1 there. It takes the steps the child takes for the others, then its own, and says
    its pid (the host's number for it, which /proc of the host's tree says) on the report pipe; the helper says its
    end. `fds`: the child's, with the read end of the exits pipe (its program's pid and end, said by the process and
    the template) and the write end of its ready pipe (its program may be forked now) after the report pipe."""
    stdin, stdout, stderr, report, exits, ready, *procs = fds
    _default_signals()
    try:
        cgroup.join(procs)
        _to_host_root(host_root)
        pid = int(os.readlink("/proc/self"))  # (the host's /proc, not yet its own: the host's number for it)
        kernel.unshare(NAMESPACES & ~kernel.CLONE_NEWPID)  # (its pid namespace the helper made: it is its pid 1)
        _stdio(stdin, stdout, stderr)
        for fd in (exits, ready):
            if fd >= 0:  # (-1: a template that preloads nothing, whose first processes fork their programs)
                os.set_inheritable(fd, False)
    except BaseException as exc:  # said on the report pipe, whatever it is
        say(report, {"error": f"the sandbox could not be made: {exc}"})
        os._exit(125)
    preloaded = str(request.get("preloaded", ""))
    _first(request["config"], request["root"], seccomp, report, lambda: say(report, {"pid": pid}),
           lambda process, env: becoming.first(process, env, preloaded, ready, exits))  # fmt: skip


def program(config: Mapping[str, Any], fds: Sequence[int], exits: int, sandbox: int, seccomp: bytes, becoming: Warm) -> None:  # fmt: skip
    """A warm template's program (never returns): forked by the template into the pid namespace of the sandbox's
    first process (`sandbox`: its pidfd), it joins the call's cgroups and the first process's other namespaces,
    takes the process's steps, and becomes what waits for the call's program. `fds`: its stdin, stdout, stderr,
    then `cgroup.procs` of each cgroup. What it cannot do is said on its stderr (the call's); its end on `exits`."""
    stdin, stdout, stderr, *procs = fds
    _default_signals()
    step = "its start"
    try:
        _stdio(stdin, stdout, stderr)
        step = "its cgroups"
        cgroup.join(procs)
        step = "its namespaces"
        kernel.setns(sandbox, NAMESPACES & ~kernel.CLONE_NEWPID)  # (its root the first process's, pivoted into)
        os.close(sandbox)
        for named, take in process_steps(config, seccomp):
            step = named
            take()
    except BaseException as exc:
        with contextlib.suppress(OSError):
            os.write(2, f"sandbox: the program's process could not be made ({step}): {exc}\n".encode())
        os._exit(125)
    becoming.program(exits)


def close_all_but(kept: Iterable[int]) -> None:
    """Every descriptor above stderr closed but `kept`: what a process forked by a template must not have of it."""
    low = 3
    for fd in sorted(fd for fd in set(kept) if fd >= 3):
        os.closerange(low, fd)
        low = fd + 1
    os.closerange(low, os.sysconf("SC_OPEN_MAX"))


def _default_signals() -> None:
    for ignored in (signal.SIGCHLD, signal.SIGPIPE, signal.SIGXFSZ):  # the interpreter's, not the program's
        signal.signal(ignored, signal.SIG_DFL)


def _to_host_root(host_root: int) -> None:
    """Back to the host's tree, where its root is built (the template's own root is the image's)."""
    os.fchdir(host_root)
    os.chroot(".")
    os.close(host_root)


def _stdio(stdin: int, stdout: int, stderr: int) -> None:
    for fd, std in ((stdin, 0), (stdout, 1), (stderr, 2)):
        os.dup2(fd, std)
        os.close(fd)


def _first(
    config: Mapping[str, Any], new_root: str, seccomp: bytes, report: int, ready: Callable[[], object],
    becoming: Callable[[Mapping[str, Any], dict[str, str]], None] | None = None,
) -> None:  # fmt: skip
    """`ready`: told once every step is taken (the child that waits to say the pid is written to; a first process a
    warm template forked says its pid itself). `becoming`: what it becomes then (None: it executes the program)."""
    step = "its start"
    try:
        os.set_inheritable(report, False)  # (handed over by the socket, inheritable: the program must not have it)
        for named, take in steps(config, new_root, seccomp):
            step = named
            take()
        process = config["process"]
        env = dict(entry.split("=", 1) for entry in process.get("env", []))
        ready()
        if becoming is not None:  # (no descriptor of the template's reaches what it starts or forks)
            os.close(report)
            becoming(process, env)
        os.execve(process["args"][0], process["args"], env)
    except BaseException as exc:
        say(report, {"error": f"the sandbox could not be made ({step}): {exc}"})
    os._exit(127)


def exit_code(status: int) -> int:
    """How a process ended, as the host is told it: its exit code, or 128 + the signal that ended it."""
    code = os.waitstatus_to_exitcode(status)
    return code if code >= 0 else 128 - code


def say(report: int, what: Mapping[str, Any]) -> None:
    """A line on the report pipe (nothing when its reader is gone)."""
    say_line(report, json.dumps(what).encode())


def say_line(pipe: int, line: bytes) -> None:
    """A line on a pipe (nothing when its reader is gone)."""
    try:
        os.write(pipe, line + b"\n")
    except OSError:
        pass
