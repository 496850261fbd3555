"""A tool's arguments made into what runs: the input files checked and decoded, the time asked for within its
cap, the working folder kept inside the workspace, and the call's sandbox spec under its tool's policy."""

from __future__ import annotations

import base64
import binascii
from collections.abc import Mapping
from dataclasses import replace
from typing import Any

from sandbox_server.errors import Refusal
from sandbox_server.policy import ToolPolicy
from sandbox_server.sandbox.archive import safe_relative_path
from sandbox_server.sandbox.spec import InputFile, SandboxSpec
from sandbox_server.tools.base import WORKSPACE, Tool, ToolContext

__all__ = ["NAME_MAX", "check_call", "decode_files", "refuse_timeout", "sandbox_spec", "workspace_folder"]


NAME_MAX = 255
"""Bytes in one part of a path (the sandbox's filesystems refuse longer names)."""


def _quoted_path(path: str) -> str:
    """A path for a one-line message: quoted with its escapes, and cut in the middle when long."""
    shown = repr(path)
    return shown if len(shown) <= 120 else shown[:100] + "…" + shown[-10:]


def _path_problem(path: str) -> str | None:
    """Why an input file path cannot be written under /workspace, or None."""
    try:
        path.encode("utf-8")
    except UnicodeEncodeError:
        return "is not valid Unicode (it holds a lone surrogate)"
    if safe_relative_path(path) is None:
        return "must be a relative path inside /workspace (no '..')"
    longest = max(len(part.encode()) for part in path.split("/"))
    if longest > NAME_MAX:
        return f"has a name part of {longest} bytes; at most {NAME_MAX} bytes per part"
    return None


def decode_files(items: list[Mapping[str, str]], policy: ToolPolicy, policy_name: str) -> tuple[InputFile, ...]:
    """Input files from the arguments; a Refusal names the file and the limit."""
    files: list[InputFile] = []
    total = 0
    if len(items) > policy.max_input_files:
        raise Refusal(
            f"refused by policy '{policy_name}': {len(items)} input files, above the cap of "
            f"{policy.max_input_files} (policy field limits.input_files); nothing was copied in",
            "limits.input_files",
        )
    for index, item in enumerate(items):
        name_problem = _path_problem(item["path"])
        if name_problem:
            raise Refusal(
                f"refused by policy '{policy_name}': files[{index}].path {_quoted_path(item['path'])} {name_problem}",
                f"files[{index}].path",
            )
        if item.get("encoding", "utf-8") == "base64":
            try:
                content = base64.b64decode(item["content"], validate=True)
            except (binascii.Error, ValueError):
                raise Refusal(
                    f"refused by policy '{policy_name}': files[{index}].content is not valid base64",
                    f"files[{index}].content",
                ) from None
        else:
            content = item["content"].encode("utf-8", "surrogatepass")
        total += len(content)
        if total > policy.max_input_file_bytes:
            raise Refusal(
                f"refused by policy '{policy_name}': input files exceed {policy.max_input_file_bytes} bytes "
                "(policy field limits.input_file_bytes); send less or raise the limit",
                "limits.input_file_bytes",
            )
        executable = bool(item.get("executable", False))
        if executable and not policy.limits.workspace_exec:
            raise Refusal(
                f"refused by policy '{policy_name}': files[{index}] asks to be executable, but programs may not "
                "run from /workspace under this policy (field workspace.exec)",
                "workspace.exec",
            )
        mode = 0o755 if executable else 0o644
        files.append(InputFile(item["path"], content, mode, float(item["mtime"]) if "mtime" in item else None))
    return tuple(files)


def refuse_timeout(requested: float | None, policy: ToolPolicy, policy_name: str, task: bool = False) -> None:
    """Refuse a call that asks for more time than the policy allows (a task: limits.max_task_s)."""
    cap, field = (policy.max_task_s, "limits.max_task_s") if task else (policy.max_timeout_s, "limits.max_timeout_s")
    if requested is not None and requested > cap:
        longer = (
            ""
            if task or policy.max_task_s <= cap
            else f", or up to {policy.max_task_s:g} s as a task (an MCP task: a 2025-11-25 client asks with `task`, "
            "a 2026-07-28 one names the io.modelcontextprotocol/tasks extension)"
        )
        raise Refusal(
            f"refused: timeout_s {requested:g} is above the cap of {cap:g} s set by policy '{policy_name}' "
            f"(field {field}); ask for {cap:g} or less{longer}",
            field,
        )


def check_call(
    tool: Tool, args: Mapping[str, Any], policy: ToolPolicy, policy_name: str, task: bool
) -> tuple[InputFile, ...]:
    """Every refusal valid arguments can meet with no engine: the time asked for, the working folder, the input
    files (which it returns, decoded) and the tool's own rules."""
    refuse_timeout(args.get("timeout_s"), policy, policy_name, task)
    if "workdir" in args and workspace_folder(args["workdir"]) is None:
        raise Refusal(
            f"refused: workdir {_quoted_path(args['workdir'])} must be {WORKSPACE} or a folder under it (no '..'); "
            "a call never sets the container's working directory",
            "workdir",
        )
    tool.refuse(args, policy, policy_name)
    return decode_files(args.get("files", []), policy, policy_name)


OFFLINE_ENV = (("PIP_RETRIES", "0"), ("npm_config_fetch_retries", "0"))
"""Without a network, package tools fail at once instead of retrying for seconds."""


def sandbox_spec(
    args: Mapping[str, Any],
    ctx: ToolContext,
    argv: tuple[str, ...],
    stdin: bytes,
    extra_env: tuple[tuple[str, str], ...] = (),
) -> SandboxSpec:
    """The spec of one call from its arguments (checked by `check_call`) and its tool's policy."""
    policy = ctx.policy
    workdir = workspace_folder(args.get("workdir", WORKSPACE))
    assert workdir is not None, "check_call refuses a working folder outside the workspace"
    limits = policy.limits
    if "timeout_s" in args:
        limits = replace(limits, timeout_s=float(args["timeout_s"]))
    elif ctx.task:
        limits = replace(limits, timeout_s=policy.max_task_s)
    network, network_env = (
        ("none", OFFLINE_ENV) if ctx.proxy is None else (ctx.proxy.network, ctx.proxy.environment(ctx.service_names))
    )
    template = policy.container_spec()
    return replace(
        template,
        mounts=template.mounts + (ctx.proxy.mounts() if ctx.proxy is not None else ()),
        argv=argv,
        limits=limits,
        network=network,
        call_env=network_env + extra_env,
        stdin=stdin,
        files=ctx.files,
        call_workdir=workdir,
        service_network=ctx.service_network,
    )


def workspace_folder(path: str) -> str | None:
    """A working folder as a normalised path relative to the workspace ("" for itself), or None when outside.

    Lexical only (the folder may not exist yet): `/proc/self/fd/N` and every other path
    outside the workspace is refused on the host, so the engine never sees it.
    """
    if path.rstrip("/") == WORKSPACE:
        return ""
    if path.startswith(WORKSPACE + "/"):
        path = path[len(WORKSPACE) + 1 :]
    if path in (".", "./"):
        return ""
    return None if _path_problem(path) else safe_relative_path(path)
