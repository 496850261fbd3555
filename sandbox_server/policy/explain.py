"""What security teams read: a policy fully resolved, the container settings it yields, and diffs."""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

from sandbox_server.policy.model import Policy, ToolPolicy

__all__ = ["diff_policies", "explain_policy", "flatten"]


def _tool_view(tool: ToolPolicy) -> dict[str, Any]:
    view = asdict(tool)
    view["env"] = {name: "(set)" for name, _ in tool.env}
    view["seccomp_profile"] = view.pop("seccomp_profile_source") or "engine default"
    return view


def explain_policy(policy: Policy, tool_names: list[str]) -> dict[str, Any]:
    """The effective policy of every tool and the exact container settings each one gets."""
    from sandbox_server.sandbox.host_config import host_config_kwargs

    tools = {}
    for name in tool_names:
        tool = policy.for_tool(name)
        settings = host_config_kwargs(tool.container_spec())
        if tool.seccomp_profile:
            settings["security_opt"] = ["no-new-privileges", f"seccomp={tool.seccomp_profile_source}"]
        tools[name] = {"policy": _tool_view(tool), "container": {"user": tool.user, "image": tool.image, **settings}}
    return {
        "name": policy.name,
        "source": policy.source,
        "sha256": policy.digest,
        "tool_prefix": policy.tool_prefix,
        "rate": asdict(policy.rate),
        "host": asdict(policy.host),
        "audit": asdict(policy.audit),
        "tools": tools,
        "notes": list(policy.notes),
    }


def flatten(value: Any, prefix: str = "") -> dict[str, Any]:
    """Dotted keys -> leaf values."""
    if isinstance(value, dict):
        flat: dict[str, Any] = {}
        for key, item in value.items():
            flat.update(flatten(item, f"{prefix}.{key}" if prefix else str(key)))
        return flat
    return {prefix: value}


def diff_policies(first: dict[str, Any], second: dict[str, Any]) -> list[str]:
    """Lines `field: a -> b` for every effective setting that differs."""
    a, b = flatten(first), flatten(second)
    ignored = {"name", "source", "sha256", "notes"}
    lines = []
    for key in sorted(set(a) | set(b)):
        if key in ignored or a.get(key) == b.get(key):
            continue
        lines.append(f"{key}: {a.get(key, '(unset)')!r} -> {b.get(key, '(unset)')!r}")
    return lines
