"""Whether a service that was started listens yet: on its port, and at its ready path when it names one."""

from __future__ import annotations

import time
from typing import Any

import anyio
import anyio.to_thread

from sandbox_server.sandbox.engine import services as containers
from sandbox_server.sandbox.runc import netns
from sandbox_server.services.service import Service

__all__ = ["READY_POLL_S", "until_ready"]

READY_POLL_S = 0.1
ELSEWHERE_S = 1.0
"""How long a service that listens only on other ports than its own is given to open its own too (a program
may open a side port first), before it is refused."""


async def until_ready(api: Any, service: Service) -> tuple[str | None, str]:
    """Wait until the service listens on its port: (None, ""), or why it will not and the field that says."""
    deadline = time.monotonic() + service.settings.start_timeout_s
    elsewhere_since: float | None = None
    while True:
        if service.stop_asked:
            return f"it was stopped while it started ({service.stop_reason})", "service"
        state = await anyio.to_thread.run_sync(containers.container_state, api, service.container_id)
        if not state.get("Running"):
            if state.get("OOMKilled"):
                memory = service.settings.memory_mb
                return f"it ran out of memory (field services.memory_mb: {memory})", "services.memory_mb"
            code = state.get("ExitCode", "?")
            return f"it exited with code {code} before listening on port {service.port}", "services.start_timeout_s"
        ports = await anyio.to_thread.run_sync(containers.listening_ports, service.pid)
        answered = None
        if service.port in ports:
            if service.ready_path is None or netns.unavailable() is not None:
                return None, ""
            answered = await anyio.to_thread.run_sync(
                netns.status_inside, service.pid, service.port, service.name, service.ready_path
            )
            if answered is not None and answered < 500:
                return None, ""
        if ports and service.port not in ports:
            elsewhere_since = elsewhere_since or time.monotonic()
            if time.monotonic() - elsewhere_since > ELSEWHERE_S:
                others = ", ".join(str(p) for p in sorted(ports))
                return (
                    f"it listens on {others}, not on port {service.port} it was started for (field service.port): "
                    f"start it on port {service.port}, or ask for port {sorted(ports)[0]}",
                    "service.port",
                )
        if time.monotonic() > deadline:
            if service.port in ports:
                said = f"answered {answered}" if answered is not None else "did not answer"
                return (
                    f"it listens on port {service.port}, but GET {service.ready_path} {said} within "
                    f"{service.settings.start_timeout_s:g} s (field services.start_timeout_s)",
                    "services.start_timeout_s",
                )
            others = ", ".join(str(p) for p in sorted(ports))
            elsewhere = f" (it listens on {others})" if others else ""
            waited = service.settings.start_timeout_s
            return (
                f"it did not listen on port {service.port} within {waited:g} s (field services.start_timeout_s)"
                f"{elsewhere}",
                "services.start_timeout_s",
            )
        await anyio.sleep(READY_POLL_S)
