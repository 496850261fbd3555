"""A policy file made a frozen Policy for this host: its document (policy/documents.py: YAML, JSON Schema,
`extends`) -> each tool's settings checked against the host -> frozen Policy.

Every error names the file, the field path and what is allowed; all errors of a
file are reported at once, and a policy with any error is never used.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from sandbox_server.errors import ConfigError
from sandbox_server.network.egress import Egress, parse_egress
from sandbox_server.policy.documents import effective_tool_settings, resolved_document
from sandbox_server.policy.hints import closest
from sandbox_server.policy.model import (
    ApprovalSettings,
    AuditSettings,
    HostAdmission,
    Policy,
    RateLimits,
    ServiceSettings,
    TaskSettings,
    ToolPolicy,
    WorkspaceSettings,
)
from sandbox_server.policy.references import policy_path, seccomp_path, shipped_policies
from sandbox_server.policy.tool_images import tool_image
from sandbox_server.sandbox.spec import Mount, ResourceLimits

__all__ = [
    "policy_problem",
    "HostFacts",
    "load_policy",
    "policy_errors",
    "policy_path",
]

LIMIT_FIELDS = {
    "timeout_s",
    "memory_mb",
    "cpus",
    "pids",
    "nofile",
    "file_size_mb",
    "tmp_mb",
    "workspace_mb",
    "shm_mb",
    "output_bytes",
    "returned_files",
    "returned_file_bytes",
    "returned_images",
    "returned_image_bytes",
}


@dataclass(frozen=True, slots=True)
class HostFacts:
    """What the host can honour; None where it is not known (engine down)."""

    runtimes: frozenset[str] | None = None
    runtime_advice: str = (
        "install it (`sandbox-server setup` registers runsc when it installs the engine) or choose runc"
    )
    """What to do about a runtime the engine does not have."""
    networks_missing: str = ""
    """Why the engine cannot open a network through the proxy ("" when it can)."""
    cpus: int | None = None
    """The CPUs of the engine's host: a sandbox cannot be given more."""
    memory_mb: int | None = None
    """The memory of the engine's host, in MiB: a sandbox cannot be given more."""


def _tool_policy(
    settings: Mapping[str, Any], field_prefix: str, source: Path, host: HostFacts, errors: list[str]
) -> ToolPolicy:
    def error(field: str, message: str) -> None:
        errors.append(f"{source}: {field_prefix}.{field}: {message}")

    limits = settings.get("limits", {})
    defaults = ToolPolicy()
    resource_limits = ResourceLimits(**{key: value for key, value in limits.items() if key in LIMIT_FIELDS})
    max_timeout_s = float(limits.get("max_timeout_s", defaults.max_timeout_s))
    if max_timeout_s < resource_limits.timeout_s:
        error("limits.max_timeout_s", f"{max_timeout_s:g} is below limits.timeout_s ({resource_limits.timeout_s:g})")
    max_task_s = float(limits.get("max_task_s", defaults.max_task_s))
    if max_task_s < max_timeout_s:
        error("limits.max_task_s", f"{max_task_s:g} is below limits.max_timeout_s ({max_timeout_s:g})")
    commands = settings.get("commands", {})
    shell = bool(commands.get("shell", True))
    if shell and (commands.get("allow") or commands.get("deny")):
        error("commands.shell", "must be false when commands.allow or commands.deny is set: a shell runs anything")
    runtime = settings.get("runtime", "runc")
    _beyond_host(resource_limits, runtime, host, error)
    mounts = []
    for index, item in enumerate(settings.get("mounts", [])):
        if not os.path.isdir(item["host"]):
            error(f"mounts[{index}].host", f"{item['host']} does not exist or is not a folder on this host")
        mounts.append(Mount(item["host"], item["sandbox"], item.get("mode", "ro") == "ro"))
    seccomp, seccomp_source = _seccomp(settings, source, runtime, error)
    egress = _egress(settings, host, runtime, error)
    pool = settings.get("pool", {})
    pool_max, pool_ahead = int(pool.get("max", defaults.pool_max)), int(pool.get("ahead", defaults.pool_ahead))
    env_settings = settings.get("env", {})
    environment = {name: os.environ[name] for name in env_settings.get("pass", []) if name in os.environ}
    environment.update(env_settings.get("set", {}))
    image, packages, build = tool_image(settings, defaults.image, source.parent, error)
    return ToolPolicy(
        image=image,
        packages=packages,
        build=build,
        runtime=runtime,
        user=settings.get("user", defaults.user),
        egress=egress,
        seccomp_profile=seccomp,
        seccomp_profile_source=seccomp_source,
        limits=resource_limits,
        max_timeout_s=max_timeout_s,
        max_task_s=max_task_s,
        allow_shell=shell,
        commands_allow=tuple(commands.get("allow", [])),
        commands_deny=tuple(commands.get("deny", [])),
        max_argument_bytes=int(limits.get("argument_bytes", defaults.max_argument_bytes)),
        max_input_file_bytes=int(limits.get("input_file_bytes", defaults.max_input_file_bytes)),
        max_input_files=int(limits.get("input_files", defaults.max_input_files)),
        max_csv_bytes=int(limits.get("csv_bytes", defaults.max_csv_bytes)),
        max_csv_line_bytes=int(limits.get("csv_line_bytes", defaults.max_csv_line_bytes)),
        mounts=tuple(mounts),
        env=tuple(sorted(environment.items())),
        enabled=bool(settings.get("enabled", True)),
        pool_size=int(settings.get("pool", {}).get("min", settings.get("pool", {}).get("size", defaults.pool_size))),
        pool_max=pool_max,
        pool_ahead=pool_ahead,
        pool_on_runc=_on_runc(pool.get("runc"), pool_ahead, pool_max),
        pool_idle_s=float(settings.get("pool", {}).get("idle_s", defaults.pool_idle_s)),
        preload=tuple(settings.get("preload", defaults.preload)),
    )


def _on_runc(deeper: Mapping[str, Any] | None, ahead: int, most: int) -> tuple[int, int] | None:
    """A pool's (ahead, max) where runc itself makes its sandboxes (`pool.runc`), each as the pool's own `ahead`
    and `max` when not given."""
    if deeper is None:
        return None
    return int(deeper.get("ahead", ahead)), int(deeper.get("max", most))


def _beyond_host(limits: ResourceLimits, runtime: str, host: HostFacts, error: Callable[[str, str], None]) -> None:
    """A tool's limits past what this host's engine has, and a runtime it does not have."""
    if host.cpus is not None and limits.cpus > host.cpus:
        error("limits.cpus", f"{limits.cpus:g} is more than the {host.cpus} CPU(s) this host's engine has")
    if host.memory_mb is not None and limits.memory_mb > host.memory_mb:
        error("limits.memory_mb", f"{limits.memory_mb} is more than the {host.memory_mb} MiB this host's engine has")
    if host.runtimes is not None and runtime not in host.runtimes:
        error(
            "runtime",
            f"{runtime!r} is not available on this host's engine (it has: {', '.join(sorted(host.runtimes))}); "
            + host.runtime_advice,
        )


def _seccomp(
    settings: Mapping[str, Any], source: Path, runtime: str, error: Callable[[str, str], None]
) -> tuple[str | None, str | None]:
    """A tool's own seccomp profile, as the engine takes it, and the file it came from (None, None: the default)."""
    if not settings.get("seccomp_profile"):
        return None, None
    profile_path = seccomp_path(settings["seccomp_profile"], source.parent)
    profile = None
    try:
        profile = json.dumps(json.loads(profile_path.read_text()))
    except (OSError, ValueError) as exc:
        error("seccomp_profile", f"cannot use {profile_path}: {exc}")
    if runtime == "runsc":
        error(
            "seccomp_profile",
            "runsc does not apply a container seccomp profile (gVisor filters the host calls of its own "
            "kernel, and io_uring there is gVisor's, not the host's); set seccomp_profile: null",
        )
    return profile, str(profile_path)


def _egress(
    settings: Mapping[str, Any], host: HostFacts, runtime: str, error: Callable[[str, str], None]
) -> Egress | None:
    """A tool's allow list (None: no network)."""
    if settings.get("network", "none") == "none":
        return None
    if host.networks_missing:
        error("network", f"{host.networks_missing}; use Docker for this policy, or set network: none")
        return None
    network_errors: list[str] = []
    egress = parse_egress(settings["network"], "network", network_errors)
    for problem in network_errors:
        field, _, message = problem.partition(": ")
        error(field, message)
    if runtime == "runsc":
        error(
            "network",
            "runsc is registered here with --network=none, so a gVisor sandbox has no network to open; "
            "use runtime runc for a tool with an allow list",
        )
    return egress


def _name_errors(document: Mapping[str, Any], source: Path, known: list[str]) -> list[str]:
    """Tools named in `tools` and `approval.tools` that do not exist, each with the closest known name."""

    def unknown(field: str, name: object) -> str:
        near = closest(str(name), known)
        guess = f"did you mean '{near}'? " if near is not None else ""
        return f"{source}: {field}: no such tool {name!r} ({guess}known: {', '.join(known)})"

    errors = []
    tools = document.get("tools")
    if isinstance(tools, Mapping):
        errors += [unknown(f"tools.{name}", name) for name in tools if name not in known]
    approval = document.get("approval")
    named = approval.get("tools") if isinstance(approval, Mapping) else None
    if isinstance(named, list):
        errors += [unknown(f"approval.tools[{i}]", name) for i, name in enumerate(named) if name not in known]
    tasks = document.get("tasks")
    first = tasks.get("first") if isinstance(tasks, Mapping) else None
    if isinstance(first, list):
        errors += [unknown(f"tasks.first[{i}]", name) for i, name in enumerate(first) if name not in known]
    services = document.get("services")
    starting = services.get("tools") if isinstance(services, Mapping) else None
    if isinstance(starting, list):
        errors += [unknown(f"services.tools[{i}]", name) for i, name in enumerate(starting) if name not in known]
    return errors


def _build(
    document: dict[str, Any], source: Path, tool_names: Iterable[str], host: HostFacts
) -> tuple[Policy, list[str]]:
    known = list(tool_names)
    errors = _name_errors(document, source, known)
    from_defaults: list[str] = []
    default = _tool_policy(document.get("defaults", {}), "defaults", source, host, from_defaults)
    affects: dict[str, list[str]] = {line: [] for line in from_defaults}
    own: list[str] = []
    built = []
    for name in (name for name in known if name in document.get("tools", {})):
        found: list[str] = []
        built.append(
            (name, _tool_policy(effective_tool_settings(document, name), f"tools.{name}", source, host, found))
        )
        for line in found:  # a mistake under `defaults` is said once, naming the tools it reaches
            inherited = line.replace(f": tools.{name}.", ": defaults.", 1)
            if inherited in affects:
                affects[inherited].append(name)
            else:
                own.append(line)
    errors += [line + (f" (so for {', '.join(names)})" if names else "") for line, names in affects.items()] + own
    tools = tuple(built)
    workspace = WorkspaceSettings(**document.get("workspace", {}))
    workspace_limits: dict[str, Any] = {"workspace_exec": workspace.exec}
    if workspace.persist:  # every tool's /workspace is the persistent one, sized by the workspace section
        workspace_limits |= {"workspace_mb": workspace.size_mb, "workspace_files": workspace.files}
    default = replace(default, limits=replace(default.limits, **workspace_limits))
    tools = tuple((name, replace(tool, limits=replace(tool.limits, **workspace_limits))) for name, tool in tools)
    approval = document.get("approval", {})
    approvals = ApprovalSettings(
        commands=tuple(approval.get("commands", [])),
        tools=tuple(approval.get("tools", [])),
        writable_mounts=bool(approval.get("writable_mounts", False)),
    )
    digest = hashlib.sha256(json.dumps(document, sort_keys=True).encode()).hexdigest()
    policy = Policy(
        name=document["name"],
        description=str(document.get("description") or ""),
        tool_prefix=str(document.get("tool_prefix", "")),
        default=default,
        tools=tools,
        rate=RateLimits(**document.get("rate", {})),
        host=HostAdmission(**document.get("host", {})),
        audit=AuditSettings(**document.get("audit", {})),
        workspace=workspace,
        approval=approvals,
        tasks=TaskSettings(**{**document.get("tasks", {}), "first": tuple(document.get("tasks", {}).get("first", []))}),
        services=ServiceSettings(
            **{**document.get("services", {}), "tools": tuple(document.get("services", {}).get("tools", []))}
        ),
        source=str(source),
        digest=digest,
        notes=_mount_notes(document, known),
    )
    return policy, errors


def _mount_notes(document: Mapping[str, Any], known: list[str]) -> tuple[str, ...]:
    """A note for each tool whose own `mounts` leave out folders `defaults` mounts: lists are replaced whole."""
    inherited = [item["sandbox"] for item in document.get("defaults", {}).get("mounts", [])]
    notes = []
    for name in known:
        section = document.get("tools", {}).get(name, {})
        if "mounts" not in section:
            continue
        left_out = [path for path in inherited if path not in {item["sandbox"] for item in section["mounts"]}]
        if left_out:
            notes.append(
                f"tools.{name}.mounts replaces defaults.mounts whole: {', '.join(left_out)} "
                f"{'is' if len(left_out) == 1 else 'are'} not mounted for {name} "
                f"(list {'it' if len(left_out) == 1 else 'them'} in tools.{name}.mounts to keep {'it' if len(left_out) == 1 else 'them'})"
            )
    return tuple(notes)


def policy_errors(path: Path, tool_names: Iterable[str], host: HostFacts = HostFacts()) -> list[str]:
    """Every error in a policy file (and what it extends); empty when it is usable."""
    document, errors = resolved_document(path)
    if errors:  # the names are checked too, so that one run shows every error
        return errors + _name_errors(document, path.resolve(), list(tool_names))
    _, build_errors = _build(document, path.resolve(), tool_names, host)
    return build_errors


def load_policy(reference: str, tool_names: Iterable[str], host: HostFacts = HostFacts()) -> Policy:
    """Load a policy by shipped name or path; raises ConfigError listing every error."""
    path = policy_path(reference)
    if not path.exists():
        shipped = ", ".join(shipped_policies())
        raise ConfigError(f"no policy {reference!r}: give a shipped name ({shipped}) or a path to a .yaml file")
    known = list(tool_names)
    document, errors = resolved_document(path)
    if errors:  # the names are checked too, so that one run shows every error
        errors += _name_errors(document, path.resolve(), known)
    else:
        policy, errors = _build(document, path.resolve(), known, host)
    if errors:
        raise ConfigError("policy refused:\n  " + "\n  ".join(errors))
    return policy


def policy_problem(load: Callable[[str], object]) -> Callable[[str], str | None]:
    """What is wrong with a policy reference (None when `load` loads it), for a tokens file's entries."""

    def problem(reference: str) -> str | None:
        try:
            load(reference)
        except ConfigError as exc:
            return str(exc)
        return None

    return problem
