"""The only module that talks to Docker: a SandboxSpec becomes a hardened, single-use
container; images are looked up, pulled, imported and built here too.

Every docker-py and transport exception is converted in `_engine_errors`, most
specific first: an engine that does not answer becomes EngineUnavailable, any
other refusal EngineError.
"""

from __future__ import annotations

import contextlib
import os
import re
import secrets
import select
import socket
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import anyio
import anyio.to_thread
import docker
import docker.errors
import psutil
import requests.exceptions

from sandbox_server.errors import EngineError, EngineUnavailable, ImageError
from sandbox_server.sandbox.archive import build_request, read_outputs
from sandbox_server.sandbox.runtime import ProgressCallback
from sandbox_server.sandbox.spec import SANDBOX_LABEL, ExecutionResult, SandboxSpec
from sandbox_server.sandbox.streams import STDERR, CappedBuffer, FrameDemuxer, StdoutSplitter

__all__ = ["DockerRuntime", "EngineInfo", "ImageRecord", "WarmContainer", "host_config_kwargs"]

OWNER_LABEL = "org.sandbox-server.owner"
FLOOD_FACTOR = 16
FLOOD_MIN_BYTES = 64 * 1024 * 1024
"""A program that writes more than FLOOD_FACTOR times its output cap (and at least
FLOOD_MIN_BYTES) is killed as a flood: draining it longer only burns the host's CPU."""
RUNSC_PIDS_FACTOR, RUNSC_PIDS_BASE = 8, 256
"""Under gVisor the sandbox kernel's own host threads (several per guest task on the ptrace
platform) count against the pids cgroup, so the cgroup limit is pids * 8 + 256 there."""
LAUNCHER = "/usr/local/bin/sandbox-launch"
ENGINE_CONNECTIONS = 64
"""HTTP connections kept to the engine: concurrent calls, pool refills and removals each hold one."""
ENGINE_HINT = "start it with `scripts/engine-up` (as root), or `dockerd &`, or point DOCKER_HOST at a running engine"


_UNREACHABLE = (requests.exceptions.ConnectionError, ConnectionError, FileNotFoundError)


def _unreachable(exc: BaseException) -> bool:
    """True when an exception, or one it was raised from, says nothing answered."""
    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, _UNREACHABLE):
            return True
        seen = seen.__cause__ or seen.__context__
    return False


@contextlib.contextmanager
def _engine_errors(action: str) -> Iterator[None]:
    try:
        yield
    except (docker.errors.DockerException, requests.exceptions.RequestException, OSError) as exc:
        if _unreachable(exc):
            raise EngineUnavailable(
                f"sandbox engine unavailable: no Docker engine answers at {engine_address()} "
                f"(while trying to {action}); {ENGINE_HINT}"
            ) from exc
        if isinstance(exc, docker.errors.DockerException):
            raise EngineError(f"sandbox engine refused to {action}: {exc}") from exc
        raise EngineUnavailable(f"sandbox engine unavailable while trying to {action}: {exc}") from exc


@dataclass(frozen=True, slots=True)
class EngineInfo:
    """What the engine says about itself."""

    server_version: str
    api_version: str
    runtimes: tuple[str, ...]
    default_runtime: str
    cgroup_version: str
    security_options: tuple[str, ...]
    operating_system: str


@dataclass(frozen=True, slots=True)
class ImageRecord:
    """A local image and its labels."""

    reference: str
    image_id: str
    labels: dict[str, str]
    size_bytes: int
    created: str


def _owner() -> str:
    me = psutil.Process()
    return f"{socket.gethostname()}:{me.pid}:{int(me.create_time())}"


def _owner_alive(owner: str) -> bool:
    host, _, rest = owner.partition(":")
    pid_text, _, created_text = rest.partition(":")
    if host != socket.gethostname():
        return True  # another host's server: not ours to judge
    try:
        process = psutil.Process(int(pid_text))
        return int(process.create_time()) == int(created_text)
    except (ValueError, psutil.Error):
        return False


def host_config_kwargs(spec: SandboxSpec) -> dict[str, Any]:
    """The engine's HostConfig for a spec: the hardened defaults of DESIGN.md."""
    limits = spec.limits
    uid, _, gid = spec.user.partition(":")
    security_opt = ["no-new-privileges"]
    if spec.seccomp_profile is not None:
        security_opt.append(f"seccomp={spec.seccomp_profile}")
    return {
        "read_only": True,
        "cap_drop": ["ALL"],
        "security_opt": security_opt,
        "tmpfs": {
            "/tmp": f"size={limits.tmp_mb}m,nr_inodes={max(1024, limits.tmp_mb * 256)},mode=1777,noexec,nosuid,nodev",
            spec.workdir: (
                f"size={limits.workspace_mb}m,nr_inodes={max(1024, limits.workspace_mb * 256)},"
                f"uid={uid},gid={gid or uid},mode=0755,nosuid,nodev"
            ),
        },
        "pids_limit": limits.pids if spec.runtime != "runsc" else limits.pids * RUNSC_PIDS_FACTOR + RUNSC_PIDS_BASE,
        "mem_limit": limits.memory_mb * 1024 * 1024,
        "memswap_limit": limits.memory_mb * 1024 * 1024,
        "nano_cpus": int(limits.cpus * 1e9),
        "ulimits": [
            {"name": "nofile", "soft": limits.nofile, "hard": limits.nofile},
            {"name": "fsize", "soft": limits.file_size_mb * 1024 * 1024, "hard": limits.file_size_mb * 1024 * 1024},
            {"name": "core", "soft": 0, "hard": 0},
        ],
        "network_mode": spec.network,
        "ipc_mode": "private",
        "shm_size": limits.shm_mb * 1024 * 1024,
        "init": True,
        "log_config": {"type": "none", "config": {}},
        "runtime": spec.runtime,
        "binds": {
            mount.host_path: {"bind": mount.sandbox_path, "mode": "ro" if mount.read_only else "rw"}
            for mount in spec.mounts
        },
        "privileged": False,
    }


@dataclass(frozen=True, slots=True)
class WarmContainer:
    """A container created, attached and started, its launcher waiting for a request on stdin."""

    container_id: str
    stream: socket.socket
    key: tuple[object, ...]
    ready_at: float
    """time.monotonic() when it became ready."""
    handle: Any = None
    """The engine client's file object around `stream`: the socket is really closed only once both are."""

    def close(self) -> None:
        """Close our end of the attach stream; never raises."""
        _close(self.stream)
        if self.handle is not None and self.handle is not self.stream:
            with contextlib.suppress(OSError):
                self.handle.close()


class _Drain:
    """Reads one attach stream in a worker thread; the async side reads its state."""

    def __init__(self, spec: SandboxSpec, boundary: bytes) -> None:
        cap = spec.limits.output_bytes
        self.stdout = CappedBuffer(cap)
        self.stderr = CappedBuffer(cap)
        self.splitter = StdoutSplitter(boundary, self.stdout, spec.limits.returned_file_bytes + 1024 * 1024)
        self.flood_limit = max(cap * FLOOD_FACTOR, FLOOD_MIN_BYTES)
        self.flooded = False
        self.finished = False

    def run(self, raw: socket.socket) -> None:
        """Read until the stream ends or the output turns into a flood."""
        demuxer = FrameDemuxer()
        try:
            while True:
                chunk = raw.recv(65536)
                if not chunk:
                    break
                for stream, payload in demuxer.feed(chunk):
                    if stream == STDERR:
                        self.stderr.feed(payload)
                    else:
                        self.splitter.feed(payload)
                if self.stdout.total + self.stderr.total > self.flood_limit:
                    self.flooded = True
                    break
                if self.splitter.trailer is not None:
                    break  # the launcher is done: no need to wait for the container to stop
        except OSError:
            pass  # the container was removed under us: what we have is what there is
        finally:
            self.splitter.finish()
            self.finished = True


class DockerRuntime:
    """A SandboxRuntime on the Docker engine; one instance per server process."""

    def __init__(self, client: docker.DockerClient | None = None) -> None:
        self._connected = client
        self._connect_lock = threading.Lock()
        self.owner = _owner()
        self._removals = ThreadPoolExecutor(max_workers=2, thread_name_prefix="sandbox-remove")
        self._unremoved: set[str] = set()
        """Containers whose removal failed because the engine was away: removed once it answers again."""
        self._unremoved_lock = threading.Lock()

    @property
    def _api(self) -> docker.APIClient:
        """The engine's API, connecting on first use (and again after a failed attempt)."""
        if self._connected is None:
            with self._connect_lock, _engine_errors("connect"):
                if self._connected is None:
                    self._connected = docker.from_env(timeout=60, max_pool_size=ENGINE_CONNECTIONS)
        return self._connected.api

    @classmethod
    def connect(cls, timeout_s: float = 60.0) -> DockerRuntime:
        """Connect to the engine named by the environment (DOCKER_HOST or the local socket)."""
        with _engine_errors("connect"):
            client = docker.from_env(timeout=int(timeout_s), max_pool_size=ENGINE_CONNECTIONS)
            client.ping()
        return cls(client)

    @classmethod
    def lazy(cls) -> DockerRuntime:
        """A runtime that does not contact the engine until first used, so a server starts without one."""
        return cls(None)

    def close(self) -> None:
        """Finish the removals still under way (and retry failed ones once), then release the connections."""
        self._removals.shutdown(wait=True)
        self._retry_removals()
        if self._connected is not None:
            self._connected.close()

    # -- the engine ------------------------------------------------------------------

    def info(self) -> EngineInfo:
        """Version, runtimes and security options of the engine."""
        with _engine_errors("describe itself"):
            version = self._api.version()
            info = self._api.info()
        return EngineInfo(
            server_version=str(version.get("Version", "?")),
            api_version=str(version.get("ApiVersion", "?")),
            runtimes=tuple(sorted(info.get("Runtimes") or {})),
            default_runtime=str(info.get("DefaultRuntime", "runc")),
            cgroup_version=str(info.get("CgroupVersion", "1")),
            security_options=tuple(info.get("SecurityOptions") or ()),
            operating_system=str(info.get("OperatingSystem", "?")),
        )

    # -- images ----------------------------------------------------------------------

    def image(self, reference: str) -> ImageRecord | None:
        """The local image with this reference, or None."""
        with _engine_errors(f"inspect image {reference}"):
            try:
                data = self._api.inspect_image(reference)
            except docker.errors.ImageNotFound:
                return None
        return ImageRecord(
            reference=reference,
            image_id=data["Id"],
            labels=dict((data.get("Config") or {}).get("Labels") or {}),
            size_bytes=int(data.get("Size", 0)),
            created=str(data.get("Created", "")),
        )

    def try_pull(self, reference: str) -> bool:
        """Pull an image; False when no registry can serve it."""
        try:
            with _engine_errors(f"pull {reference}"):
                self._api.pull(reference)
        except EngineUnavailable:
            raise
        except EngineError:
            return False
        return True

    def import_rootfs(self, tar_path: str, reference: str, changes: list[str]) -> str:
        """Import a root filesystem tarball as an image; returns the image id."""
        repository, _, tag = reference.rpartition(":")
        with _engine_errors(f"import {reference}"):
            self._api.import_image_from_file(tar_path, repository=repository, tag=tag, changes=changes)
        record = self.image(reference)
        if record is None:
            raise ImageError(f"importing {tar_path} as {reference} produced no image")
        return record.image_id

    def build(
        self, context_dir: str, reference: str, buildargs: dict[str, str], labels: dict[str, str]
    ) -> Iterator[str]:
        """Build an image, yielding the build's progress lines; raises ImageError on failure."""
        with _engine_errors(f"build {reference}"):
            stream = self._api.build(
                path=context_dir,
                tag=reference,
                buildargs=buildargs,
                labels=labels,
                rm=True,
                forcerm=True,
                pull=False,
                decode=True,
            )
            for event in stream:
                if "error" in event:
                    raise ImageError(f"building {reference} failed: {event['error'].strip()}")
                text = event.get("stream") or event.get("status")
                if text and text.strip():
                    yield text.rstrip("\n")

    def images_with_label(self, label: str) -> list[ImageRecord]:
        """Every local image carrying a label, newest first."""
        with _engine_errors("list images"):
            found = self._api.images(filters={"label": label})
        records = []
        for item in found:
            for reference in item.get("RepoTags") or []:
                records.append(
                    ImageRecord(reference, item["Id"], dict(item.get("Labels") or {}), int(item.get("Size", 0)), "")
                )
        return records

    # -- containers --------------------------------------------------------------------

    def reap_strays(self) -> int:
        """Remove containers of ours whose server process is gone; returns how many."""
        removed = 0
        with _engine_errors("list sandbox containers"):
            found = self._api.containers(all=True, filters={"label": SANDBOX_LABEL})
        for item in found:
            owner = (item.get("Labels") or {}).get(OWNER_LABEL, "")
            if owner != self.owner and not _owner_alive(owner):
                self._remove(item["Id"])
                removed += 1
        return removed

    def sandbox_containers(self) -> list[str]:
        """Ids of every container carrying our label, whichever server made it."""
        with _engine_errors("list sandbox containers"):
            found = self._api.containers(all=True, filters={"label": SANDBOX_LABEL})
        return [item["Id"] for item in found]

    def _remove(self, container_id: str) -> None:
        """Kill and remove; never raises (cleanup must not hide the first error).

        When the engine cannot be reached the container is remembered and removed once the
        engine answers again (an engine restarted mid-call leaves its containers stopped).
        """
        try:
            self._api.remove_container(container_id, force=True, v=True)
        except docker.errors.NotFound:
            pass
        except docker.errors.APIError as exc:
            if exc.status_code != 409:  # 409: a removal is already under way
                self._remember_unremoved(container_id)
        except Exception:  # the engine is away (connection refused or reset, EngineUnavailable)
            self._remember_unremoved(container_id)

    def _remember_unremoved(self, container_id: str) -> None:
        with self._unremoved_lock:
            self._unremoved.add(container_id)

    def _retry_removals(self) -> None:
        """Try again to remove what could not be removed while the engine was away."""
        with self._unremoved_lock:
            pending, self._unremoved = self._unremoved, set()
        for container_id in pending:
            self._remove(container_id)

    def _engine_answered(self) -> None:
        """The engine works again: retry the removals that failed while it was away, off the caller's path."""
        if self._unremoved:
            with contextlib.suppress(RuntimeError):  # shutting down: close() retries
                self._removals.submit(self._retry_removals)

    def _remove_later(self, container_id: str) -> None:
        """Remove a finished container off the answer's path; close() waits for it."""
        try:
            self._removals.submit(self._remove, container_id)
        except RuntimeError:  # shutting down: remove now
            self._remove(container_id)

    def prepare(self, spec: SandboxSpec) -> WarmContainer:
        """Create, attach and start a container whose launcher then waits for its request."""
        labels = {SANDBOX_LABEL: "1", OWNER_LABEL: self.owner, **dict(spec.labels)}
        with _engine_errors("create a sandbox container"):
            host_config = self._api.create_host_config(**host_config_kwargs(spec))
            created = self._api.create_container(
                image=spec.image,
                command=[LAUNCHER],
                user=spec.user,
                working_dir=spec.workdir,
                environment=dict(spec.env),
                labels=labels,
                hostname="sandbox",
                stdin_open=True,
                tty=False,
                network_disabled=spec.network == "none",
                host_config=host_config,
            )
        container_id = str(created["Id"])
        self._engine_answered()
        try:
            with _engine_errors("start the sandbox container"):
                attached = self._api.attach_socket(
                    container_id, params={"stdin": 1, "stdout": 1, "stderr": 1, "stream": 1}
                )
                raw: socket.socket = getattr(attached, "_sock", attached)
                self._api.start(container_id)
        except BaseException:
            self._remove(container_id)
            raise
        return WarmContainer(container_id, raw, spec.container_key(), time.monotonic(), attached)

    @staticmethod
    def healthy(warm: WarmContainer) -> bool:
        """Still waiting for its request: its stream has neither ended nor said anything."""
        try:
            readable, _, _ = select.select([warm.stream], [], [], 0)
        except (OSError, ValueError):
            return False
        return not readable

    def host_pids(self, container_id: str) -> list[int]:
        """Host pids of a running container's processes: its first process, then every descendant."""
        with _engine_errors("inspect the sandbox container"):
            first = int(self._api.inspect_container(container_id)["State"]["Pid"])
        if first <= 0:
            raise EngineError(f"container {container_id[:12]} is not running")
        try:
            return [first, *(child.pid for child in psutil.Process(first).children(recursive=True))]
        except psutil.Error as exc:
            raise EngineError(f"container {container_id[:12]}: its processes cannot be read here: {exc}") from exc

    def discard(self, warm: WarmContainer) -> None:
        """Throw a warm container away unused; never raises."""
        warm.close()
        self._remove(warm.container_id)

    def discard_later(self, warm: WarmContainer) -> None:
        """Throw a warm container away unused, off the caller's path."""
        warm.close()
        self._remove_later(warm.container_id)

    @staticmethod
    def _send(raw: socket.socket, request: bytes) -> None:
        try:
            raw.sendall(request)
            raw.shutdown(socket.SHUT_WR)
        except OSError:
            pass  # the program exited before reading all of its input; its output says the rest

    def _finish(self, container_id: str) -> tuple[int | None, bool]:
        """Exit code and OOM flag of a container whose stream has ended: one inspect, a wait only if it lags."""
        with _engine_errors("read the sandbox's exit status"):
            state = self._api.inspect_container(container_id)["State"]
            if state.get("Running") or state.get("Status") not in ("exited", "dead"):
                self._api.wait(container_id, timeout=30)
                state = self._api.inspect_container(container_id)["State"]
        return int(state.get("ExitCode", -1)), bool(state.get("OOMKilled"))

    async def run(
        self, spec: SandboxSpec, on_progress: ProgressCallback | None = None, warm: WarmContainer | None = None
    ) -> ExecutionResult:
        """Run a spec in a fresh container (or a warm one made for its key), never reused, always removed."""
        boundary = secrets.token_hex(16)
        request = build_request(spec.files, spec.stdin, spec.argv, boundary, spec.call_env, spec.call_workdir)
        started = time.monotonic()
        if warm is None:
            warm = await anyio.to_thread.run_sync(self.prepare, spec)
        elif warm.key != spec.container_key():
            raise ValueError("a warm container made for other settings was handed to this call")
        container_id, raw = warm.container_id, warm.stream
        drain = _Drain(spec, boundary.encode())
        timed_out = cancelled = removed = False
        try:
            await anyio.to_thread.run_sync(self._send, raw, request)
            with anyio.move_on_after(spec.limits.timeout_s) as deadline:
                async with anyio.create_task_group() as group:
                    if on_progress is not None:
                        group.start_soon(self._report, drain, started, on_progress)
                    await anyio.to_thread.run_sync(drain.run, raw, abandon_on_cancel=True)
                    group.cancel_scope.cancel()
            timed_out = deadline.cancelled_caught
            if timed_out or drain.flooded:
                # Close our end first: the engine does not finish a kill while an attach stream backs up.
                warm.close()
                await anyio.to_thread.run_sync(self._remove, container_id)
                removed = True
                exit_code: int | None = None
                oom_killed = False
            else:
                known = _from_trailer(drain.splitter.trailer)
                if known is None:
                    exit_code, oom_killed = await anyio.to_thread.run_sync(self._finish, container_id)
                else:
                    exit_code, oom_killed = known
        except anyio.get_cancelled_exc_class():
            cancelled = True
            raise
        finally:
            warm.close()
            if not removed:
                if cancelled:
                    with anyio.CancelScope(shield=True):
                        await anyio.to_thread.run_sync(self._remove, container_id)
                else:
                    self._remove_later(container_id)
        duration_ms = int((time.monotonic() - started) * 1000)
        files, notes = read_outputs(
            bytes(drain.splitter.archive),
            spec.limits.returned_files,
            spec.limits.returned_file_bytes,
            complete=not drain.splitter.archive_overflow,
        )
        killed = not (timed_out or oom_killed or drain.flooded or cancelled) and not drain.splitter.found
        return ExecutionResult(
            exit_code=exit_code,
            stdout=_joined(drain.stdout),
            stderr=_joined(drain.stderr),
            duration_ms=duration_ms,
            timed_out=timed_out,
            oom_killed=oom_killed,
            pids_limited=_pids_limited(drain.splitter.trailer),
            killed=killed,
            flooded=drain.flooded,
            stdout_truncated_bytes=drain.stdout.truncated_bytes,
            stderr_truncated_bytes=drain.stderr.truncated_bytes,
            files=files,
            skipped_files=notes,
            container_id=container_id,
        )

    @staticmethod
    async def _report(drain: _Drain, started: float, on_progress: ProgressCallback) -> None:
        while not drain.finished:
            await anyio.sleep(1.0)
            await on_progress(time.monotonic() - started, drain.stdout.total, drain.stderr.total)


_COUNTER = re.compile(r"[0-9]{1,10}")


def _counter(trailer: dict[str, str] | None, name: str) -> int | None:
    """A small non-negative number from the trailer, or None.

    The trailer comes from inside the sandbox, where the program could forge it (it shares
    the launcher's user): only up to ten ASCII digits are taken as a number.
    """
    value = (trailer or {}).get(name, "")
    return int(value) if _COUNTER.fullmatch(value) else None


def _from_trailer(trailer: dict[str, str] | None) -> tuple[int, bool] | None:
    """Exit code and OOM flag from the launcher's trailer; None when the engine must be asked."""
    code, oom = _counter(trailer, "exit"), _counter(trailer, "oom_kill")
    if code is None or code > 255 or oom is None:
        return None
    return code, oom > 0


def _pids_limited(trailer: dict[str, str] | None) -> bool:
    """Whether the launcher saw the process limit refuse a fork."""
    return (_counter(trailer, "pids_max") or 0) > 0


def _close(raw: socket.socket) -> None:
    with contextlib.suppress(OSError):
        raw.shutdown(socket.SHUT_RDWR)
    with contextlib.suppress(OSError):
        raw.close()


def _joined(buffer: CappedBuffer) -> bytes:
    """Head and tail with a marker where the middle was dropped."""
    if not buffer.truncated_bytes:
        return buffer.head()
    marker = f"\n[… {buffer.truncated_bytes} bytes truncated …]\n".encode()
    return buffer.head() + marker + buffer.tail()


def engine_address() -> str:
    """Where the client looks for the engine, for messages."""
    return os.environ.get("DOCKER_HOST", "unix:///var/run/docker.sock")
