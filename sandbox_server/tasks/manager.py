"""Tasks: calls that outlive their request. The request is answered once the call is past its checks and
approval; the call goes on in the server's own task group, its output read while it runs, and its end kept on
disk for the policy's `tasks.ttl_s`, whoever asks for it later and whether or not its client is still there.

A task belongs to its holder (Identity.holder) and to no one else: any other caller is answered as for an id that never existed.
Each runs in its own fresh container, like every call, removed at its end; cancelling one cancels the call, which
removes its container, and its workspace keeps what the program left, as after a timeout.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import anyio
import anyio.abc
import anyio.to_thread

from sandbox_server.access.audit import AuditLog, event_record
from sandbox_server.calls.pipeline import TaskStart
from sandbox_server.errors import Refusal
from sandbox_server.policy import TaskSettings
from sandbox_server.sandbox.held import HeldMemory
from sandbox_server.sandbox.streams import CappedBuffer
from sandbox_server.tasks.caps import refuse_past_held, refuse_past_running
from sandbox_server.tasks.records import TaskFiles, TaskRecord, new_task_id

if TYPE_CHECKING:  # the PostgreSQL driver is imported only by a server given --state
    from sandbox_server.tasks.shared import TaskRows

__all__ = ["Started", "Tasks", "Work"]

logger = logging.getLogger("sandbox_server")

SWEEP_S = 60.0
"""How often expired tasks are forgotten."""
CANCEL_WAIT_S = 30.0
"""How long tasks/cancel waits for the task's container to be removed before it answers."""
SERVER_STOPPED = -32603
SHARED_WATCH_S = 1.0
"""Replicas: how often the shared tasks are looked at for a replica that died and for cancels left for this one."""

Work = Callable[[TaskStart], Awaitable[dict[str, Any] | Any]]
"""The call itself: it calls `created` once it becomes a task; it returns the task's result (a tools/call result
as the protocol writes it) or, when it ends before it became one, whatever answers the request instead."""


@dataclass(frozen=True, slots=True)
class Started:
    """How starting a task went: its record (a task exists), or what answers the request instead."""

    record: TaskRecord | None = None
    answer: Any = None


@dataclass(eq=False)
class _Live:
    record: TaskRecord
    memory_bytes: int
    scope: anyio.CancelScope = field(default_factory=anyio.CancelScope)
    created: anyio.Event = field(default_factory=anyio.Event)
    done: anyio.Event = field(default_factory=anyio.Event)
    started: float = field(default_factory=time.monotonic)
    streams: tuple[CappedBuffer, CappedBuffer] | None = None
    last_line: str = ""
    cancel_asked: bool = False
    answer: Any = None
    failure: Exception | None = None
    """What the work raised before it became a task (raised again on the request)."""
    on_end: Callable[[TaskRecord], Awaitable[None]] | None = None
    slots: int = 1
    """What it counts against the caps of running tasks: one, or one per call of a branch (each a sandbox)."""


class Tasks:
    """Every task of this server's callers: running ones in memory, all of them on disk."""

    def __init__(
        self,
        folder: Path,
        server: str,
        audit: AuditLog | None,
        alive: Callable[[str], bool] = lambda _: True,
        rows: TaskRows | None = None,
        held: HeldMemory | None = None,
    ) -> None:
        self.files: TaskFiles | TaskRows = rows if rows is not None else TaskFiles(folder)
        self.rows = rows
        """The shared state's tasks (replicas): another replica's tasks are read there, cancels left there."""
        self.server = server
        self.audit = audit
        self._alive = alive
        self._live: dict[str, _Live] = {}
        self._group: anyio.abc.TaskGroup | None = None
        if held is not None:  # the warm pool leaves room for what running tasks' containers may hold
            held.counts(self.memory_bytes)

    # -- the server's side -------------------------------------------------------------------------------------

    async def serve(self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """Run the tasks' group until cancelled (tasks still running then end as failed, and say why)."""
        await anyio.to_thread.run_sync(self.recover)
        async with anyio.create_task_group() as group:
            self._group = group
            task_status.started()
            try:
                swept = time.monotonic()
                while True:
                    await anyio.sleep(SHARED_WATCH_S if self.rows is not None else SWEEP_S)
                    try:
                        if self.rows is not None:
                            for task_id in await anyio.to_thread.run_sync(self._watch_shared):
                                live = self._live.get(task_id)  # cancelled here, on the loop its scope belongs to
                                if live is not None and not live.cancel_asked:
                                    live.cancel_asked = True
                                    live.scope.cancel()
                        if time.monotonic() - swept >= SWEEP_S:
                            swept = time.monotonic()
                            await anyio.to_thread.run_sync(self.sweep)
                    except Refusal as exc:  # the shared state does not answer: tried again at the next turn
                        logger.warning("tasks: %s", exc)
            finally:
                self._group = None

    def recover(self) -> int:
        """Tasks a stopped server left working end as failed, saying so (their containers went with it: the
        reaper removes a dead server's containers, so there is nothing to take back); expired ones go."""
        failed = 0
        for record in self.files.working():
            if record.server == self.server or self._alive(record.server):
                continue
            message = (
                "failed: the server running this task stopped before it ended, and its container was removed with "
                "it (a sandbox never outlives its server); run the call again"
            )
            error = {"code": SERVER_STOPPED, "message": message}
            self.files.save(record.moved("failed", message, error=error))
            self._audit("task_failed", record, status="failed", reason="server stopped")
            failed += 1
        self.sweep()
        return failed

    def sweep(self) -> int:
        """Forget the tasks whose time to live has passed (a running one is cancelled first)."""
        now, gone = time.time(), 0
        for record in self.files.all():
            if not record.expired(now):
                continue
            live = self._live.get(record.id)
            if live is not None:
                live.cancel_asked = True
                live.scope.cancel()
                continue  # it ends as cancelled, and goes at the next sweep
            self.files.remove(record.id)
            self._audit("task_expired", record, status=record.status)
            gone += 1
        return gone

    def _watch_shared(self) -> list[str]:
        """Replicas: fail the tasks of a replica that died; the tasks of this replica another was asked to
        cancel."""
        assert self.rows is not None
        self.recover()
        return self.rows.cancels_for(self.server)

    def running(self) -> int:
        """Tasks running here now (a draining replica waits for them)."""
        return sum(1 for live in self._live.values() if live.created.is_set())

    def memory_bytes(self) -> int:
        """What the running tasks' containers may hold together (warm containers leave room for it)."""
        return sum(live.memory_bytes for live in self._live.values())

    # -- a caller's side ---------------------------------------------------------------------------------------

    async def start(
        self,
        settings: TaskSettings,
        policy_name: str,
        holder: str,
        caller: str,
        tool: str,
        memory_bytes: int,
        ttl_ms: int | None,
        work: Work,
        on_end: Callable[[TaskRecord], Awaitable[None]] | None = None,
        slots: int = 1,
    ) -> Started:
        """Start `work` as a task once the caps allow it (a Refusal naming the cap when not): its record once the
        work says it is created, or the work's own answer when it ended before that (a refusal, a question).
        `slots`: the sandboxes it runs side by side (a branch's calls), each counted as a running task."""
        if self._group is None:
            raise Refusal("refused: this server runs no tasks (it was not started to serve them)", "tasks")
        now = time.time()
        ttl_s = settings.ttl_s if ttl_ms is None else max(1.0, min(settings.ttl_s, ttl_ms / 1000))
        record = TaskRecord(
            new_task_id(), holder, caller, tool, policy_name, self.server, now, now, ttl_s, settings.poll_interval_ms
        )
        live = _Live(record, memory_bytes * slots, on_end=on_end, slots=slots)
        # Checked and counted in one step (no await between): a burst of N gets exactly the caps, the rest refused.
        self._refuse_past_caps(settings, policy_name, holder, slots)
        self._live[record.id] = live
        try:
            await anyio.to_thread.run_sync(self._refuse_past_held, settings, policy_name, holder, record)
        except BaseException:
            self._live.pop(record.id, None)
            raise
        self._group.start_soon(self._run, live, work)
        async with anyio.create_task_group() as waiting:

            async def until(event: anyio.Event) -> None:
                await event.wait()
                waiting.cancel_scope.cancel()

            waiting.start_soon(until, live.created)
            waiting.start_soon(until, live.done)
        if not live.created.is_set():
            if live.failure is not None:
                raise live.failure
            return Started(answer=live.answer)
        return Started(record=self.status(record.id, holder))

    def status(self, task_id: str, holder: str) -> TaskRecord | None:
        """The task as it stands now, with its latest output line; None when the holder has none of this id."""
        live = self._live.get(task_id)
        if live is not None and live.created.is_set():
            if live.record.holder != holder:
                return None
            return live.record if live.record.ended else live.record.moved("working", self._progress(live))
        record = self.files.load(task_id)
        if record is None or record.holder != holder or record.expired(time.time()):
            return None
        return record

    def held(self, holder: str) -> list[TaskRecord]:
        """The holder's tasks, oldest first."""
        now, found = time.time(), []
        for record in self.files.all():  # each file read once; a running task's state is its live one
            if record.holder != holder or record.expired(now):
                continue
            live = self._live.get(record.id)
            found.append(self.status(record.id, holder) if live is not None else record)
        return sorted((record for record in found if record is not None), key=lambda record: record.created_at)

    async def result(self, task_id: str, holder: str) -> TaskRecord | None:
        """The task once it has ended (waiting for it while it runs here); None as for `status`."""
        live = self._live.get(task_id)
        if live is not None and live.record.holder == holder:
            await live.done.wait()
        return await self._another_replicas(task_id, holder, math.inf)

    async def cancel(self, task_id: str, holder: str) -> TaskRecord | None:
        """Cancel a running task and wait (a while) until its container is gone: the task as it then stands."""
        live = self._live.get(task_id)
        if live is not None and live.record.holder == holder and live.created.is_set():
            live.cancel_asked = True
            live.scope.cancel()
            with anyio.move_on_after(CANCEL_WAIT_S):
                await live.done.wait()
        elif self.rows is not None and live is None:
            record = await anyio.to_thread.run_sync(self.status, task_id, holder)
            if record is not None and not record.ended:  # another replica runs it: it acts on the cancel
                await anyio.to_thread.run_sync(self.rows.ask_cancel, task_id)
                return await self._another_replicas(task_id, holder, CANCEL_WAIT_S)
        return await anyio.to_thread.run_sync(self.status, task_id, holder)

    async def _another_replicas(self, task_id: str, holder: str, wait_s: float) -> TaskRecord | None:
        """The task as it stands once it ended, waiting up to `wait_s` while another replica runs it (its row is
        read at the task's poll interval)."""
        record = await anyio.to_thread.run_sync(self.status, task_id, holder)
        with anyio.move_on_after(wait_s):
            while self.rows is not None and record is not None and not record.ended and task_id not in self._live:
                await anyio.sleep(record.poll_interval_ms / 1000)
                record = await anyio.to_thread.run_sync(self.status, task_id, holder)
        return record

    def output(self, task_id: str, holder: str) -> str | None:
        """Its stdout and stderr so far (the beginning and end when there is more than the policy returns)."""
        if self.status(task_id, holder) is None:
            return None
        live = self._live.get(task_id)
        if live is not None and live.streams is not None:
            return _output_text(*live.streams)
        return self.files.output(task_id) or ""

    # -- inside --------------------------------------------------------------------------------------------------

    def _refuse_past_caps(self, settings: TaskSettings, policy_name: str, holder: str, slots: int) -> None:
        running = [(live.record.holder, live.slots) for live in self._live.values() if not live.record.ended]
        refuse_past_running(settings, policy_name, (holder, slots), running)

    def _refuse_past_held(self, settings: TaskSettings, policy_name: str, holder: str, record: TaskRecord) -> None:
        """Refuse a task past the holder's held tasks; with replicas, its place is held in the shared rows here, and
        the holder's running tasks are counted on every replica."""
        if self.rows is not None:
            passed = self.rows.reserve(record, settings.per_caller, settings.running_per_caller)
        else:
            kept = {r.id for r in self.files.all() if r.holder == holder and not r.expired(time.time())}
            starting = {i for i, live in list(self._live.items()) if live.record.holder == holder and i != record.id}
            held = len(kept | starting)  # the tasks kept, and those starting beside this one that are not yet
            passed = ("per_caller", held) if held >= settings.per_caller else None
        if passed is not None:
            refuse_past_held(settings, policy_name, *passed)

    async def _run(self, live: _Live, work: Work) -> None:
        record = live.record

        async def created() -> None:
            await anyio.to_thread.run_sync(self.files.save, live.record)
            await anyio.to_thread.run_sync(lambda: self._audit("task_created", live.record))
            live.created.set()

        def watch(stdout: CappedBuffer, stderr: CappedBuffer) -> None:
            live.streams = (stdout, stderr)

        answer: Any = None
        error: dict[str, Any] | None = None
        try:
            with live.scope:
                answer = await work(TaskStart(record.id, created, watch))
        except Exception as exc:  # a fault of the server, not of the program: the task failed, and says how
            if not live.created.is_set():
                live.failure = exc
            else:
                logger.exception("task %s failed", record.id)
                error = {"code": SERVER_STOPPED, "message": f"internal error: {exc}"}
        finally:
            with anyio.CancelScope(shield=True):
                await self._end(live, answer, error)

    async def _end(self, live: _Live, answer: Any, error: dict[str, Any] | None) -> None:
        try:
            if not live.created.is_set():  # it never became a task: its answer goes back on the request
                live.answer = answer
                if self.rows is not None:  # the place it held among the caller's tasks is free again
                    await anyio.to_thread.run_sync(self.rows.remove, live.record.id)
                return
            elapsed = time.monotonic() - live.started
            record = live.record
            if error is not None:
                record = record.moved("failed", error["message"], error=error)
            elif isinstance(answer, dict):
                failed = bool(answer.get("isError"))
                said = "ended with an error" if failed else "completed"
                record = record.moved("completed", f"{said} after {elapsed:.0f} s", result=answer)
            elif live.cancel_asked:
                record = record.moved("cancelled", f"cancelled after {elapsed:.0f} s; its container was removed")
            else:
                message = "failed: the server stopped while the task ran, and its container was removed"
                record = record.moved("failed", message, error={"code": SERVER_STOPPED, "message": message})
            live.record = record
            if live.streams is not None:
                await anyio.to_thread.run_sync(self.files.save_output, record.id, _output_text(*live.streams))
            await anyio.to_thread.run_sync(self.files.save, record)
            event = "task_cancelled" if record.status == "cancelled" else "task_finished"
            duration_ms = int(elapsed * 1000)
            await anyio.to_thread.run_sync(
                lambda: self._audit(event, record, status=record.status, duration_ms=duration_ms)
            )
            if live.on_end is not None:
                try:
                    await live.on_end(record)
                except Exception as exc:  # a client gone away hears nothing; the result waits for it
                    logger.info("task %s: could not tell its client it ended (%r)", record.id, exc)
        finally:
            self._live.pop(live.record.id, None)
            live.done.set()

    def _progress(self, live: _Live) -> str:
        elapsed = time.monotonic() - live.started
        message = f"working for {elapsed:.0f} s"
        if live.streams is not None:
            stdout, stderr = live.streams
            latest = max(live.streams, key=lambda stream: stream.fed)
            line = latest.last_line() or stdout.last_line() or stderr.last_line()
            message += f"; {stdout.total} bytes of stdout, {stderr.total} of stderr"
            if line:
                message += f"; last line: {line}"
        return message

    def _audit(self, event: str, record: TaskRecord, **fields: Any) -> None:
        if self.audit is None:
            return
        self.audit.write(
            event_record(event, task=record.id, caller=record.caller, tool=record.tool, policy=record.policy, **fields)
        )


def _output_text(stdout: CappedBuffer, stderr: CappedBuffer) -> str:
    """The output as one text: stdout, then stderr under its own heading, each with what was cut said."""
    parts = []
    for name, stream in (("stdout", stdout), ("stderr", stderr)):
        head, tail = stream.head(), stream.tail()
        text = head.decode("utf-8", "replace")
        if stream.truncated_bytes:
            text += f"\n[… {stream.truncated_bytes} bytes not kept …]\n"
        text += tail.decode("utf-8", "replace")
        if name == "stdout":
            parts.append(text)
        elif text:
            parts.append(f"--- stderr ---\n{text}")
    return "\n".join(part for part in parts if part)
