"""The only module that speaks MCP: the tool registry becomes tools/list and tools/call.

Protocol faults (unknown tool, bad cursor, malformed request) are JSON-RPC errors;
everything about a call (invalid arguments, refusals, failed programs, an engine
that is down) is an `isError` result whose first line says what happened.
"""

from __future__ import annotations

import base64
import getpass
import json
import logging
import secrets
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import Any

import anyio
import anyio.to_thread
import mcp_types as types
import psutil
from jsonschema import Draft202012Validator
from mcp.server import ServerRequestContext
from mcp.server.auth.middleware.bearer_auth import AuthenticatedUser
from mcp.server.auth.provider import AccessToken
from mcp.server.lowlevel import NotificationOptions, Server
from mcp.server.request_state import RequestStateBoundary, RequestStateSecurity
from mcp.server.session import ServerSession
from mcp.server.subscriptions import InMemorySubscriptionBus, ListenHandler, ResourcesListChanged, ToolsListChanged
from mcp.shared.exceptions import MCPError
from mcp_types.version import HANDSHAKE_PROTOCOL_VERSIONS

from sandbox_server import __version__
from sandbox_server.access.admission import Admission
from sandbox_server.access.approval import APPROVAL_FORM, Approval, approval_needed, approval_notice
from sandbox_server.access.audit import AuditLog, call_record
from sandbox_server.access.auth import POLICY_CLAIM
from sandbox_server.calls.arguments import argument_path, describe_error, paginate, requested_part
from sandbox_server.errors import EngineError, EngineUnavailable, Refusal
from sandbox_server.network.egress import ProxyEndpoint
from sandbox_server.network.proxies import EgressProxies
from sandbox_server.policy import Policy, ToolPolicy
from sandbox_server.protocol.results import OWN_NAME_META, RenderedResult, ResourceStore, render
from sandbox_server.sandbox.pool import PoolTarget, WarmPool
from sandbox_server.sandbox.runtime import SandboxRuntime
from sandbox_server.tools import Tool, ToolContext, ToolOutcome
from sandbox_server.tools.base import annotations_for
from sandbox_server.workspaces.store import RESOURCE_TEMPLATE, KeptWorkspace, WorkspaceStore, session_owner

__all__ = ["SandboxServer"]

logger = logging.getLogger("sandbox_server")

Context = ServerRequestContext[Any, Any]
INVALID_PARAMS = -32602
RESOURCE_NOT_FOUND_HANDSHAKE = -32002
"""Handshake-era code for a missing resource; the 2026-07-28 era retired it for -32602."""
REMEMBERED_SESSIONS = 1024
APPROVAL_TTL_S = 600.0
"""How long a question for approval (2026-07-28 era) may wait for its answer."""
MAX_QUESTIONS = 100
"""Approval questions of one caller awaiting an answer at most (2026-07-28 era); past it its oldest lapse."""
RESOURCES_PAGE = 500
"""Resources per resources/list page."""
READ_PART_BYTES = 512 * 1024
"""The most one resources/read returns: base64 makes it about 700 KB, within the 1 MiB message a client accepts."""
PART_META = "org.sandbox-server/part"
"""`_meta` key of a part of a file read with `?offset=`: its offset, length, the file's size and the next part's URI."""
APPROVAL_META = "sandbox-server/approval"
"""Tool `_meta` key: what the policy asks a person to approve before the tool's calls run."""
INSTRUCTIONS = (
    "Every tool call runs in a fresh, isolated, resource-limited container that is destroyed "
    "afterwards; processes and /tmp never outlive a call. When the policy keeps workspaces, "
    "/workspace is as the previous call of this session left it (in the 2026-07-28 era: of the "
    "`workspace` id you pass back from a result), and run_python keeps a cell's variables for the "
    "next. Send input files with `files`; files written to /workspace/out come back with the result."
)


class SandboxServer:
    """Tools, policy and runtime wired to an MCP low-level Server."""

    def __init__(
        self,
        tools: list[Tool],
        policy: Policy,
        runtime: SandboxRuntime,
        page_size: int = 50,
        store: ResourceStore | None = None,
        audit: AuditLog | None = None,
        pool: WarmPool[Any] | None = None,
        tool_prefix: str | None = None,
        workspaces: WorkspaceStore | None = None,
        instance: str = "local",
        proxies: EgressProxies | None = None,
        caller_policy: Callable[[str], Policy] | None = None,
    ) -> None:
        self.all_tools = {tool.name: tool for tool in tools}
        self.tool_prefix = tool_prefix
        """Overrides the policy's `tool_prefix` when set (serve --tool-prefix)."""
        self.validators = {tool.name: Draft202012Validator(tool.input_schema) for tool in tools}
        self.policy = policy
        self.admission = Admission(policy.rate, policy.host, policy.name)
        self.workspaces = workspaces
        """Kept workspaces, used when the policy's workspace.persist is true."""
        self.pool = pool
        self.proxies = proxies
        """The egress proxies of policies with an allow list (None: such a policy's calls are refused)."""
        self.caller_policy = caller_policy
        """The policy a caller's token names, by its reference (None: every call runs under the server's)."""
        self._pooled_networks: set[str] = set()
        """Allow lists whose network the warm pools know of (by key)."""
        self._caller_policies: dict[str, Policy] = {}
        """Callers' policies other than the server's, by reference: the warm pools keep containers for them too."""
        self.runtime: SandboxRuntime = pool if pool is not None else runtime
        self._configure_pool()
        self.page_size = max(1, page_size)
        self.store = store or ResourceStore()
        self.audit = audit
        self.instance = instance
        """This server process, in the owner of its handshake sessions' workspaces."""
        self._sessions: OrderedDict[str, ServerSession] = OrderedDict()
        """Handshake-era connections to tell of a tools/list change, by MCP session id (the latest request's)."""
        self._events = InMemorySubscriptionBus()  # 2026-07-28 clients hear of changes via subscriptions/listen
        self.server: Server[Any] = Server(
            "sandbox-server",
            version=__version__,
            title="Sandbox server",
            instructions=INSTRUCTIONS,
            on_list_tools=self._list_tools,
            on_call_tool=self._call_tool,
            on_list_resources=self._list_resources,
            on_read_resource=self._read_resource,
            on_list_resource_templates=self._list_templates,
            on_subscriptions_listen=ListenHandler(self._events),
        )
        # 2026-07-28 approvals carry their question's id in requestState: sealed by the SDK, bound to the
        # call's tool, arguments and caller, so an answer cannot be carried over to another call.
        security = RequestStateSecurity.ephemeral(ttl=APPROVAL_TTL_S)
        self.server.middleware.append(RequestStateBoundary(security, default_audience="sandbox-server"))
        self._questions: dict[str, OrderedDict[str, float]] = {}
        """Approval questions asked and not yet answered (2026-07-28 era), per caller: id -> when they lapse."""
        self._waiting: dict[str, int] = {}
        """Handshake-era calls waiting for a person's answer, per caller."""

    @property
    def prefix(self) -> str:
        """What is put before every tool name clients see."""
        return self.policy.tool_prefix if self.tool_prefix is None else self.tool_prefix

    @property
    def tools(self) -> dict[str, Tool]:
        """The tools the current policy offers, by the names clients see."""
        return self.tools_of(self.policy)

    def tools_of(self, policy: Policy) -> dict[str, Tool]:
        """The tools a policy offers, by the names clients see."""
        prefix = self.prefix
        return {prefix + name: tool for name, tool in self.all_tools.items() if policy.for_tool(name).enabled}

    def _policy_of(self, identity: _Identity) -> Policy:
        """The policy a caller's calls run under: its token's, else the server's (as it is now)."""
        if identity.policy is None or self.caller_policy is None:
            return self.policy
        policy = self.caller_policy(identity.policy)
        if policy is not self.policy and self._caller_policies.get(identity.policy) is not policy:
            self._caller_policies[identity.policy] = policy  # one not known before: its warm pools from now on
            self._configure_pool()
        return policy

    def know_policies(self, references: list[str]) -> None:
        """Keep warm containers for these callers' policies from the start (the tokens' and the issuer rules')."""
        if self.caller_policy is None:
            return
        for reference in references:
            policy = self.caller_policy(reference)
            if policy is not self.policy:
                self._caller_policies[reference] = policy
        self._configure_pool()

    def largest_arguments(self) -> int:
        """The largest `limits.argument_bytes` of any tool under the server's and the known callers' policies."""
        policies = [self.policy, *self._caller_policies.values()]
        return max(p.for_tool(name).max_argument_bytes for p in policies for name in self.all_tools)

    def _pool_targets(self, policy: Policy) -> list[PoolTarget]:
        """One warm pool per enabled tool's container settings (tools with equal settings share one)."""
        targets = []
        for name in self.all_tools:
            tool_policy = policy.for_tool(name)
            if not tool_policy.enabled:
                continue
            template = tool_policy.container_spec()
            if tool_policy.egress is not None:  # on its internal network, which the first call's proxy made
                network = None if self.proxies is None else self.proxies.network_of(tool_policy.egress)
                if network is None:
                    continue
                template = replace(template, network=network)
            if policy.workspace.persist and self.workspaces is not None:
                template = self.workspaces.shape(template)  # calls in kept workspaces get such containers
            most = tool_policy.pool_most(policy.rate.concurrent_calls)
            targets.append(PoolTarget(template, tool_policy.pool_size, tool_policy.pool_idle_s, most))
        return targets

    def _configure_pool(self) -> None:
        """The warm pools the server's and the known callers' policies want, within the server policy's memory
        budget and the host's memory floor."""
        if self.pool is None:
            return
        policy = self.policy
        floor = policy.host.min_available_memory_mb * 2**20

        def host_room() -> bool:
            return bool(psutil.virtual_memory().available > floor)

        targets = self._pool_targets(policy)
        for other in self._caller_policies.values():
            targets += self._pool_targets(other)
        self.pool.configure(targets, policy.host.pool_memory_mb * 2**20, host_room)

    async def swap_policy(self, policy: Policy) -> None:
        """Use a new policy for new calls (running calls keep theirs) and tell clients the tools changed."""
        self.policy = policy
        self.admission.reconfigure(policy.rate, policy.host, policy.name)
        if self.workspaces is not None:
            self.workspaces.reconfigure(policy.workspace, policy.host.workspace_storage_mb * 1024 * 1024)
        self._configure_pool()
        logger.info("policy %s (%s) is now in force", policy.name, policy.digest[:12])
        await self._events.publish(ToolsListChanged())
        for key, session in list(self._sessions.items()):
            try:
                await session.send_tool_list_changed()
            except Exception as exc:  # a closed session must not stop the others from hearing
                logger.info("session %s is gone (%r); it will not be told again", key, exc)
                self._sessions.pop(key, None)

    def _remember(self, ctx: Context) -> None:
        """Keep a handshake-era connection's session to tell it of tools/list changes later.

        A session's notifications go out on its connection's own stream, so the session of
        any of its requests will do; 2026-07-28 clients hear through subscriptions/listen.
        """
        if ctx.protocol_version not in HANDSHAKE_PROTOCOL_VERSIONS:
            return
        key = _session_id(ctx) or "stdio"
        self._sessions[key] = ctx.session
        self._sessions.move_to_end(key)
        while len(self._sessions) > REMEMBERED_SESSIONS:
            self._sessions.popitem(last=False)

    # -- tools/list --------------------------------------------------------------------

    def _tool_model(self, exposed: str, tool: Tool, policy: Policy) -> types.Tool:
        """A tool as a caller under `policy` sees it: what it can reach and what needs approval, said plainly."""
        tool_policy = policy.for_tool(tool.name)
        hints = annotations_for(tool, tool_policy)
        description, meta = tool.description, {OWN_NAME_META: tool.name}
        writable = [f"{m.host_path} (as {m.sandbox_path})" for m in tool_policy.writable_mounts]
        if writable:
            description += f"\nUnder policy '{policy.name}' it can write to host folders: {', '.join(writable)}."
        if tool_policy.egress is not None:
            description += (
                f"\nUnder policy '{policy.name}' it reaches the network, only the hosts its allow list names."
            )
        notice = approval_notice(policy.approval, tool.name, tool_policy)
        if notice is not None:
            description += "\n" + notice
            meta[APPROVAL_META] = notice
        return types.Tool(
            name=exposed,
            title=tool.title,
            description=description,
            input_schema=dict(tool.input_schema),
            output_schema=dict(tool.output_schema),
            annotations=types.ToolAnnotations.model_validate({"title": tool.title, **hints}),
            _meta=meta,
        )

    async def _list_tools(self, ctx: Context, params: types.PaginatedRequestParams | None) -> types.ListToolsResult:
        self._remember(ctx)
        policy = self._policy_of(_identity(ctx, _client_name(ctx)))
        tools = self.tools_of(policy)
        names = sorted(tools)
        cursor = params.cursor if params else None
        try:
            page, next_cursor = paginate(names, cursor, self.page_size)
        except ValueError:
            raise MCPError(
                INVALID_PARAMS, f"invalid cursor {cursor!r}: use the nextCursor of a previous page"
            ) from None
        return types.ListToolsResult(
            tools=[self._tool_model(n, tools[n], policy) for n in page], next_cursor=next_cursor
        )

    # -- tools/call --------------------------------------------------------------------

    async def _call_tool(
        self, ctx: Context, params: types.CallToolRequestParams
    ) -> types.CallToolResult | types.InputRequiredResult:
        self._remember(ctx)
        client = _client_name(ctx)
        identity = _identity(ctx, client)
        # One policy for the whole call, even if a new one is swapped in meanwhile: the caller's, else the server's.
        policy = self._policy_of(identity)
        arguments = params.arguments or {}
        started = time.monotonic()
        tool = self.tools_of(policy).get(params.name)
        own_name = tool.name if tool is not None else params.name
        record = call_record(
            client, own_name, params.name, arguments, policy.name, policy.digest, policy.audit.include_arguments
        )
        record["caller"] = identity.caller
        if tool is None:
            message = f"unknown tool {params.name!r}; tools/list names the tools"
            await self._audit_finish(record, ToolOutcome.refused(Refusal(message, "name"), policy.name), started)
            raise MCPError(INVALID_PARAMS, message)
        outcome: ToolOutcome | None = None
        try:
            try:
                self._check_arguments(tool, arguments, policy)
                needed = approval_needed(policy.approval, policy.name, tool.name, policy.for_tool(tool.name), arguments)
                if needed is not None:
                    question = await self._approve(ctx, params, needed, record, identity.limits_key, policy)
                    if question is not None:  # 2026-07-28: asked through the client, answered in the call's next round
                        record["outcome"] = "awaiting_approval"
                        return question
                outcome = await self._run_checked(tool, arguments, ctx, policy, identity)
            except Refusal as refusal:  # the one place a refusal becomes a result
                outcome = ToolOutcome.refused(refusal, policy.name)
            limits = policy.for_tool(tool.name).limits
            rendered = render(outcome, self.store, limits.returned_images, limits.returned_image_bytes, identity.owner)
        finally:
            with anyio.CancelScope(shield=True):
                await self._audit_finish(record, outcome, started)
        return _result_model(rendered)

    async def _audit_finish(self, record: dict[str, Any], outcome: ToolOutcome | None, started: float) -> None:
        if self.audit is None:
            return
        record["duration_ms"] = int((time.monotonic() - started) * 1000)
        if outcome is not None:
            record.update(outcome.audit_fields())
        record.setdefault("outcome", "cancelled")
        await anyio.to_thread.run_sync(self.audit.write, record)

    async def _approve(
        self,
        ctx: Context,
        params: types.CallToolRequestParams,
        needed: Approval,
        record: dict[str, Any],
        caller: str,
        policy: Policy,
    ) -> types.InputRequiredResult | None:
        """Ask a person, through the client, to approve the call; None when they did (a Refusal when not).

        Handshake era: an elicitation/create request while the call waits. 2026-07-28 era: the
        call answers with the question (input_required); the client asks and calls again with the
        answer and the question's id in its sealed requestState, which is good for one answer.
        """
        record["approval"] = {"field": needed.field, "reason": needed.reason}
        capabilities = ctx.session.client_capabilities
        elicitation = capabilities.elicitation if capabilities is not None else None
        if elicitation is None or (elicitation.form is None and elicitation.url is not None):
            record["approval"]["decision"] = "unavailable"
            raise Refusal(
                f"refused: policy '{needed.policy}' needs a person to approve this call ({needed.field}: "
                f"{needed.reason}), and this client cannot ask one (it declares no form elicitation); use a "
                f"client that can, or change the policy field {needed.field}",
                needed.field,
            )
        action: str | None
        if ctx.protocol_version in HANDSHAKE_PROTOCOL_VERSIONS:
            # A call waiting for a person holds its arguments: a caller may have as many waiting as it may run.
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
                action = await self._ask_in_session(ctx, needed, record)
            finally:
                self._waiting[caller] -= 1
                if not self._waiting[caller]:
                    del self._waiting[caller]
        else:
            now = time.monotonic()
            questions = self._questions.setdefault(caller, OrderedDict())
            while questions and (next(iter(questions.values())) <= now or len(questions) >= MAX_QUESTIONS):
                questions.popitem(last=False)  # lapsed, or this caller's oldest past its cap
            asked = questions.pop(params.request_state or "", None)
            if not questions:
                del self._questions[caller]
            response = (params.input_responses or {}).get("approval")
            if asked is None or response is None:  # a first round, a lapsed question or a used answer: ask
                question_id = secrets.token_urlsafe(16)
                self._questions.setdefault(caller, OrderedDict())[question_id] = now + APPROVAL_TTL_S
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

    async def _ask_in_session(self, ctx: Context, needed: Approval, record: dict[str, Any]) -> str:
        """Handshake era: ask through an elicitation/create while the call waits; the person's action."""
        action = "no answer"
        with anyio.move_on_after(APPROVAL_TTL_S):
            try:
                answer = await ctx.session.elicit_form(needed.message, APPROVAL_FORM, related_request_id=ctx.request_id)
            except MCPError as exc:
                record["approval"]["decision"] = "client error"
                raise Refusal(
                    f"not approved: the client could not ask the user ({exc.error.message}) "
                    f"(policy field {needed.field})",
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

    def _check_arguments(self, tool: Tool, arguments: Mapping[str, Any], policy: Policy) -> None:
        """Refuse arguments over the policy's size cap or not valid against the tool's input schema."""
        tool_policy = policy.for_tool(tool.name)
        size = len(json.dumps(arguments, ensure_ascii=False).encode("utf-8", "surrogatepass"))
        if size > tool_policy.max_argument_bytes:
            raise Refusal(
                f"refused: arguments are {size} bytes, above the cap of {tool_policy.max_argument_bytes} bytes "
                f"set by policy '{policy.name}' (field limits.argument_bytes)",
                "limits.argument_bytes",
            )
        errors = sorted(
            self.validators[tool.name].iter_errors(arguments), key=lambda e: list(map(str, e.absolute_path))
        )
        if errors:
            raise Refusal(
                f"invalid arguments for {tool.name}: " + "; ".join(describe_error(e) for e in errors[:5]),
                argument_path(errors[0]),
                kind="invalid_arguments",
            )

    async def _run_checked(
        self, tool: Tool, arguments: Mapping[str, Any], ctx: Context, policy: Policy, identity: _Identity
    ) -> ToolOutcome:
        """Check admission, then run the tool; every refusal on the way is raised."""
        tool_policy = policy.for_tool(tool.name)
        # An authenticated caller's limits are its own policy's and count its calls alone.
        ticket = self.admission.admit(identity.limits_key, policy.rate, policy.name)
        try:
            runtime, kept = await self._workspace_runtime(arguments, ctx, policy, identity)
        except BaseException:
            ticket.release()
            raise

        async def progress(elapsed_s: float, stdout_bytes: int, stderr_bytes: int) -> None:
            message = f"{elapsed_s:.0f} s elapsed; {stdout_bytes} bytes of stdout, {stderr_bytes} of stderr so far"
            await ctx.session.report_progress(elapsed_s, None, message)

        try:
            proxy = await self._proxy(tool_policy, policy.name)
            tool_ctx = ToolContext(runtime, tool_policy, policy.name, progress, kept is not None, proxy)
            outcome = await tool.run(arguments, tool_ctx)
            if proxy is not None:
                outcome = await self._with_requests(outcome, proxy)
            if kept is None:
                return outcome
            if kept.saved:
                await self._resources_changed(ctx)
            structured = {**(outcome.structured or {}), "workspace": kept.record.id}
            if kept.record.owner is not None:  # a session's own workspace: the next call of the session finds it
                return replace(outcome, structured=structured)
            note = f"workspace {kept.record.id}: pass it as `workspace` to continue in it"
            return replace(outcome, structured=structured, notes=(*outcome.notes, note))
        except EngineUnavailable as exc:
            raise Refusal(str(exc), kind="engine_unavailable") from exc
        except EngineError as exc:
            raise Refusal(f"sandbox engine error: {exc}", kind="engine_error") from exc
        finally:
            ticket.release()

    async def _proxy(self, tool_policy: ToolPolicy, policy_name: str) -> ProxyEndpoint | None:
        """The running proxy of a tool with an allow list (a Refusal saying why when there is none)."""
        if tool_policy.egress is None:
            return None
        if self.proxies is None:
            raise Refusal(
                f"refused: policy '{policy_name}' opens a network (field network), and this server runs no proxies",
                "network",
                kind="network_unavailable",
            )
        endpoint = await anyio.to_thread.run_sync(self.proxies.endpoint, tool_policy.egress, policy_name)
        if endpoint.key not in self._pooled_networks:  # its network exists now: the tool's warm pool can fill
            self._pooled_networks.add(endpoint.key)
            self._configure_pool()
        return endpoint

    async def _with_requests(self, outcome: ToolOutcome, proxy: ProxyEndpoint) -> ToolOutcome:
        """The outcome with the requests its sandbox made through the proxy (answer, notes and audit)."""
        assert self.proxies is not None
        address = str((outcome.audit or {}).get("address") or "")
        requests, dropped = await anyio.to_thread.run_sync(self.proxies.requests_of, proxy, address)
        records = [request.record() for request in requests]
        denied = sorted({f"{r.host}:{r.port}" for r in requests if not r.allowed})
        network: dict[str, Any] = {"requests": records, "denied": denied}
        notes = outcome.notes
        if dropped:
            network["requests_not_kept"] = dropped
            notes = (*notes, f"{dropped} earlier requests through the proxy are counted but not listed")
        if denied:
            notes = (*notes, f"the proxy refused {', '.join(denied)} (policy field network.allow)")
        audit = {**(outcome.audit or {}), "network": network} if outcome.audit is not None else None
        structured = {**outcome.structured, "network": network} if outcome.structured is not None else None
        return replace(outcome, structured=structured, notes=notes, audit=audit)

    async def _resources_changed(self, ctx: Context) -> None:
        """Tell the caller its workspace files changed (handshake: on its session; 2026: to listeners)."""
        await self._events.publish(ResourcesListChanged())
        if ctx.protocol_version in HANDSHAKE_PROTOCOL_VERSIONS:
            try:
                await ctx.session.send_resource_list_changed()
            except Exception as exc:  # a client without a stream for it still gets its answer
                logger.info("could not send resources/list_changed: %r", exc)

    async def session_ended(self, session_id: str) -> None:
        """A handshake session over HTTP was ended by its client: its workspace goes with it."""
        self._sessions.pop(session_id, None)
        if self.workspaces is not None:
            await anyio.to_thread.run_sync(self.workspaces.end_owner, session_owner(self.instance, session_id))

    async def _workspace_runtime(
        self, arguments: Mapping[str, Any], ctx: Context, policy: Policy, identity: _Identity
    ) -> tuple[SandboxRuntime, KeptWorkspace | None]:
        """The runtime of this call: in its kept workspace when the policy keeps them, else the plain one.

        Opening one may remove another to make room (unmounting it), so it happens off the event loop."""
        store = self.workspaces if policy.workspace.persist else None
        requested, session = arguments.get("workspace"), self._session_owner(ctx)
        kept = await anyio.to_thread.run_sync(
            KeptWorkspace.open, self.runtime, store, requested, session, identity.limits_key, identity.owner
        )
        return (kept or self.runtime), kept

    # -- resources ---------------------------------------------------------------------

    def _session_owner(self, ctx: Context) -> str | None:
        """The session whose workspace a request may see: its handshake session's; None in the 2026-07-28 era."""
        if ctx.protocol_version not in HANDSHAKE_PROTOCOL_VERSIONS:
            return None
        return session_owner(self.instance, _session_id(ctx) or "stdio")

    async def _list_resources(
        self, ctx: Context, params: types.PaginatedRequestParams | None
    ) -> types.ListResourcesResult:
        caller = _identity(ctx, _client_name(ctx)).owner
        found: dict[str, types.Resource] = {}
        for uri in self.store.uris(caller):
            kept = self.store.get(uri, caller)
            if kept:
                name = uri.rsplit("/", 1)[-1]
                found[uri] = types.Resource(uri=uri, name=name, mime_type=kept[0], size=len(kept[1]))
        session = self._session_owner(ctx)
        if self.workspaces is not None and session is not None:
            listing = await anyio.to_thread.run_sync(self.workspaces.listing, session, caller)
            found |= {u: types.Resource(uri=u, name=n, mime_type=m, size=size) for u, n, m, size in listing}
        cursor = params.cursor if params else None
        try:
            page, next_cursor = paginate(list(found), cursor, RESOURCES_PAGE)
        except ValueError:
            raise MCPError(
                INVALID_PARAMS, f"invalid cursor {cursor!r}: use the nextCursor of a previous page"
            ) from None
        return types.ListResourcesResult(resources=[found[uri] for uri in page], next_cursor=next_cursor)

    async def _list_templates(
        self, ctx: Context, params: types.PaginatedRequestParams | None
    ) -> types.ListResourceTemplatesResult:
        kept = types.ResourceTemplate(
            uri_template=RESOURCE_TEMPLATE,
            name="workspace-file",
            title="A file in a kept workspace",
            description="A file of the workspace a tool result named in `structuredContent.workspace`.",
        )
        return types.ListResourceTemplatesResult(resource_templates=[kept])

    def _file(
        self, ctx: Context, uri: str, caller: str | None, offset: int, length: int
    ) -> tuple[str, int, bytes] | None:
        """A kept output or workspace file the caller may read: (MIME type, its size, `length` bytes from `offset`)."""
        kept = self.store.get(uri, caller)
        if kept is not None:
            return kept[0], len(kept[1]), kept[1][offset : offset + length]
        if self.workspaces is None:
            return None
        try:
            limit = self.policy.default.limits.returned_file_bytes
            return self.workspaces.read_resource(uri, self._session_owner(ctx), limit, caller, offset, length)
        except Refusal as refusal:
            raise MCPError(INVALID_PARAMS, refusal.message) from None

    async def _read_resource(self, ctx: Context, params: types.ReadResourceRequestParams) -> types.ReadResourceResult:
        uri = str(params.uri)
        try:
            base, part = requested_part(uri, READ_PART_BYTES)
        except ValueError as exc:
            raise MCPError(INVALID_PARAMS, str(exc)) from None
        caller = _identity(ctx, _client_name(ctx)).owner
        offset, length = part or (0, READ_PART_BYTES)
        found = await anyio.to_thread.run_sync(self._file, ctx, base, caller, offset, length)
        if found is None:
            code = (
                RESOURCE_NOT_FOUND_HANDSHAKE if ctx.protocol_version in HANDSHAKE_PROTOCOL_VERSIONS else INVALID_PARAMS
            )
            raise MCPError(code, f"resource not found: {base} (files are kept for a while, then dropped)")
        mime, size, content = found
        if part is not None:  # one part, as bytes, with where the next one starts
            following = offset + len(content)
            meta: dict[str, Any] = {"offset": offset, "length": len(content), "size": size}
            meta["next"] = f"{base}?offset={following}" if following < size else None
            blob = base64.b64encode(content).decode()
            piece = types.BlobResourceContents(uri=uri, mime_type=mime, blob=blob, _meta={PART_META: meta})
            return types.ReadResourceResult(contents=[piece])
        if size > READ_PART_BYTES:
            raise MCPError(
                INVALID_PARAMS,
                f"{base} is {size} bytes, more than one read returns ({READ_PART_BYTES} bytes, so that an answer "
                f"fits the 1 MiB message a client accepts); read it in parts: {base}?offset=0, then "
                f"?offset={READ_PART_BYTES} and so on (each part's _meta[{PART_META!r}] names the next)",
            )
        try:
            text = content.decode("utf-8")
        except UnicodeDecodeError:
            blob = base64.b64encode(content).decode()
            item: Any = types.BlobResourceContents(uri=uri, mime_type=mime, blob=blob)
        else:
            item = types.TextResourceContents(uri=uri, mime_type=mime, text=text)
        return types.ReadResourceResult(contents=[item])

    def initialization_options(self) -> Any:
        """What the server announces in the handshake."""
        return self.server.create_initialization_options(
            NotificationOptions(tools_changed=True, resources_changed=True)
        )


ANONYMOUS = "anonymous"
"""The one caller every unauthenticated HTTP client is (only loopback is served without authentication)."""


def _access_token(ctx: Context) -> AccessToken | None:
    """The checked bearer token of an authenticated HTTP request; None over stdio or without auth."""
    user = getattr(ctx.request, "scope", {}).get("user")
    return user.access_token if isinstance(user, AuthenticatedUser) else None


@dataclass(frozen=True, slots=True)
class _Identity:
    caller: str
    """Who calls, as the audit record names them."""
    policy: str | None
    """The policy reference their token names (None: the server's)."""
    limits_key: str
    """Whose calls the limits count together: an authenticated caller's, the local user's, or the anonymous
    caller's (never a name the client gives itself)."""
    owner: str | None
    """Whose files and workspaces the call may see: an authenticated caller's, an anonymous HTTP session's or the
    anonymous caller's (None: over stdio, where one client is served)."""


def _identity(ctx: Context, client: str) -> _Identity:
    """Who calls, never by anything the client may choose: a token's caller; over stdio the local user running
    the server; over HTTP without tokens (loopback) one anonymous caller, whose files are its session's (handshake
    era) or the anonymous caller's."""
    token = _access_token(ctx)
    if token is not None:
        claims = token.claims or {}
        caller, reference, issuer = token.subject or token.client_id, claims.get(POLICY_CLAIM), claims.get("iss")
        key = caller if issuer is None else f"{caller} ({issuer})"  # a `sub` is unique only per issuer
        return _Identity(caller, str(reference) if reference is not None else None, key, key)
    if ctx.request is None:
        caller = f"local user {getpass.getuser()}"
        return _Identity(caller, None, caller, None)
    session = _session_id(ctx) if ctx.protocol_version in HANDSHAKE_PROTOCOL_VERSIONS else None
    return _Identity(ANONYMOUS, None, ANONYMOUS, f"{ANONYMOUS} session {session}" if session else ANONYMOUS)


def _client_name(ctx: Context) -> str:
    params = ctx.session.client_params
    info = params.client_info if params is not None else None
    name = f"{info.name}/{info.version}" if info is not None else "unknown-client"
    session_id = _session_id(ctx)
    return f"{name}@{session_id[:8]}" if session_id else name


def _session_id(ctx: Context) -> str | None:
    """The Streamable HTTP session of a handshake-era request; None over stdio or without one."""
    headers = getattr(ctx.request, "headers", None)  # the HTTP request, when the transport has one
    return headers.get("mcp-session-id") if headers is not None else None


def _result_model(rendered: RenderedResult) -> types.CallToolResult:
    return types.CallToolResult.model_validate(
        {"content": rendered.content, "structuredContent": rendered.structured, "isError": rendered.is_error}
    )
