"""One tool call from its arguments to its outcome, with no MCP in it.

The route runs downward: check the arguments, ask a person when the policy says so (the
asking is handed in), admit the call against its caller's limits, open its kept workspace,
find its egress proxy, run the tool, add what its sandbox asked of the network, and turn
every refusal and engine fault on the way into an outcome. Every call, refused or not,
leaves one audit record. What the protocol layer must announce (a workspace saved, so
its files changed) comes back with the outcome.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import anyio
import anyio.to_thread

from sandbox_server.access.admission import Admission, Waiting
from sandbox_server.access.approval import Approval, approval_needed
from sandbox_server.access.audit import AuditLog, call_record
from sandbox_server.access.identity import Identity
from sandbox_server.calls.arguments import check_arguments
from sandbox_server.calls.hosts import CallAsker, Grants, Question
from sandbox_server.calls.metering import metered
from sandbox_server.calls.registry import ToolRegistry
from sandbox_server.calls.tracing import Tracing
from sandbox_server.errors import EngineError, EngineUnavailable, Refusal
from sandbox_server.network.egress import ProxyEndpoint
from sandbox_server.policy import Policy, ToolPolicy
from sandbox_server.sandbox.runtime import ADDRESS_WATCH, ProgressCallback, SandboxRuntime
from sandbox_server.sandbox.spec import ResourceLimits
from sandbox_server.services.manager import Services
from sandbox_server.services.scope import ServiceScope
from sandbox_server.state.calls import CURRENT
from sandbox_server.tools import Tool, ToolContext, ToolOutcome
from sandbox_server.workspaces.changes import changes_line
from sandbox_server.workspaces.kept import KeptWorkspace
from sandbox_server.workspaces.naming import ID_PATTERN

if TYPE_CHECKING:  # the PostgreSQL driver is imported only by a server given --state, Prometheus' by one metering
    from sandbox_server.access.shared import SharedRate
    from sandbox_server.calls.meters import Meters
    from sandbox_server.state.calls import SharedCall

__all__ = ["Ask", "CallEnd", "CallPipeline", "TaskStart", "UnknownTool"]

DENIED_NAMED = 20
"""Hosts the proxy refused that an answer's note names (the answer's `network.denied` lists them all)."""

Ask = Callable[[Approval, Policy, dict[str, Any]], Awaitable[Any]]
"""Asks a person to approve a call (given what needs approval, the call's policy and its audit record): None
when they approved, a Refusal raised when not, or a question the call is answered with instead (the client asks
it and calls again with the answer)."""


class UnknownTool(Exception):
    """The call names no tool its policy offers (a protocol fault, not a result)."""


@dataclass(frozen=True, slots=True)
class TaskStart:
    """A call that runs as a task: its id, and what to do once it is past its checks and approval (from then on
    it is a task; a refusal before that answers the request itself). It takes no slot of rate.concurrent_calls
    (the tasks' own caps counted it) and may run for up to limits.max_task_s."""

    id: str
    created: Callable[[], Awaitable[None]]


@dataclass(frozen=True, slots=True)
class CallEnd:
    """How a call ended: an outcome to render, or a question to answer the call with."""

    outcome: ToolOutcome | None = None
    limits: ResourceLimits | None = None
    """The tool's limits under the call's policy (what a result may carry)."""
    question: Any = None
    workspace_saved: bool = False
    """The call saved its kept workspace: the files it lists may have changed."""


class CallPipeline:
    """Runs calls: registry for tools and policies, admission for limits, a runtime for sandboxes, an audit trail."""

    def __init__(self, registry: ToolRegistry, runtime: SandboxRuntime, audit: AuditLog | None = None) -> None:
        self.registry = registry
        policy = registry.policy
        self.admission = Admission(policy.rate, policy.host, policy.name)
        self.runtime = runtime
        self.audit = audit
        self.services: Services | None = None
        """The server's services (None: this server starts none)."""
        self.shared_rate: SharedRate | None = None
        """Replicas: a caller's calls counted across every replica too (None: this process alone)."""
        self.meters: Meters | None = None
        """Every call counted for Prometheus (None: no /metrics)."""
        self.tracing = Tracing()
        """Spans of every call (none unless an OTLP endpoint is given)."""
        self.grants = Grants()
        """The hosts people approved or declined live, per session or caller (network.ask)."""

    def swap(self, policy: Policy) -> None:
        """A new server policy for new calls; running calls keep theirs."""
        self.registry.swap(policy)
        self.admission.reconfigure(policy.rate, policy.host, policy.name)

    async def call(
        self,
        exposed: str,
        arguments: Mapping[str, Any],
        identity: Identity,
        client: str,
        session: str | None,
        progress: ProgressCallback,
        ask: Ask,
        waiting: Waiting | None = None,
        task: TaskStart | None = None,
        question: Question | None = None,
        unable: str = "",
    ) -> CallEnd:
        """Run one call of the tool clients see as `exposed`; UnknownTool when its policy offers none such.

        `client` is how the client names itself (for the audit record only); `session` is the handshake session
        whose workspace the call works in (None: the 2026-07-28 era, where a result's `workspace` id is passed);
        `waiting` hears how many calls are ahead while the call waits for a slot; `question` asks the person about
        a host the allow list does not name (None: nobody can be asked, `unable` says why).
        """
        with self.tracing.span("tools/call"):  # named after the call once its audit record is whole
            # One policy for the whole call, even if a new one is swapped in meanwhile: the caller's, else the server's.
            policy = self.registry.policy_for(identity.policy)
            started = time.monotonic()
            tool = self.registry.tools_of(policy).get(exposed)
            own_name = tool.name if tool is not None else exposed
            record = call_record(
                client, own_name, exposed, arguments, policy.name, policy.digest, policy.audit.include_arguments
            )
            record["caller"] = identity.caller
            if task is not None:
                record["task"] = task.id
            if tool is None:
                message = f"unknown tool {exposed!r}; tools/list names the tools"
                await self._audit_finish(record, ToolOutcome.refused(Refusal(message, "name"), policy.name), started)
                raise UnknownTool(message)
            outcome: ToolOutcome | None = None
            saved = False
            try:
                try:
                    check_arguments(tool.name, self.registry.validators[tool.name], arguments, policy)
                    needed = approval_needed(
                        policy.approval, policy.name, tool.name, policy.for_tool(tool.name), arguments
                    )
                    if needed is not None:
                        question = await ask(needed, policy, record)
                        # 2026-07-28: asked through the client, answered in the call's next round
                        if question is not None:
                            record["outcome"] = "awaiting_approval"
                            return CallEnd(question=question)
                    if task is not None:
                        await task.created()
                    asking = (question, unable)
                    outcome, saved = await self._run_checked(
                        tool, arguments, policy, identity, session, progress, waiting, task is not None, asking
                    )
                except Refusal as refusal:  # the one place a refusal becomes an outcome
                    outcome = ToolOutcome.refused(refusal, policy.name)
                outcome = metered(outcome, time.monotonic() - started, task is not None)
                return CallEnd(outcome, policy.for_tool(tool.name).limits, workspace_saved=saved)
            finally:
                with anyio.CancelScope(shield=True):
                    await self._audit_finish(record, outcome, started)

    async def _audit_finish(self, record: dict[str, Any], outcome: ToolOutcome | None, started: float) -> None:
        if self.audit is None and self.meters is None and self.tracing.tracer is None:
            return
        record["duration_ms"] = int((time.monotonic() - started) * 1000)
        if outcome is not None:
            record.update(outcome.audit_fields())
            if outcome.structured is not None and "usage" in outcome.structured:
                record["usage"] = outcome.structured["usage"]
        record.setdefault("outcome", "cancelled")
        self.tracing.describe(record)
        if self.meters is not None:
            self.meters.observe(record)
        if self.audit is not None:
            await anyio.to_thread.run_sync(self.audit.write, record)

    async def _run_checked(
        self,
        tool: Tool,
        arguments: Mapping[str, Any],
        policy: Policy,
        identity: Identity,
        session: str | None,
        progress: ProgressCallback,
        waiting: Waiting | None,
        as_task: bool = False,
        asking: tuple[Question | None, str] = (None, ""),
    ) -> tuple[ToolOutcome, bool]:
        """Admit (a call past the concurrency cap waits its turn, within its own timeout), then run the tool: its
        outcome and whether it saved a kept workspace; refusals are raised."""
        tool_policy = policy.for_tool(tool.name)
        timeout = arguments.get("timeout_s")
        deadline = float(timeout) if isinstance(timeout, int | float) else tool_policy.limits.timeout_s
        # An authenticated caller's limits are its own policy's and count its calls alone; a task was counted by
        # the tasks' own caps, and only the host's saturation may still refuse it.
        if as_task:
            self.admission.check_host()
            ticket = None
        else:
            with self.tracing.span("admission"):
                ticket = await self.admission.enter(identity.limits_key, policy.rate, policy.name, deadline, waiting)
        shared_call = None
        current = CURRENT.set(None)
        try:
            if self.shared_rate is not None and ticket is not None:
                named = arguments.get("workspace") if policy.workspace.persist else None
                named = named if isinstance(named, str) and ID_PATTERN.fullmatch(named) else None
                with self.tracing.span("admission (replicas)"):
                    shared_call = await self.shared_rate.admit(identity.limits_key, policy.rate, policy.name, named)
                CURRENT.set(shared_call)
            with self.tracing.span("workspace"):
                runtime, kept = await self._workspace_runtime(arguments, policy, identity, session)
        except BaseException:
            if ticket is not None:
                ticket.release()
            if shared_call is not None:
                await self._leave_shared(shared_call)
            CURRENT.reset(current)
            raise
        try:
            proxy = await self._proxy(tool_policy, policy.name)
            scope = None
            if self.services is not None:
                record = kept.record if kept is not None else None
                if record is not None:
                    self.services.touch(record.id)
                scope = ServiceScope(self.services, record, identity.limits_key, policy.services, policy.name)
            tool_ctx = ToolContext(
                runtime, tool_policy, policy.name, progress, kept is not None, proxy, as_task, scope,
                scope.network if scope is not None else None, scope.names if scope is not None else (),
            )  # fmt: skip
            asker = self._asker(tool_policy, policy.name, proxy, asking, identity, session, kept)
            watching = ADDRESS_WATCH.set(asker.watch if asker is not None else None)
            try:
                with self.tracing.span("container"):
                    outcome = await tool.run(arguments, tool_ctx)
            finally:
                ADDRESS_WATCH.reset(watching)
            if proxy is not None:
                with self.tracing.span("proxy"):
                    outcome = await self._with_requests(outcome, proxy, asker)
            if kept is None:
                return outcome, False
            structured = {**(outcome.structured or {}), "workspace": kept.record.id}
            if outcome.audit is not None:
                outcome = replace(outcome, audit={**outcome.audit, "workspace_bytes": kept.size_bytes})
            if scope is not None and (running := scope.listed()):
                structured["services"] = running
            notes = outcome.notes
            if kept.changes is not None:
                structured["changes"] = kept.changes
                said = changes_line(kept.changes)
                notes = (*notes, said) if said else notes
            if kept.record.session is None:  # the 2026-07-28 era: the id is how the next call continues it
                notes = (*notes, f"workspace {kept.record.id}: pass it as `workspace` to continue in it")
            return replace(outcome, structured=structured, notes=notes), kept.saved
        except EngineUnavailable as exc:
            raise Refusal(str(exc), kind="engine_unavailable") from exc
        except EngineError as exc:
            raise Refusal(f"sandbox engine error: {exc}", kind="engine_error") from exc
        finally:
            if ticket is not None:
                ticket.release()
            if shared_call is not None:
                await self._leave_shared(shared_call)
            CURRENT.reset(current)

    async def _leave_shared(self, call: SharedCall) -> None:
        rate = self.shared_rate
        with anyio.CancelScope(shield=True):
            try:
                if rate is not None:
                    await rate.leave(call)
            except Refusal as exc:  # the database is down: the row goes with this replica's heartbeat
                logging.getLogger("sandbox_server").warning("%s", exc)

    async def _workspace_runtime(
        self, arguments: Mapping[str, Any], policy: Policy, identity: Identity, session: str | None
    ) -> tuple[SandboxRuntime, KeptWorkspace | None]:
        """The runtime of this call: in its kept workspace when the policy keeps them, else the plain one.

        Opening one may remove another to make room (unmounting it), so it happens off the event loop."""
        store = self.registry.workspaces if policy.workspace.persist else None
        kept = await anyio.to_thread.run_sync(
            KeptWorkspace.open,
            self.runtime,
            store,
            arguments.get("workspace"),
            session,
            identity.tenant or identity.limits_key,  # counted per tenant: anonymous sessions keep apart
            identity.tenant,
        )
        return (kept or self.runtime), kept

    async def _proxy(self, tool_policy: ToolPolicy, policy_name: str) -> ProxyEndpoint | None:
        """The running proxy of a tool with an allow list (a Refusal saying why when there is none)."""
        if tool_policy.egress is None:
            return None
        proxies = self.registry.proxies
        if proxies is None:
            raise Refusal(
                f"refused: policy '{policy_name}' opens a network (field network), and this server runs no proxies",
                "network",
                kind="network_unavailable",
            )
        endpoint = await anyio.to_thread.run_sync(proxies.endpoint, tool_policy.egress, policy_name)
        self.registry.network_ready(endpoint.key)  # its network exists now: the tool's warm pool can fill
        return endpoint

    def _asker(
        self,
        tool_policy: ToolPolicy,
        policy_name: str,
        proxy: ProxyEndpoint | None,
        asking: tuple[Question | None, str],
        identity: Identity,
        session: str | None,
        kept: KeptWorkspace | None,
    ) -> CallAsker | None:
        """A call whose policy asks about hosts not on its list: its asker, watching for its sandbox's address."""
        settings = tool_policy.egress.ask if tool_policy.egress is not None else None
        proxies = self.registry.proxies
        if settings is None or proxy is None or proxies is None:
            return None
        if settings.remember == "caller":
            key = f"caller:{identity.limits_key}"
        else:  # a handshake session, else the kept workspace the call continues, else the call alone
            key = f"session:{session or (kept.record.id if kept is not None else os.urandom(8).hex())}"
        return CallAsker(settings, self.grants.scope(key), *asking, policy_name, proxies.gatekeeper, proxy.key)

    async def _with_requests(
        self, outcome: ToolOutcome, proxy: ProxyEndpoint, asker: CallAsker | None = None
    ) -> ToolOutcome:
        """The outcome with the requests its sandbox made through the proxy (answer, notes and audit)."""
        proxies = self.registry.proxies
        assert proxies is not None
        address = str((outcome.audit or {}).get("address") or "")
        requests, dropped = await anyio.to_thread.run_sync(proxies.requests_of, proxy, address)
        records = [request.record() for request in requests]
        denied = sorted({f"{r.host}:{r.port}" for r in requests if not r.allowed})
        network: dict[str, Any] = {"requests": records, "denied": denied}
        if asker is not None and asker.asked:
            network["asked"] = asker.asked
        notes = outcome.notes
        if dropped:
            network["requests_not_kept"] = dropped
            notes = (*notes, f"{dropped} earlier requests through the proxy are counted but not listed")
        if denied:
            named = ", ".join(denied[:DENIED_NAMED]) + (
                f" and {len(denied) - DENIED_NAMED} more" if len(denied) > DENIED_NAMED else ""
            )
            notes = (*notes, f"the proxy refused {named} (policy field network.allow)")
        audit = {**(outcome.audit or {}), "network": network} if outcome.audit is not None else None
        structured = {**outcome.structured, "network": network} if outcome.structured is not None else None
        return replace(outcome, structured=structured, notes=notes, audit=audit)
