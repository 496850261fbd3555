"""The client's side of tasks (2026-07-28 era), for the official Python client: an extension that names the
tasks extension in every request and, when a call is answered with a task, follows it to its end.

    async with Client(url, mode="2026-07-28", extensions=[TasksExtension(on_progress=show)]) as client:
        result = await client.call_tool("execute_command", {"command": "make test", "timeout_s": 900})

`on_progress` is a progress callback as `call_tool` takes one (progress, total, message): it hears, each time the
task is polled (every pollIntervalMs, 2 s by default), the seconds it has run and its statusMessage (the time, the
output's size and its last line). The SDK does not hand a call's own progress callback to an extension, so a task
reports its progress here. `on_status` hears the whole task each time instead. A call cancelled while it follows
its task cancels the task (tasks/cancel), so no container is left running.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from typing import Any, Literal

import anyio
import mcp_types as types
from mcp.client.extension import ClaimContext, ClientExtension, ResultClaim
from mcp.client.session import ClientSession
from mcp.shared.dispatcher import ProgressFnT
from mcp.shared.exceptions import MCPError
from pydantic import ConfigDict

__all__ = ["CreatedTask", "TasksExtension", "task_request"]

EXTENSION = "io.modelcontextprotocol/tasks"
TERMINAL = ("completed", "failed", "cancelled")


class CreatedTask(types.Result):
    """The answer to a call that became a task: `resultType: "task"` and the task's first state."""

    model_config = ConfigDict(extra="allow")
    result_type: Literal["task"] = "task"
    task_id: str
    status: str
    status_message: str | None = None
    poll_interval_ms: int | None = None


class _TaskRequest(types.Request[dict[str, Any], str]):
    """A tasks/* request (the client's session stamps the era's _meta on it)."""


class _Answer(types.Result):
    """Any answer, every field kept as sent."""

    model_config = ConfigDict(extra="allow")


async def task_request(session: ClientSession, method: str, **params: Any) -> dict[str, Any]:
    """Send a tasks/* request (tasks/get, tasks/list, tasks/cancel, ...): the answer as sent."""
    answer = await session.send_request(_TaskRequest(method=method, params=params), _Answer)
    return answer.model_dump(by_alias=True, exclude_none=True)


class TasksExtension(ClientExtension):
    """Names the tasks extension and follows a task to its end, polling tasks/get as often as it is told."""

    identifier = EXTENSION

    def __init__(
        self,
        on_status: Callable[[dict[str, Any]], Awaitable[None]] | None = None,
        on_progress: ProgressFnT | None = None,
    ) -> None:
        self._on_status, self._on_progress = on_status, on_progress

    def claims(self) -> Sequence[ResultClaim[Any]]:
        return [ResultClaim(result_type="task", model=CreatedTask, resolve=self._follow)]

    async def _follow(self, created: CreatedTask, ctx: ClaimContext) -> types.CallToolResult:
        task_id, started = created.task_id, anyio.current_time()
        try:
            while True:
                task = await task_request(ctx.session, "tasks/get", taskId=task_id)
                if self._on_status is not None:
                    await self._on_status(task)
                if self._on_progress is not None and task["status"] not in TERMINAL:
                    await self._on_progress(round(anyio.current_time() - started, 1), None, task.get("statusMessage"))
                if task["status"] in TERMINAL:
                    break
                await anyio.sleep(max(0.1, (task.get("pollIntervalMs") or 1000) / 1000))
        except anyio.get_cancelled_exc_class():
            with anyio.CancelScope(shield=True), anyio.move_on_after(35):
                await task_request(ctx.session, "tasks/cancel", taskId=task_id)
            raise
        if task["status"] == "completed":
            return types.CallToolResult.model_validate(task["result"], by_name=False)
        if task["status"] == "failed":
            error = task.get("error") or {}
            raise MCPError(int(error.get("code", -32603)), str(error.get("message", task.get("statusMessage"))))
        said = task.get("statusMessage") or "the task was cancelled"
        return types.CallToolResult(content=[types.TextContent(type="text", text=said)], is_error=True)
