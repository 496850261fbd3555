"""One service: what it is, where its life stands, and what its task is asked to do (restart, stop)."""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import anyio

from sandbox_server.errors import Refusal
from sandbox_server.policy import ServiceSettings
from sandbox_server.sandbox.meter import Meter, Usage
from sandbox_server.sandbox.spec import SandboxSpec

__all__ = ["Answer", "Service", "ServiceRequest"]


@dataclass(frozen=True, slots=True)
class ServiceRequest:
    """What a call asks a service to be: its name and port, the command it runs (as the call gave it), the tool
    and caller that start it under which policy, and how its readiness is checked."""

    name: str
    port: int
    command: str
    tool: str
    caller: str
    """The limits key of the caller who starts it."""
    policy_name: str
    settings: ServiceSettings
    ready_path: str | None = None
    arguments: Mapping[str, Any] | None = None
    """The call's arguments, which its workspace's record keeps to start it again (None: not kept)."""


@dataclass(slots=True)
class Answer:
    """What one waiting side (a start, a restart) is told by a service's task: done, with an error or none."""

    done: anyio.Event = field(default_factory=anyio.Event)
    error: BaseException | None = None

    def answer(self, error: BaseException | None) -> None:
        if not self.done.is_set():
            self.error = error
            self.done.set()


@dataclass(slots=True)
class Service:
    """One running (or just stopped) service."""

    id: str
    name: str
    port: int
    ready_path: str | None
    """A path that answers below 500 once the service is ready (None: listening on its port is enough)."""
    command: str
    tool: str
    policy_name: str
    caller: str
    """Whose it is (the limits key of the caller who started it)."""
    workspace_id: str
    session: str | None
    settings: ServiceSettings
    network: str
    container_id: str = ""
    pid: int = 0
    slot: str | None = None
    address: str = ""
    """Its container's address on its workspace's network."""
    spec: SandboxSpec | None = None
    """What its container is made from (a restart makes it again)."""
    restarts: int = 0
    started_at: float = field(default_factory=time.time)
    last_used: float = field(default_factory=time.monotonic)
    state: str = "starting"
    """starting, running, stopping or stopped."""
    stop_reason: str = ""
    stop_asked: bool = False
    ran: bool = False
    resumable: bool = False
    """Its stop keeps it in its workspace's record, to start again (its workspace paused, or, named, its session
    ended); a stop the server's own end causes keeps it too."""
    """It became ready once (its end is then recorded)."""
    asks: list[Answer] = field(default_factory=list)
    """Restarts asked of its task, in turn."""
    wake: anyio.Event = field(default_factory=anyio.Event)
    stopped: anyio.Event = field(default_factory=anyio.Event)
    let_go: anyio.Event = field(default_factory=anyio.Event)
    """Its task ended: its workspace is no longer held by it."""
    meter: Meter | None = None
    """Its container's CPU time and peak memory, read from the host."""
    used: Usage = field(default_factory=Usage)
    """What its containers before the current one used (a restart makes a new one)."""

    def ask_stop(self, reason: str) -> None:
        """Ask its task to end it (the first reason given is the one kept); the task may be starting it."""
        if not self.stop_asked:
            self.stop_asked, self.stop_reason = True, reason
            if self.state != "stopped":
                self.state = "stopping"
        self.wake.set()

    async def wait_for_ask(self) -> Answer | None:
        """The next restart asked of its task, or None once a stop is (restarts still waiting are refused)."""
        while not self.stop_asked:
            if self.asks:
                return self.asks.pop(0)
            await self.wake.wait()
            self.wake = anyio.Event()
        for asked in self.asks:
            asked.answer(Refusal(f"refused: service {self.name!r} stopped ({self.stop_reason})", "service"))
        return None

    def spend(self) -> Usage:
        """Count what its current container used into `used` (before the container goes)."""
        now = self.meter.read() if self.meter is not None else Usage()
        self.meter = None
        cpu = None if now.cpu_s is None and self.used.cpu_s is None else (now.cpu_s or 0) + (self.used.cpu_s or 0)
        peak = max(now.peak_memory_bytes or 0, self.used.peak_memory_bytes or 0) or None
        self.used = Usage(cpu, peak)
        return self.used

    def describe(self, preview: str | None = None) -> dict[str, Any]:
        """The service as a result's `services` entry."""
        described: dict[str, Any] = {
            "name": self.name,
            "id": self.id,
            "state": self.state,
            "port": self.port,
            "url": f"http://{self.name}:{self.port}/",
            "uptime_s": round(time.time() - self.started_at, 1),
        }
        if self.stop_reason:
            described["stopped_because"] = self.stop_reason
        if self.restarts:
            described["restarts"] = self.restarts
        if preview is not None:
            described["preview"] = preview
        return described
