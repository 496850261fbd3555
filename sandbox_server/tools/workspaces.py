"""The `workspaces` tool: a caller's kept workspaces, listed, named (so they outlive their session and restarts
of the server, and any later session opens them by name), forked, snapshotted and restored, compared, exported
and imported, paused and resumed, and deleted. It runs no sandbox of its own."""

from __future__ import annotations

import tempfile
import time
from collections.abc import Mapping
from typing import Any

import anyio

from sandbox_server.errors import Refusal
from sandbox_server.policy import Policy, ToolPolicy
from sandbox_server.sandbox.archive import safe_relative_path
from sandbox_server.tools.base import MANAGING_ANNOTATIONS, WORKSPACE_ARGUMENT, ToolContext, ToolOutcome, result_schema
from sandbox_server.tools.workspace_branches import branch, compare
from sandbox_server.tools.workspace_rows import (
    BRANCH_SCHEMA,
    REFERENCE,
    WORKSPACE_SCHEMA,
    listing,
    workspace_event,
)
from sandbox_server.words import duration
from sandbox_server.workspaces.exports import KEEP_S
from sandbox_server.workspaces.kept import KeptWorkspace
from sandbox_server.workspaces.naming import NAME_IN_WORDS
from sandbox_server.workspaces.records import WorkspaceRecord

__all__ = ["WorkspacesTool"]

ACTIONS = (
    "list", "keep", "fork", "snapshot", "restore", "compare", "branch", "export", "import", "pause", "resume", "delete",
)  # fmt: skip
IMPORT_PART = 8 * 1024 * 1024
"""What an import reads of the export in the call's workspace at a time."""


class WorkspacesTool:
    """List, name, fork, branch, snapshot, restore, compare, export, import, pause, resume and delete the caller's
    workspaces."""

    name = "workspaces"
    title = "Keep, fork, compare or delete workspaces"
    description = (
        "This caller's kept workspaces: the one `workspace` names, else the session's. `list`, `keep` (under "
        "`name`: it outlives the session), `fork`, `snapshot`, `restore`, `branch` (forks run side by side), "
        "`compare`, `export`, `import`, `pause` (services stopped) until `resume`, `delete`.\n"
        'Example: {"action": "list"}'
    )
    input_schema: dict[str, Any] = {
        "type": "object",
        "title": "workspaces: arguments",
        "properties": {
            "action": {
                "type": "string",
                "enum": list(ACTIONS),  # fmt: skip
            },
            "name": {
                "type": "string",
                "pattern": "^(?!ws-)[a-z0-9][a-z0-9._-]{0,62}$",
                "x-in-words": NAME_IN_WORDS,
                "description": "keep: the name to keep it under; fork, snapshot, restore: the copy's name.",
            },
            "workspace": WORKSPACE_ARGUMENT,
            "snapshot": REFERENCE | {"description": "restore, delete: its id or name."},
            "calls": {
                "type": "array",
                "minItems": 1,
                "maxItems": 8,
                "items": {
                    "type": "object",
                    "properties": {
                        "tool": {"type": "string", "minLength": 1, "maxLength": 64},
                        "arguments": {"type": "object"},
                    },
                    "required": ["tool"],
                    "additionalProperties": False,
                },
                "description": "branch: a tool call per branch. Each runs in a fork of the call's workspace made for it; "
                "its arguments name no workspace.",
            },
            "path": {
                "type": "string",
                "minLength": 1,
                "maxLength": 4096,
                "description": "import: the export's file. It is relative to /workspace, and becomes a new workspace.",
            },
            "replace": {
                "type": "boolean",
                "description": "restore over the call's workspace. What it holds now is gone, where without it the "
                "snapshot is restored as a new workspace.",
            },
            "branches": {
                "type": "array",
                "items": REFERENCE,
                "minItems": 1,
                "maxItems": 8,
                "uniqueItems": True,
                "description": "compare: its forks, by id or name.",
            },
        },
        "required": ["action"],
        "additionalProperties": False,
    }
    output_schema = result_schema(
        "workspaces: result",
        {
            "workspaces": {
                "type": "array",
                "items": WORKSPACE_SCHEMA,
                "description": "The caller's workspaces and snapshots",
            },
            "forked": {"type": "string", "description": "The new workspace's id (fork, restore)"},
            "imported": {"type": "string", "description": "The new workspace's id (import)"},
            "snapshot": {"type": "string", "description": "The new snapshot's id (snapshot)"},
            "export": {
                "type": "object",
                "properties": {
                    "uri": {"type": "string"},
                    "size_bytes": {"type": "integer"},
                    "files": {"type": "integer"},
                    "bytes": {"type": "integer"},
                },
                "required": ["uri", "size_bytes", "files", "bytes"],
                "description": "export: the file (a resource read in parts, its content checked by zstd's checksum "
                "at import) and how many entries and bytes of content it holds",
            },
            "branches": {
                "type": "array",
                "items": BRANCH_SCHEMA,
                "description": "compare: what each branch changed from the call's workspace",
            },
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
        store, action = kept.store, args["action"]
        extra: dict[str, Any] = {}
        sections: list[tuple[str, str]] = []
        name = args.get("name") if isinstance(args.get("name"), str) else None
        headline, record = await self._act(args, kept, name, ctx, (extra, sections))
        services = ctx.services.services if ctx.services is not None else None
        rows, lines = listing(store, record, services)
        if action == "list":
            headline = f"{len(rows)} workspace(s) and snapshot(s)" if rows else "no workspace is kept for this caller"
        if lines:
            sections.append(("workspaces", "\n".join(lines)))
        audit = {"workspace_event": workspace_event(args, record, name, extra)}  # the call's record says who
        return ToolOutcome(headline, False, tuple(sections), {"workspaces": rows, **extra}, audit=audit)

    async def _act(
        self,
        args: Mapping[str, Any],
        kept: KeptWorkspace,
        name: str | None,
        ctx: ToolContext,
        said: tuple[dict[str, Any], list[tuple[str, str]]],
    ) -> tuple[str, WorkspaceRecord]:
        """Do what the action asks: its headline, and the call's workspace as it is after (`said`: the answer's
        structured extras and sections, filled in)."""
        store, record, action = kept.store, kept.record, args["action"]
        extra, sections = said
        if action == "keep":
            if name is None:
                raise Refusal("refused: `keep` needs the `name` to keep the workspace under", "name")
            record = kept.record = store.keep(record, name, ctx.policy_name)
            return (
                f'workspace {record.id} is kept as {name!r}: pass "workspace": "{name}" to continue it from any '
                f"session; it lasts {duration(store.settings.keep_s)} unused (workspace.keep_s)"
            ), record
        if action == "fork":
            fork = await anyio.to_thread.run_sync(store.fork, record, name, ctx.policy_name)
            extra["forked"] = fork.id
            called = f" as {fork.name!r}" if fork.name else ""
            return (
                f'workspace {record.id} is forked{called}: pass "workspace": "{fork.name or fork.id}" to work in '
                "the fork; the two change apart from now on"
            ), record
        if action == "snapshot":
            taken = await anyio.to_thread.run_sync(store.snapshot, record, name, ctx.policy_name)
            extra["snapshot"] = taken.id
            called = f" as {taken.name!r}" if taken.name else ""
            return (
                f'workspace {record.id} is snapshotted{called}: restore it with {{"action": "restore", "snapshot": '
                f'"{taken.name or taken.id}"}}; it lasts {duration(store.settings.keep_s)} (workspace.keep_s)'
            ), record
        if action == "restore":
            return await self._restore(args, kept, name, ctx, extra)
        if action == "pause":
            return await self._pause(kept, ctx), kept.record
        if action == "resume":
            running = ctx.services.listed() if ctx.services is not None else []
            return f"workspace {record.name or record.id} is in use again, {len(running)} service(s) running" + (
                f" ({', '.join(s['name'] for s in running)})" if running else ""
            ), record
        acted = {
            "import": lambda: self._import(args, kept, name, ctx, extra),
            "compare": lambda: compare(args, kept, extra, sections),
            "branch": lambda: branch(args, kept, ctx, extra, sections),
            "export": lambda: self._export(args, kept, ctx, extra),
            "delete": lambda: self._delete(args, kept, ctx),
        }.get(action)
        return (await acted() if acted is not None else ""), record

    @staticmethod
    def _snapshot_named(args: Mapping[str, Any], kept: KeptWorkspace, action: str) -> WorkspaceRecord:
        requested = args.get("snapshot")
        if not isinstance(requested, str):
            raise Refusal(f"refused: `{action}` needs the `snapshot` to {action} (its id or name)", "snapshot")
        found = kept.store.resolve(requested, kept.record.session, kept.record.tenant)
        if not found.snapshot:
            raise Refusal(f"refused: {requested!r} is a workspace, not a snapshot; fork it instead", "snapshot")
        return found

    async def _restore(
        self, args: Mapping[str, Any], kept: KeptWorkspace, name: str | None, ctx: ToolContext, extra: dict[str, Any]
    ) -> tuple[str, WorkspaceRecord]:
        store, record, policy_name = kept.store, kept.record, ctx.policy_name
        snapshot = self._snapshot_named(args, kept, "restore")
        called = snapshot.name or snapshot.id
        if args.get("replace"):
            if ctx.services is not None:  # they ran on what it held: the snapshot's own start on its next call
                for service in ctx.services.services.running(record.id):
                    await ctx.services.services.stop(service, "its workspace was restored from a snapshot")
            record = await anyio.to_thread.run_sync(store.restore, snapshot, record)
            kept.record = record
            return f"workspace {record.id} holds snapshot {called!r} again (what it held before is gone)", record
        made = await anyio.to_thread.run_sync(store.fork, snapshot, name, policy_name)
        extra["forked"] = made.id
        return (
            f'snapshot {called!r} is restored into a new workspace: pass "workspace": "{made.name or made.id}" '
            "to work in it",
            record,
        )

    @staticmethod
    async def _export(args: Mapping[str, Any], kept: KeptWorkspace, ctx: ToolContext, extra: dict[str, Any]) -> str:
        store = kept.store
        source = WorkspacesTool._snapshot_named(args, kept, "export") if args.get("snapshot") else kept.record
        deadline = time.monotonic() + ctx.policy.max_timeout_s
        uri, size, manifest = await anyio.to_thread.run_sync(store.export, source, deadline)
        extra["export"] = {"uri": uri, "size_bytes": size, "files": manifest["files"], "bytes": manifest["bytes"]}
        return (
            f"{'snapshot' if source.snapshot else 'workspace'} {source.name or source.id} is exported: read {uri} "
            f"({size} bytes) in parts, {uri}?offset=0 and on (each part names the next), within {KEEP_S:g} s; "
            "`sandbox-server workspace import` makes a workspace of it on any server"
        )

    @staticmethod
    async def _import(
        args: Mapping[str, Any], kept: KeptWorkspace, name: str | None, ctx: ToolContext, extra: dict[str, Any]
    ) -> str:
        store, record = kept.store, kept.record
        asked = args.get("path")
        if not isinstance(asked, str):
            raise Refusal("refused: `import` needs the `path` of an export in the call's workspace", "path")
        path = safe_relative_path(asked.removeprefix("/workspace/"))
        if path is None:
            raise Refusal(
                f"refused: not imported: {asked[:100]!r} is not a path inside the workspace (relative to /workspace, "
                "no '..')",
                "path",
            )
        largest = store.settings.size_mb * 1024 * 1024  # an export never holds more than the workspace it makes

        def load() -> WorkspaceRecord:
            with tempfile.TemporaryFile(dir=store.root) as copied:
                offset, size = 0, 1
                while offset < size:  # in parts: an export may be as large as a workspace
                    found = store.contents.read_file(record.id, path, largest, offset, IMPORT_PART)
                    if found is None:
                        raise Refusal(f"refused: not imported: the workspace holds no file {path!r}", "path")
                    size, part = found
                    if not part:
                        break
                    copied.write(part)
                    offset += len(part)
                copied.seek(0)
                return store.import_from(copied, record.tenant, record.holder, name, ctx.policy_name, ctx.policy.user)

        made = await anyio.to_thread.run_sync(load)
        extra["imported"] = made.id
        return (
            f'{path} is imported as workspace {made.name or made.id}: pass "workspace": '
            f'"{made.name or made.id}" to work in it'
        )

    @staticmethod
    async def _pause(kept: KeptWorkspace, ctx: ToolContext) -> str:
        stopped = []
        if ctx.services is not None:  # each stays in the workspace's record, to start again when it is resumed
            for service in ctx.services.services.running(kept.record.id):
                service.resumable = True
                await ctx.services.services.stop(service, "its workspace was paused")
                stopped.append(service.name)
        kept.record, released = await anyio.to_thread.run_sync(kept.store.pause, kept.record)
        said = (
            f"its {len(stopped)} service(s) stopped ({', '.join(stopped)}) and start again"
            if stopped
            else "it runs no service"
        )
        return (
            f"workspace {kept.record.name or kept.record.id} is paused: {said}; it holds no container"
            + (" and its filesystem is unmounted" if released else " and no mount")
            + '. Any call in it, or {"action": "resume"}, resumes it; its files and run_python\'s variables are '
            "kept, the memory of its processes and their open connections are not"
        )

    @staticmethod
    async def _delete(args: Mapping[str, Any], kept: KeptWorkspace, ctx: ToolContext) -> str:
        store, record = kept.store, kept.record
        if args.get("snapshot") is not None:
            snapshot = WorkspacesTool._snapshot_named(args, kept, "delete")
            store.forget(snapshot)
            return f"snapshot {snapshot.id}" + (f" ({snapshot.name!r})" if snapshot.name else "") + " is deleted"
        if ctx.services is not None:
            for service in ctx.services.services.running(record.id):
                await ctx.services.services.stop(service, "its workspace was deleted")
        store.forget(record)
        kept.deleted = True
        return f"workspace {record.id}" + (f" ({record.name!r})" if record.name else "") + " is deleted"
