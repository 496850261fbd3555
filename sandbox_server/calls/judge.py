"""A call judged by a policy without running it.

The judgment is the one a call meets before it waits for anything, made by the same checks: its tool offered,
the size and shape of its arguments, the time it asks for, its working folder, its input files, the tool's own
rules (a program's name, a shell, a path's root), and whether a person must approve it; and, for a host its
sandbox reaches, the allow list. `policy test` states such judgments and checks them; `policy replay` makes them
again, under a changed policy, for the calls an audit trail recorded.

A trail keeps a call's arguments only when its policy says so (`audit.include_arguments`); otherwise each record
keeps what a policy judges of them (`judged`): the program's name and no argument of it, the programs a shell line
runs, the path analyze_csv reads, the time asked for, how many files were sent and their bytes. Judged from that,
what a policy says of the rest (an approval pattern naming a program's arguments) is named as not judged.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from jsonschema.protocols import Validator

from sandbox_server.access.approval import approval_needed, shell_commands
from sandbox_server.calls.arguments import check_arguments
from sandbox_server.errors import Refusal
from sandbox_server.policy import Policy
from sandbox_server.policy.ecma import SchemaValidator
from sandbox_server.tools import Tool, offers
from sandbox_server.tools.arguments import check_call

__all__ = ["Judge", "Verdict", "judged_facts"]

Decision = Literal["allowed", "refused", "approval"]
KEPT_PROGRAMS = 32
"""Programs of one shell line a record names (more are counted)."""
KEPT_CHARS = 256
"""The longest program name or path a record keeps."""
READ_CHARS = 8192
"""How much of a shell line is read for the programs it runs (reading it costs more than its length)."""


@dataclass(frozen=True, slots=True)
class Verdict:
    """What a policy says of a call: it runs, it is refused (by which field, why), or a person is asked first."""

    decision: Decision
    field: str | None = None
    reason: str = ""
    unjudged: tuple[str, ...] = ()
    """What the policy says that could not be judged from what was known of the call."""

    def said(self) -> str:
        """`allowed`, `refused (commands.allow)`, `approval (approval.tools)`."""
        return self.decision if self.field is None else f"{self.decision} ({self.field})"


def judged_facts(tool: str, arguments: Mapping[str, Any], long: bool) -> dict[str, Any]:
    """What an audit record keeps of a call's arguments for a later judgment: arguments of the same shape holding
    only what a policy reads (no command's arguments, no code, no file's content), and the input files counted."""
    kept: dict[str, Any] = {}
    for name in ("timeout_s", "workdir"):
        if name in arguments:
            kept[name] = arguments[name] if name == "timeout_s" else str(arguments[name])[:KEPT_CHARS]
    if tool == "execute_command" and isinstance(arguments.get("command"), str):
        if "args" in arguments:  # the program alone: its arguments may carry anything
            kept |= {"command": arguments["command"][:KEPT_CHARS], "args": []}
        else:  # the programs the line runs, as far as reading it tells
            line = arguments["command"][:READ_CHARS]  # a hostile line of megabytes is read no further
            programs = [words[0][:KEPT_CHARS] for words in shell_commands(line) if words]
            kept["command"] = " ; ".join(dict.fromkeys(programs[:KEPT_PROGRAMS]))
    elif tool == "analyze_csv" and isinstance(arguments.get("filepath"), str):
        kept |= {"filepath": arguments["filepath"][:KEPT_CHARS], "operations": []}
    facts: dict[str, Any] = {"arguments": kept}
    files = arguments.get("files")
    if isinstance(files, list) and files:
        facts["files"] = len(files)
        facts["files_bytes"] = sum(_content_bytes(item) for item in files if isinstance(item, Mapping))
        facts["executable_files"] = sum(1 for item in files if isinstance(item, Mapping) and item.get("executable"))
    if long:
        facts["long"] = True
    return facts


def _content_bytes(item: Mapping[str, Any]) -> int:
    content = item.get("content")
    if not isinstance(content, str):
        return 0
    if item.get("encoding") == "base64":  # its size, not a decoding of it: the call decodes it once, later
        return 0 if len(content) % 4 else len(content) // 4 * 3 - content[-2:].count("=")
    return len(content.encode("utf-8", "surrogatepass"))


class Judge:
    """Judges calls and hosts under one policy (the tools given: every tool this server has)."""

    def __init__(self, policy: Policy, tools: list[Tool]) -> None:
        self.policy = policy
        self.tools = {tool.name: tool for tool in tools}
        self._validators: dict[str, Validator] = {}

    def call(self, tool_name: str, arguments: Mapping[str, Any], long: bool = False) -> Verdict:
        """A call whose arguments are known in full (a policy test's case, a trail that keeps them)."""
        policy, tool = self.policy, self.tools.get(tool_name)
        offered = self._offered(tool_name, tool)
        if offered is not None:
            return offered
        assert tool is not None
        try:
            validator = self._validators.get(tool_name) or SchemaValidator(tool.input_schema)
            self._validators[tool_name] = validator
            check_arguments(tool_name, validator, arguments, policy)
            check_call(tool, arguments, policy.for_tool(tool_name), policy.name, long)
        except Refusal as refusal:
            return Verdict("refused", refusal.field, refusal.message)
        return self._approval(tool_name, arguments, ())

    def recorded(self, tool_name: str, facts: Mapping[str, Any] | None, arguments_bytes: int | None) -> Verdict:
        """A call known by what its audit record kept (`judged_facts`, the arguments' size; None: a record from
        before they were kept, judged by its tool and size alone)."""
        policy, tool = self.policy, self.tools.get(tool_name)
        offered = self._offered(tool_name, tool)
        if offered is not None:
            return offered
        assert tool is not None
        tool_policy = policy.for_tool(tool_name)
        kept = (facts or {}).get("arguments") or {}
        try:
            if arguments_bytes is not None and arguments_bytes > tool_policy.max_argument_bytes:
                raise Refusal(
                    f"arguments of {arguments_bytes} bytes are above the cap of {tool_policy.max_argument_bytes}",
                    "limits.argument_bytes",
                )
            if facts is None:
                return self._approval(tool_name, {}, ())
            check_call(tool, kept, tool_policy, policy.name, bool(facts.get("long")))
            files, sent = int(facts.get("files") or 0), int(facts.get("files_bytes") or 0)
            if files > tool_policy.max_input_files:
                raise Refusal(f"{files} input files are above the cap of {tool_policy.max_input_files}",
                              "limits.input_files")  # fmt: skip
            if sent > tool_policy.max_input_file_bytes:
                raise Refusal(f"input files of {sent} bytes are above the cap of {tool_policy.max_input_file_bytes}",
                              "limits.input_file_bytes")  # fmt: skip
            if facts.get("executable_files") and not tool_policy.limits.workspace_exec:
                raise Refusal("an input file asks to be executable, and no program may run from /workspace",
                              "workspace.exec")  # fmt: skip
        except Refusal as refusal:
            return Verdict("refused", refusal.field, refusal.message)
        unjudged: tuple[str, ...] = ()
        commands = policy.approval.commands
        if tool_name == "execute_command" and any(" " in pattern for pattern in commands):
            unjudged = ("approval.commands patterns that name a program's arguments (the trail keeps programs' "
                        "names alone unless audit.include_arguments is set)",)  # fmt: skip
        return self._approval(tool_name, kept, unjudged)

    def host(self, tool_name: str, host: str, port: int) -> Verdict:
        """A host a tool's sandbox reaches through the proxy: opened by the allow list, put to a person, or refused."""
        egress = self.policy.for_tool(tool_name).egress
        name = self.policy.name
        if egress is None:
            return Verdict("refused", "network", f"policy '{name}' gives {tool_name} no network")
        if egress.admits(host, port):
            return Verdict("allowed")
        if egress.ask is not None:
            return Verdict("approval", "network.ask", f"{host}:{port} is not on the allow list; a person is asked")
        return Verdict("refused", "network.allow", f"{host}:{port} is not on policy '{name}''s allow list")

    def _offered(self, tool_name: str, tool: Tool | None) -> Verdict | None:
        if tool is not None and offers(self.policy, tool):
            return None
        return Verdict(
            "refused", f"tools.{tool_name}.enabled", f"policy '{self.policy.name}' does not offer {tool_name}"
        )

    def _approval(self, tool_name: str, arguments: Mapping[str, Any], unjudged: tuple[str, ...]) -> Verdict:
        policy = self.policy
        needed = approval_needed(policy.approval, policy.name, tool_name, policy.for_tool(tool_name), arguments)
        if needed is None:
            return Verdict("allowed", unjudged=unjudged)
        return Verdict("approval", needed.field, needed.reason, unjudged)
