"""The `workspaces` tool: a caller's kept workspaces, listed, named (so they outlive their session and restarts
of the server, and any later session opens them by name) and deleted. It runs no sandbox of its own."""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

import anyio

from sandbox_server.errors import Refusal
from sandbox_server.policy import Policy, ToolPolicy
from sandbox_server.tools.base import MANAGING_ANNOTATIONS, WORKSPACE_ARGUMENT, ToolContext, ToolOutcome, result_schema
from sandbox_server.workspaces.kept import KeptWorkspace
from sandbox_server.workspaces.naming import NAME_IN_WORDS
from sandbox_server.workspaces.records import WorkspaceRecord

__all__ = ["WorkspacesTool"]

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
    },
    "required": ["id", "name", "created", "last_used", "size_bytes", "expires_in_s", "current"],
}


def _iso(seconds: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(seconds))


class WorkspacesTool:
    """List the caller's workspaces, name one so it is kept, delete one."""

    name = "workspaces"
    title = "List, name (keep) or delete your workspaces"
    description = (
        "The kept workspaces of this caller (/workspace's files and run_python's variables). `list` them; `keep` "
        "the call's workspace under a name: the session goes on in it, and it outlives that session and "
        "restarts of the server, any later call opens it by passing that name as `workspace`, and it lasts workspace.keep_s unused (keep it again "
        "with another name to rename it); `fork` it: a new workspace with its files and variables as they are now, "
        "which the next calls change apart from it (named if `name` is given; the answer's `forked` is its id); "
        "`delete` the call's workspace and everything in it. The workspace "
        "acted on is the one `workspace` names (an id or a name), else the session's.\n"
        'Example: {"action": "list"}'
    )
    input_schema: dict[str, Any] = {
        "type": "object",
        "title": "workspaces: arguments",
        "properties": {
            "action": {"type": "string", "enum": ["list", "keep", "fork", "delete"]},
            "name": {
                "type": "string",
                "pattern": "^(?!ws-)[a-z0-9][a-z0-9._-]{0,62}$",
                "x-in-words": NAME_IN_WORDS,
                "description": "The name to keep the workspace under (keep), or to give its fork (fork)",
            },
            "workspace": WORKSPACE_ARGUMENT,
        },
        "required": ["action"],
        "additionalProperties": False,
    }
    output_schema = result_schema(
        "workspaces: result",
        {
            "workspaces": {"type": "array", "items": WORKSPACE_SCHEMA, "description": "The caller's workspaces"},
            "forked": {"type": "string", "description": "The new workspace's id (action fork)"},
        },
        ["workspaces"],
    )
    annotations: dict[str, Any] = MANAGING_ANNOTATIONS
    sandbox = False
    """It runs no container: no warm pool is kept for it."""

    @staticmethod
    def of_use(policy: Policy) -> bool:
        """Offered only where the policy keeps workspaces."""
        return policy.workspace.persist

    def refuse(self, args: Mapping[str, Any], policy: ToolPolicy, policy_name: str) -> None:
        """Nothing of its own: the store says what a caller may keep."""

    async def run(self, args: Mapping[str, Any], ctx: ToolContext) -> ToolOutcome:
        kept = ctx.runtime
        if not isinstance(kept, KeptWorkspace):
            raise Refusal(
                f"refused: policy '{ctx.policy_name}' keeps no workspace (field workspace.persist), so there are "
                "none to list, keep or delete",
                "workspace.persist",
            )
        store, record = kept.store, kept.record
        action = args["action"]
        extra: dict[str, Any] = {}
        if action == "keep":
            name = args.get("name")
            if not isinstance(name, str):
                raise Refusal("refused: `keep` needs the `name` to keep the workspace under", "name")
            record = store.keep(record, name, ctx.policy_name)
            kept.record = record
            headline = (
                f'workspace {record.id} is kept as {name!r}: pass "workspace": "{name}" to continue it from any '
                f"session; it lasts {store.settings.keep_s:g} s unused (workspace.keep_s)"
            )
        elif action == "fork":
            name = args.get("name")
            fork = await anyio.to_thread.run_sync(store.fork, record, name if isinstance(name, str) else None,
                                                  ctx.policy_name)  # fmt: skip
            extra["forked"] = fork.id
            called = f" as {fork.name!r}" if fork.name else ""
            headline = (
                f'workspace {record.id} is forked{called}: pass "workspace": "{fork.name or fork.id}" to work in '
                "the fork; the two change apart from now on"
            )
        elif action == "delete":
            if ctx.services is not None:
                for service in ctx.services.services.running(record.id):
                    await ctx.services.services.stop(service, "its workspace was deleted")
            store.forget(record)
            kept.deleted = True
            headline = f"workspace {record.id}" + (f" ({record.name!r})" if record.name else "") + " is deleted"
        else:
            headline = ""
        listed = store.listed(record.session, record.tenant)
        rows = [self._row(item, record, store.settings.keep_s, store.settings.idle_ttl_s) for item in listed]
        lines = [
            f"{row['name'] or '(not named)'}: {row['id']}, {row['size_bytes']} bytes, last used {row['last_used']}"
            + (" (this call's)" if row["current"] else "")
            for row in rows
        ]
        if action == "list":
            headline = f"{len(rows)} workspace(s)" if rows else "no workspace is kept for this caller"
        sections = (("workspaces", "\n".join(lines)),) if lines else ()
        return ToolOutcome(headline, False, sections, {"workspaces": rows, **extra})

    @staticmethod
    def _row(item: WorkspaceRecord, current: WorkspaceRecord, keep_s: float, idle_s: float) -> dict[str, Any]:
        lasts = keep_s if item.name is not None else idle_s
        return {
            "id": item.id,
            "name": item.name,
            "created": _iso(item.created),
            "last_used": _iso(item.last_used),
            "size_bytes": item.size_bytes,
            "expires_in_s": round(max(0.0, item.last_used + lasts - time.time()), 1),
            "current": item.id == current.id,
        }
