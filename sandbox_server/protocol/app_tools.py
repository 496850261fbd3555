"""The app-only tool a view calls through its host (`_meta.ui.visibility: ["app"]`): `tasks`, the caller's own
tasks with their output so far, and the cancelling of one.

It does what tasks/list, the task's output resource and tasks/cancel do for the same caller, as a tool call, the
one request a view can send for it: listed only to clients that negotiated MCP Apps under a policy that runs
tasks, hidden from the model, acting only on the caller's own tasks, and audited like any other call.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable
from typing import Any

import anyio.to_thread
import mcp_types as types

from sandbox_server.access.audit import AuditLog
from sandbox_server.policy import Policy
from sandbox_server.protocol.listing import icons_of
from sandbox_server.protocol.requests import Context, client_name, identity_of
from sandbox_server.tasks.manager import Tasks
from sandbox_server.tasks.records import TaskRecord

__all__ = ["TASKS_TOOL", "AppTools"]

TASKS_TOOL = "tasks"
OUTPUT_TAIL = 16_000
"""The end of a task's output a listing carries (the whole is its output resource)."""
LIGHT_PER_MINUTE = 120
"""The calls a minute the tool answers one caller at least (twice a second: views following a task poll once a
second each); a policy whose rate.calls_per_minute is higher allows twice that. It starts no sandbox, but each call
reads the caller's tasks."""

_TASK: dict[str, Any] = {
    "type": "object",
    "properties": {
        "id": {"type": "string"},
        "tool": {"type": "string"},
        "status": {"type": "string", "enum": ["working", "input_required", "completed", "failed", "cancelled"]},
        "message": {"type": "string"},
        "created_at": {"type": "number", "description": "Unix time"},
        "elapsed_s": {"type": "number", "minimum": 0},
        "output": {"type": "string", "description": f"The last {OUTPUT_TAIL} characters of its stdout and stderr"},
    },
    "required": ["id", "tool", "status", "elapsed_s"],
}


class AppTools:
    """The `tasks` tool: list the caller's tasks, or cancel one of them."""

    def __init__(self, tasks: Tasks, policy_of: Callable[[Context], Policy], audit: AuditLog | None = None) -> None:
        self.tasks = tasks
        self.policy_of = policy_of
        self.audit = audit
        self._recent: dict[str, deque[float]] = {}
        """Per caller, when its calls of the last minute came."""

    def offered(self, ctx: Context) -> bool:
        """Whether the caller's policy runs tasks (else there is nothing to list or cancel)."""
        return self.policy_of(ctx).tasks.running > 0

    def model(self) -> types.Tool:
        return types.Tool(
            name=TASKS_TOOL,
            title="Your tasks",
            description="Your tasks (tools/call run as tasks), each with its status, elapsed time and the end of its "
            'output so far; or cancel one. For views: {"action": "list"}, {"action": "cancel", "task": "<id>"}.',
            input_schema={
                "type": "object",
                "properties": {
                    "action": {"type": "string", "enum": ["list", "cancel"]},
                    "task": {"type": "string", "maxLength": 128, "description": "cancel: the task's id"},
                },
                "required": ["action"],
                "additionalProperties": False,
            },
            output_schema={
                "type": "object",
                "properties": {"tasks": {"type": "array", "items": _TASK}, "error": {"type": "string"}},
            },
            annotations=types.ToolAnnotations(title="Your tasks", read_only_hint=False, destructive_hint=False),
            icons=icons_of(TASKS_TOOL),
            _meta={"ui": {"visibility": ["app"]}},
        )

    async def call(self, ctx: Context, arguments: dict[str, Any]) -> types.CallToolResult:
        identity = identity_of(ctx)
        action, task_id = arguments.get("action"), arguments.get("task")
        record: dict[str, Any] = {
            "tool": TASKS_TOOL, "action": action, "caller": identity.caller, "client": client_name(ctx), "ts": time.time()
        }  # fmt: skip
        if action not in ("list", "cancel") or (action == "cancel" and not isinstance(task_id, str)):
            return self._answer(record, "invalid arguments: give action list, or cancel with the task's id", None)
        if not self.offered(ctx):
            said = f"refused: policy '{self.policy_of(ctx).name}' runs no tasks (field tasks.running is 0)"
            return self._answer(record, said, None)
        limited = self._past_light_limit(identity.limits_key, self.policy_of(ctx))
        if limited is not None:
            return self._answer(record, limited, None)
        if action == "cancel":
            record["task"] = task_id
            cancelled = await self.tasks.cancel(str(task_id), identity.holder)
            if cancelled is None:
                return self._answer(record, f"no task {task_id} of yours", None)
            return self._answer(record, f"task {task_id}: {cancelled.status}", [self._row(cancelled)])
        held = await anyio.to_thread.run_sync(self.tasks.held, identity.holder)
        return self._answer(record, f"{len(held)} task(s)", [self._row(t) for t in held])

    def _past_light_limit(self, key: str, policy: Policy) -> str | None:
        """The refusal for a caller past the tool's own calls per minute (None: it may call)."""
        most = max(LIGHT_PER_MINUTE, 2 * policy.rate.calls_per_minute)
        now = time.monotonic()
        if len(self._recent) > 10_000:  # callers idle for a minute have nothing left to count
            self._recent = {k: d for k, d in self._recent.items() if d and d[-1] > now - 60}
        recent = self._recent.setdefault(key, deque())
        while recent and recent[0] <= now - 60:
            recent.popleft()
        if len(recent) >= most:
            return (
                f"rate limited: the tasks tool answers a caller {most} times a minute (twice policy "
                f"'{policy.name}''s field rate.calls_per_minute, at least {LIGHT_PER_MINUTE}); retry in "
                f"{max(1, math.ceil(recent[0] + 60 - now))} s"
            )
        recent.append(now)
        return None

    def _row(self, record: TaskRecord) -> dict[str, Any]:
        ended = record.updated_at if record.ended else time.time()
        output = self.tasks.output(record.id, record.holder) or ""
        return {
            "id": record.id,
            "tool": record.tool,
            "status": record.status,
            "message": record.message,
            "created_at": record.created_at,
            "elapsed_s": round(max(0.0, ended - record.created_at), 3),
            "output": output[-OUTPUT_TAIL:],
        }

    def _answer(self, record: dict[str, Any], said: str, rows: list[dict[str, Any]] | None) -> types.CallToolResult:
        record["outcome"] = "ok" if rows is not None else "refused"
        if self.audit is not None:
            self.audit.write(record)
        structured: dict[str, Any] = {"tasks": rows} if rows is not None else {"error": said}
        return types.CallToolResult(
            content=[types.TextContent(type="text", text=said)], structured_content=structured, is_error=rows is None
        )
