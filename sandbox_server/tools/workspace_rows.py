"""What the `workspaces` tool says: the shapes of its answer, and each workspace or snapshot as a row of it."""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import anyio.to_thread

from sandbox_server.tools.base import ToolOutcome
from sandbox_server.workspaces.compare import compared
from sandbox_server.workspaces.naming import shown_time
from sandbox_server.workspaces.records import WorkspaceRecord
from sandbox_server.workspaces.store import WorkspaceStore

if TYPE_CHECKING:
    from sandbox_server.services.manager import Services

__all__ = [
    "BRANCH_SCHEMA",
    "REFERENCE",
    "WORKSPACE_SCHEMA",
    "call_summary",
    "compare_rows",
    "listing",
    "row",
    "workspace_event",
]

WORKSPACE_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "id": {"type": "string"},
        "name": {"type": ["string", "null"], "description": "Its caller's name for it (null: not named)"},
        "created": {"type": "string", "description": "ISO 8601 UTC"},
        "last_used": {"type": "string", "description": "ISO 8601 UTC"},
        "size_bytes": {"type": "integer"},
        "expires_in_s": {"type": "number", "description": "Removed after this long unused"},
        "current": {"type": "boolean", "description": "The workspace this call worked in"},
        "snapshot": {"type": "boolean", "description": "A snapshot: kept as it was taken, restored to work in"},
        "origin": {"type": ["string", "null"], "description": "What it was forked, snapshotted or restored from"},
        "paused": {"type": "boolean", "description": "Paused: no container, no mount; its next call resumes it"},
        "services": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {
                    "name": {"type": "string"},
                    "port": {"type": "integer"},
                    "tool": {"type": "string"},
                    "command": {"type": "string"},
                    "running": {"type": "boolean"},
                },
                "required": ["name", "port", "tool", "command", "running"],
            },
            "description": "The services it starts again when resumed, as their calls asked",
        },
    },
    "required": [
        "id",
        "name",
        "created",
        "last_used",
        "size_bytes",
        "expires_in_s",
        "current",
        "snapshot",
        "origin",
        "paused",
        "services",
    ],
}
CHANGES_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {kind: {"type": "array", "items": {"type": "string"}} for kind in ("created", "modified", "deleted")}
    | {"renamed": {"type": "array", "items": {"type": "object"}}, "more": {"type": "integer"}},
}
VARIABLE_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "about": {"type": "string"}, "was": {"type": "string"}},
    "required": ["name", "about"],
}
BRANCH_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "workspace": {"type": "string"},
        "name": {"type": ["string", "null"]},
        "size_bytes": {"type": "integer"},
        "files": CHANGES_SCHEMA,
        "variables": {
            "type": "object",
            "properties": {k: {"type": "array", "items": VARIABLE_SCHEMA} for k in ("added", "changed", "removed")}
            | {"more": {"type": "integer"}},
        },
        "call": {
            "type": "object",
            "properties": {
                "tool": {"type": "string"},
                "is_error": {"type": "boolean"},
                "exit_code": {"type": ["integer", "null"]},
                "headline": {"type": "string"},
                "stdout": {"type": "string", "description": "The end of its output"},
            },
            "required": ["tool", "is_error", "exit_code", "headline", "stdout"],
            "description": "branch: the call run in this branch",
        },
    },
    "required": ["workspace", "name", "size_bytes", "files", "variables"],
}
REFERENCE: dict[str, Any] = {
    "type": "string",
    "pattern": "^(ws-[A-Za-z0-9_-]{22}|(?!ws-)[a-z0-9][a-z0-9._-]{0,62})$",
    "x-in-words": "a workspace's or snapshot's id (ws-…) or the name its caller gave it",
}


def _command_of(entry: Mapping[str, Any]) -> str:
    """A recorded service's command as its call gave it (run_python's code, or execute_command's command)."""
    arguments = entry.get("arguments") or {}
    said = arguments.get("command", arguments.get("code", ""))
    extra = arguments.get("args")
    return " ".join([str(said), *map(str, extra)]) if isinstance(extra, list) else str(said)


def row(
    item: WorkspaceRecord, current: WorkspaceRecord, keep_s: float, idle_s: float, running: set[str]
) -> dict[str, Any]:
    """One workspace or snapshot as the answer lists it; `running`: the names of its services running now."""
    lasts = keep_s if item.name is not None or item.snapshot else idle_s
    return {
        "id": item.id,
        "name": item.name,
        "created": shown_time(item.created),
        "last_used": shown_time(item.last_used),
        "size_bytes": item.size_bytes,
        "expires_in_s": round(max(0.0, item.last_used + lasts - time.time()), 1),
        "current": item.id == current.id,
        "snapshot": item.snapshot,
        "origin": item.origin,
        "paused": item.paused,
        "services": [
            {
                "name": str(entry.get("name")),
                "port": int(entry.get("port") or 0),
                "tool": str(entry.get("tool")),
                "command": _command_of(entry)[:200],
                "running": str(entry.get("name")) in running,
            }
            for entry in item.services
        ],
    }


SHOWN = 2000
"""The end of a branch call's output its row shows."""


async def compare_rows(
    store: WorkspaceStore, base: WorkspaceRecord, branches: list[WorkspaceRecord]
) -> list[dict[str, Any]]:
    """What each branch changed from the base (files and variables), read off the event loop."""

    def read() -> tuple[dict[str, Any], dict[str, Any]]:
        every = [base, *branches]
        return {r.id: store.states(r) for r in every}, {r.id: store.variables_index(r) for r in every}

    states, indexes = await anyio.to_thread.run_sync(read)
    return [compared(base, branch, states, indexes) for branch in branches]


def call_summary(tool: str, outcome: ToolOutcome | None) -> dict[str, Any]:
    """A branch's call as its row says it: the tool, whether it failed, its exit code and the end of its output."""
    if outcome is None:
        return {"tool": tool, "is_error": True, "exit_code": None, "headline": "it did not run", "stdout": ""}
    structured = outcome.structured or {}
    code = structured.get("exit_code")
    return {
        "tool": tool,
        "is_error": outcome.is_error,
        "exit_code": code if isinstance(code, int) else None,
        "headline": outcome.headline[:300],
        "stdout": str(structured.get("stdout") or "")[-SHOWN:],
    }


def listing(
    store: WorkspaceStore, record: WorkspaceRecord, services: Services | None
) -> tuple[list[dict[str, Any]], list[str]]:
    """The caller's workspaces and snapshots after a call, as rows and as lines of its text (`record`: the call's
    own)."""
    rows = [
        row(
            item, record, store.settings.keep_s, store.settings.idle_ttl_s,
            {s.name for s in services.running(item.id)} if services is not None else set(),
        )
        for item in store.listed(record.session, record.tenant)
    ]  # fmt: skip
    lines = [
        ("snapshot " if row["snapshot"] else "")
        + f"{row['name'] or '(not named)'}: {row['id']}, {row['size_bytes']} bytes, last used {row['last_used']}"
        + (" (this call's)" if row["current"] else "")
        for row in rows
    ]
    return rows, lines


def workspace_event(
    args: Mapping[str, Any], record: WorkspaceRecord, name: str | None, extra: Mapping[str, Any]
) -> dict[str, Any]:
    """What the audit record says the call did to which workspace (the record says who)."""
    action = args["action"]
    event = {"action": action, "workspace": record.id, "name": name}
    event |= {key: extra[key] for key in ("forked", "snapshot", "imported") if key in extra}
    if "export" in extra:
        event["export"] = extra["export"]["uri"]
    if "snapshot" not in event and isinstance(args.get("snapshot"), str):
        event["snapshot"] = args["snapshot"]  # the one restored or deleted, as the caller named it
    if action == "compare":
        event["branches"] = [row["workspace"] for row in extra.get("branches", [])]
    return event
