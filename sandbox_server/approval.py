"""Which calls a person must approve first (a policy's `approval` section), and what they are shown.

Pure logic: the server asks through the client (an elicitation) and keeps the decision.
Approval keeps a human in the loop; it is not a boundary against a client that answers
for itself, so everything a policy enforces stays enforced for approved calls too.
"""

from __future__ import annotations

import fnmatch
import json
import shlex
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from sandbox_server.policy import ApprovalSettings, ToolPolicy

__all__ = ["APPROVAL_FORM", "Approval", "approval_needed", "approval_notice"]

APPROVAL_FORM: dict[str, Any] = {"type": "object", "properties": {}}
"""The form shown with the question: nothing to fill in, the answer is accept, decline or cancel."""
SHOWN_TEXT_CHARS = 4000
"""How much of a program or cell the question shows before saying how much more there is."""


@dataclass(frozen=True, slots=True)
class Approval:
    """Why a call needs a person's yes, and what they are shown."""

    policy: str
    field: str
    """The policy field that asks (approval.commands, approval.tools, approval.writable_mounts)."""
    reason: str
    message: str
    """The question, showing exactly what will run."""


def _command_line(arguments: Mapping[str, Any]) -> tuple[str, str]:
    """(program, whole command line) of an execute_command call."""
    command = str(arguments.get("command", ""))
    if "args" in arguments:
        return command, shlex.join([command, *map(str, arguments["args"])])
    try:
        words = shlex.split(command)
    except ValueError:
        words = command.split()
    return (words[0] if words else command), command


def _matching(patterns: tuple[str, ...], program: str, line: str) -> str | None:
    """The first pattern matching the program (as written, or its file name) or the whole command line."""
    names = {program, program.rsplit("/", 1)[-1], line}
    return next((p for p in patterns if any(fnmatch.fnmatchcase(name, p) for name in names)), None)


def _shown(text: str) -> str:
    if len(text) <= SHOWN_TEXT_CHARS:
        return text
    return f"{text[:SHOWN_TEXT_CHARS]}\n… ({len(text) - SHOWN_TEXT_CHARS} more characters not shown)"


def _what_runs(tool: str, arguments: Mapping[str, Any]) -> str:
    """What the call will do, as a person reads it."""
    if tool == "execute_command":
        _, line = _command_line(arguments)
        shown = f"$ {_shown(line)}"
    elif tool == "run_python":
        shown = _shown(str(arguments.get("code", "")))
    else:
        rest = {k: v for k, v in arguments.items() if k not in ("files", "workspace")}
        shown = _shown(json.dumps(rest, indent=2, ensure_ascii=False))
    files = arguments.get("files") or []
    if files:
        names = ", ".join(str(item.get("path")) for item in files[:20])
        shown += f"\nwith {len(files)} file(s) sent in: {names}" + (" …" if len(files) > 20 else "")
    if arguments.get("workspace"):
        shown += f"\nin workspace {arguments['workspace']}"
    return shown


def approval_needed(
    settings: ApprovalSettings, policy_name: str, tool: str, tool_policy: ToolPolicy, arguments: Mapping[str, Any]
) -> Approval | None:
    """Why this call must be approved first (None when the policy lets it run without asking)."""
    field = reason = None
    if tool in settings.tools:
        field, reason = "approval.tools", f"every call of {tool}"
    elif tool == "execute_command" and settings.commands:
        pattern = _matching(settings.commands, *_command_line(arguments))
        if pattern is not None:
            field, reason = "approval.commands", f"the command matches {pattern!r}"
    if field is None and settings.writable_mounts:
        if tool_policy.writable_mounts:
            shown = ", ".join(f"{m.host_path} as {m.sandbox_path}" for m in tool_policy.writable_mounts)
            field, reason = "approval.writable_mounts", f"it can write to the host's {shown}"
    if field is None or reason is None:
        return None
    message = (
        f"Allow {tool} to run this in the sandbox? Policy '{policy_name}' asks a person first "
        f"({field}: {reason}).\n\n{_what_runs(tool, arguments)}"
    )
    return Approval(policy_name, field, reason, message)


def approval_notice(settings: ApprovalSettings, tool: str, tool_policy: ToolPolicy) -> str | None:
    """What a tool's description says of the approvals its calls may need (None: none)."""
    asks = []
    if tool in settings.tools:
        asks.append("every call (approval.tools)")
    elif tool == "execute_command" and settings.commands:
        asks.append(f"commands matching {', '.join(settings.commands)} (approval.commands)")
    if settings.writable_mounts and tool_policy.writable_mounts:
        asks.append("every call, as it can write to host folders (approval.writable_mounts)")
    if not asks:
        return None
    return "A person is asked to approve, through the client, before it runs: " + "; ".join(asks) + "."
