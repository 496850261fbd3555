"""The host's side of template sandboxes: a template process per image root and seccomp filter, started once
and kept while the server runs; a sandbox asked of it per call, and how that sandbox ends.

A template is the image's own `python3`, chrooted into the image's unpacked root, running this package's
child-side modules (kernel, mnt, net, caps, limits, cgroup, contain, template), which are handed to it as text:
nothing of the server is installed in an image. It keeps a descriptor of the host's root, so that its children
can build each sandbox's root from the host's tree before they pivot into it and detach the rest."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from sandbox_server.errors import EngineError, ServerStopping
from sandbox_server.sandbox.polling import readable
from sandbox_server.sandbox.template import bpf, cgroups

__all__ = ["Asked", "Forked", "Templates", "WarmTemplate", "template_refusal"]

CHILD_MODULES = ("kernel", "mnt", "net", "caps", "limits", "cgroup", "contain", "warm", "template")
"""The modules a template runs, in the order they are loaded (each imports only those before it)."""
BOOT = """
import json, os, sys, types
blob = b""
code, control, host_root = (int(fd) for fd in sys.argv[1:4])
while chunk := os.read(code, 1 << 20):
    blob += chunk
os.close(code)
given = json.loads(blob)
package = types.ModuleType("sandbox_template")
package.__path__ = []
sys.modules["sandbox_template"] = package
for name in given["order"]:
    module = types.ModuleType("sandbox_template." + name)
    module.__package__ = "sandbox_template"
    sys.modules[module.__name__] = module
    setattr(package, name, module)
    exec(compile(given["modules"][name], "/sandbox-template/" + name + ".py", "exec"), module.__dict__)
becoming = None
if len(sys.argv) > 4:  # a warm template: the image's own interpreter, in the sandbox of its own it made
    host_root, becoming = package.warm.ready(int(sys.argv[4]), json.loads(sys.argv[5]))
package.template.serve(control, host_root, bytes.fromhex(given["seccomp"]), becoming, blob)
"""
"""What a template's interpreter runs: the child's modules, read from a descriptor, loaded as a package."""
PYTHON = "/usr/bin/python3"
"""The image's interpreter, which a warm template executes once it is in a sandbox of its own."""
FORKS_PER_TEMPLATE = int(os.environ.get("SANDBOX_TEMPLATE_FORKS", "5000"))
TEMPLATE_LIFE_S = 3600.0
"""A template is made again after this many sandboxes (`SANDBOX_TEMPLATE_FORKS`: how many share one address-space
layout), or this long: whatever its interpreter may have gathered (memory it grew to, a state its loop kept) lasts
a bounded time; its sandboxes never ran in it."""
WARM_WITHIN_S = 60.0
"""The longest a warm template may take to import its preload list."""
WARM_RETRY_S = 30.0
"""How long after a warm template could not be made it is tried again."""
HERE = Path(__file__).parent
T = TypeVar("T", bound="Asked")

log = logging.getLogger("sandbox_server")


def _filter(seccomp: dict[str, Any] | None) -> bytes:
    """The OCI seccomp profile as the kernel's filter (empty: none)."""
    return bpf.compiled(json.dumps(seccomp, sort_keys=True)) if seccomp else b""


def _moves_favored() -> bool:
    """Whether a move into a cgroup waits for no grace period here (cgroups.FAVOR_MOVES; True where it cannot be
    told)."""
    try:
        found = cgroups.moves_here()
    except OSError:
        return True
    return found is None or found[1]


def template_refusal(rootfs: Path) -> str | None:
    """Why a template cannot be made of this image root (None: it can)."""
    if not rootfs.is_dir():
        return "its root is not unpacked"
    return cgroups.usable()


class Asked:
    """A template's socket, on which each request is one message with its descriptors, and its count of them."""

    def __init__(self, ours: socket.socket) -> None:
        self.socket = ours
        self.lock = threading.Lock()
        self.forks, self.born = 0, time.monotonic()

    def spent(self) -> bool:
        """Whether it has made its share of sandboxes, or lived its time (FORKS_PER_TEMPLATE, TEMPLATE_LIFE_S)."""
        return self.forks >= FORKS_PER_TEMPLATE or time.monotonic() - self.born > TEMPLATE_LIFE_S

    def fork(self, request: dict[str, Any], fds: list[int]) -> None:
        """Ask for a sandbox: the request and its descriptors in one message."""
        with self.lock:
            socket.send_fds(self.socket, [json.dumps(request).encode()], fds)
            self.forks += 1

    def retire(self) -> None:
        """No more requests: it forks those already sent, then ends (its sandboxes live on)."""
        with contextlib.suppress(OSError):
            self.socket.close()

    def alive(self) -> bool:
        raise NotImplementedError

    def close(self) -> None:
        raise NotImplementedError


class Template(Asked):
    """One template process and its end of the socket it is asked on."""

    def __init__(self, seccomp: bytes) -> None:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        code_read, code_write = os.pipe()
        host_root = os.open("/", os.O_PATH | os.O_DIRECTORY)
        modules = {name: (HERE / f"{name}.py").read_text() for name in CHILD_MODULES}
        given = {"order": CHILD_MODULES, "modules": modules, "seccomp": seccomp.hex(), "boot": BOOT, "python": PYTHON}
        try:
            fds = (code_read, theirs.fileno(), host_root)
            # The server's own interpreter, isolated, its standard library alone: nothing of the image runs here.
            command = [sys.executable, "-I", "-S", "-c", BOOT, *(str(fd) for fd in fds)]
            self.process = subprocess.Popen(
                command, pass_fds=fds, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, start_new_session=True
            )  # (nothing of it reaches the server's stdout, which may be its MCP channel)
        finally:
            os.close(code_read)
            theirs.close()
            os.close(host_root)
        with os.fdopen(code_write, "wb") as code:
            code.write(json.dumps(given).encode())
        super().__init__(ours)

    def alive(self) -> bool:
        return self.process.poll() is None

    def close(self) -> None:
        self.retire()
        with contextlib.suppress(OSError):
            self.process.kill()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.process.wait(timeout=5)


class WarmTemplate(Asked):
    """A warm template (the child side's `warm`): forked by its image's template into a user namespace the host
    made for it, it has imported the policy's preload list, and forks each of its sandboxes already warm."""

    def __init__(
        self, root: Template, warm: dict[str, Any], within_s: float, preloading: Callable[[WarmTemplate], None]
    ) -> None:
        """`preloading`: told of it once it runs and imports (closing it then ends the wait for its preload)."""
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        report, told = os.pipe()
        try:
            root.fork({"warm": warm}, [theirs.fileno(), told])
        except OSError:
            ours.close()
            os.close(report)
            raise
        finally:
            theirs.close()
            os.close(told)
        super().__init__(ours)
        self.pid, self.pidfd = -1, -1
        self.huge_mib = 0
        """How much of its heap is in huge pages (kernel.collapse_heap), in MiB."""
        try:
            said = Forked(report, "warm template")
            self.pid = said.started(within_s)
            self.pidfd = os.pidfd_open(self.pid)
            preloading(self)
            ready = said.line(within_s)
            if ready is None or "ready" not in ready:
                raise EngineError(f"the warm template did not preload: {(ready or {}).get('error', 'no answer')}")
            self.huge_mib = int(ready.get("huge_mib", 0))
        except BaseException:
            self.close()
            raise
        finally:
            said.close()

    def alive(self) -> bool:
        return self.pidfd >= 0 and not readable([self.pidfd], 0)

    def close(self) -> None:
        self.retire()
        if self.pidfd >= 0:
            with contextlib.suppress(OSError):
                signal.pidfd_send_signal(self.pidfd, signal.SIGKILL)
            os.close(self.pidfd)
            self.pidfd = -1


class Templates:
    """The server's templates, one per seccomp filter, and its warm templates, one per image, filter and preload
    list; each made at its first sandbox."""

    def __init__(self) -> None:
        self._made: dict[bytes, Template] = {}
        self._warm: dict[tuple[str, bytes, str], WarmTemplate] = {}
        self._refused: dict[str, str | None] = {}
        self._lock = threading.Lock()
        self._closed = False
        self._making: set[tuple[str, bytes, str]] = set()
        self._retry_at: dict[tuple[str, bytes, str], float] = {}
        self._preloads: set[WarmTemplate] = set()
        """The warm templates importing their preload list now."""

    def serves(self, rootfs: Path) -> bool:
        """Whether the image of this root can have a template (said once per image, in the log, when not)."""
        with self._lock:
            if str(rootfs) not in self._refused:
                self._refused[str(rootfs)] = why_not = template_refusal(rootfs)
                if why_not is not None:
                    log.info("sandboxes of %s are started by runc, not forked from a template: %s", rootfs.parent.name,
                             why_not)  # fmt: skip
                elif len(self._refused) == 1 and not _moves_favored():
                    log.info("each sandbox made while its call waits also waits 6 to 15 ms for the kernel as it "
                             "joins its cgroups: `sandbox-server setup` mounts cgroup2 %s", cgroups.FAVOR_MOVES)  # fmt: skip
            return self._refused[str(rootfs)] is None

    def of(self, rootfs: Path, seccomp: dict[str, Any] | None) -> Template:
        """The template that forks the sandboxes of this image with this seccomp filter (one per filter: it runs
        nothing of any image, so the image's sandboxes share it with every other's)."""
        program = _filter(seccomp)
        with self._lock:
            if self._closed:
                raise ServerStopping("the server is stopping")
            return self._current(self._made, program, lambda: Template(program))

    def warm(self, rootfs: Path, seccomp: dict[str, Any] | None, warm: dict[str, Any]) -> WarmTemplate | None:
        """The warm template of this image, seccomp filter and `warm` request (its user namespace, environment and
        preload list); None while it is made, in a thread of its own from its first sandbox on (its preload takes
        seconds: a sandbox asked for meanwhile is forked cold, its program importing what it uses itself)."""
        program = _filter(seccomp)
        key = (str(rootfs), program, json.dumps(warm, sort_keys=True))
        with self._lock:
            if self._closed:
                raise ServerStopping("the server is stopping")
            found = self._warm.get(key)
            if found is not None and found.alive() and not found.spent():
                return found
            if key not in self._making and time.monotonic() >= self._retry_at.get(key, 0.0):
                self._making.add(key)
                made = threading.Thread(target=self._make_warm, args=(key, rootfs, seccomp, warm), daemon=True)
                made.start()
            return found if found is not None and found.alive() else None  # (a spent one serves until replaced)

    def _make_warm(self, key: tuple[str, bytes, str], rootfs: Path, seccomp: dict[str, Any] | None, warm: dict[str, Any]) -> None:  # fmt: skip
        made = None
        try:
            made = WarmTemplate(self.of(rootfs, seccomp), warm, WARM_WITHIN_S, self._preloading)
        except EngineError as exc:
            if not self._closed:  # (ended by the server's stop: nothing to say)
                log.warning("the warm template of %s could not be made (its sandboxes' programs import their libraries "
                            "themselves; tried again in %g s): %s", rootfs.parent.name, WARM_RETRY_S, exc)  # fmt: skip
                self._retry_at[key] = time.monotonic() + WARM_RETRY_S
        finally:
            with self._lock:
                self._making.discard(key)
                if made is not None:
                    self._preloads.discard(made)
                    if self._closed:
                        made.close()
                    else:
                        self._current(self._warm, key, lambda: made)
                        log.info("warm template of %s ready: its sandboxes start with its imports from now on "
                                 "(%d MiB of its heap in huge pages)", rootfs.parent.name, made.huge_mib)  # fmt: skip

    def _preloading(self, made: WarmTemplate) -> None:
        with self._lock:
            self._preloads.add(made)
            if self._closed:
                made.close()

    @staticmethod
    def _current(made: dict[Any, T], key: Any, make: Callable[[], T]) -> T:
        """The living, unspent template of `key`, made (again) when there is none; a spent one retires."""
        found = made.get(key)
        if found is None or not found.alive() or found.spent():
            if found is not None and found.alive():
                found.retire()
            elif found is not None:  # a dead one's requests were answered by their report pipes' end
                found.close()
            found = made[key] = make()
        return found

    def close(self) -> None:
        """Every template ended, those still importing their preload list too (nothing waits for them)."""
        with self._lock:
            self._closed = True
            for made in (*self._warm.values(), *self._made.values(), *self._preloads):
                made.close()
            self._made.clear()
            self._warm.clear()


class Forked:
    """A template sandbox's first process as the host knows it (what runc's `run` process is on runc's path):
    its pid, then its exit status, said by the template's child on the report pipe."""

    def __init__(self, report: int, cgroup_path: str) -> None:
        self.report = report
        self.cgroup_path = cgroup_path
        self.returncode: int | None = None
        self.pid = -1
        self._said = b""
        self.superseded: Callable[[], bool] = lambda: False
        """Whether a sandbox made now would serve better (one forked cold while its warm template was made)."""
        self.ends_with_first = False
        """Whether the host learns the sandbox's end from its first process's (its pidfd readable), rather than by
        looking at its processes: every process of a warm template's sandbox has ended once its first process has,
        which ends as soon as the launcher stops or ends (pid 1 of the sandbox's pid namespace, not the launcher:
        the kernel kills every other process of the namespace and waits for their ends before it says pid 1's)."""

    def _read(self, timeout: float | None) -> dict[str, Any] | None:
        while b"\n" not in self._said:
            if timeout is not None and not readable([self.report], timeout):
                return None
            chunk = os.read(self.report, 4096)
            if not chunk:
                return {"exit": 255} if self.pid >= 0 else {"error": "the template's child ended without a word"}
            self._said += chunk
        line, self._said = self._said.split(b"\n", 1)
        said: dict[str, Any] = json.loads(line)
        if "error" in said and self.pid >= 0:  # its first process failed a step: said, then its end is read
            log.warning("sandbox %s: %s", self.cgroup_path.rsplit("/", 1)[-1], said["error"])
            return self._read(timeout)
        return said

    def line(self, within_s: float) -> dict[str, Any] | None:
        """The next line said, as it is (None: nothing within `within_s`)."""
        return self._read(within_s)

    def started(self, within_s: float) -> int:
        said = self._read(within_s)
        if said is None:
            raise EngineError(f"the template made no sandbox within {within_s:g} s")
        if "error" in said:
            raise EngineError(str(said["error"]))
        if "pid" not in said:  # (a warm template's sandbox killed before its first process said its pid)
            raise EngineError(f"the sandbox ended before it started (exit {said.get('exit')})")
        self.pid = int(said["pid"])
        return self.pid

    def poll(self) -> int | None:
        if self.returncode is None:
            said = self._read(0)
            if said is not None:
                self.returncode = int(said.get("exit", 255))
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.returncode is None:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            said = self._read(left)
            if said is None:
                raise subprocess.TimeoutExpired("sandbox", timeout or 0)
            self.returncode = int(said.get("exit", 255))
        return self.returncode

    def kill(self) -> None:
        if self.pid > 0 and self.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signal.SIGKILL)

    def close(self) -> None:
        with contextlib.suppress(OSError):
            os.close(self.report)
