"""The services of one server: started by calls, kept while their workspace is used, stopped for a reason.

A service belongs to the workspace its call ran in (a handshake session's, or a 2026-07-28 workspace id) and to
its caller. It holds that workspace as a running call does, so the workspace is not removed under it, and it
stops when its session ends, after `services.idle_s` without a call in its workspace or a request through its
preview, at `services.max_lifetime_s`, when it is stopped by its caller, and with the server. A killed server's
services are removed by its reaper with its other containers (they carry its owner label).
"""

from __future__ import annotations

import contextlib
import logging
import secrets
import time
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import anyio
import anyio.abc
import anyio.to_thread

from sandbox_server.access.audit import AuditLog, event_record
from sandbox_server.errors import Refusal
from sandbox_server.network.egress import ProxyEndpoint
from sandbox_server.network.proxies import EgressProxies
from sandbox_server.sandbox.engine import services as containers
from sandbox_server.sandbox.engine.runtime import DockerRuntime
from sandbox_server.sandbox.held import HeldMemory
from sandbox_server.sandbox.spec import SandboxSpec
from sandbox_server.services.caps import refuse_past_caps
from sandbox_server.services.links import PreviewLinks
from sandbox_server.services.making import ServiceMaker
from sandbox_server.services.service import Answer, Service, ServiceRequest
from sandbox_server.workspaces.pausing import service_entry
from sandbox_server.workspaces.store import WorkspaceRecord, WorkspaceStore

if TYPE_CHECKING:  # the PostgreSQL driver is imported only by a server given --state
    from sandbox_server.state.homes import Homes

__all__ = ["Service", "Services"]

log = logging.getLogger("sandbox_server")

CHECK_S = 1.0
"""How often running services are looked at (ended by themselves, idle, past their lifetime)."""


class Services:
    """Every service this server started; the engine work runs in worker threads."""

    def __init__(
        self,
        runtime: DockerRuntime,
        store: WorkspaceStore,
        audit: AuditLog | None = None,
        proxies: EgressProxies | None = None,
        *,
        on_networks: Callable[[Mapping[str, Mapping[str, str]]], None] = lambda _: None,
        links: PreviewLinks | None = None,
        observe: Callable[[Mapping[str, Any]], None] | None = None,
        held: HeldMemory | None = None,
    ) -> None:
        self.runtime, self.store, self.audit, self.proxies = runtime, store, audit, proxies
        self._services: dict[str, Service] = {}
        self._holding: dict[str, Service] = {}
        """Services whose task has not ended: each holds its workspace until then, stopped or not."""
        self.resuming: dict[str, anyio.Lock] = {}
        """Per workspace: held while its recorded services are started again (one call starts them, others wait)."""
        self._group: anyio.abc.TaskGroup | None = None
        self.on_networks = on_networks
        """Told the networks of workspaces with running services, and each one's services by name with their
        addresses there, whenever a service's container comes or goes (the warm pools; the names that sandboxes
        runc makes beside them read)."""
        self.links = links if links is not None else PreviewLinks()
        """The links this server gives to its services' previews (none, and why, when it gives none)."""
        self.observe = observe
        """Hears each audit event of a service (the Prometheus metrics count what a stopped one used)."""
        self.homes: Homes | None = store.contents.homed.homes if store.contents.homed is not None else None
        """Replicas with homes (workspaces.homed): where each service is said to live, for a peer given a request for one (its preview)."""
        self.maker = ServiceMaker(runtime, proxies, self._networks_changed)
        if held is not None:  # the warm pool leaves room for what running services' containers may hold
            held.counts(self.memory_bytes)

    # -- what calls and resources see ------------------------------------------------------

    def running(self, workspace_id: str | None = None, stopping: bool = False) -> list[Service]:
        """The services (of a workspace) starting or running; `stopping`: those stopping too, each until it has let
        go of its workspace (its `let_go`)."""
        among = self._holding if stopping else self._services
        return [
            s
            for s in among.values()
            if (stopping or s.state != "stopped") and (workspace_id is None or s.workspace_id == workspace_id)
        ]

    def network_of(self, workspace_id: str) -> str | None:
        """The network a call in this workspace joins to reach its services (None: it has none running)."""
        running = self.running(workspace_id)
        return running[0].network if running else None

    def touch(self, workspace_id: str) -> None:
        """A call ran in the workspace: its services are in use."""
        for service in self.running(workspace_id):
            service.last_used = time.monotonic()

    def listed(self, workspace_id: str) -> list[dict[str, Any]]:
        return [s.describe(self.links.link(s)) for s in self.running(workspace_id)]

    def get(self, service_id: str) -> Service | None:
        """A running service by its id (None when there is none such)."""
        service = self._services.get(service_id)
        return service if service is not None and service.state == "running" else None

    def of_caller(self, caller: str) -> list[Service]:
        """A caller's running services, every workspace of theirs together."""
        return [s for s in self.running() if s.caller == caller and s.state == "running"]

    def find(self, service_id: str, caller: str) -> Service | None:
        """A service of this caller (None for every other case, as for an id that never existed)."""
        service = self.get(service_id)
        return service if service is not None and service.caller == caller else None

    def memory_bytes(self) -> int:
        """What running services' containers may hold (the warm pool's budget leaves room for it)."""
        return sum(s.settings.memory_mb for s in self.running()) * 1024 * 1024

    # -- starting ----------------------------------------------------------------------------

    async def start(
        self, spec: SandboxSpec, record: WorkspaceRecord, asked: ServiceRequest, proxy: ProxyEndpoint | None = None
    ) -> Service:
        """Start a service and wait until it listens on its port; a Refusal says why it did not.

        The service is counted against its caps from here on, and its own task (in the services' group) owns it
        from its first step to its last: whatever the start makes, that task removes, whenever the stop comes."""
        refuse_past_caps(asked, self.running(record.id), self.running())
        if not self.store.contents.side_by_side:
            raise Refusal(
                "refused: services need workspaces mounted beside calls, and this server keeps them as archives "
                "(serve --workspaces)",
                "services",
            )
        if not self.runtime.dialect.bridge_networks:
            raise Refusal(f"refused: {self.runtime.dialect.networks_missing()}", "services")
        if self._group is None:
            raise Refusal("refused: this server is not running services (it is stopping)", "services")
        network = containers.network_name(record.id, self.runtime.owner)
        service = Service(
            id=f"svc-{secrets.token_urlsafe(12)}", name=asked.name, port=asked.port, ready_path=asked.ready_path,
            command=asked.command, tool=asked.tool, policy_name=asked.policy_name, caller=asked.caller,
            workspace_id=record.id, session=record.session, settings=asked.settings, network=network,
        )  # fmt: skip
        self._services[service.id] = service  # counted from now on: no await between the caps and this
        answer = Answer()
        self._group.start_soon(self._life, service, record, spec, proxy, answer)
        try:
            await answer.done.wait()
        except BaseException:
            service.ask_stop("its call was cancelled while it started")
            raise
        if answer.error is not None:
            raise answer.error
        if self.homes is not None:
            await anyio.to_thread.run_sync(self.homes.add_service, service.id, record.id, service.name, service.caller)
        if asked.arguments is not None:
            entry = service_entry(service.name, service.port, service.tool, asked.arguments)
            await anyio.to_thread.run_sync(self.store.record_service, record.id, entry)
        return service

    async def _life(
        self, service: Service, record: WorkspaceRecord, spec: SandboxSpec, proxy: ProxyEndpoint | None, up: Answer
    ) -> None:
        """A service from its start to its end: the one task that makes, remakes and removes its container."""
        failure: Exception | None = None
        failed_restart: Answer | None = None
        self._holding[service.id] = service
        try:
            async with self.store.using(record, 0):  # held as a running call holds it, until what it made is gone
                try:
                    failure, failed_restart = await self._live(service, record, spec, proxy, up)
                finally:
                    with anyio.CancelScope(shield=True):
                        await self._end(service)
        finally:
            with anyio.CancelScope(shield=True):
                await self._end(service)  # a no-op once done above (here when the workspace could not be held)
            stopped = Refusal(f"service {service.name!r} stopped while it started: {service.stop_reason}", "service")
            up.answer(failure if failure is not None else stopped)  # once what it made is gone
            if failed_restart is not None:
                failed_restart.answer(failure)
            self._holding.pop(service.id, None)
            service.let_go.set()

    async def _live(
        self, service: Service, record: WorkspaceRecord, spec: SandboxSpec, proxy: ProxyEndpoint | None, up: Answer
    ) -> tuple[Exception | None, Answer | None]:
        """Start the service, then make it again for each restart asked until a stop is: what ended it (a failed
        start or restart, and the restart that failed), or nothing when a stop did."""
        try:
            spec = await anyio.to_thread.run_sync(self.store.begin, record, spec)
            if proxy is not None:
                neighbours = tuple(s.name for s in self.running(service.workspace_id))
                spec = await self.maker.through_proxy(spec, proxy, service, neighbours)
            service.spec = spec
            await self.maker.bring_up(service, "did not start")
        except Exception as exc:
            return exc, None
        up.answer(None)
        await self.audit_event("service_started", service, container=service.container_id[:12])
        while (restart := await service.wait_for_ask()) is not None:
            try:
                service.spend()
                service.state = "starting"  # its container's end, seen by _look meanwhile, is the restart's
                await self.maker.remove_container(service)
                await self.maker.bring_up(service, "did not start again")
            except Exception as exc:
                service.ask_stop("it did not start again")  # the first reason given is kept
                return exc, restart
            service.restarts += 1
            restart.answer(None)
            await self.audit_event("service_restarted", service, container=service.container_id[:12])
        return None, None

    async def restart(self, service: Service) -> Service:
        """Its container removed and made again from the same spec, its command run anew; ready as at its start."""
        if service.spec is None or service.state != "running":
            raise Refusal(f"refused: service {service.name!r} cannot be restarted now ({service.state})", "service")
        asked = Answer()
        service.asks.append(asked)
        service.wake.set()
        await asked.done.wait()
        if asked.error is not None:
            raise asked.error
        return service

    # -- stopping ----------------------------------------------------------------------------

    async def stop(self, service: Service, reason: str) -> None:
        """Stop a service, starting or running: its task removes its container (every process in it) and lets go of
        its workspace; answered once that is done."""
        service.ask_stop(reason)
        await service.stopped.wait()

    async def _end(self, service: Service) -> None:
        """The service's last step (in its own task, shielded): what it made removed, its end recorded."""
        if service.stopped.is_set():
            return
        recorded = service.resumable or not service.stop_asked  # not asked: the server is stopping around it
        service.ask_stop(service.stop_reason or "the server stopped")
        service.state = "stopped"
        last = not self.running(service.workspace_id)
        self._networks_changed()  # its name goes; and if it was the last, the warm containers on its network
        used = service.spend()  # before its container goes
        try:
            if not recorded:  # its caller stopped it, or it stopped by itself: not to start again (said before it
                # is gone, so that no call finds it gone and still recorded, and starts it again)
                await anyio.to_thread.run_sync(self.store.drop_service, service.workspace_id, service.name)
            await self.maker.remove_container(service)
            if self.homes is not None:
                with contextlib.suppress(Refusal):
                    await anyio.to_thread.run_sync(self.homes.drop_service, service.id)
            if last:
                await anyio.to_thread.run_sync(containers.remove_network, self.runtime.api, service.network)
            if service.ran:  # recorded even when the server is stopping around it
                wall = round(time.time() - service.started_at, 3)
                usage = {"wall_s": wall, "cpu_s": used.cpu_s, "peak_memory_bytes": used.peak_memory_bytes}
                await self.audit_event(
                    "service_stopped", service, reason=service.stop_reason, caller=service.caller, usage=usage
                )
        finally:
            self._services.pop(service.id, None)
            for asked in service.asks:
                asked.answer(Refusal(f"refused: service {service.name!r} stopped ({service.stop_reason})", "service"))
            service.stopped.set()

    def _networks_changed(self) -> None:
        named: dict[str, dict[str, str]] = {}
        for service in self.running():
            if service.container_id:
                named.setdefault(service.network, {})[service.name] = service.address
        self.on_networks(named)

    async def stop_session(self, session: str) -> None:
        """A handshake session ended: its workspace's services stop."""
        for service in [s for s in self.running() if s.session == session]:
            service.resumable = self.store.outlives_sessions(service.workspace_id)  # named: it starts again
            await self.stop(service, "its session ended")

    async def serve(self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """Hold the services' task group and look at them each second, until the server stops (then stop all)."""
        try:
            async with anyio.create_task_group() as group:
                self._group = group
                task_status.started()
                while True:
                    await anyio.sleep(CHECK_S)
                    await self._look()
        finally:
            self._group = None  # each service's task ended with the group, removing what it made

    async def _look(self) -> None:
        now, clock = time.time(), time.monotonic()
        for service in self.running():
            if service.state != "running":
                continue
            settings = service.settings
            if now - service.started_at > settings.max_lifetime_s:
                await self.stop(service, f"it reached its maximum lifetime (services.max_lifetime_s: "
                                         f"{settings.max_lifetime_s:g} s)")  # fmt: skip
            elif clock - service.last_used > settings.idle_s:
                await self.stop(service, f"it was idle (services.idle_s: {settings.idle_s:g} s)")
            else:
                looked_at = service.container_id
                state = await anyio.to_thread.run_sync(containers.container_state, self.runtime.api, looked_at)
                if service.state != "running" or service.container_id != looked_at:
                    continue  # restarted or stopped meanwhile: that container's end was asked for
                if not state.get("Running"):
                    why = "out of memory" if state.get("OOMKilled") else f"with code {state.get('ExitCode', '?')}"
                    await self.stop(service, f"its program ended ({why})")

    async def audit_event(self, event: str, service: Service, **fields: Any) -> None:
        """One line of the audit trail about a service, written off the event loop as a call's is (and counted by
        the Prometheus metrics)."""
        record = event_record(
            event, service=service.id, name=service.name, client=service.caller, tool=service.tool,
            policy=service.policy_name, port=service.port, **fields,
        )  # fmt: skip
        if self.observe is not None:
            self.observe(record)
        if self.audit is not None:
            await anyio.to_thread.run_sync(self.audit.write, record)
