"""A service's container: made on its workspace's network (behind its allow list's proxy), awaited until it listens,
read (its log) and removed. The engine side of one service's life; `Services` decides when."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import replace

import anyio
import anyio.to_thread

from sandbox_server.errors import Refusal
from sandbox_server.network.egress import ProxyEndpoint
from sandbox_server.network.proxies import EgressProxies
from sandbox_server.sandbox.engine import services as containers
from sandbox_server.sandbox.engine.runtime import DockerRuntime
from sandbox_server.sandbox.meter import Meter
from sandbox_server.sandbox.spec import SandboxSpec
from sandbox_server.services.readiness import until_ready
from sandbox_server.services.service import Service

__all__ = ["LOG_SHOWN", "ServiceMaker"]

LOG_SHOWN = 2000
"""The end of a service's log shown in an answer about it."""


class ServiceMaker:
    """Makes, reads and removes services' containers (the engine work in worker threads)."""

    def __init__(
        self, runtime: DockerRuntime, proxies: EgressProxies | None, networks_changed: Callable[[], None]
    ) -> None:
        self.runtime, self.proxies = runtime, proxies
        self.networks_changed = networks_changed
        """Called once a container is on its network (the warm pool makes its calls' containers meanwhile)."""

    def log_of(self, service: Service, max_bytes: int = LOG_SHOWN) -> str:
        return containers.log_tail(self.runtime.api, service.container_id, max_bytes) if service.container_id else ""

    async def bring_up(self, service: Service, failed: str) -> None:
        """Make the service's container and wait until it listens; a Refusal says why it did not (what was made is
        the service's, removed at its end)."""
        if service.stop_asked or service.spec is None:
            raise Refusal(f"service {service.name!r} {failed}: it was stopped ({service.stop_reason})", "service")
        service.state = "starting"
        with anyio.CancelScope(shield=True):  # what the engine makes is known, even when a stop comes meanwhile
            try:
                started = await anyio.to_thread.run_sync(
                    containers.start_container, self.runtime, service.spec, service.id, service.name,
                    service.network, self.runtime.owner, service.settings.log_kb,
                )  # fmt: skip
            except Exception:
                service.ask_stop("its container could not start")
                raise
        service.container_id, service.pid, service.slot = started.container_id, started.pid, started.slot
        service.address = started.address
        service.meter = Meter.start(started.pid)
        self.networks_changed()
        problem, field_name = await until_ready(self.runtime.api, service)
        if problem is not None:
            last = self.log_of(service)
            service.ask_stop("it never became ready")
            shown = f"; its last output:\n{last}" if last else "; it printed nothing"
            raise Refusal(f"service {service.name!r} {failed}: {problem}{shown}", field_name)
        service.state = "running"
        service.ran = True
        service.last_used = time.monotonic()

    async def through_proxy(
        self, spec: SandboxSpec, proxy: ProxyEndpoint, service: Service, neighbours: tuple[str, ...]
    ) -> SandboxSpec:
        """The spec of a service under an allow list: on its workspace's network alone, the list's proxy joined
        to it there and named in its environment (with its `neighbours`, the workspace's other services)."""
        if self.proxies is None:
            raise Refusal("refused: this server runs no egress proxy for services", "network")
        api, proxies = self.runtime.api, self.proxies
        try:
            await anyio.to_thread.run_sync(containers.ensure_network, api, service.network, self.runtime.owner)
            joined = await anyio.to_thread.run_sync(proxies.join, proxy, service.network)
        except OSError as exc:
            service.ask_stop("its network could not be made")
            raise Refusal(f"service {service.name!r} did not start: {exc}", "network") from exc
        proxied = {name for name, _ in joined.environment()}
        env = tuple((k, v) for k, v in spec.call_env if k not in proxied) + joined.environment(neighbours)
        return replace(spec, network="none", call_env=env, mounts=spec.mounts + joined.mounts())

    async def remove_container(self, service: Service) -> None:
        if service.container_id:
            await anyio.to_thread.run_sync(containers.remove, self.runtime.api, service.container_id, service.slot)
        service.container_id, service.slot, service.address = "", None, ""
