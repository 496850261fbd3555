"""A warm template: forked from a template, it makes itself a sandbox of its own, executes the image's interpreter
there, imports what the policy preloads, then forks each of its sandboxes already warm (contain.first, its first
process the image's warm interpreter rather than an exec).

Nothing of the image runs as the host's root: the child enters a user namespace the host made for it (a range of
host ids of its own, as each sandbox of runc's path has), makes a mount namespace of its own (with a /tmp and /dev
of its own over the image's root, seen through a read-only view), and only then, chrooted there, executes the
image's `python3`. Its sandboxes are made in its user namespace: they share its host ids, each with every other
namespace of its own."""

from __future__ import annotations

import gc
import json
import os
import signal
import socket
import sys
from collections.abc import Mapping, Sequence
from typing import Any

from . import caps, contain, kernel

OWN_MOUNTS = (
    ("tmpfs", "tmpfs", "tmp", kernel.MS_NOSUID | kernel.MS_NODEV),
    (None, "/dev", "dev", kernel.MS_BIND | kernel.MS_REC),
)
"""Over the image's root, in the warm template's own mount namespace (its sandboxes see none of them: theirs are
made of the config): a /tmp to write the preload's caches to, and the host's devices."""


def enter(warm: Mapping[str, Any], host_root: int, fds: Sequence[int], given: bytes) -> None:
    """The template's child that becomes a warm template (never returns): in the user namespace the host made for
    it, with a mount namespace of its own, chrooted into the view of the image's root, it executes the image's
    interpreter, which loads these modules again from `given` and goes on in `ready`. `fds`: its socket and its
    report pipe, on which its pid, then what the preload said (or why it could not be made), are said."""
    control, report = fds
    try:
        os.fchdir(host_root)
        os.chroot(".")
        os.close(host_root)
        held = os.open(warm["userns"], os.O_RDONLY | os.O_CLOEXEC)
        kernel.setns(held, kernel.CLONE_NEWUSER)
        os.close(held)
        os.setresgid(0, 0, 0)
        os.setresuid(0, 0, 0)
        _own_pid_namespace(report)
        kernel.unshare(kernel.CLONE_NEWNS)
        kernel.mount(None, "/", None, kernel.MS_REC | kernel.MS_SLAVE)
        rootfs = warm["rootfs"]
        for kind, source, target, flags in OWN_MOUNTS:
            if os.path.isdir(os.path.join(rootfs, target)):
                kernel.mount(source, os.path.join(rootfs, target), kind, flags, "size=64m" if kind else None)
        own_root = os.open("/", os.O_PATH | os.O_DIRECTORY)
        os.chroot(rootfs)
        os.chdir("/")
        code = os.memfd_create("sandbox-template", 0)
        os.write(code, given)
        os.lseek(code, 0, os.SEEK_SET)
        for fd in (code, control, own_root, report):  # (what it executes keeps these four)
            os.set_inheritable(fd, True)
        loaded = json.loads(given)
        python, fds_said = loaded["python"], [str(fd) for fd in (code, control, own_root, report)]
        os.execve(python, [python, "-I", "-S", "-c", loaded["boot"], *fds_said, json.dumps(dict(warm))], {})
    except BaseException as exc:  # said on the report pipe, whatever it is
        contain.say(report, {"error": f"the warm template could not be made: {type(exc).__name__}: {exc}"})
    os._exit(125)


def _own_pid_namespace(report: int) -> None:
    """The warm template goes on as pid 1 of a pid namespace of its own, owned by its user namespace: there it may
    make one for each sandbox's first process and come back to its own after each fork (a process may only go
    back to a pid namespace whose user namespace it has the capabilities of). This process stays as its parent,
    having said its pid (the host's number for it), and ends with it."""
    kernel.unshare(kernel.CLONE_NEWPID)
    go, told = os.pipe()
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)  # (its template's: children reaped by the kernel)
    template = os.fork()
    if template == 0:
        os.close(told)
        os.read(go, 1)  # its pid said before anything else it may say
        os.close(go)
        return
    os.close(go)
    contain.say(report, {"pid": template})
    os.closerange(3, os.sysconf("SC_OPEN_MAX"))  # (nothing held but its child, which it waits for)
    _, status = os.waitpid(template, 0)
    os._exit(os.waitstatus_to_exitcode(status) & 0xFF)


def ready(report: int, warm: Mapping[str, Any]) -> tuple[int, contain.Warm]:
    """In the image's interpreter, executed by `enter`: its helper forked, the preload imported, said on `report`;
    its root's descriptor (the host's tree in its mount namespace), and what its sandboxes' processes become. In the
    helper (forked before the imports, so that each sandbox's first process it forks copies no library): the same,
    for the helper's own part."""
    host_root = int(sys.argv[3])
    try:
        caps.drop_bounding()  # its own, once: inherited by every process it forks, each of which checks it is empty
        module = _warm_interpreter(warm)
        helped = bool(warm.get("helper"))
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET) if helped else (None, None)
        if ours is not None and theirs is not None and os.fork() == 0:
            ours.close()
            os.close(report)
            return host_root, _becoming(module, theirs.detach(), helping=True, preloaded="")
        if theirs is not None:
            theirs.close()
        said = module.preload_template()
        _flush()
        gc.collect()  # what importing left behind, then every object it keeps out of the collector's sight: a
        gc.freeze()  # collection in a sandbox would otherwise write to each one's header, copying every page
        huge = _huge(host_root)  # the heap each call's fork copies: huge pages, where it is in use
        if ours is not None:
            ours.send(json.dumps({"preloaded": said}).encode())
    except BaseException as exc:  # said on the report pipe, whatever it is
        contain.say(report, {"error": f"the warm template could not preload: {type(exc).__name__}: {exc}"})
        os._exit(125)
    contain.say(report, {"ready": said, "huge_mib": huge})
    os.close(report)
    return host_root, _becoming(module, ours.detach() if ours is not None else -1, helping=False, preloaded=said)


def _huge(host_root: int) -> int:
    """The warm template's heap made huge pages where it is in use (kernel.collapse_heap): how many MiB."""
    try:
        maps = os.open("proc/self/maps", os.O_RDONLY | os.O_CLOEXEC, dir_fd=host_root)  # (the host's /proc)
    except OSError:
        return 0
    return kernel.collapse_heap(maps)


def _warm_interpreter(warm: Mapping[str, Any]) -> Any:
    """The image's warm interpreter module, imported as the image's own interpreter would find it (its site
    packages, its launchers' folder first), with the image's environment and the preload list."""
    import importlib
    import site

    os.environ.clear()
    os.environ.update(dict(entry.split("=", 1) for entry in warm["env"]))
    sys.dont_write_bytecode = True
    site.main()
    sys.path.insert(0, warm["launchers"])
    return importlib.import_module("warm_python")


def _becoming(module: Any, helper: int, helping: bool, preloaded: str) -> contain.Warm:
    """What a warm sandbox's processes become once their every step is taken: the image's warm interpreter's first
    process, which starts the launcher, and the process that becomes the program it hands over."""

    def become_first(process: Mapping[str, Any], env: dict[str, str], preloaded: str, ready: int, exits: int) -> None:
        args = list(process["args"])  # the launcher alone: no init before it (this process is the sandbox's)
        module.first_process(args[args.index("--") + 1 :] if "--" in args else args, env, preloaded, ready, exits)

    return contain.Warm(become_first, module.program_process, helper, helping, preloaded)


def _flush() -> None:
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
