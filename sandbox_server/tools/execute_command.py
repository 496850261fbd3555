"""execute_command: run one program in a fresh, hardened container."""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import replace
from typing import Any

from sandbox_server.errors import Refusal
from sandbox_server.policy import ToolPolicy
from sandbox_server.tools.arguments import sandbox_spec
from sandbox_server.tools.base import (
    FILES_SCHEMA,
    SANDBOX_ANNOTATIONS,
    TIMEOUT_SCHEMA,
    WORKSPACE_ARGUMENT,
    Sandboxed,
    ToolContext,
    ToolOutcome,
    result_schema,
)
from sandbox_server.tools.outcome import outcome_from_execution
from sandbox_server.tools.schemas import SERVICE_ARGUMENT
from sandbox_server.tools.services import start_service
from sandbox_server.tools.shell_session import session_argv
from sandbox_server.tools.terminal import TTY_SCHEMA, rendered, size_of, tty_argv

__all__ = ["EXECUTION_PROPERTIES", "EXECUTION_REQUIRED", "OUTPUT_SCHEMA", "ExecuteCommand"]

NO_NUL = "^[^\\u0000]*$"
BACKGROUND = re.compile(r"(?<![&|><])&(?=\s|$|[;)])|\b(?:nohup|disown|setsid)\b")
"""A shell command line that starts something in the background."""
BACKGROUND_NOTE = (
    "processes left running in the background end with the call (its sandbox is removed); to keep a server "
    "running for later calls, start it with the `service` argument"
)

EXECUTION_PROPERTIES: dict[str, Any] = {
    "exit_code": {"type": ["integer", "null"], "description": "null when the program was killed"},
    "stdout": {"type": "string"},
    "stderr": {"type": "string"},
    "timed_out": {"type": "boolean"},
    "oom_killed": {"type": "boolean"},
    "duration_ms": {"type": "integer"},
    "truncated": {"type": "boolean", "description": "stdout or stderr was cut to the output cap"},
    "files": {
        "type": "array",
        "items": {
            "type": "object",
            "properties": {
                "path": {"type": "string"},
                "size": {"type": "integer"},
                "modified": {"type": "string", "description": "when the program last changed it (ISO 8601, UTC)"},
                "uri": {"type": "string", "description": "read it with resources/read (absent: not returned)"},
            },
            "required": ["path", "size"],
        },
    },
}
"""What a program that ran left: run_python shares it."""
EXECUTION_REQUIRED = list(EXECUTION_PROPERTIES)
OUTPUT_SCHEMA = result_schema("execute_command: result", EXECUTION_PROPERTIES, EXECUTION_REQUIRED)


def _refuse_program(command: str, policy: ToolPolicy, policy_name: str) -> None:
    """Refuse a program the policy's command lists do not admit."""
    program = command.rsplit("/", 1)[-1]
    if program in policy.commands_deny:
        raise Refusal(
            f"refused: program {program!r} is denied by policy '{policy_name}' (field commands.deny)", "commands.deny"
        )
    if policy.commands_allow and program not in policy.commands_allow:
        allowed = ", ".join(policy.commands_allow)
        raise Refusal(
            f"refused: program {program!r} is not allowed by policy '{policy_name}' (field commands.allow: {allowed})",
            "commands.allow",
        )


class ExecuteCommand(Sandboxed):
    """Run a command in a fresh container that is destroyed afterwards."""

    name = "execute_command"
    title = "Run a shell command in a sandbox"
    description = (
        "Run a command in a fresh Linux sandbox (Debian; no network; read-only root; writable /workspace, /tmp). "
        "Files written to /workspace/out come back. Where workspaces are kept, the next call finds /workspace and the "
        "shell (bash) as this one left them: its folder, exported variables, functions, aliases, options. "
        "Processes end with the call (`service` keeps a server running).\n"
        'Example: {"command": "wc -l data.txt", "files": [{"path": "data.txt", "content": "a\\nb\\n"}]}'
    )
    input_schema: dict[str, Any] = {
        "type": "object",
        "properties": {
            "command": {
                "type": "string",
                "minLength": 1,
                "pattern": NO_NUL,
                "description": "A shell command line, or the program to run when `args` is given.",
            },
            "args": {
                "type": "array",
                "items": {"type": "string", "pattern": NO_NUL},
                "maxItems": 10000,
                "description": "Arguments passed literally (no shell, no expansion).",
            },
            "stdin": {"type": "string", "description": "Given on standard input."},
            "workdir": {
                "type": "string",
                "minLength": 1,
                "maxLength": 4096,
                "pattern": NO_NUL,
                "description": "A folder under /workspace to run in (made if missing).",
            },
            "tty": TTY_SCHEMA,
            "reset": {
                "type": "boolean",
                "description": "A clean shell: nothing carried over.",
            },
            "timeout_s": TIMEOUT_SCHEMA,
            "files": FILES_SCHEMA,
            "workspace": WORKSPACE_ARGUMENT,
            "service": SERVICE_ARGUMENT,
        },
        "title": "execute_command: arguments",
        "required": ["command"],
        "additionalProperties": False,
    }
    output_schema = OUTPUT_SCHEMA
    annotations = SANDBOX_ANNOTATIONS

    def refuse(self, args: Mapping[str, Any], policy: ToolPolicy, policy_name: str) -> None:
        """A program the policy does not allow, or a shell where it allows none."""
        if "args" in args:
            _refuse_program(args["command"], policy, policy_name)
        elif not policy.allow_shell:
            raise Refusal(
                f"refused: policy '{policy_name}' does not allow a shell (field commands.shell); "
                "give the program in `command` and its arguments in `args`",
                "commands.shell",
            )

    async def run(self, args: Mapping[str, Any], ctx: ToolContext) -> ToolOutcome:
        """Build the spec from the arguments and the policy (checked by `refuse`), run it, describe what happened."""
        session: tuple[tuple[str, str], ...] = ()
        if "args" in args:
            argv: tuple[str, ...] = (args["command"], *args["args"])
        elif ctx.kept_workspace and "service" not in args:
            argv, session = session_argv(args["command"], ctx.policy.image, "workdir" in args, bool(args.get("reset")))
        else:
            argv = ("/bin/sh", "-c", args["command"])
        size = size_of(args.get("tty", False)) if "service" not in args else None
        if size is not None:
            argv = tty_argv(argv, size)
        spec = sandbox_spec(args, ctx, argv, args.get("stdin", "").encode("utf-8", "surrogatepass"), session)
        if "service" in args:
            return await start_service(args, ctx, spec, self.name)
        result = await ctx.runtime.run(spec, ctx.hooks)
        if size is not None:
            result = replace(result, stdout=rendered(result.stdout))
        outcome = outcome_from_execution(result, spec)
        if "args" not in args and BACKGROUND.search(args["command"]):
            outcome = replace(outcome, notes=(*outcome.notes, BACKGROUND_NOTE))
        return outcome
