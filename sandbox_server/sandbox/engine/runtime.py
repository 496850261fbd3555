"""The container lifecycle on the Docker engine: a SandboxSpec becomes a hardened, single-use
container, is run through its attach stream, and is always removed.

The other concerns live beside it: the engine connection and its errors (`engine.py`),
the host configuration (`host_config.py`), the stream and its trailer (`attach.py`) and
removal (`removal.py`).
"""

from __future__ import annotations

import contextlib
import io
import os
import secrets
import socket
import tempfile
import time
from collections.abc import Callable
from typing import BinaryIO

import anyio
import anyio.to_thread
import docker

from sandbox_server.errors import EngineError
from sandbox_server.sandbox import mounts, wire
from sandbox_server.sandbox.activity import Activity
from sandbox_server.sandbox.archive import build_request
from sandbox_server.sandbox.engine import answer
from sandbox_server.sandbox.engine.attach import Drain, Ending, exit_from_trailer, persist_grace_s, result_of
from sandbox_server.sandbox.engine.connection import Engine, engine_errors, oom_reported
from sandbox_server.sandbox.engine.host_config import host_config_kwargs, masked_paths
from sandbox_server.sandbox.engine.removal import Remover, current_owner, owned_by
from sandbox_server.sandbox.meter import Meter
from sandbox_server.sandbox.out_folder import read_by_host, read_outputs_of
from sandbox_server.sandbox.polling import readable
from sandbox_server.sandbox.runtime import NO_HOOKS, RunHooks
from sandbox_server.sandbox.spec import SANDBOX_LABEL, ExecutionResult, SandboxSpec
from sandbox_server.sandbox.warm_container import SETTLE_S, WarmContainer, process_tree, sandbox_processes, settled

__all__ = ["DockerRuntime"]

SPOOL_BYTES = 4 * 1024 * 1024
"""A kept workspace larger than this goes through a temporary file on the host rather than memory."""


def _request(spec: SandboxSpec, boundary: str) -> BinaryIO:
    """The launcher's request for a call: its files, stdin, command and kept workspace. A large kept workspace
    goes through a temporary file, never whole in memory (small ones stay in memory, where they are quicker)."""
    persist = spec.saved_workspace is not None
    large = bool(spec.saved_workspace) and os.path.getsize(spec.saved_workspace or "") > SPOOL_BYTES
    request: BinaryIO = tempfile.TemporaryFile() if large else io.BytesIO()
    build_request(
        spec.files, spec.stdin, spec.argv, boundary, spec.call_env, spec.call_workdir,
        saved=spec.saved_workspace, deadline_s=spec.limits.timeout_s if persist else None, into=request,
        outputs_by_host=read_by_host(spec),
    )  # fmt: skip
    return request


class DockerRuntime(Engine):
    """A SandboxRuntime on the Docker engine; one instance per server process."""

    def __init__(self, client: docker.DockerClient | None = None) -> None:
        super().__init__(client)
        self.owner = current_owner()
        self.activity = Activity()
        """The calls running now: used containers are removed, and warm ones made, in the pauses between them."""
        self.removal = Remover(lambda: self.api, self.activity)

    @classmethod
    def connect(cls, timeout_s: float = 60.0) -> DockerRuntime:
        """Connect to the engine named by the environment (DOCKER_HOST or the local socket)."""
        return cls(cls._client(timeout_s))

    @classmethod
    def lazy(cls) -> DockerRuntime:
        """A runtime that does not contact the engine until first used, so a server starts without one."""
        return cls(None)

    def close(self) -> None:
        """Finish the removals still under way (and retry failed ones once), then release the connections."""
        self.removal.close()
        self.close_connection()

    def reap_strays(self) -> int:
        """Remove containers of ours whose server process is gone; returns how many."""
        return self.removal.reap(self.owner)

    def sandbox_containers(self) -> list[str]:
        """Ids of every container carrying our label, whichever server made it."""
        with engine_errors("list sandbox containers"):
            found = self.api.containers(all=True, filters={"label": SANDBOX_LABEL})
        return [item["Id"] for item in found]

    def prepare(self, spec: SandboxSpec) -> WarmContainer:
        """Create, attach and start a container whose launcher then waits for its request."""
        labels = {**owned_by(self.owner), **dict(spec.labels)}
        slot = tempfile.mkdtemp(prefix="slot-", dir=spec.workspace_slots) if spec.workspace_slots else None
        # The slot itself stays root's (mode 0700): a program never writes to the host's disk through it.
        try:
            return self._start(spec, labels, slot)
        except BaseException:
            if slot is not None:
                os.rmdir(slot)
            raise

    def _start(self, spec: SandboxSpec, labels: dict[str, str], slot: str | None) -> WarmContainer:
        if spec.runtime != "runc" and not self.dialect.chooses_runtime:
            raise EngineError(f"{self.dialect.runtime_ignored()}: no sandbox is run on runc in place of {spec.runtime}")
        with engine_errors("create a sandbox container"):
            host_config = self.api.create_host_config(**host_config_kwargs(spec, slot, self.dialect))
            masked = masked_paths(spec)
            if masked is not None:
                host_config["MaskedPaths"] = masked  # the engine client has no keyword for it
            created = self.api.create_container(
                image=spec.image,
                entrypoint=[wire.LAUNCHER],  # the launcher alone: neither the image's ENTRYPOINT nor its CMD
                user=spec.user,
                working_dir=spec.workdir,
                environment=dict(spec.env) | ({} if spec.runtime == "runsc" else {wire.LINGER_ENV: "1"}),
                labels=labels,
                hostname="sandbox",
                stdin_open=True,
                tty=False,
                network_disabled=not spec.networked,
                host_config=host_config,
            )
        container_id = str(created["Id"])
        self.removal.engine_answered()
        try:
            with engine_errors("start the sandbox container"):
                attached = self.api.attach_socket(
                    container_id, params={"stdin": 1, "stdout": 1, "stderr": 1, "stream": 1}
                )
                raw: socket.socket = getattr(attached, "_sock", attached)
                if spec.service_network is not None and spec.network != "none":
                    self.api.connect_container_to_network(container_id, spec.service_network)
                self.api.start(container_id)
                state = self.api.inspect_container(container_id)
                pid = int(state["State"].get("Pid") or 0)
                networks = (state.get("NetworkSettings") or {}).get("Networks") or {}
                address = str((networks.get(spec.network) or {}).get("IPAddress") or "")
        except BaseException:
            self.removal.remove(container_id)
            raise
        return WarmContainer(container_id, raw, spec.container_key(), time.monotonic(), attached, slot, pid, address)

    @staticmethod
    def healthy(warm: WarmContainer) -> bool:
        """Still waiting for its request: its stream has neither ended nor said anything."""
        try:
            said = readable([warm.stream], 0)
        except (OSError, ValueError):
            return False
        return not said

    def host_pids(self, container_id: str) -> list[int]:
        """Host pids of a running container's processes: its first process, then every descendant."""
        with engine_errors("inspect the sandbox container"):
            first = int(self.api.inspect_container(container_id)["State"]["Pid"])
        if first <= 0:
            raise EngineError(f"container {container_id[:12]} is not running")
        found = process_tree(first)
        if not found:
            raise EngineError(f"container {container_id[:12]}: its processes cannot be read here")
        return found

    @staticmethod
    def memory(warm: WarmContainer) -> int:
        """Resident bytes of a waiting container's processes, read from the host (0 when they cannot be read).

        The pool reads this for every waiting container each second, in its event loop: a few small
        files per process, never a scan of every process on the host."""
        page = os.sysconf("SC_PAGESIZE")
        held = 0
        for pid in process_tree(warm.pid) if warm.pid > 0 else ():
            try:
                with open(f"/proc/{pid}/statm", "rb") as statm:
                    held += int(statm.read().split()[1]) * page
            except (OSError, ValueError, IndexError):
                continue  # it ended meanwhile
        return held

    def discard(self, warm: WarmContainer) -> None:
        """Throw a warm container away unused; never raises."""
        warm.close()
        self.removal.remove(warm.container_id)
        warm.free_slot()

    def discard_later(self, warm: WarmContainer) -> None:
        """Throw a warm container away unused, off the caller's path."""
        warm.close()
        self.removal.remove_later(warm.container_id, then=warm.free_slot)

    def _finish(self, container_id: str, lingering: bool) -> tuple[int | None, bool]:
        """Exit code and OOM flag of a container whose stream has ended, or whose launcher wrote a trailer the
        host cannot read and now waits, stopped (`lingering`): one inspect, a wait only if it lags."""
        with engine_errors("read the sandbox's exit status"):
            state = self.api.inspect_container(container_id)["State"]
            if state.get("Running") or state.get("Status") not in ("exited", "dead"):
                if lingering:
                    with contextlib.suppress(docker.errors.APIError):  # it ended meanwhile
                        self.api.kill(container_id)
                self.api.wait(container_id, timeout=30)
                state = self.api.inspect_container(container_id)["State"]
            oom = bool(state.get("OOMKilled"))
            if not oom and not lingering and state.get("ExitCode") == 137:  # killed with no word: memory?
                oom = oom_reported(self.api, container_id)
        return int(state.get("ExitCode", -1)), oom

    async def run(
        self, spec: SandboxSpec, hooks: RunHooks = NO_HOOKS, warm: WarmContainer | None = None
    ) -> ExecutionResult:
        """Run a spec in a fresh container (or a warm one made for its key), never reused, always removed."""
        with self.activity.call():
            return await self._run(spec, hooks, warm)

    async def _run(self, spec: SandboxSpec, hooks: RunHooks, warm: WarmContainer | None) -> ExecutionResult:
        boundary = secrets.token_hex(16)
        request = _request(spec, boundary)
        started = time.monotonic()
        warm = await self._ready(spec, warm)
        sink = tempfile.SpooledTemporaryFile(SPOOL_BYTES) if spec.saved_workspace is not None else None
        drain = Drain(spec, boundary.encode(), sink, hooks.output)  # type: ignore[arg-type]
        ending = await self._drive(spec, warm, request, drain, hooks, started)
        duration_ms = int((time.monotonic() - started) * 1000)
        return result_of(spec, drain, ending, (warm.container_id, warm.address), duration_ms)

    async def _ready(self, spec: SandboxSpec, warm: WarmContainer | None) -> WarmContainer:
        """The call's container: the warm one made for its key (a fresh one without), its workspace bound in."""
        if warm is None:
            warm = await anyio.to_thread.run_sync(self.prepare, spec)
        elif warm.key != spec.container_key():
            raise ValueError("a warm container made for other settings was handed to this call")
        if (spec.mounted_workspace is None) != (warm.slot is None):
            self.discard_later(warm)
            raise ValueError("a container with a workspace slot runs exactly the calls with a mounted workspace")
        if spec.mounted_workspace is not None and warm.slot is not None:
            try:
                mounts.bind(spec.mounted_workspace, warm.slot, warm.namespace)
                mounts.bind_outputs(warm.slot, spec.user, spec.mounted_workspace, warm.namespace)
            except OSError as exc:
                self.discard_later(warm)
                raise EngineError(f"could not mount the workspace into the sandbox: {exc}") from exc
        return warm

    async def _drive(
        self, spec: SandboxSpec, warm: WarmContainer, request: BinaryIO, drain: Drain, hooks: RunHooks, started: float
    ) -> Ending:
        """Send the request, read the answer until the launcher's trailer or the deadline, and see the sandbox
        end: removed now when it ran out of time, flooded its output or did not settle, else later."""
        # A persistent workspace is saved even when its program runs out of time: the launcher stops
        # the program at the deadline and writes the workspace; the host waits that much longer.
        grace_s = persist_grace_s(spec) if spec.saved_workspace is not None else 0
        meter, unwatch = Meter.start(warm.pid), hooks.watch_address(warm.address)
        ending, cancelled = Ending(), False
        small = answer.small(request)  # sent by whatever reads the answer: one trip to a thread at most, not two
        try:
            if not small:  # (a large one is sent before the deadline starts: its unpacking is not the program's)
                await anyio.to_thread.run_sync(answer.send, warm.stream, request)
            with anyio.move_on_after(spec.limits.timeout_s + grace_s) as deadline:
                async with anyio.create_task_group() as group:
                    if hooks.progress is not None:
                        group.start_soon(answer.report, drain, started, hooks.progress)
                    await answer.answer(warm.stream, request, small, drain)
                    group.cancel_scope.cancel()
            ending.timed_out = deadline.cancelled_caught
            if ending.timed_out or drain.flooded:
                ending.usage = meter.read()
                ending.oom_killed = ending.usage.oom_kills > 0  # the kernel's kill for memory, however late
                # Close our end first: the engine does not finish a kill while an attach stream backs up.
                warm.close()
                await anyio.to_thread.run_sync(self.removal.remove, warm.container_id)
                ending.removed = True
            else:
                await self._ended(spec, warm, drain, meter, ending)
        except anyio.get_cancelled_exc_class():
            cancelled = True
            raise
        finally:
            warm.close()
            unwatch()
            # The program's processes are gone (the launcher killed what it left before its trailer, or the
            # container is removed before the answer), so nothing of this call writes to its workspace after
            # the answer. The slot is let go of after the removal, off the answer's path: unmounting from a
            # live container's mounts waits for the kernel's RCU grace period, some milliseconds.
            if ending.removed:
                warm.free_slot()
            elif cancelled:
                with anyio.CancelScope(shield=True):
                    await anyio.to_thread.run_sync(self.removal.remove, warm.container_id)
                warm.free_slot()
            else:
                self.removal.remove_later(warm.container_id, then=warm.free_slot)
        return ending

    async def _ended(self, spec: SandboxSpec, warm: WarmContainer, drain: Drain, meter: Meter, ending: Ending) -> None:
        """A sandbox that answered in time: its exit code and memory verdict, its usage, and whether it settled."""
        known = exit_from_trailer(drain.splitter.trailer)
        if known is None:
            lingering = drain.splitter.trailer is not None and spec.runtime != "runsc"
            ending.exit_code, ending.oom_killed = await anyio.to_thread.run_sync(
                self._finish, warm.container_id, lingering
            )
        else:
            ending.exit_code, ending.oom_killed = known
        # The trailer is the launcher's word, which the program can forge: the call ends when the
        # host sees the sandbox's processes stopped; one that does not settle is removed first.
        settled = await _settle(warm, spec, self._settled)
        ending.usage = meter.read()  # before any removal: the launcher waits, stopped, until then
        if (
            warm.slot is not None and drain.splitter.trailer is not None and read_by_host(spec)
        ):  # (before the slot goes)
            limits = spec.limits
            outputs = await anyio.to_thread.run_sync(
                read_outputs_of, warm.slot, limits.returned_files, limits.returned_file_bytes
            )
            ending.outputs = outputs
        if not settled:
            warm.close()
            await anyio.to_thread.run_sync(self.removal.remove, warm.container_id)
            ending.removed = ending.unsettled = True

    def _settled(self, warm: WarmContainer, spec: SandboxSpec) -> bool:
        """Whether a sandbox whose processes the host cannot see (gVisor's) has ended with its launcher's trailer
        (`_settle`)."""
        try:
            self.api.wait(warm.container_id, timeout=SETTLE_S)
        except (docker.errors.APIError, OSError, ValueError):
            return False
        return True


async def _settle(warm: WarmContainer, spec: SandboxSpec, ended: Callable[[WarmContainer, SandboxSpec], bool]) -> bool:
    """Whether the sandbox's processes have ended with its launcher's trailer: where a descriptor tells the end of
    every one (`warm.ends`), that one readable, awaited on the event loop; else every process but its init stopped
    or gone, read from the host's /proc between short sleeps on the event loop (a few small reads each time: no
    trip to a thread); where the host cannot see them (gVisor), whether the sandbox ended (`ended`, in a thread),
    asked only when a workspace is mounted or a proxy files its requests."""
    if warm.ends is not None:
        with anyio.move_on_after(SETTLE_S):
            await anyio.wait_readable(warm.ends)
            return True
        return False
    if spec.runtime == "runsc" or warm.pid <= 0:
        if spec.mounted_workspace is None and not spec.networked:
            return True  # nothing of the call outlives its answer but the container, which is removed
        return await anyio.to_thread.run_sync(ended, warm, spec)
    deadline = time.monotonic() + SETTLE_S
    while _running(warm.pid):
        if time.monotonic() > deadline:
            return False
        await anyio.sleep(0.002)
    return True


def _running(init: int) -> bool:
    """Whether a process of the sandbox whose init is `init`, other than its init, still runs (neither stopped,
    exiting nor ended): its init's tree, and the warm cell's process a template forked into it."""
    return not all(settled(pid) for pid in sandbox_processes(init)[1:])
