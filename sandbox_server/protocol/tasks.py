"""MCP tasks, in both eras, in one place: which calls become tasks, and the tasks/* requests.

- 2025-11-25 (core): the client asks by sending `tools/call` with `task`; the server declares
  `capabilities.tasks` and each tool's `execution.taskSupport`, answers `CreateTaskResult` at once and serves
  tasks/get, tasks/result, tasks/list and tasks/cancel, telling the creating session of the end with
  notifications/tasks/status.
- 2026-07-28 (the `io.modelcontextprotocol/tasks` extension): the client names the extension in a request's
  capabilities and the server decides: a call asking for more than `limits.max_timeout_s`, or of a tool in the
  policy's `tasks.first`, is answered `resultType: "task"`, then served by tasks/get, tasks/update and
  tasks/cancel. Without the extension, such a call is refused as any call asking too much is: a tool result
  naming the cap, the task's, and the extension.

The SDK has no tasks of its own: the methods are registered with its request-handler API, and the 2025 task
answer to tools/call (which its tools/call result check would refuse) is given by a server middleware.
"""

from __future__ import annotations

import re
from collections.abc import Awaitable, Callable
from typing import Any

import anyio.to_thread
import mcp_types as types
from mcp.server.context import CallNext, HandlerResult
from mcp.server.lowlevel import Server
from mcp.shared.exceptions import MCPError
from mcp_types.jsonrpc import INVALID_PARAMS, MISSING_REQUIRED_CLIENT_CAPABILITY
from mcp_types.version import MODERN_PROTOCOL_VERSIONS
from pydantic import Field

from sandbox_server.policy import Policy
from sandbox_server.protocol.listing import page_of
from sandbox_server.protocol.requests import Context, handshake_era, identity_of
from sandbox_server.tasks.manager import Tasks
from sandbox_server.tasks.records import TaskRecord

__all__ = ["EXTENSION", "OUTPUT_TEMPLATE", "TaskProtocol", "task_capabilities"]

EXTENSION = "io.modelcontextprotocol/tasks"
RELATED_TASK = "io.modelcontextprotocol/related-task"
OUTPUT_TEMPLATE = "sandbox://tasks/{task_id}/output"
_OUTPUT_URI = re.compile(r"^sandbox://tasks/([^/?#]+)/output$")
TASKS_PAGE = 100

Call = Callable[[Context, types.CallToolRequestParams, bool], Awaitable[Any]]
"""Runs a tools/call, as a task when told (the server's own call handler)."""


class UpdateTaskParams(types.RequestParams):
    """tasks/update (2026-07-28): answers to a task's questions; this server's tasks ask none."""

    task_id: str
    input_responses: dict[str, Any] = Field(default_factory=dict)


def task_capabilities() -> types.ServerTasksCapability:
    """What a handshake-era client is told: tasks can be listed and cancelled, and tools/call may be one."""
    return types.ServerTasksCapability(
        list=types.TasksListCapability(),
        cancel=types.TasksCancelCapability(),
        requests=types.ServerTasksRequestsCapability(
            tools=types.TasksToolsCapability(call=types.TasksCallCapability())
        ),
    )


def _not_found(task_id: str) -> MCPError:
    """The one answer for an id that is not the caller's: never made, expired, or another caller's."""
    return MCPError(INVALID_PARAMS, f"Failed to retrieve task: Task not found ({task_id!r}); tasks are kept for the "
                    "policy's tasks.ttl_s after they start, for their own caller only")  # fmt: skip


class TaskProtocol:
    """The tasks/* handlers and the decision of which calls become tasks."""

    def __init__(self, tasks: Tasks, policy_of: Callable[[Context], Policy], call: Call) -> None:
        self.tasks = tasks
        self._policy_of = policy_of
        self._call = call

    def install(self, server: Server[Any]) -> None:
        """Register the methods, the 2025 tools/call middleware, and the 2026 extension's announcement."""
        server.add_request_handler("tasks/get", types.GetTaskRequestParams, self._get)
        server.add_request_handler("tasks/result", types.GetTaskPayloadRequestParams, self._result)
        server.add_request_handler("tasks/list", types.PaginatedRequestParams, self._list)
        server.add_request_handler("tasks/cancel", types.CancelTaskRequestParams, self._cancel)
        server.add_request_handler("tasks/update", UpdateTaskParams, self._update)
        server.middleware.append(self._task_augmented_call)
        server.extensions[EXTENSION] = {}

    # -- which calls are tasks ------------------------------------------------------------------------------------

    def as_task(self, ctx: Context, params: types.CallToolRequestParams, tool: str | None) -> bool:
        """Whether a 2026-07-28 call becomes a task (the server decides). One that asks for more time than a request
        may take, from a client that cannot take a task, is not: the call's own check refuses it as a tool result
        a model reads (naming the cap, the task's longer one and the extension), as in the handshake era."""
        if handshake_era(ctx) or tool is None:
            return False
        policy = self._policy_of(ctx)
        if policy.tasks.running <= 0:
            return False
        limits = policy.for_tool(tool)
        timeout = _longest_timeout(params.arguments or {})
        long = isinstance(timeout, int | float) and limits.max_timeout_s < timeout <= limits.max_task_s
        if not (long or tool in policy.tasks.first):
            return False
        return _declares_extension(ctx)  # (a task-first tool runs as an ordinary call for a client without it)

    async def _task_augmented_call(self, ctx: Context, call_next: CallNext) -> HandlerResult:
        """2025-11-25: a tools/call with `task` is answered CreateTaskResult (the middleware gives the answer
        itself: the SDK checks every tools/call answer of that era against CallToolResult)."""
        raw = ctx.params
        if ctx.method != "tools/call" or not isinstance(raw, dict) or raw.get("task") is None or not handshake_era(ctx):
            return await call_next(ctx)
        try:
            params = types.CallToolRequestParams.model_validate(raw, by_name=False)
        except ValueError:
            return await call_next(ctx)  # the SDK answers the malformed request as it does any other
        answer = await self._call(ctx, params, True)
        if isinstance(answer, TaskRecord):
            return {"task": answer.wire(era_2026=False)}
        result: HandlerResult = answer  # a refusal or an answer that came before the task existed
        return result

    def created_answer(self, ctx: Context, record: TaskRecord) -> dict[str, Any]:
        """The answer to a call that became a task, as the era writes it."""
        if handshake_era(ctx):
            return {"task": record.wire(era_2026=False)}
        return {"resultType": "task", **record.wire(era_2026=True)}

    # -- tasks/* -----------------------------------------------------------------------------------------------------

    def _check_extension(self, ctx: Context) -> None:
        if ctx.protocol_version in MODERN_PROTOCOL_VERSIONS and not _declares_extension(ctx):
            raise MCPError(
                MISSING_REQUIRED_CLIENT_CAPABILITY,
                f"Missing required client capability: {ctx.method} needs the {EXTENSION} extension named in the "
                "request's client capabilities",
                {"requiredCapabilities": {"extensions": {EXTENSION: {}}}},
            )

    async def _found(self, ctx: Context, task_id: str) -> TaskRecord:
        self._check_extension(ctx)
        record = await anyio.to_thread.run_sync(self.tasks.status, task_id, identity_of(ctx).holder)
        if record is None:
            raise _not_found(task_id)
        return record

    async def _get(self, ctx: Context, params: types.GetTaskRequestParams) -> dict[str, Any]:
        record = await self._found(ctx, params.task_id)
        return record.wire(era_2026=not handshake_era(ctx))

    async def _result(self, ctx: Context, params: types.GetTaskPayloadRequestParams) -> dict[str, Any]:
        """2025-11-25: the task's result once it has ended (the request waits for it)."""
        await self._found(ctx, params.task_id)
        record = await self.tasks.result(params.task_id, identity_of(ctx).holder)
        if record is None:
            raise _not_found(params.task_id)
        related = {RELATED_TASK: {"taskId": record.id}}
        if record.status == "completed" and record.result is not None:
            return {**record.result, "_meta": {**(record.result.get("_meta") or {}), **related}}
        error = record.error or {"code": INVALID_PARAMS, "message": f"the task was {record.status}: {record.message}"}
        raise MCPError(int(error["code"]), str(error["message"]), related)

    async def _list(self, ctx: Context, params: types.PaginatedRequestParams) -> dict[str, Any]:
        self._check_extension(ctx)
        owned = {
            record.id: record for record in await anyio.to_thread.run_sync(self.tasks.held, identity_of(ctx).holder)
        }
        page, next_cursor = page_of(list(owned), params.cursor, TASKS_PAGE)
        era_2026 = not handshake_era(ctx)
        answer: dict[str, Any] = {"tasks": [_listed(owned[task_id], era_2026) for task_id in page]}
        if next_cursor is not None:
            answer["nextCursor"] = next_cursor
        return answer

    async def _cancel(self, ctx: Context, params: types.CancelTaskRequestParams) -> dict[str, Any]:
        record = await self._found(ctx, params.task_id)
        if record.ended:
            if not handshake_era(ctx):
                return {}
            raise MCPError(INVALID_PARAMS, f"task {record.id} has already ended ({record.status}); nothing to cancel")
        cancelled = await self.tasks.cancel(record.id, identity_of(ctx).holder) or record
        return cancelled.wire(era_2026=False) if handshake_era(ctx) else {}

    async def _update(self, ctx: Context, params: UpdateTaskParams) -> dict[str, Any]:
        await self._found(ctx, params.task_id)
        return {}  # this server's tasks never ask for input: every answer is for a request it did not make

    # -- the output resource -----------------------------------------------------------------------------------------

    async def output(self, ctx: Context, uri: str) -> types.ReadResourceResult | None:
        """`sandbox://tasks/<id>/output`: the task's stdout and stderr so far (None: not such a resource)."""
        matched = _OUTPUT_URI.match(uri)
        if matched is None:
            return None
        text = await anyio.to_thread.run_sync(self.tasks.output, matched.group(1), identity_of(ctx).holder)
        if text is None:
            return None
        return types.ReadResourceResult(
            contents=[types.TextResourceContents(uri=uri, mime_type="text/plain", text=text)]
        )

    async def tell_end(self, ctx: Context, record: TaskRecord) -> None:
        """2025-11-25: tell the session that created the task of its end (a session gone away hears nothing)."""
        if handshake_era(ctx):
            params = types.TaskStatusNotificationParams.model_validate(record.wire(era_2026=False), by_name=False)
            await ctx.session.send_notification(types.TaskStatusNotification(params=params))  # type: ignore[arg-type]


def _listed(record: TaskRecord, era_2026: bool) -> dict[str, Any]:
    """A task in a listing: its state, without the result it may carry (tasks/get or tasks/result gives it)."""
    wire = record.wire(era_2026)
    wire.pop("result", None)
    wire.pop("error", None)
    return wire


def _longest_timeout(arguments: dict[str, Any]) -> Any:
    """The time a call asks for: its `timeout_s`, or (the `workspaces` tool's `branch`) the longest its calls ask
    for, since it lasts as long as they do."""
    if arguments.get("action") == "branch" and isinstance(arguments.get("calls"), list):
        asked = [
            call["arguments"]["timeout_s"]
            for call in arguments["calls"]
            if isinstance(call, dict)
            and isinstance(call.get("arguments"), dict)
            and isinstance(call["arguments"].get("timeout_s"), int | float)
        ]
        return max(asked, default=None)
    return arguments.get("timeout_s")


def _declares_extension(ctx: Context) -> bool:
    """Whether this request's client capabilities name the tasks extension (2026-07-28: per request)."""
    meta: Any = ctx.meta or {}
    declared = meta.get(types.CLIENT_CAPABILITIES_META_KEY) if isinstance(meta, dict) else None
    extensions = declared.get("extensions") if isinstance(declared, dict) else None
    return isinstance(extensions, dict) and EXTENSION in extensions
