"""What security teams read: a policy fully resolved, the container settings it yields, and diffs."""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path
from typing import Any

import yaml

from sandbox_server.network.egress import Destination
from sandbox_server.policy.model import Policy, ToolPolicy
from sandbox_server.policy.references import policy_path
from sandbox_server.policy.yaml_files import load_yaml

__all__ = ["diff_policies", "explain_policy", "flatten"]


def _tool_view(tool: ToolPolicy) -> dict[str, Any]:
    """A tool's effective settings under the names its policy file gives them (`tools.<name>.limits.cpus`,
    `commands.allow`, `network.allow`, `pool.max`), whichever file set them."""
    limits = {
        key: value for key, value in asdict(tool.limits).items() if key not in ("workspace_files", "workspace_exec")
    }
    limits |= {
        "max_timeout_s": tool.max_timeout_s,
        "max_task_s": tool.max_task_s,
        "argument_bytes": tool.max_argument_bytes,
        "input_file_bytes": tool.max_input_file_bytes,
        "input_files": tool.max_input_files,
        "csv_bytes": tool.max_csv_bytes,
        "csv_line_bytes": tool.max_csv_line_bytes,
    }
    pool: dict[str, Any] = {"min": tool.pool_size, "max": tool.pool_max, "ahead": tool.pool_ahead}
    if tool.pool_on_runc is not None:
        pool["runc"] = {"ahead": tool.pool_on_runc[0], "max": tool.pool_on_runc[1]}
    return {
        "enabled": tool.enabled,
        "image": tool.image,
        "packages": tool.packages,
        "build": tool.build,
        "runtime": tool.runtime,
        "user": tool.user,
        "network": "none" if tool.egress is None else {"allow": [e for d in tool.egress.allow for e in _entries(d)]},
        "seccomp_profile": tool.seccomp_profile_source or "engine default",
        "limits": limits,
        "commands": {"shell": tool.allow_shell, "allow": list(tool.commands_allow), "deny": list(tool.commands_deny)},
        "mounts": [
            {"host": m.host_path, "sandbox": m.sandbox_path, "mode": "ro" if m.read_only else "rw"} for m in tool.mounts
        ],
        "env": {name: "(set)" for name, _ in tool.env},
        "preload": list(tool.preload),
        "pool": {**pool, "idle_s": tool.pool_idle_s},
    }


def _entries(destination: Destination) -> list[str]:
    """An allow list's entry as a file writes it: `host` (ports 443 and 80), else `host:port` per port."""
    name = f"*.{destination.host}" if destination.subdomains else destination.host
    if sorted(destination.ports) == [80, 443]:
        return [name]
    return [f"{name}:{port}" for port in destination.ports]


def _network_mode(tool: ToolPolicy, settings: dict[str, Any]) -> str:
    """The network a tool's sandboxes join as they run: none, or the internal one of its allow list's proxy."""
    if tool.egress is None:
        return str(settings.get("network_mode", "none"))
    return (
        f"sandbox-egress-{tool.egress.key()}-… (an internal network whose one way out is the allow list's proxy, "
        "made at the tool's first call)"
    )


def explain_policy(policy: Policy, tool_names: list[str], managing: tuple[str, ...] = ()) -> dict[str, Any]:
    """The effective policy of every tool it offers (`tool_names`) and the exact container settings each one gets,
    every other section resolved, and which file set each setting a file sets (the rest are built-in defaults)."""
    from sandbox_server.sandbox.engine.host_config import host_config_kwargs

    tools: dict[str, Any] = {}
    for name in tool_names:
        if name in managing:  # the services and workspaces tools: they run no sandbox of their own
            tools[name] = {"runs_no_sandbox": True}
            continue
        tool = policy.for_tool(name)
        settings = host_config_kwargs(tool.container_spec())
        if tool.seccomp_profile:
            settings["security_opt"] = ["no-new-privileges", f"seccomp={tool.seccomp_profile_source}"]
        settings["network_mode"] = _network_mode(tool, settings)
        tools[name] = {**_tool_view(tool), "container": {"user": tool.user, "image": tool.image, **settings}}
    return {
        "name": policy.name,
        "source": policy.source,
        "sha256": policy.digest,
        "tool_prefix": policy.tool_prefix,
        "rate": asdict(policy.rate),
        "host": asdict(policy.host),
        "audit": {**asdict(policy.audit), "written_to": written_to(policy)},
        "workspace": asdict(policy.workspace),
        "approval": asdict(policy.approval),
        "tasks": asdict(policy.tasks),
        "services": asdict(policy.services),
        "tools": tools,
        "set_by": set_by(Path(policy.source)) if Path(policy.source).is_file() else {},
        "notes": list(policy.notes),
    }


def written_to(policy: Policy) -> str:
    """Where a server under this policy writes its audit trail: `audit.path`, else the state folder's (the trail
    is on by default); `serve --audit-log` names another."""
    from sandbox_server.state.folder import default_state_dir

    if policy.audit.path:
        return policy.audit.path
    return (
        f"{default_state_dir() / 'audit.jsonl'} (the state folder's: the trail is on by default; serve --audit-log "
        "or audit.path names another)"
    )


def set_by(source: Path) -> dict[str, str]:
    """Each setting a policy file or a file it extends sets (dotted, as written: `defaults.limits.memory_mb`),
    with the file that sets it: the nearest in the `extends` chain. What none sets is a built-in default."""
    found: dict[str, str] = {}
    seen: set[Path] = set()
    whole: set[str] = set()  # the pools a nearer file set, each taken whole from it (policy.documents)
    path: Path | None = source.resolve()
    while path is not None and path not in seen and path.is_file():
        seen.add(path)
        try:
            document = load_yaml(path) or {}
        except (OSError, yaml.YAMLError):
            break  # the loader has said what is wrong with it
        if not isinstance(document, dict):
            break
        written = {k: v for k, v in document.items() if k not in ("extends", "name", "description")}
        keys = [key for key in flatten(written) if not _taken_whole(key, whole)]
        for key in keys:
            found.setdefault(key, str(path))
        whole |= {key.rsplit(".pool.", 1)[0] + ".pool" for key in keys if ".pool." in f".{key}"}
        parent = document.get("extends")
        path = policy_path(parent, path.parent).resolve() if isinstance(parent, str) else None
    return dict(sorted(found.items()))


def _taken_whole(key: str, pools: set[str]) -> bool:
    """Whether a setting of a file further up the chain is under a pool a nearer file set (a nearer `defaults.pool`
    is every tool's that file does not name)."""
    if any(key.startswith(f"{pool}.") for pool in pools):
        return True
    return "defaults.pool" in pools and key.startswith("tools.") and key.split(".")[2:3] == ["pool"]


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
    a = {key: value for key, value in a.items() if not key.startswith("set_by.")}
    b = {key: value for key, value in b.items() if not key.startswith("set_by.")}
    offered = ({key.split(".")[1] for key in side if key.startswith("tools.")} for side in (a, b))
    first_tools, second_tools = offered
    lines = [
        f"tools.{name}: {'offered' if name in first_tools else 'not offered'} -> "
        f"{'offered' if name in second_tools else 'not offered'}"
        for name in sorted(first_tools ^ second_tools)
    ]
    alone = {f"tools.{name}." for name in first_tools ^ second_tools}
    for key in sorted(set(a) | set(b)):
        if key in ignored or a.get(key) == b.get(key) or key.startswith(tuple(alone)):
            continue
        lines.append(f"{key}: {a.get(key, '(unset)')!r} -> {b.get(key, '(unset)')!r}")
    return lines
