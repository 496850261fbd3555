"""The connection to the Docker engine, the one place its errors are mapped, and its images.

Every docker-py and transport exception is converted in `engine_errors`, most
specific first: an engine that does not answer becomes EngineUnavailable, any
other refusal EngineError.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import socket
import struct
import tarfile
import threading
import time
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

import docker
import docker.errors
import requests.exceptions
import urllib3.exceptions

from sandbox_server.errors import EngineError, EngineUnavailable, ImageError
from sandbox_server.sandbox.engine.dialect import EngineDialect, dialect_of

__all__ = ["ENGINE_HINT", "Engine", "EngineInfo", "ImageRecord", "engine_address", "engine_errors", "oom_reported"]

ENGINE_CONNECTIONS = 64
"""HTTP connections kept to the engine: concurrent calls, pool refills and removals each hold one."""
ENGINE_HINT = (
    "start it with `sandbox-server setup` (as root on Debian), or `dockerd &`, or point DOCKER_HOST at a running engine"
)

_UNREACHABLE = (requests.exceptions.ConnectionError, ConnectionError, FileNotFoundError)


def engine_address() -> str:
    """Where the client looks for the engine, for messages."""
    return os.environ.get("DOCKER_HOST", "unix:///var/run/docker.sock")


def engine_pid() -> int | None:
    """The process of the engine, when it answers on a Unix socket of this host (the socket's peer); else None."""
    address = engine_address()
    if not address.startswith("unix://"):
        return None
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
            probe.settimeout(2)
            probe.connect(address.removeprefix("unix://"))
            credentials = probe.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    except OSError:
        return None
    return struct.unpack("3i", credentials)[0] or None


def _unreachable(exc: BaseException) -> bool:
    """True when an exception, or one it was raised from, says nothing answered."""
    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, _UNREACHABLE):
            return True
        seen = seen.__cause__ or seen.__context__
    return False


@contextlib.contextmanager
def engine_errors(action: str) -> Iterator[None]:
    """Turn whatever the engine client raises while doing `action` into EngineUnavailable or EngineError."""
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


def _within(stream: Iterator[dict[str, Any]], ends: float | None) -> Iterator[dict[str, Any]]:
    """A build's events until `ends` (a monotonic time; None: no end): past it, or when a silent step's read timed
    out there, the stream is closed (the engine then cancels the build) and TimeoutError raised."""
    while True:
        try:
            event = next(stream)
        except StopIteration:
            return
        except (requests.exceptions.RequestException, urllib3.exceptions.HTTPError, OSError):
            if ends is None or time.monotonic() < ends - 1:
                raise
            event = {}
        if ends is not None and time.monotonic() >= ends:
            with contextlib.suppress(Exception):
                stream.close()  # type: ignore[attr-defined]
            raise TimeoutError
        yield event


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
    dialect: EngineDialect
    cpus: int = 0
    """The CPUs the engine's host has (0: it did not say)."""
    memory_bytes: int = 0
    """The memory the engine's host has (0: it did not say)."""


@dataclass(frozen=True, slots=True)
class ImageRecord:
    """A local image and its labels."""

    reference: str
    image_id: str
    labels: dict[str, str]
    size_bytes: int
    created: str


class Engine:
    """A connection to the engine (made on first use when lazy), its facts and its images."""

    def __init__(self, client: docker.DockerClient | None = None) -> None:
        self._connected = client
        self._connect_lock = threading.Lock()
        self._dialect: EngineDialect | None = None

    @property
    def api(self) -> docker.APIClient:
        """The engine's API, connecting on first use (and again after a failed attempt)."""
        if self._connected is None:
            with self._connect_lock, engine_errors("connect"):
                if self._connected is None:
                    self._connected = docker.from_env(timeout=60, max_pool_size=ENGINE_CONNECTIONS)
        return self._connected.api

    @staticmethod
    def _client(timeout_s: float) -> docker.DockerClient:
        """A client of the engine named by the environment, which answered a ping."""
        with engine_errors("connect"):
            client = docker.from_env(timeout=int(timeout_s), max_pool_size=ENGINE_CONNECTIONS)
            client.ping()
        return client

    def close_connection(self) -> None:
        """Release the connections to the engine."""
        if self._connected is not None:
            self._connected.close()

    def on_this_host(self) -> bool:
        """Whether the engine runs on this host: reached over a Unix socket, and naming this host when it answers."""
        try:
            if not str(self.api.base_url).startswith("http+docker://"):
                return False
            with engine_errors("describe itself"):
                return bool(self.api.info().get("Name") == socket.gethostname())
        except EngineError:
            return True  # a local socket whose engine does not answer yet

    @property
    def dialect(self) -> EngineDialect:
        """How this engine is spoken to (Docker, or Podman's Docker-compatible service); asked once."""
        if self._dialect is None:
            with engine_errors("describe itself"):
                self._dialect = dialect_of(self.api.version(), engine_pid())
        return self._dialect

    def info(self) -> EngineInfo:
        """Version, runtimes and security options of the engine."""
        with engine_errors("describe itself"):
            version = self.api.version()
            info = self.api.info()
        default = str(info.get("DefaultRuntime", "runc"))
        return EngineInfo(
            server_version=str(version.get("Version", "?")),
            api_version=str(version.get("ApiVersion", "?")),
            # An engine that ignores the runtime asked for runs its default, the ordinary runc-like one, whatever it is
            runtimes=tuple(sorted(info.get("Runtimes") or {} if self.dialect.chooses_runtime else {"runc", default})),
            default_runtime=default,
            cgroup_version=str(info.get("CgroupVersion", "1")),
            security_options=tuple(info.get("SecurityOptions") or ()),
            operating_system=str(info.get("OperatingSystem", "?")),
            dialect=self.dialect,
            cpus=int(info.get("NCPU") or 0),
            memory_bytes=int(info.get("MemTotal") or 0),
        )

    def image(self, reference: str) -> ImageRecord | None:
        """The local image with this reference, or None."""
        with engine_errors(f"inspect image {reference}"):
            try:
                data = self.api.inspect_image(reference)
            except docker.errors.ImageNotFound:
                return None
        return ImageRecord(
            reference=reference,
            image_id=data["Id"],
            labels=dict((data.get("Config") or {}).get("Labels") or {}),
            size_bytes=int(data.get("Size", 0)),
            created=str(data.get("Created", "")),
        )

    def untag(self, reference: str) -> None:
        """Remove a tag (its layers stay while another image uses them); nothing when it is not there."""
        with contextlib.suppress(docker.errors.DockerException):
            self.api.remove_image(reference, noprune=True)

    def image_config(self, reference: str) -> dict[str, Any]:
        """An image's configuration (its Env, User, Entrypoint, Cmd, Labels)."""
        with engine_errors(f"inspect image {reference}"):
            return dict(self.api.inspect_image(reference).get("Config") or {})

    @contextlib.contextmanager
    def unstarted(self, reference: str) -> Iterator[str]:
        """A container of the image, made and never started: its files read and written, then committed."""
        with engine_errors(f"create a container of {reference}"):
            container = str(self.api.create_container(reference, ["/bin/sh"])["Id"])
        try:
            yield container
        finally:
            with contextlib.suppress(docker.errors.DockerException):
                self.api.remove_container(container, force=True)

    def read_file(self, container: str, path: str) -> bytes | None:
        """A file of a container (None when it has none there)."""
        with engine_errors(f"read {path}"):
            try:
                stream, _ = self.api.get_archive(container, path)
            except docker.errors.NotFound:
                return None
            packed = b"".join(stream)
        with tarfile.open(fileobj=io.BytesIO(packed)) as archive:
            member = next((m for m in archive.getmembers() if m.isfile()), None)
            handle = archive.extractfile(member) if member is not None else None
            return handle.read() if handle is not None else None

    def has_path(self, container: str, path: str) -> bool:
        """Whether a container has anything at `path` (its links followed as the container's own)."""
        api = self.api  # the archive endpoint's HEAD: its stat alone (a GET would start packing the file)
        with engine_errors(f"look at {path}"):
            found = api.head(f"{api.base_url}/v{api.api_version}/containers/{container}/archive", params={"path": path})
            if found.status_code not in (200, 404):
                raise EngineError(f"the engine answered {found.status_code} about {path} in {container[:12]}")
        return bool(found.status_code == 200)

    def put_files(self, container: str, archive: bytes) -> None:
        """Unpack a tar archive at the root of a container's files."""
        with engine_errors("write files"):
            if not self.api.put_archive(container, "/", archive):
                raise EngineError("the engine did not write the files")

    def commit(self, container: str, reference: str, changes: list[str]) -> None:
        """The container's files as an image, its configuration changed as Dockerfile lines say."""
        repository, _, tag = reference.rpartition(":")
        with engine_errors(f"commit {reference}"):
            self.api.commit(container, repository=repository, tag=tag, changes=changes)

    def try_pull(self, reference: str) -> bool:
        """Pull an image; False when no registry can serve it (Podman says so inside a successful answer: the
        image's presence afterwards is what counts)."""
        try:
            with engine_errors(f"pull {reference}"):
                self.api.pull(reference)
        except EngineUnavailable:
            raise
        except EngineError:
            return False
        return self.image(reference) is not None

    def import_rootfs(self, tar_path: str, reference: str, changes: list[str]) -> str:
        """Import a root filesystem tarball as an image; returns the image id."""
        repository, _, tag = reference.rpartition(":")
        with engine_errors(f"import {reference}"):
            said = self.api.import_image_from_file(tar_path, repository=repository, tag=tag, changes=changes)
            if self.image(reference) is None:  # Podman names an import `<repository>:latest`, whatever its tag
                made = json.loads(str(said).strip().splitlines()[-1] or "{}").get("status", "")
                if made and self.api.tag(made, repository, tag):
                    stray = self.image(f"{repository}:latest")
                    if tag != "latest" and stray is not None and stray.image_id == made:
                        self.api.remove_image(f"{repository}:latest")
        record = self.image(reference)
        if record is None:
            raise ImageError(f"importing {tar_path} as {reference} produced no image")
        return record.image_id

    def build(
        self, context_dir: str, reference: str, buildargs: dict[str, str], labels: dict[str, str],
        within_s: float | None = None,
    ) -> Iterator[str]:  # fmt: skip
        """Build an image, yielding the build's progress lines; raises ImageError on failure, naming the step that
        failed and the last lines it printed, and on a build past `within_s` (stopped: the engine cancels a build
        whose client went away)."""
        step, said = "", deque[str](maxlen=8)
        ends = time.monotonic() + within_s if within_s is not None else None
        with engine_errors(f"build {reference}"):
            stream = self.api.build(
                path=context_dir,
                tag=reference,
                buildargs=buildargs,
                labels=labels,
                rm=True,
                forcerm=True,
                pull=False,
                decode=True,
                timeout=within_s,  # a step that says nothing is cut off by the read's own timeout
            )
            events = _within(stream, ends)
            while True:
                try:
                    event = next(events)
                except StopIteration:
                    break
                except TimeoutError:
                    at = f" at {step}" if step else ""
                    raise ImageError(
                        f"building {reference} took longer than its cap of {within_s:g} s (images build --max-s) "
                        f"and was stopped{at}: make the step finish, or give it more time"
                    ) from None
                if "error" in event:
                    number, _, instruction = step.removeprefix("Step ").partition(" : ")
                    where = f" at step {number} ({instruction})" if step else ""
                    last = "".join(f"\n  {line}" for line in said)
                    raise ImageError(f"building {reference} failed{where}: {event['error'].strip()}{last}")
                text = event.get("stream") or event.get("status")
                if text and text.strip():
                    line = text.rstrip("\n")
                    if line.startswith("Step "):
                        step = line
                        said.clear()
                    elif not line.startswith((" ---> ", "Removing intermediate container")):
                        said.append(line[:300])
                    yield line


OOM_LATE_S = 2
"""How long a container's out-of-memory event may come after its end is recorded."""


def oom_reported(api: docker.APIClient, container_id: str, within_s: float = OOM_LATE_S) -> bool:
    """Whether the engine reported the container out of memory (its `oom` event), waiting up to `within_s` for a
    late one: a busy engine may record a container's end before its out-of-memory event, and its state's
    OOMKilled flag with it. Asked only of a sandbox that was killed without a word from its launcher."""
    since = api.inspect_container(container_id)["Created"]
    events = api.events(
        since=datetime.fromisoformat(since[:26].rstrip("Z")).replace(tzinfo=UTC) if since else None,
        until=datetime.now(UTC) + timedelta(seconds=within_s),
        filters={"container": container_id, "event": "oom"},
        decode=True,
    )
    try:
        return any(True for _ in events)
    finally:
        events.close()
