"""What one call may do with services: start one in its workspace, for its caller, under its policy; see and
reach the ones running there."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from sandbox_server.errors import Refusal
from sandbox_server.network.egress import ProxyEndpoint
from sandbox_server.policy import ServiceSettings
from sandbox_server.sandbox.spec import SandboxSpec
from sandbox_server.services.caps import refuse_tool
from sandbox_server.services.manager import Service, Services
from sandbox_server.services.service import ServiceRequest
from sandbox_server.workspaces.store import WorkspaceRecord

__all__ = ["ServiceScope"]


@dataclass(frozen=True, slots=True)
class ServiceScope:
    """What a call may do with services: start one in its workspace, for its caller, under its policy."""

    services: Services
    record: WorkspaceRecord | None
    """The call's kept workspace (None: the policy keeps none, and so starts no service)."""
    caller: str
    settings: ServiceSettings
    policy_name: str

    @property
    def network(self) -> str | None:
        """The workspace's services' network, which the call joins (None: none runs)."""
        return self.services.network_of(self.record.id) if self.record is not None else None

    @property
    def names(self) -> tuple[str, ...]:
        """The names of the workspace's running services (how its calls reach them)."""
        return tuple(s.name for s in self.services.running(self.record.id)) if self.record is not None else ()

    async def start(
        self,
        spec: SandboxSpec,
        name: str,
        port: int,
        command: str,
        tool: str,
        ready_path: str | None = None,
        proxy: ProxyEndpoint | None = None,
        arguments: Mapping[str, Any] | None = None,
    ) -> Service:
        """Start a service; `arguments`, the call's, are kept in the workspace's record to start it again."""
        refuse_tool(tool, self.policy_name, self.settings)
        if self.record is None:
            raise Refusal(
                f"refused: policy '{self.policy_name}' keeps no workspace (field workspace.persist), and a service "
                "lives in its session's workspace",
                "workspace.persist",
            )
        asked = ServiceRequest(
            name, port, command, tool, self.caller, self.policy_name, self.settings, ready_path, arguments
        )
        return await self.services.start(spec, self.record, asked, proxy)

    def listed(self) -> list[dict[str, Any]]:
        return self.services.listed(self.record.id) if self.record is not None else []

    def named(self, name: str) -> Service | None:
        """The workspace's running service of that name (None when it runs none such)."""
        mine = self.services.running(self.record.id) if self.record is not None else []
        return next((s for s in mine if s.name == name), None)
