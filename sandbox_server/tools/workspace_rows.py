"""What the `workspaces` tool says: the shapes of its answer, and each workspace or snapshot as a row of it."""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

from sandbox_server.workspaces.records import WorkspaceRecord

__all__ = ["BRANCH_SCHEMA", "REFERENCE", "WORKSPACE_SCHEMA", "row"]

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


def _iso(seconds: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(seconds))


def row(
    item: WorkspaceRecord, current: WorkspaceRecord, keep_s: float, idle_s: float, running: set[str]
) -> dict[str, Any]:
    """One workspace or snapshot as the answer lists it; `running`: the names of its services running now."""
    lasts = keep_s if item.name is not None or item.snapshot else idle_s
    return {
        "id": item.id,
        "name": item.name,
        "created": _iso(item.created),
        "last_used": _iso(item.last_used),
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
