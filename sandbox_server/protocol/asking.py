"""Asking a person, through the client, to approve a call, in both protocol eras.

Handshake era: an elicitation/create request while the call waits. 2026-07-28 era: the call
answers with the question (input_required); the client asks and calls again with the answer
and the question's id in its sealed requestState, which is good for one answer.
"""

from __future__ import annotations

import math
import secrets
import threading
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

import anyio
import anyio.abc
import anyio.to_thread
import mcp_types as types
from mcp.shared.exceptions import MCPError

from sandbox_server.access.approval import APPROVAL_FORM, Approval
from sandbox_server.calls.hosts import Question
from sandbox_server.errors import Refusal
from sandbox_server.policy import Policy
from sandbox_server.protocol.requests import Context, handshake_era

__all__ = ["APPROVAL_TTL_S", "Approvals", "LocalQuestions", "ParkedCalls", "Questions", "elicits", "host_question"]

APPROVAL_TTL_S = 600.0
"""How long a question for approval may wait for its answer."""
MAX_QUESTIONS = 100
"""Approval questions of one caller awaiting an answer at most (2026-07-28 era); past it its oldest lapse."""


class Questions(Protocol):
    """Where approval questions wait for their answer."""

    def ask(self, caller: str, lapse_s: float, most: int) -> str:
        """A new question's id (the caller's questions past `most`, oldest first, and lapsed ones go)."""

    def take(self, caller: str, question_id: str) -> bool:
        """Whether the question was asked of this caller and not yet answered or lapsed (it is used up now)."""


class LocalQuestions:
    """This process's questions, per caller: id -> when it lapses."""

    def __init__(self) -> None:
        self._asked: dict[str, OrderedDict[str, float]] = {}
        self._lock = threading.Lock()

    def _live(self, caller: str) -> OrderedDict[str, float]:
        now, questions = time.monotonic(), self._asked.setdefault(caller, OrderedDict())
        while questions and next(iter(questions.values())) <= now:
            questions.popitem(last=False)  # lapsed (asked in order, so the oldest lapse first)
        return questions

    def ask(self, caller: str, lapse_s: float, most: int) -> str:
        question_id = secrets.token_urlsafe(16)
        with self._lock:
            questions = self._live(caller)
            while len(questions) >= most:
                questions.popitem(last=False)  # this caller's oldest, past its cap
            questions[question_id] = time.monotonic() + lapse_s
        return question_id

    def take(self, caller: str, question_id: str) -> bool:
        with self._lock:
            questions = self._live(caller)
            asked = questions.pop(question_id, None)
            if not questions:
                del self._asked[caller]
        return asked is not None


class Approvals:
    """The questions asked and the calls waiting for an answer, per caller (its limits key)."""

    def __init__(self, questions: Questions | None = None) -> None:
        self.questions: Questions = questions if questions is not None else LocalQuestions()
        """Approval questions asked and not yet answered (2026-07-28 era): this process's, or the replicas'."""
        self._waiting: dict[str, int] = {}
        """Handshake-era calls waiting for a person's answer, per caller."""

    async def ask(
        self,
        ctx: Context,
        params: types.CallToolRequestParams,
        caller: str,
        needed: Approval,
        policy: Policy,
        record: dict[str, Any],
    ) -> types.InputRequiredResult | None:
        """None when a person approved the call; the question to answer it with (2026-07-28 era); else a Refusal."""
        record["approval"] = {"field": needed.field, "reason": needed.reason}
        if not elicits(ctx):
            record["approval"]["decision"] = "unavailable"
            raise Refusal(
                f"refused: policy '{needed.policy}' needs a person to approve this call ({needed.field}: "
                f"{needed.reason}), and this client cannot ask one (it declares no form elicitation); use a "
                f"client that can, or change the policy field {needed.field}",
                needed.field,
            )
        action: str | None
        if handshake_era(ctx):
            action = await self._ask_while_waiting(ctx, caller, needed, policy, record)
        else:
            state = params.request_state or ""
            asked = bool(state) and await anyio.to_thread.run_sync(self.questions.take, caller, state)
            response = (params.input_responses or {}).get("approval")
            if not asked or response is None:  # a first round, a lapsed question or a used answer: ask
                question_id = await anyio.to_thread.run_sync(self.questions.ask, caller, APPROVAL_TTL_S, MAX_QUESTIONS)
                request = types.ElicitRequest(
                    params=types.ElicitRequestFormParams(message=needed.message, requested_schema=APPROVAL_FORM)
                )
                record["approval"]["decision"] = "asked"
                return types.InputRequiredResult(input_requests={"approval": request}, request_state=question_id)
            action = getattr(response, "action", None)
        record["approval"]["decision"] = action
        if action != "accept":
            raise Refusal(f"declined by the user (policy field {needed.field})", needed.field, kind="declined")
        return None

    async def _ask_while_waiting(
        self, ctx: Context, caller: str, needed: Approval, policy: Policy, record: dict[str, Any]
    ) -> str:
        """Handshake era: a call waiting for a person holds its arguments, so a caller may have as many waiting as
        it may run; the person's action."""
        most = policy.rate.concurrent_calls
        if self._waiting.get(caller, 0) >= most:
            record["approval"]["decision"] = "too many waiting"
            raise Refusal(
                f"busy: {most} calls of this caller already wait for a person's approval, as many as it may "
                f"run at once (policy '{policy.name}', field rate.concurrent_calls); retry once they are answered",
                "rate.concurrent_calls",
                kind="busy",
                retry_after_s=5,
            )
        self._waiting[caller] = self._waiting.get(caller, 0) + 1
        try:
            return await _elicit(ctx, needed, record)
        finally:
            self._waiting[caller] -= 1
            if not self._waiting[caller]:
                del self._waiting[caller]


async def _elicit(ctx: Context, needed: Approval, record: dict[str, Any]) -> str:
    """Ask through an elicitation/create while the call waits; the person's action."""
    action = "no answer"
    with anyio.move_on_after(APPROVAL_TTL_S):
        try:
            answer = await ctx.session.elicit_form(needed.message, APPROVAL_FORM, related_request_id=ctx.request_id)
        except MCPError as exc:
            record["approval"]["decision"] = "client error"
            raise Refusal(
                f"not approved: the client could not ask the user ({exc.error.message}) (policy field {needed.field})",
                needed.field,
                kind="declined",
            ) from None
        action = answer.action
    if action == "no answer":
        record["approval"]["decision"] = action
        raise Refusal(
            f"not approved: no answer from the user within {APPROVAL_TTL_S:g} s (policy field {needed.field})",
            needed.field,
            kind="declined",
        )
    return action


def elicits(ctx: Context) -> bool:
    """Whether the client can put a form question to the person."""
    capabilities = ctx.session.client_capabilities
    elicitation = capabilities.elicitation if capabilities is not None else None
    return elicitation is not None and not (elicitation.form is None and elicitation.url is not None)


def host_question(ctx: Context, as_task: bool) -> tuple[Question | None, str]:
    """How a call asks the person about a host its allow list does not name (network.ask), or why it cannot."""
    if not elicits(ctx):
        return None, "this client cannot ask a person (it declares no form elicitation)"
    if as_task:
        return None, "a call running as a task is not asked about hosts (run it as a plain call)"
    if not handshake_era(ctx):
        return None, "this server cannot ask the person beside a 2026-07-28 call"

    async def question(message: str, wait_s: float) -> str:
        with anyio.move_on_after(wait_s):
            try:
                answer = await ctx.session.elicit_form(message, APPROVAL_FORM, related_request_id=ctx.request_id)
            except MCPError:
                return "client error"
            return answer.action
        return "no answer"

    return question, ""


class _Parked:
    """A 2026-07-28 call running beside its requests while the person is asked about a host: each request
    answers with its next question or its result."""

    def __init__(self, caller: str) -> None:
        self.caller = caller
        # unbounded, but at most network.ask.questions and one result: a client that never comes back holds nothing up
        self.sending, self.events = anyio.create_memory_object_stream[tuple[str, Any]](math.inf)
        self._answer: tuple[anyio.Event, list[str]] | None = None

    async def question(self, message: str, wait_s: float) -> str:
        answered, answer = anyio.Event(), ["no answer"]
        self._answer = (answered, answer)
        await self.sending.send(("question", message))
        with anyio.move_on_after(wait_s):
            await answered.wait()
        self._answer = None
        return answer[0]

    def answer(self, action: str) -> None:
        if self._answer is not None:
            answered, answer = self._answer
            answer[0] = action
            answered.set()


class ParkedCalls:
    """2026-07-28 calls that may ask the person about a host mid-run (network.ask): a request's answer is the
    call's result, or its question (input_required) with the parked call's id as requestState; the client's
    next round carries the answer, and is answered in turn. The call runs in this process's task group."""

    def __init__(self) -> None:
        self._group: anyio.abc.TaskGroup | None = None
        self._parked: OrderedDict[str, _Parked] = OrderedDict()

    async def serve(self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        async with anyio.create_task_group() as group:
            self._group = group
            task_status.started()
            try:
                await anyio.sleep_forever()
            finally:
                self._group = None

    @property
    def running(self) -> bool:
        return self._group is not None

    async def start(self, caller: str, run: Callable[[Question], Awaitable[Any]]) -> Any:
        """Run a call beside its request: its result, or its first question."""
        assert self._group is not None
        parked, call_id = _Parked(caller), secrets.token_urlsafe(16)
        self._parked[call_id] = parked
        while len(self._parked) > MAX_QUESTIONS * 10:
            self._parked.popitem(last=False)  # the oldest, whose client never came back

        async def work() -> None:
            with parked.sending:
                try:
                    await parked.sending.send(("done", await run(parked.question)))
                except Exception as exc:  # the request waiting for it raises it
                    await parked.sending.send(("error", exc))

        self._group.start_soon(work)
        return await self._next(call_id, parked)

    async def resume(self, caller: str, call_id: str, action: str) -> Any | None:
        """A round answering a parked call's question: its next answer (None: no such call of this caller)."""
        parked = self._parked.get(call_id)
        if parked is None or parked.caller != caller:
            return None
        parked.answer(action)
        return await self._next(call_id, parked)

    async def _next(self, call_id: str, parked: _Parked) -> Any:
        kind, value = await parked.events.receive()
        if kind == "question":
            request = types.ElicitRequest(
                params=types.ElicitRequestFormParams(message=value, requested_schema=APPROVAL_FORM)
            )
            return types.InputRequiredResult(input_requests={"network": request}, request_state=call_id)
        self._parked.pop(call_id, None)
        if kind == "error":
            raise value
        return value
