"""Removing containers: always, off the answer's path when possible, again once the engine is back.

Every container carries its server's owner label (host, pid, process start time), so a
server can tell its own containers from those of a server process that died, and remove
the latter when it starts.
"""

from __future__ import annotations

import contextlib
import functools
import os
import shutil
import socket
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import docker
import docker.errors
import psutil

from sandbox_server.errors import UsageError
from sandbox_server.sandbox.activity import Activity
from sandbox_server.sandbox.engine.connection import engine_errors
from sandbox_server.sandbox.polling import readable
from sandbox_server.sandbox.runc.state import STATE, delete_left_by, folders_left
from sandbox_server.sandbox.spec import SANDBOX_LABEL

__all__ = ["LABELS_VARIABLE", "OWNER_LABEL", "Remover", "current_owner", "operator_labels", "owned_by", "owner_alive",
           "until_network_removed"]  # fmt: skip

OWNER_LABEL = "org.sandbox-server.owner"
LABELS_VARIABLE = "SANDBOX_CONTAINER_LABELS"
"""The operator's own labels for everything a server makes, `key=value` pairs split by commas."""
DEFER_S = 2.0
"""The longest a used container's removal waits for a pause between calls."""
CLOSING_WORKERS = 8
"""Removals side by side once the server stops: its exit has a client's grace period (2 s for the SDK's stdio
client before SIGTERM, 2 more before SIGKILL), and 2 workers took 2 s for a burst's used containers."""
BACKLOG = 48
"""With more removals than this waiting, none waits for a pause. A burst of calls one after another can use up a
whole warm pool (40 on `default`) before its first pause: each used container waits stopped, holding a few MiB,
and removing them beside the burst's calls would slow each call several times over."""
NETWORK_TRIES = 50
"""How often removing a network is tried, 0.2 s apart: the engine refuses while a container is on it (one being
removed, or one that joined it meanwhile)."""


def until_network_removed(remove: Callable[[], None], giving_up: Callable[[], bool] = lambda: False) -> None:
    """Call `remove` until the network is gone (or was already), at most NETWORK_TRIES times, unless `giving_up`
    says to stop; never raises."""
    for _ in range(NETWORK_TRIES):
        try:
            remove()
            return
        except docker.errors.NotFound:
            return
        except docker.errors.APIError:
            if giving_up():
                return
            time.sleep(0.2)


def current_owner() -> str:
    """This server process as an owner label: host, pid and start time."""
    me = psutil.Process()
    return f"{socket.gethostname()}:{me.pid}:{int(me.create_time())}"


def operator_labels() -> dict[str, str]:
    """The labels SANDBOX_CONTAINER_LABELS adds to every container and network a server makes (to find a
    deployment's, or a test worker's, with the engine's own filters). A pair without `=` or with an empty key, or
    a key of the server's own, is refused: UsageError naming the variable and the pair."""
    return dict(_labels_said(os.environ.get(LABELS_VARIABLE, "")))


@functools.cache
def _labels_said(said: str) -> tuple[tuple[str, str], ...]:
    """SANDBOX_CONTAINER_LABELS's pairs, read once per value (every container a server makes asks for them)."""
    labels = {}
    for pair in filter(None, (part.strip() for part in said.split(","))):
        key, equals, value = (part.strip() for part in pair.partition("="))
        if not equals or not key or key.startswith("org.sandbox-server."):
            raise UsageError(
                f"{LABELS_VARIABLE}: {pair!r} is not a label of the operator's own: give key=value pairs split by "
                "commas, with keys outside org.sandbox-server.*, which the server's own labels use"
            )
        labels[key] = value
    return tuple(labels.items())


def owned_by(owner: str) -> dict[str, str]:
    """The labels of a container or network a server makes: ours, its owner's, and the operator's own."""
    return {**operator_labels(), SANDBOX_LABEL: "1", OWNER_LABEL: owner}


def owner_alive(owner: str) -> bool:
    """Whether the server process named by an owner label still runs (another host's is assumed alive). A part of
    a process may label what it makes apart from the rest with a role after its start time (`…:<start>-posture`,
    `doctor --posture`'s proxies): alive as long as that process is."""
    host, _, rest = owner.partition(":")
    pid_text, _, created_text = rest.partition(":")
    created_text = created_text.partition("-")[0]
    if host != socket.gethostname():
        return True  # another host's server: not ours to judge
    try:
        process = psutil.Process(int(pid_text))
        return abs(process.create_time() - int(created_text)) < START_SLACK_S
    except (ValueError, psutil.Error):
        return False


START_SLACK_S = 2.0
"""How far a process's start, read now, may be from the one its label says. The kernel says when a process
started in ticks since boot; as a time of day it adds the boot's time, which moves by a whole second when the
clock is set or drifts past a second's edge: read exactly, every live server would then look gone to the next
server's sweep, which would remove their sandboxes and networks mid-call. A pid taken again by another process
within two seconds of the first's start is not met."""


def reap_after(pid: int, owner: str) -> int:
    """Wait for the server process `pid` to end (a pidfd: no polling), then remove the containers it left.

    A server that stops cleanly has removed them already; one killed with SIGKILL has not, and
    its warm containers would otherwise wait, stopped, for the next server's sweep.
    """
    try:
        handle = os.pidfd_open(pid)
    except OSError:
        handle = None  # ended before this process started watching: what it left is removed below
    if handle is not None:
        try:
            if owner_alive(owner):  # the pid is still the server's, not a later process given the same number
                readable([handle])
        finally:
            os.close(handle)
    delete_left_by(owner)  # the sandboxes runc ran for it
    try:
        api = docker.from_env(timeout=30).api
        for item in api.containers(all=True, filters={"label": f"{OWNER_LABEL}={owner}"}):
            with contextlib.suppress(docker.errors.APIError):
                api.remove_container(item["Id"], force=True, v=True)
        for network in api.networks(filters={"label": f"{OWNER_LABEL}={owner}"}):  # egress networks
            with contextlib.suppress(docker.errors.APIError):
                api.remove_network(network["Id"])
    except Exception:  # the engine is away: the next server's sweep removes them
        return 1
    return 0


class Remover:
    """Kills and removes containers; never raises, and remembers what the engine could not remove."""

    def __init__(
        self, api: Callable[[], docker.APIClient], activity: Activity | None = None, state: Path = STATE
    ) -> None:
        self._api = api
        self.state = state
        """runc's state, where each server also keeps folders of its own (runc_state.SERVER_FOLDERS)."""
        self._activity = activity or Activity()
        self._pending: dict[int, Callable[[], None]] = {}
        """Removals submitted and not yet begun, by their number: close() takes them all at once."""
        self._numbered = 0
        self._closing = False
        self._workers = ThreadPoolExecutor(max_workers=2, thread_name_prefix="sandbox-remove")
        self._unremoved: set[str] = set()
        """Containers whose removal failed because the engine was away: removed once it answers again."""
        self._lock = threading.Lock()

    def remove(self, container_id: str) -> None:
        """Kill and remove now; never raises (cleanup must not hide the first error).

        When the engine cannot be reached the container is remembered and removed once the
        engine answers again (an engine restarted mid-call leaves its containers stopped).
        """
        try:
            self._api().remove_container(container_id, force=True, v=True)
        except docker.errors.NotFound:
            pass
        except docker.errors.APIError as exc:
            if exc.status_code != 409:  # 409: a removal is already under way
                self._remember(container_id)
        except Exception:  # the engine is away (connection refused or reset, EngineUnavailable)
            self._remember(container_id)

    def remove_later(self, container_id: str, then: Callable[[], None] | None = None) -> None:
        """Remove off the caller's path, in a pause between calls (unless the backlog grows), then call
        `then` (which must not raise); close() waits for both."""

        def finish() -> None:
            self.remove(container_id)
            if then is not None:
                then()

        def remove() -> None:
            self._activity.wait_for_pause(DEFER_S, unless=lambda: self._closing or len(self._pending) > BACKLOG)
            with self._lock:
                if self._pending.pop(number, None) is None:
                    return  # close() took it
            finish()

        with self._lock:
            self._numbered += 1
            number = self._numbered
            self._pending[number] = finish
        self._activity.changed()  # the backlog may have grown past what waits for a pause
        try:
            self._workers.submit(remove)
        except RuntimeError:  # shutting down: remove now
            remove()

    def engine_answered(self) -> None:
        """The engine works again: retry the removals that failed while it was away, off the caller's path."""
        if self._unremoved:
            with contextlib.suppress(RuntimeError):  # shutting down: close() retries
                self._workers.submit(self._retry)

    def reap(self, owner: str) -> int:
        """Remove containers of ours whose server process is gone; returns how many."""
        removed = 0
        with engine_errors("list sandbox containers"):
            found = self._api().containers(all=True, filters={"label": SANDBOX_LABEL})
        for item in found:
            other = (item.get("Labels") or {}).get(OWNER_LABEL, "")
            if other != owner and not owner_alive(other):
                self.remove(item["Id"])
                removed += 1
        with engine_errors("list sandbox networks"):
            networks = self._api().networks(filters={"label": SANDBOX_LABEL})
        for network in networks:  # egress networks, once their proxies and sandboxes are gone
            other = (network.get("Labels") or {}).get(OWNER_LABEL, "")
            if other != owner and not owner_alive(other):
                self.remove_network(network["Id"])
        for other, folder in folders_left(self.state):  # hosts files, and proxies' keys and configurations
            if other != owner and not owner_alive(other):
                shutil.rmtree(folder, ignore_errors=True)
        return removed

    def remove_network(self, network_id: str) -> None:
        """Remove a network of a server that is gone, after the containers on it; never raises."""

        def remove() -> None:
            self._api().remove_network(network_id)

        # (refused while its containers are still being removed; a stopping server does not wait on another's
        # network: its reaper will)
        self._workers.submit(until_network_removed, remove, lambda: self._closing)

    def close(self) -> None:
        """Finish the removals under way (none waits for a pause any more), and retry the failed ones once."""
        self._closing = True
        self._activity.changed()
        with self._lock:
            taken, self._pending = list(self._pending.values()), {}
        with ThreadPoolExecutor(max_workers=CLOSING_WORKERS, thread_name_prefix="sandbox-remove") as wide:
            for finish in taken:
                wide.submit(finish)
        self._workers.shutdown(wait=True)
        self._retry()

    def _remember(self, container_id: str) -> None:
        with self._lock:
            self._unremoved.add(container_id)

    def _retry(self) -> None:
        with self._lock:
            pending, self._unremoved = self._unremoved, set()
        for container_id in pending:
            self.remove(container_id)
