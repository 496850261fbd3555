"""files: read, write, edit exactly, find and grep in the call's workspace, each in a sandbox of its own.

What a coding agent's file tools do (read with line numbers and ranges, an edit by exact match that
sends the diff back, a glob, a regex search), on the workspace its shell calls use. A path is checked
on the host to lie inside /workspace, as every path of every tool is; the work itself is done by a
small program (files_program.py) in a fresh sandbox on that workspace, so that links, odd names and
what the sandbox's user may not touch are the kernel's to decide, never the server's.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import replace
from importlib import resources
from typing import Any

from jsonschema import Draft202012Validator

from sandbox_server.errors import Refusal
from sandbox_server.policy import Policy, ToolPolicy
from sandbox_server.tools.arguments import sandbox_spec, workspace_folder
from sandbox_server.tools.base import (
    SANDBOX_ANNOTATIONS,
    WORKSPACE,
    WORKSPACE_ARGUMENT,
    ToolContext,
    ToolOutcome,
    result_schema,
)
from sandbox_server.tools.outcome import outcome_from_execution

__all__ = ["Files"]

PROGRAM = resources.files("sandbox_server.tools").joinpath("files_program.py").read_text()
"""The program run in the sandbox (`python3 -I -S -c`), with the request as JSON on its stdin."""

READ_LINES = 2000
"""Lines a `read` shows when it is not given `limit`."""
MAX_RESULTS = 500
"""Paths a `find`, or matching lines a `grep`, returns at most."""

READS = frozenset({"read", "find", "grep"})
"""The actions whose program writes nothing in the workspace."""
NEEDS = {"read": (), "write": ("content",), "edit": ("old", "new"), "find": ("pattern",), "grep": ("pattern",)}
"""The arguments each action needs besides `action` (and `path`, which `read`, `write` and `edit` need)."""

FILE_RESULT: dict[str, Any] = {
    "action": {"type": "string"},
    "path": {"type": "string", "description": "Relative to /workspace."},
    "size": {"type": "integer", "description": "The file's size in bytes (after a write or an edit)."},
    "lines": {"type": "integer", "description": "read: lines in the file."},
    "offset": {"type": "integer", "description": "read: the first line shown (from 1)."},
    "shown": {"type": "integer", "description": "read: lines shown."},
    "content": {"type": "string", "description": "read: the lines, each as its number, a tab and its text."},
    "more": {"type": "boolean", "description": "Cut short: more lines, paths or matches than shown."},
    "created": {"type": "boolean", "description": "write: the file did not exist."},
    "diff": {"type": "string", "description": "edit: the unified diff of the change."},
    "pattern": {"type": "string"},
    "paths": {"type": "array", "items": {"type": "string"}, "description": "find: the paths that match."},
    "matches": {
        "type": "array",
        "items": {
            "type": "object",
            "properties": {"path": {"type": "string"}, "line": {"type": "integer"}, "text": {"type": "string"}},
            "required": ["path", "line", "text"],
        },
        "description": "grep: each matching line.",
    },
    "in_files": {"type": "integer", "description": "grep: files with a matching line."},
    "duration_ms": {"type": "integer"},
}


def _without_services(schema: dict[str, Any]) -> dict[str, Any]:
    """A result schema with no service fields: a files call starts none."""
    properties = {k: v for k, v in schema["properties"].items() if k not in ("service", "services", "network")}
    return {**schema, "properties": properties, "anyOf": schema["anyOf"][:2]}


def _refuse_path(args: Mapping[str, Any]) -> str:
    """The path as a folder relative to the workspace ("" for itself); a Refusal when it lies outside."""
    path = args.get("path", WORKSPACE)
    relative = workspace_folder(path)
    if relative is None:
        raise Refusal(
            f"refused: path {path!r} must be {WORKSPACE} or lie under it (relative paths start there; no '..')",
            "path",
            kind="invalid_arguments",
        )
    return relative


class Files:
    """Read, write and edit files of the workspace, and find and grep in it, each call in a fresh sandbox."""

    name = "files"
    title = "Edit and search workspace files"
    description = (
        "The workspace's files. `read`: numbered lines (`offset`, `limit`). `write`: `content` as the whole file. "
        "`edit`: `old`, found exactly once, replaced by `new`; the diff comes back. `find`: paths matching a glob "
        "(`**/*.py`). `grep`: lines matching a regex.\n"
        'Example: {"action": "grep", "pattern": "TODO"}'
    )
    input_schema: dict[str, Any] = {
        "type": "object",
        "properties": {
            "action": {"enum": ["read", "write", "edit", "find", "grep"]},
            "path": {
                "type": "string",
                "minLength": 1,
                "maxLength": 4096,
                "description": "A file or folder (default: /workspace).",
            },
            "offset": {"type": "integer", "minimum": 1, "description": "read: the first line (from 1)."},
            "limit": {"type": "integer", "minimum": 1, "maximum": 100000, "description": "read: lines at most."},
            "content": {"type": "string"},
            "old": {"type": "string", "minLength": 1},
            "new": {"type": "string"},
            "pattern": {"type": "string", "minLength": 1, "maxLength": 4096},
            "workspace": WORKSPACE_ARGUMENT,
        },
        "title": "files: arguments",
        "required": ["action"],
        "additionalProperties": False,
    }
    output_schema = _without_services(result_schema("files: result", FILE_RESULT, ["action", "duration_ms"]))
    annotations = SANDBOX_ANNOTATIONS
    sandbox = True

    def of_use(self, policy: Policy) -> bool:
        """Only where workspaces are kept: elsewhere each call's workspace starts empty."""
        return policy.workspace.persist

    def refuse(self, args: Mapping[str, Any], policy: ToolPolicy, policy_name: str) -> None:
        """An action without what it needs, a path outside the workspace, content above the input cap."""
        action = args["action"]
        for needed in (*NEEDS[action], *(("path",) if action in ("read", "write", "edit") else ())):
            if needed not in args:
                raise Refusal(f"refused: `{action}` needs `{needed}`", needed, kind="invalid_arguments")
        _refuse_path(args)
        written = len(args.get("content", "").encode("utf-8", "surrogatepass")) + len(
            args.get("new", "").encode("utf-8", "surrogatepass")
        )
        if written > policy.max_input_file_bytes:
            raise Refusal(
                f"refused by policy '{policy_name}': {written} bytes to write, above the cap of "
                f"{policy.max_input_file_bytes} (policy field limits.input_file_bytes); nothing was written",
                "limits.input_file_bytes",
            )

    async def run(self, args: Mapping[str, Any], ctx: ToolContext) -> ToolOutcome:
        """Run the program on the request; its answer (hostile input) becomes the result."""
        action = args["action"]
        request = {
            "action": action,
            "path": _refuse_path(args),
            "offset": args.get("offset", 1),
            "limit": args.get("limit", READ_LINES),
            "max_bytes": max(1024, ctx.policy.limits.output_bytes - 4096),
            "max_results": MAX_RESULTS,
            **{key: args[key] for key in ("content", "old", "new", "pattern") if key in args},
        }
        stdin = json.dumps(request).encode("utf-8", "surrogatepass")
        spec = sandbox_spec({}, ctx, ("python3", "-I", "-S", "-c", PROGRAM), stdin)
        spec = replace(spec, reads_only=action in READS)
        result = await ctx.runtime.run(spec, ctx.hooks)
        ran = outcome_from_execution(result, spec)
        answer = _answer(result.stdout) if result.exit_code == 0 and not result.truncated else None
        if answer is None:
            return replace(ran, is_error=True)
        if "refused" in answer:
            message = f"refused: {answer['refused']}"
            return ToolOutcome.failed("invalid_arguments", message, ctx.policy_name, str(answer.get("field")))
        if not _valid(action, answer["ok"]):
            return replace(
                ran, headline=f"the files program's answer was not understood · {ran.headline}", is_error=True
            )
        return _rendered(action, answer["ok"], result.duration_ms, ran)


def _answer(stdout: bytes) -> dict[str, Any] | None:
    """The program's JSON answer, or None when it is not one."""
    try:
        answer = json.loads(stdout)
    except ValueError:
        return None
    if not isinstance(answer, dict):
        return None
    if isinstance(answer.get("ok"), dict) or isinstance(answer.get("refused"), str):
        return answer
    return None


ANSWERS = {
    "read": ("path", "size", "lines", "offset", "shown", "content", "more"),
    "write": ("path", "size", "created"),
    "edit": ("path", "size", "diff"),
    "find": ("pattern", "paths", "more"),
    "grep": ("pattern", "matches", "in_files", "more"),
}
"""What the program's answer to each action holds (and the result shows)."""
_CHECK = Draft202012Validator({"type": "object", "properties": {**FILE_RESULT, "cut_lines": {"type": "integer"}}})


def _valid(action: str, ok: dict[str, Any]) -> bool:
    """The answer holds its action's fields, each of its schema's type (it is read as hostile input)."""
    return all(key in ok for key in ANSWERS[action]) and _CHECK.is_valid(ok)


def _rendered(action: str, ok: dict[str, Any], duration_ms: int, ran: ToolOutcome) -> ToolOutcome:
    """The result a model reads: a headline that says what was done, the text, and the structured fields."""
    structured = {key: value for key, value in ok.items() if key in FILE_RESULT and key != "cut_lines"}
    structured.update(action=action, duration_ms=duration_ms)
    notes: list[str] = []
    if action == "read":
        last = ok["offset"] + ok["shown"] - 1
        headline = f"{ok['path']}: lines {ok['offset']}-{last} of {ok['lines']} ({ok['size']} bytes)"
        if ok["more"]:
            notes.append(f"more lines follow: read on with offset {last + 1}")
        if ok.get("cut_lines"):
            notes.append(f"{ok['cut_lines']} line(s) longer than 2000 characters cut, marked with …")
        body = ok["content"]
    elif action == "write":
        headline = f"{ok['path']}: {'created' if ok['created'] else 'written'}, {ok['size']} bytes"
        body = ""
    elif action == "edit":
        headline = f"{ok['path']}: edited, {ok['size']} bytes"
        body = ok["diff"]
    elif action == "find":
        headline = f"{len(ok['paths'])} path(s) match {ok['pattern']!r}"
        body = "\n".join(ok["paths"])
    else:
        headline = f"{len(ok['matches'])} line(s) in {ok['in_files']} file(s) match {ok['pattern']!r}"
        body = "\n".join(f"{m['path']}:{m['line']}:{m['text']}" for m in ok["matches"])
    if action in ("find", "grep") and ok["more"]:
        notes.append(f"more than {MAX_RESULTS} found: only the first are shown; narrow `path` or `pattern`")
    return ToolOutcome(
        headline=f"{headline} · {duration_ms} ms",
        is_error=False,
        sections=((action, body),) if body else (),
        structured=structured,
        notes=tuple(notes),
        audit=ran.audit,
    )
