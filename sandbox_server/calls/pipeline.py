"""One tool call from its arguments to its outcome, with no MCP in it.

The route runs downward: check everything that needs no engine (the arguments, the time asked
for, the files, the tool's own rules), ask a person when the policy says so (the asking is
handed in with the call), admit the call against its caller's limits, open its kept workspace,
find its egress proxy, run the tool, add what its sandbox asked of the network, and turn
every refusal and engine fault on the way into an outcome. Every call, refused or not,
leaves one audit record. What the protocol layer must announce (a workspace's files
changed) comes back with the outcome.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import anyio
import anyio.to_thread

from sandbox_server.access.admission import Admission
from sandbox_server.access.approval import approval_needed
from sandbox_server.access.audit import AuditLog, call_record
from sandbox_server.access.identity import Identity
from sandbox_server.calls.arguments import check_arguments
from sandbox_server.calls.call import AskApproval, Call, TaskStart, branch_calls, branching, starts_sandbox
from sandbox_server.calls.hosts import CallAsker, Grants
from sandbox_server.calls.judge import judged_facts
from sandbox_server.calls.registry import ToolRegistry
from sandbox_server.calls.requests_made import with_requests
from sandbox_server.calls.resume import resume_services, resumes
from sandbox_server.calls.tracing import Tracing
from sandbox_server.calls.usage import with_usage
from sandbox_server.errors import EngineError, EngineUnavailable, Refusal
from sandbox_server.network.egress import ProxyEndpoint
from sandbox_server.policy import Policy, ToolPolicy
from sandbox_server.sandbox.runtime import RunHooks, SandboxRuntime
from sandbox_server.sandbox.spec import InputFile, ResourceLimits
from sandbox_server.services.manager import Services
from sandbox_server.services.scope import ServiceScope
from sandbox_server.tools import ToolContext, ToolOutcome
from sandbox_server.tools.arguments import check_call
from sandbox_server.workspaces.changes import changes_line
from sandbox_server.workspaces.kept import KeptWorkspace
from sandbox_server.workspaces.naming import ID_PATTERN

if TYPE_CHECKING:  # the PostgreSQL driver is imported only by a server given --state
    from sandbox_server.access.shared import SharedRate
    from sandbox_server.state.calls import SharedCall

__all__ = ["AskApproval", "Call", "CallEnd", "CallPipeline", "TaskStart", "UnknownTool"]


class UnknownTool(Exception):
    """The call names no tool its policy offers (a protocol fault, not a result)."""


@dataclass(frozen=True, slots=True)
class CallEnd:
    """How a call ended: an outcome to render, or a question to answer the call with."""

    outcome: ToolOutcome | None = None
    limits: ResourceLimits | None = None
    """The tool's limits under the call's policy (what a result may carry)."""
    question: Any = None
    workspace_changed: bool = False
    """The call saved its kept workspace with its files changed (or where what changed is not known): the list of
    its files, what clients are told changed, may have."""


class CallPipeline:
    """Runs calls: registry for tools and policies, admission for limits, a runtime for sandboxes, and the
    observers every finished call is told of (its audit record)."""

    def __init__(
        self,
        registry: ToolRegistry,
        runtime: SandboxRuntime,
        observers: Sequence[Callable[[dict[str, Any]], None]] = (),
        *,
        services: Services | None = None,
        shared_rate: SharedRate | None = None,
        grants: Grants | None = None,
        tracing: Tracing | None = None,
        audit: AuditLog | None = None,
    ) -> None:
        self.registry = registry
        policy = registry.policy
        self.admission = Admission(policy.rate, policy.host, policy.name)
        self.runtime = runtime
        self.observers = tuple(observers)
        """Told every call's audit record as it ends (the Prometheus metrics), before the audit log writes it."""
        self.audit = audit
        self.services = services
        """The server's services (None: this server starts none)."""
        self.shared_rate = shared_rate
        """Replicas: a caller's calls counted across every replica too (None: this process alone)."""
        self.tracing = tracing or Tracing()
        """Spans of every call (none unless an OTLP endpoint is given)."""
        self.grants = grants or Grants()
        """The hosts people approved or declined live, per session or caller (network.ask)."""

    def swap(self, policy: Policy) -> None:
        """A new server policy for new calls; running calls keep theirs."""
        self.registry.swap(policy)
        self.admission.reconfigure(policy.rate, policy.host, policy.name)

    def new_call(
        self, exposed: str, arguments: Mapping[str, Any], identity: Identity, client: str, session: str | None
    ) -> Call:
        """A call as it arrives: its policy (the caller's, else the server's) and its tool, looked up once."""
        policy = self.registry.policy_for(identity.policy)
        tool = self.registry.tools_of(policy).get(exposed)
        return Call(exposed, arguments, identity, client, session, policy, tool)

    async def call(self, call: Call) -> CallEnd:
        """Run one call; UnknownTool when its policy offers no tool of its name. Its stages, in order: the
        checks that need no engine, a person's approval, admission, its kept workspace, its network, the run,
        and what its sandbox asked of the network; release is written once, on one exit stack."""
        with self.tracing.span("tools/call"):  # named after the call once its audit record is whole
            started = time.monotonic()
            policy, tool = call.policy, call.tool
            record = call_record(
                call.client, tool.name if tool is not None else call.exposed, call.exposed, call.arguments,
                policy.name, policy.digest, policy.audit.include_arguments,
            )  # fmt: skip
            record["caller"] = call.identity.caller
            record |= {"task": call.task.id} if call.task is not None else {}
            if tool is None:
                message = f"unknown tool {call.exposed!r}; tools/list names the tools"
                await self._finished(record, ToolOutcome.refused(Refusal(message, "name"), policy.name), started)
                raise UnknownTool(message)
            record["judged"] = judged_facts(tool.name, call.arguments, call.task is not None or call.in_task)
            outcome, changed = None, False
            try:
                try:
                    files = self._check(call)
                    question = await self._approval(call, record)
                    if question is not None:  # 2026-07-28: asked through the client, answered in the next round
                        record["outcome"] = "awaiting_approval"
                        return CallEnd(question=question)
                    if call.task is not None:
                        await call.task.created()
                    outcome, changed = await self._run(call, files)
                except Refusal as refusal:  # the one place a refusal becomes an outcome
                    outcome = ToolOutcome.refused(refusal, policy.name)
                    if refusal.field == "workspace":
                        record.update(await self._denied(call))
                outcome = with_usage(outcome, time.monotonic() - started, call.task is not None)
                return CallEnd(outcome, call.tool_policy.limits, workspace_changed=changed)
            finally:
                with anyio.CancelScope(shield=True):
                    await self._finished(record, outcome, started)

    async def _denied(self, call: Call) -> dict[str, Any]:
        """What the audit record says of a workspace a call was refused: whose it is, when it is another caller's
        or another session's (the caller is told only that it is unknown)."""
        requested = call.arguments.get("workspace")
        store, identity = self.registry.workspaces, call.identity
        if not isinstance(requested, str) or not call.policy.workspace.persist or store is None:
            return {}
        whose = await anyio.to_thread.run_sync(store.whose, requested, call.session, identity.tenant)
        return {"denied": whose, "workspace": requested[:64]} if whose is not None else {}

    def _check(self, call: Call) -> tuple[InputFile, ...]:
        """Every refusal that needs no engine, before the call waits for anything: its arguments against the
        tool's schema and the policy, the time it asks for, its files and the tool's own rules."""
        assert call.tool is not None
        check_arguments(call.tool.name, self.registry.validators[call.tool.name], call.arguments, call.policy)
        long = call.task is not None or call.in_task
        return check_call(call.tool, call.arguments, call.tool_policy, call.policy.name, long)

    async def _approval(self, call: Call, record: dict[str, Any]) -> Any:
        """Ask a person when the policy says so: None when approved (a Refusal when not), or the question the
        call is answered with."""
        assert call.tool is not None
        policy = call.policy
        needed = approval_needed(policy.approval, policy.name, call.tool.name, call.tool_policy, call.arguments)
        if needed is None:
            return None
        if call.approval is None:
            raise Refusal(
                f"refused: policy '{policy.name}' needs a person's approval for this call (field approval), and "
                "nobody can be asked",
                "approval",
            )
        return await call.approval(needed, policy, record)

    async def _finished(self, record: dict[str, Any], outcome: ToolOutcome | None, started: float) -> None:
        """The call's audit record, whole, to its span, its observers and the audit log."""
        if self.audit is None and not self.observers and self.tracing.tracer is None:
            return
        record["duration_ms"] = int((time.monotonic() - started) * 1000)
        if outcome is not None:
            record.update(outcome.audit_fields())
            if outcome.structured is not None and "usage" in outcome.structured:
                record["usage"] = outcome.structured["usage"]
        record.setdefault("outcome", "cancelled")
        worked_in = (outcome.structured or {}).get("workspace") if outcome is not None else None
        if isinstance(worked_in, str):  # who worked in which workspace
            record.setdefault("workspace", worked_in)
        self.tracing.describe(record)
        for observe in self.observers:
            observe(record)
        if self.audit is not None:
            await anyio.to_thread.run_sync(self.audit.write, record)

    async def _run(self, call: Call, files: tuple[InputFile, ...]) -> tuple[ToolOutcome, bool]:
        """Admit the call, open its workspace, find its network, run the tool: its outcome and whether it changed
        a kept workspace's files; refusals are raised, engine faults become refusals."""
        assert call.tool is not None
        try:
            async with contextlib.AsyncExitStack() as stack:
                shared = await stack.enter_async_context(self._admitted(call))
                with self.tracing.span("workspace"):
                    kept = await self._workspace(call, shared)
                proxy = await self._proxy(call.tool_policy, call.policy.name)
                scope = self._scope(call, kept)
                resumed: tuple[str, ...] = ()
                if kept is not None and kept.store.book.shared:  # replicas: a workspace is continued on its home
                    arrived = await anyio.to_thread.run_sync(kept.store.arrive, kept.record, call.tool_policy.user)
                    resumed = (arrived,) if arrived is not None else ()
                if kept is not None and scope is not None and resumes(call):
                    with self.tracing.span("resume"):
                        resumed += await resume_services(self.registry, self._proxy, call, kept, scope)
                asker = self._asker(call, proxy, kept)
                hooks = RunHooks(
                    call.progress,
                    call.task.output if call.task is not None else None,
                    asker.watch if asker is not None else None,
                )
                tool_ctx = ToolContext(
                    kept or self.runtime, call.tool_policy, call.policy.name, hooks, files, kept is not None, proxy,
                    call.task is not None, scope, scope.network if scope is not None else None,
                    scope.names if scope is not None else (), self._brancher(call),
                )  # fmt: skip
                with self.tracing.span("container"):
                    outcome = await call.tool.run(call.arguments, tool_ctx)
                if proxy is not None:
                    with self.tracing.span("proxy"):
                        outcome = await self._with_requests(outcome, proxy, asker)
                if resumed:
                    outcome = replace(outcome, notes=(*resumed, *outcome.notes))
                return _in_workspace(outcome, kept, scope)
        except EngineUnavailable as exc:
            raise Refusal(str(exc), kind="engine_unavailable") from exc
        except EngineError as exc:
            raise Refusal(f"sandbox engine error: {exc}", kind="engine_error") from exc

    @contextlib.asynccontextmanager
    async def _admitted(self, call: Call) -> AsyncIterator[SharedCall | None]:
        """The call admitted against its caller's limits (one past the concurrency cap waits its turn, for at most
        the queue's wait: its timeout is its program's), across the replicas too: their side of the call, if any.
        An authenticated caller's limits are its own policy's and count its calls alone; a task was counted by the
        tasks' own caps, and only the host's saturation may still refuse it."""
        if call.task is not None or branching(call):  # a branch's calls are admitted each as any call is
            self.admission.check_host()
            if branching(call):  # but no fork is made for calls the caller's rate has no room for
                self.admission.check_rate(
                    call.identity.limits_key, call.policy.rate, call.policy.name, branch_calls(call)
                )
            yield None
            return
        policy, key = call.policy, call.identity.limits_key
        with self.tracing.span("admission"):
            ticket = await self.admission.enter(key, policy.rate, policy.name, call.waiting, starts_sandbox(call))
        shared = None
        try:
            if self.shared_rate is not None:
                named = call.arguments.get("workspace") if policy.workspace.persist else None
                named = named if isinstance(named, str) and ID_PATTERN.fullmatch(named) else None
                with self.tracing.span("admission (replicas)"):
                    shared = await self.shared_rate.admit(key, policy.rate, policy.name, named)
            yield shared
        finally:
            ticket.release()
            if shared is not None:
                await self._leave_shared(shared)

    async def _leave_shared(self, call: SharedCall) -> None:
        rate = self.shared_rate
        with anyio.CancelScope(shield=True):
            try:
                if rate is not None:
                    await rate.leave(call)
            except Refusal as exc:  # the database is down: the row goes with this replica's heartbeat
                logging.getLogger("sandbox_server").warning("%s", exc)

    async def _workspace(self, call: Call, shared: SharedCall | None) -> KeptWorkspace | None:
        """The call's kept workspace when its policy keeps them (None: it runs in the plain runtime).

        Opening one may remove another to make room (unmounting it), so it happens off the event loop."""
        store = self.registry.workspaces if call.policy.workspace.persist else None
        identity = call.identity
        if store is None:  # nothing kept, nothing to open: no trip to a thread
            return KeptWorkspace.open(
                self.runtime, None, call.arguments.get("workspace"), call.session, identity.holder
            )
        return await anyio.to_thread.run_sync(
            KeptWorkspace.open,
            self.runtime,
            store,
            call.arguments.get("workspace"),
            call.session,
            identity.holder,
            identity.tenant,
            shared,
            call.tool is not None and not call.tool.sandbox,  # the managing tools (workspaces, services) write no files
        )

    def _brancher(self, call: Call) -> Callable[[str, Mapping[str, Any], str], Awaitable[ToolOutcome]]:
        """How the `workspaces` tool's `branch` runs a call of a sandbox tool in a fork: as a call of its own, by the
        same caller under the same policy (checked, admitted, audited), with no person to ask."""

        async def branch(tool_name: str, arguments: Mapping[str, Any], workspace_id: str) -> ToolOutcome:
            tools = self.registry.tools_of(call.policy)
            exposed = tool_name if tool_name in tools else self.registry.prefix + tool_name
            tool = tools.get(exposed)
            if tool is None or not tool.sandbox:
                refused = Refusal(
                    f"refused: a branch runs one of the sandbox tools policy '{call.policy.name}' offers, not "
                    f"{tool_name[:64]!r}",
                    "calls",
                )
                return ToolOutcome.refused(refused, call.policy.name)
            inner = Call(
                exposed, {**arguments, "workspace": workspace_id}, call.identity, call.client, call.session,
                call.policy, tool, in_task=call.task is not None or call.in_task,
            )  # fmt: skip
            ended = await self.call(inner)
            return ended.outcome or ToolOutcome.refused(Refusal("refused: it asked for approval", "approval"), "")

        return branch

    def _scope(self, call: Call, kept: KeptWorkspace | None) -> ServiceScope | None:
        """Services in the call's workspace (None: this server starts none)."""
        if self.services is None:
            return None
        record = kept.record if kept is not None else None
        if record is not None:
            self.services.touch(record.id)
        return ServiceScope(self.services, record, call.identity.limits_key, call.policy.services, call.policy.name)

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

    def _asker(self, call: Call, proxy: ProxyEndpoint | None, kept: KeptWorkspace | None) -> CallAsker | None:
        """A call whose policy asks about hosts not on its list: its asker, watching for its sandbox's address."""
        egress = call.tool_policy.egress
        settings = egress.ask if egress is not None else None
        proxies = self.registry.proxies
        if settings is None or proxy is None or proxies is None:
            return None
        if settings.remember == "caller":
            key = f"caller:{call.identity.limits_key}"
        else:  # a handshake session, else the kept workspace the call continues, else the call alone
            key = f"session:{call.session or (kept.record.id if kept is not None else os.urandom(8).hex())}"
        return CallAsker(
            settings, self.grants.scope(key), call.question, call.unable, call.policy.name, proxies.gatekeeper,
            proxy.key,
        )  # fmt: skip

    async def _with_requests(
        self, outcome: ToolOutcome, proxy: ProxyEndpoint, asker: CallAsker | None = None
    ) -> ToolOutcome:
        """The outcome with the requests its sandbox made through the proxy (answer, notes and audit)."""
        proxies = self.registry.proxies
        assert proxies is not None
        address = str((outcome.audit or {}).get("address") or "")
        requests, dropped = await anyio.to_thread.run_sync(proxies.requests_of, proxy, address)
        return with_requests(outcome, requests, dropped, asker.asked if asker is not None else [])


def _in_workspace(
    outcome: ToolOutcome, kept: KeptWorkspace | None, scope: ServiceScope | None
) -> tuple[ToolOutcome, bool]:
    """The outcome with what its kept workspace adds (its id, what changed, the services running in it), and
    whether the call changed the workspace's files (saved with a change; a call that changed nothing, as most
    calls of a burst of commands, tells no client to list the files again)."""
    if kept is None or kept.deleted:
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
    if kept.record.name is not None:
        notes = (*notes, f"workspace {kept.record.name!r} ({kept.record.id}): pass either as `workspace` to continue")
    elif kept.record.session is None:  # the 2026-07-28 era: the id is how the next call continues it
        notes = (*notes, f"workspace {kept.record.id}: pass it as `workspace` to continue in it")
    changed = kept.changes is None or any(kept.changes.values())
    return replace(outcome, structured=structured, notes=notes), kept.saved and changed
