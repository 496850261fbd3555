"""The sandboxes runc runs for servers of this host, by name: where runc keeps them, whose they are, and how one is
deleted (by its server, by the reaper of a server killed with SIGKILL, by the next server's sweep).

A sandbox's name carries its server's pid and start time (`sbx-<random>-<pid>-<start>`): a sandbox whose server is
gone is known without reading anything else. runc's state and the bundles live in a folder of their own, under
/run: gone with a reboot, as the sandboxes are.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from sandbox_server.errors import EngineError
from sandbox_server.sandbox.meter import memory_events
from sandbox_server.sandbox.polling import readable
from sandbox_server.sandbox.runc import host_ids
from sandbox_server.sandbox.template import cgroups, userns
from sandbox_server.sandbox.template.host import Forked
from sandbox_server.sandbox.template.launch import MARK as FORKED
from sandbox_server.sandbox.template.launch import remove_cgroups

__all__ = [
    "CGROUP_PARENT", "Run", "IMAGES", "PREFIX", "RUNSC_FLAGS", "STATE", "cgroup_paths", "delete", "delete_left_by", "hosts_folder",
    "folders_left", "owners_left", "proxies_folder", "is_gvisor", "is_runc", "listed", "oom_kills", "IN_CREATE", "IN_DELETE", "IN_MOVED_TO", "inotify_watch", "owner_of", "run_runc",
    "run_runsc", "runc_path", "runsc_path", "sandbox_name", "started_pid", "wait_for_pid_file",
]  # fmt: skip

STATE = Path(os.environ.get("SANDBOX_RUNC_STATE", "/run/sandbox-server/runc"))
"""runc's own state (`runc --root`) and each sandbox's bundle."""
IMAGES = Path(os.environ.get("SANDBOX_RUNC_IMAGES", "/var/lib/sandbox-server/images"))
"""Images' root filesystems, unpacked once by id and shared by every server of the host."""
PREFIX = "sbx-"
"""How every sandbox runc runs for us is named: sbx-<random>-<server pid>-<its start time> (its first 12
characters, as ids are shown short, are its own)."""
CGROUP_PARENT = "sandbox-server"
RUNC_WAIT_S = 10.0


def runc_path() -> str | None:
    """The runc binary of this host, if there is one."""
    return shutil.which("runc") or next((p for p in ("/usr/sbin/runc", "/usr/bin/runc") if os.access(p, os.X_OK)), None)


def _server(owner: str) -> str:
    """`<pid>-<start>` of an owner label (host:pid:start): how the names of what a server leaves here end."""
    _, pid, created = owner.split(":")
    return f"{pid}-{created}"


def _owner(server: str) -> str:
    """The owner label (this host's) of a server by its `<pid>-<start>`."""
    pid, _, created = server.partition("-")
    return f"{socket.gethostname()}:{pid}:{created}"


def owner_of(name: str) -> str:
    """The owner label of the server that made the sandbox `name` (this host's)."""
    return _owner((name.split("-", 2) + ["", ""])[2])


def sandbox_name(owner: str) -> str:
    """A new sandbox's name, for the server whose owner label is `owner`."""
    return f"{PREFIX}{secrets.token_hex(4)}-{_server(owner)}"


SERVER_FOLDERS = ("hosts", "proxies")
"""What each server keeps here in a folder of its own, removed with what it leaves when it is gone: its services'
hosts files (sandbox.hosts), and its egress proxies' files (a CA's private key, a Squid configuration holding the
secrets a policy adds), on this memory-backed, root-only state rather than under /tmp."""


def hosts_folder(state: Path, owner: str) -> Path:
    """The hosts files (sandbox.hosts) of the server whose owner label is `owner`."""
    return state / "hosts" / _server(owner)


def proxies_folder(state: Path, owner: str) -> Path:
    """The egress proxies' files of the server whose owner label is `owner`."""
    return state / "proxies" / _server(owner)


def folders_left(state: Path) -> list[tuple[str, Path]]:
    """Every server's folders here, each with its owner label."""
    found = []
    for kind in SERVER_FOLDERS:
        with contextlib.suppress(OSError):
            found += [(_owner(path.name), path) for path in (state / kind).iterdir()]
    return found


def is_runc(container_id: str) -> bool:
    """Whether a sandbox id names one that runc runs for us (the engine's ids are hexadecimal)."""
    return container_id.startswith(PREFIX)


def run_runc(state: Path, *args: str) -> subprocess.CompletedProcess[bytes]:
    return subprocess.run(
        [runc_path() or "runc", "--root", str(state / "runc"), *args],
        stdin=subprocess.DEVNULL,
        capture_output=True,
        timeout=RUNC_WAIT_S * 3,
        check=False,
    )


def runsc_path() -> str | None:
    """gVisor's runsc binary of this host, if there is one."""
    return shutil.which("runsc")


RUNSC_FLAGS = ("--network=none",)
"""runsc's own flags, as the engine's registration of it gives them: gVisor sandboxes have no network here."""


def run_runsc(state: Path, *args: str) -> subprocess.CompletedProcess[bytes]:
    return subprocess.run(
        [runsc_path() or "runsc", "--root", str(state / "runsc"), *RUNSC_FLAGS, *args],
        stdin=subprocess.DEVNULL,
        capture_output=True,
        timeout=RUNC_WAIT_S * 3,
        check=False,
    )


def is_gvisor(state: Path, name: str) -> bool:
    """Whether runsc (gVisor) runs the sandbox `name` (it keeps a state file per sandbox in its root)."""
    return (state / "runsc" / f"{name}_sandbox:{name}.state").exists()


def delete(state: Path, name: str, stopped: bool = False) -> None:
    """Kill and delete one sandbox and remove its bundle; never raises. A sandbox known `stopped` (its runc run
    ended) is deleted as runc deletes a stopped one, without starting runc: its cgroups removed, then its state;
    should any cgroup still hold a process, runc kills and deletes it. gVisor's are deleted by runsc."""
    bundle = state / "bundles" / name
    if is_gvisor(state, name):
        with contextlib.suppress(OSError, subprocess.SubprocessError):
            run_runsc(state, "delete", "--force", name)
    elif (bundle / FORKED).exists():  # forked from a template, not run by runc: its cgroups are the server's
        if not remove_cgroups(bundle):
            return
    elif not (stopped and _delete_stopped(state / "runc" / name)):
        with contextlib.suppress(OSError, subprocess.SubprocessError):
            run_runc(state, "delete", "--force", name)
    if not host_ids.detach_all(bundle):  # its views and its user namespace, then its range
        return  # never removed through a view still mounted: the next sweep tries again
    index = host_ids.range_of(bundle)
    if index is not None:
        host_ids.give_back(state, index, name)
    shutil.rmtree(bundle, ignore_errors=True)


def _delete_stopped(place: Path) -> bool:
    try:
        paths = cgroup_paths((place / "state.json").read_text()).values()
    except FileNotFoundError:
        return True  # runc never made it, or it is deleted already
    except (OSError, ValueError):
        return False
    for path in paths:
        try:
            os.rmdir(path)
        except FileNotFoundError:
            pass
        except OSError:  # a process is still there (EBUSY): runc's forced delete kills it
            return False
    shutil.rmtree(place, ignore_errors=True)
    return True


def cgroup_paths(state_json: str) -> dict[str, str]:
    """The `cgroup_paths` of runc's state file, decoded alone: the file is some 25 kB, nearly all of it the config
    (its seccomp filter's every syscall), and a burst's deletes decoded it whole at several times the cost. The
    member is found where its key stands as a key of the top-level object: in a string (a label, an annotation)
    the quotes around such a name would be escaped. ValueError when there is none."""
    key = state_json.find('"cgroup_paths":')
    if key < 0:
        raise ValueError("runc's state has no cgroup_paths")
    start = key + len('"cgroup_paths":')
    while state_json[start : start + 1] in (" ", "\t", "\n", "\r"):  # JSON's whitespace, which runc writes none of
        start += 1
    found, _ = json.JSONDecoder().raw_decode(state_json, start)
    if not isinstance(found, dict):
        raise ValueError("runc's cgroup_paths is not an object")
    return found


IN_MOVED_TO, IN_CREATE, IN_DELETE = 0x80, 0x100, 0x200
_libc = ctypes.CDLL(None, use_errno=True)


def inotify_watch(folder: Path, mask: int) -> int:
    """An inotify descriptor (close-on-exec, non-blocking) watching `folder` for the events of `mask`."""
    watch = int(_libc.inotify_init1(os.O_NONBLOCK | os.O_CLOEXEC))
    if watch < 0:
        raise OSError(ctypes.get_errno(), "inotify_init1")
    if _libc.inotify_add_watch(watch, os.fsencode(folder), mask) < 0:
        error = ctypes.get_errno()
        os.close(watch)
        raise OSError(error, f"inotify_add_watch {folder}")
    return watch


def wait_for_pid_file(pid_file: Path, process: subprocess.Popen[bytes], within_s: float) -> int | None:
    """The pid runc writes to `pid_file` once the sandbox has started (it renames it into place), awaited with
    inotify beside runc's own end (a pidfd); None when runc ends first or `within_s` passes."""
    watch = inotify_watch(pid_file.parent, IN_MOVED_TO)
    runc = os.pidfd_open(process.pid)
    try:
        deadline = time.monotonic() + within_s
        while True:
            with contextlib.suppress(OSError, ValueError):
                return int(pid_file.read_text())
            left = deadline - time.monotonic()
            if process.poll() is not None or left <= 0:
                return None
            if watch in readable([watch, runc], left):
                with contextlib.suppress(BlockingIOError):
                    os.read(watch, 4096)
    finally:
        os.close(runc)
        os.close(watch)


def started_pid(name: str, process: subprocess.Popen[bytes], bundle: Path, within_s: float) -> int:
    """The host pid of a sandbox's init once `process` (its runc run) has started it; EngineError, with the last
    line runc logged, when runc ends first or `within_s` passes."""
    pid = wait_for_pid_file(bundle / "pid", process, within_s)
    if pid is None:
        said = ""
        with contextlib.suppress(OSError, IndexError):
            said = (bundle / "runc.log").read_text(errors="replace").strip().splitlines()[-1][:400]
        raise EngineError(f"runc could not start sandbox {name}: {said or 'it said nothing'}")
    return pid


def listed(state: Path) -> set[str]:
    """Every sandbox runc knows of, or whose bundle is left, under `state`."""
    found: set[str] = set()
    for place in (state / "runc", state / "bundles"):
        with contextlib.suppress(OSError):
            found.update(name for name in os.listdir(place) if is_runc(name))
    with contextlib.suppress(OSError):  # runsc's: <sandbox>_sandbox:<container>.state, the two named alike
        found.update(
            entry.removesuffix(".state").partition("_sandbox:")[2]
            for entry in os.listdir(state / "runsc")
            if entry.endswith(".state") and is_runc(entry)
        )
    return found


def delete_left_by(owner: str, state: Path = STATE) -> int:
    """Delete the sandboxes a server (by its owner label) left, and its hosts files; returns how many sandboxes."""
    left = [name for name in listed(state) if owner_of(name) == owner]
    for name in left:
        delete(state, name)
    if _runtimes_ended(owner):  # (a `runsc create` at work as its server died saves its state after the bundle
        late = [name for name in listed(state) if owner_of(name) == owner]  # of its sandbox was removed)
        for name in late:
            delete(state, name)
        left = sorted({*left, *late})
    for name in _cgroups_left_by(owner):  # made for a sandbox it was killed before it wrote the bundle of
        cgroups.kill_and_remove(f"/{CGROUP_PARENT}/{name}")
    userns.remove_left(state, lambda name: owner_of(name) == owner)  # its warm templates' namespaces
    for index, name in host_ids.held_by(state).items():  # ranges taken for sandboxes it never made
        if owner_of(name) == owner:
            host_ids.give_back(state, index, name)
    for kind in SERVER_FOLDERS:  # the names of its services, its proxies' keys and configurations
        shutil.rmtree(state / kind / _server(owner), ignore_errors=True)
    return len(left)


def owners_left(state: Path = STATE) -> set[str]:
    """The owner labels of every server that left something here: a sandbox or its bundle, a cgroup, a warm
    template's namespace, a range of host ids."""
    names = {*listed(state), *host_ids.held_by(state).values(), *_cgroup_names()}
    with contextlib.suppress(OSError):
        names.update(os.listdir(state / userns.FOLDER))
    return {owner_of(name) for name in names if is_runc(name)}


def _runtimes_ended(owner: str) -> bool:
    """The runc and runsc commands a server (by its owner label) left at work on its sandboxes ended (a `runsc
    create` of a sandbox its pool was making, in a session of its own, outlives the server): waited for, then
    killed; whether there was any."""
    import psutil

    def working(process: psutil.Process) -> bool:
        with contextlib.suppress(psutil.Error):
            return any(is_runc(arg) and owner_of(arg) == owner for arg in process.cmdline())
        return False

    found = [process for process in psutil.process_iter() if working(process)]
    for process in psutil.wait_procs(found, timeout=RUNC_WAIT_S)[1]:
        with contextlib.suppress(psutil.Error):
            process.kill()
    psutil.wait_procs(found, timeout=RUNC_WAIT_S)
    return bool(found)


def _cgroups_left_by(owner: str) -> list[str]:
    """The sandboxes' cgroups a server (by its owner label) left, bundle or no bundle."""
    return [name for name in _cgroup_names() if is_runc(name) and owner_of(name) == owner]


def _cgroup_names() -> list[str]:
    """Every cgroup made for a sandbox here (cgroup v1's memory hierarchy names them all: each sandbox has one in
    every hierarchy)."""
    try:
        return os.listdir(cgroups.ROOT / "memory" / CGROUP_PARENT)
    except OSError:
        return []


def oom_kills(name: str) -> int:
    """How many processes the kernel killed for memory in a sandbox's cgroup (0 when it cannot be read)."""
    for folder in (Path("/sys/fs/cgroup/memory") / CGROUP_PARENT / name, Path("/sys/fs/cgroup") / CGROUP_PARENT / name):
        if folder.is_dir():  # v1's memory controller, else v2's one hierarchy
            return memory_events(folder)[1]
    return 0


@dataclass
class Run:
    """One sandbox's `runc run` (or gVisor's `runsc wait`), and a pidfd of the sandbox's init (gVisor's sandbox
    process), to kill it, never a later process."""

    process: subprocess.Popen[bytes] | Forked
    gvisor: bool = False
    init: int = -1

    def kill_init(self) -> None:
        """SIGKILL the sandbox's init, its pid namespace ending with it; never raises."""
        if self.init >= 0:
            with contextlib.suppress(OSError):
                signal.pidfd_send_signal(self.init, signal.SIGKILL)

    def kill(self) -> None:
        """Kill the sandbox's init, then wait for runc; never raises."""
        self.kill_init()
        if self.gvisor:  # its word, a second after, is not needed: runsc's delete follows
            self.process.kill()
        try:
            self.process.wait(timeout=RUNC_WAIT_S)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        self.close()

    def close(self) -> None:
        if isinstance(self.process, Forked):
            self.process.close()
        if self.init >= 0:
            with contextlib.suppress(OSError):
                os.close(self.init)
            self.init = -1
