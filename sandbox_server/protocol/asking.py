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

from sandbox_server.access.approval import APPROVAL_FORM, Approval, lapses_at, new_question
from sandbox_server.calls.hosts import Question
from sandbox_server.errors import Refusal
from sandbox_server.policy import Policy
from sandbox_server.protocol.requests import Context, handshake_era

__all__ = ["APPROVAL_TTL_S", "Approvals", "LocalQuestions", "ParkedCalls", "Questions", "elicits", "host_question"]

APPROVAL_TTL_S = 600.0
"""How long a question for approval may wait for its answer."""
MAX_QUESTIONS = 100
"""Calls of one caller parked while the person is asked about a host (2026-07-28 era); past it its oldest go."""
MAX_USED_ANSWERS = 100_000
"""Used approval answers one caller's table keeps until they lapse (each came from a genuine question)."""


class Questions(Protocol):
    """Approval questions (2026-07-28 era): each answered once, until it lapses.

    A question is kept by its client, not here: its id, with the time it lapses, travels in the requestState the
    SDK seals (bound to the call, its arguments and its caller). What is kept is the answers already used, until
    they lapse, so a flood of questions, however large, pushes no question of anyone out: there is no table of
    pending questions to fill."""

    def ask(self, caller: str, lapse_s: float) -> str:
        """A new question's id, which carries when it lapses."""

    def take(self, caller: str, question_id: str) -> bool:
        """Whether the question may be answered now (not lapsed, not answered before): it is used up now."""


class LocalQuestions:
    """This process's used answers, per caller: question id -> when it lapses (then forgotten)."""

    def __init__(self) -> None:
        self._used: dict[str, OrderedDict[str, float]] = {}
        self._lock = threading.Lock()

    def ask(self, caller: str, lapse_s: float) -> str:
        return new_question(lapse_s)

    def take(self, caller: str, question_id: str) -> bool:
        lapses, now = lapses_at(question_id), time.time()
        if lapses is None or lapses <= now:
            return False
        with self._lock:
            used = self._used.setdefault(caller, OrderedDict())
            while used and next(iter(used.values())) <= now:
                used.popitem(last=False)  # lapsed; one behind a later-lapsing answer waits its turn (it is refused
                # as lapsed before it is looked up, and the table's size is bounded)
            if question_id in used:
                return False
            used[question_id] = lapses
            while len(used) > MAX_USED_ANSWERS:
                used.popitem(last=False)  # the caller's oldest answer: replaying it replays its own approval
        return True


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
                question_id = self.questions.ask(caller, APPROVAL_TTL_S)
                request = types.ElicitRequest(
                    params=types.ElicitRequestFormParams(message=needed.message, requested_schema=APPROVAL_FORM)
                )
                record["approval"]["decision"] = "asked"
                return types.InputRequiredResult(input_requests={"approval": request}, request_state=question_id)
            action = response.action if isinstance(response, types.ElicitResult) else None
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
        self._parked: dict[str, OrderedDict[str, _Parked]] = {}
        """Per caller, its parked calls by id, oldest first: one caller's flood pushes out only its own."""

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
        theirs = self._parked.setdefault(caller, OrderedDict())
        theirs[call_id] = parked
        while len(theirs) > MAX_QUESTIONS:
            theirs.popitem(last=False)  # this caller's oldest, whose client never came back

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
        theirs = self._parked.get(caller)
        parked = theirs.get(call_id) if theirs is not None else None
        if parked is None:
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
        theirs = self._parked.get(parked.caller)
        if theirs is not None:
            theirs.pop(call_id, None)
            if not theirs:
                del self._parked[parked.caller]
        if kind == "error":
            raise value
        return value
