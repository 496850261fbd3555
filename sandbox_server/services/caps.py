"""What a server lets a call start: the tool that may, the name it gives, and how many run already, per
workspace, per caller and on the server; each refusal names its policy field."""

from __future__ import annotations

import re

from sandbox_server.errors import Refusal
from sandbox_server.policy import ServiceSettings
from sandbox_server.services.service import Service, ServiceRequest

__all__ = ["NAME", "refuse_past_caps", "refuse_tool"]

NAME = re.compile(r"^[a-z][a-z0-9-]{0,30}[a-z0-9]$|^[a-z]$")
"""A service's name: how the workspace's calls reach it (a host name), so a DNS label, lower case."""


def refuse_tool(tool: str, policy_name: str, settings: ServiceSettings) -> None:
    """A tool the policy does not let start services."""
    if tool not in settings.tools:
        allowed = ", ".join(settings.tools) or "none"
        raise Refusal(
            f"refused: {tool} may not start services under policy '{policy_name}' (field services.tools: {allowed})",
            "services.tools",
        )


def refuse_past_caps(asked: ServiceRequest, here: list[Service], everywhere: list[Service]) -> None:
    """A service the policy does not let start beside those running `here` (its workspace) and `everywhere` (the
    server): its tool, its name, and the caps per workspace, per caller and on the server."""
    settings, policy_name = asked.settings, asked.policy_name
    refuse_tool(asked.tool, policy_name, settings)
    if not NAME.match(asked.name):
        raise Refusal(
            f"refused: service name {asked.name!r} must be a host name: lower-case letters, digits and '-', "
            "starting with a letter, at most 32 characters",
            "service.name",
        )
    if any(s.name == asked.name for s in here):
        raise Refusal(
            f"refused: this workspace already runs a service named {asked.name!r}; stop it first, or choose another "
            "name",
            "service.name",
        )
    counted = [
        (len(here), settings.per_session, "services.per_session", "in this workspace"),
        (sum(s.caller == asked.caller for s in everywhere), settings.per_caller, "services.per_caller", "of yours"),
        (len(everywhere), settings.running, "services.running", "on this server"),
    ]
    for count, cap, field_name, whose in counted:
        if count >= cap:
            raise Refusal(
                f"refused: {count} services {whose} run already, the most policy '{policy_name}' allows (field "
                f"{field_name}: {cap}); stop one first",
                field_name,
            )
