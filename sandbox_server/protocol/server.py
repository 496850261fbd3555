"""The MCP server: handlers of a few lines that hand each request to the layer that owns it.

Protocol faults (unknown tool, bad cursor, malformed request) are JSON-RPC errors;
everything about a call (invalid arguments, refusals, failed programs, an engine
that is down) is an `isError` result whose first line says what happened.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import anyio.to_thread
import mcp_types as types
from mcp.server.apps import client_supports_apps
from mcp.server.lowlevel import NotificationOptions, Server
from mcp.server.request_state import RequestStateBoundary, RequestStateSecurity
from mcp.server.session import ServerSession
from mcp.server.subscriptions import InMemorySubscriptionBus, ListenHandler, ResourcesListChanged, ToolsListChanged
from mcp.shared.exceptions import MCPError
from mcp_types.jsonrpc import INVALID_PARAMS

from sandbox_server import __version__
from sandbox_server.access.approval import Approval
from sandbox_server.access.audit import AuditLog
from sandbox_server.calls.call import branch_calls
from sandbox_server.calls.hosts import Grants, Question
from sandbox_server.calls.pipeline import Call, CallPipeline, TaskStart, UnknownTool
from sandbox_server.calls.registry import ToolRegistry
from sandbox_server.calls.tracing import Tracing
from sandbox_server.errors import Refusal
from sandbox_server.policy import Policy
from sandbox_server.protocol.app_tools import TASKS_TOOL, AppTools
from sandbox_server.protocol.apps import Views, advertise, tool_ui
from sandbox_server.protocol.asking import APPROVAL_TTL_S, Approvals, ParkedCalls, elicits, host_question
from sandbox_server.protocol.listing import page_of, shipped_icon, tool_model
from sandbox_server.protocol.requests import (
    Context,
    client_name,
    handshake_era,
    http_session,
    identity_of,
    session_of,
)
from sandbox_server.protocol.resources import Resources
from sandbox_server.protocol.results import RenderedResult, ResourceStore, render
from sandbox_server.protocol.tasks import TaskProtocol, task_capabilities
from sandbox_server.sandbox.runtime import SandboxRuntime
from sandbox_server.services.manager import Services
from sandbox_server.tasks.manager import Tasks
from sandbox_server.tasks.records import TaskRecord
from sandbox_server.tools import ToolOutcome
from sandbox_server.workspaces.records import session_key

if TYPE_CHECKING:  # the PostgreSQL driver is imported only by a server given --state
    from sandbox_server.access.shared import SharedAccess

__all__ = ["SandboxServer"]

logger = logging.getLogger("sandbox_server")

REMEMBERED_SESSIONS = 1024
INSTRUCTIONS = (
    "Every tool call runs in a fresh, isolated, resource-limited container that is destroyed "
    "afterwards; processes and /tmp never outlive a call. When the policy keeps workspaces, "
    "/workspace (and execute_command's shell: its folder, variables, functions, options) is as the previous call "
    "of this connection left it (over HTTP in the 2026-07-28 era: of the "
    "`workspace` id you pass back from a result), and run_python keeps a cell's variables for the "
    "next. Send input files with `files`; files written to /workspace/out come back with the result."
)


ICON = shipped_icon("icon.svg")
"""The server's icon, shipped with the package, in its serverInfo (a client that shows servers shows it); each tool
has its own in tools/list (protocol.listing)."""


@dataclass(frozen=True, slots=True)
class Parts:
    """What a server is made of, each part built once with its collaborators (the wiring, cli/wiring.py, builds
    them for `serve`; a test builds the few it needs)."""

    registry: ToolRegistry
    runtime: SandboxRuntime
    """What calls run on: the warm pool when there is one, else the engine."""
    audit: AuditLog | None = None
    observers: tuple[Callable[[dict[str, Any]], None], ...] = ()
    """Told every call's audit record as it ends (the Prometheus metrics)."""
    tracing: Tracing | None = None
    tasks: Tasks | None = None
    services: Services | None = None
    shared: SharedAccess | None = None
    """Replicas: what they share (None: this process alone)."""
    instance: str = "local"
    """This server process, in the key of its handshake sessions' workspaces."""
    page_size: int = 50
    store: ResourceStore | None = None
    preview_origin: str | None = None
    """Where services' previews are served (the origin the service view may frame)."""
    host_folders: tuple[str, ...] = ()
    """The host's folders the server keeps its state and its sandboxes in: no answer names a path into them."""


class SandboxServer:
    """Tools, policy and runtime wired to an MCP low-level Server."""

    def __init__(self, parts: Parts) -> None:
        self.registry = registry = parts.registry
        shared, services, tasks = parts.shared, parts.services, parts.tasks
        self.calls = CallPipeline(
            registry, parts.runtime, parts.observers, services=services,
            shared_rate=shared.rate if shared is not None else None,
            grants=Grants(shared.answers) if shared is not None else None, tracing=parts.tracing, audit=parts.audit,
        )  # fmt: skip
        self.services = services
        self.page_size = max(1, parts.page_size)
        self.store = parts.store or ResourceStore()
        self.host_folders = parts.host_folders
        self.workspaces = workspaces = registry.workspaces
        self.instance = parts.instance
        """This server process, in the key of its handshake sessions' workspaces."""
        self.tasks = tasks
        self.task_protocol = (
            TaskProtocol(tasks, lambda ctx: self.registry.policy_for(identity_of(ctx).policy), self._call)
            if tasks is not None
            else None
        )
        task_output = self.task_protocol.output if self.task_protocol is not None else None
        self.shared_files = shared.files if shared is not None else None
        self.resources = Resources(
            self.store, workspaces, lambda: self.policy, self.instance, task_output, services, self.shared_files
        )
        self.views = Views(parts.preview_origin)
        self.app_tools = (
            AppTools(tasks, lambda ctx: self.registry.policy_for(identity_of(ctx).policy), parts.audit)
            if tasks is not None
            else None
        )
        self.approvals = Approvals(shared.questions if shared is not None else None)
        self.parked = ParkedCalls()
        """2026-07-28 calls asking the person about a host, running beside their requests (served by `serve`)."""
        self._sessions: OrderedDict[str, ServerSession] = OrderedDict()
        """Handshake-era connections to tell of a tools/list change, by MCP session id (the latest request's)."""
        self._events = InMemorySubscriptionBus()  # 2026-07-28 clients hear of changes via subscriptions/listen
        self.server: Server[Any] = _TaskServer(
            "sandbox-server",
            version=__version__,
            title="Sandbox server",
            instructions=INSTRUCTIONS,
            icons=[ICON] if ICON is not None else None,
            on_list_tools=self._list_tools,
            on_call_tool=self._call_tool,
            on_list_resources=self._list_resources,
            on_read_resource=self._read_resource,
            on_list_resource_templates=self.resources.templates,
            on_subscriptions_listen=ListenHandler(self._events),
        )
        # 2026-07-28 approvals carry their question's id in requestState: sealed by the SDK, bound to the
        # call's tool, arguments and caller, so an answer cannot be carried over to another call.
        # Replicas seal with the key they share, so any of them opens what another sealed.
        security = (
            RequestStateSecurity(keys=[shared.request_state_key], ttl=APPROVAL_TTL_S)
            if shared is not None
            else RequestStateSecurity.ephemeral(ttl=APPROVAL_TTL_S)
        )
        self.server.middleware.append(RequestStateBoundary(security, default_audience="sandbox-server"))
        advertise(self.server)  # MCP Apps: views for the clients that negotiate them
        if self.task_protocol is not None:
            self.task_protocol.install(self.server)

    @property
    def policy(self) -> Policy:
        """The server's policy as it is now."""
        return self.registry.policy

    def know_policies(self, references: list[str]) -> None:
        """Keep warm containers for these callers' policies from the start (the tokens' and the issuer rules')."""
        self.registry.know_policies(references)

    def largest_arguments(self) -> int:
        """The largest `limits.argument_bytes` of any tool under the server's and the known callers' policies."""
        return self.registry.largest_arguments()

    async def swap_policy(self, policy: Policy) -> None:
        """Use a new policy for new calls (running calls keep theirs) and tell clients the tools changed."""
        self.calls.swap(policy)
        logger.info("policy %s (%s) is now in force", policy.name, policy.digest[:12])
        await self._events.publish(ToolsListChanged())
        for key, session in list(self._sessions.items()):
            try:
                await session.send_tool_list_changed()
            except Exception as exc:  # a closed session must not stop the others from hearing
                logger.info("session %s is gone (%r); it will not be told again", key, exc)
                self._sessions.pop(key, None)

    async def session_ended(self, session_id: str) -> None:
        """A handshake session over HTTP was ended by its client: its workspace goes with it."""
        self._sessions.pop(session_id, None)
        if self.services is not None:
            await self.services.stop_session(session_key(self.instance, session_id))
        if self.workspaces is not None:
            await anyio.to_thread.run_sync(self.workspaces.end_session, session_key(self.instance, session_id))

    def initialization_options(self) -> Any:
        """What the server announces in the handshake."""
        return self.server.create_initialization_options(
            NotificationOptions(tools_changed=True, resources_changed=True)
        )

    def _remember(self, ctx: Context) -> None:
        """Keep a handshake-era connection's session to tell it of tools/list changes later.

        A session's notifications go out on its connection's own stream, so the session of
        any of its requests will do; 2026-07-28 clients hear through subscriptions/listen.
        """
        if not handshake_era(ctx):
            return
        key = http_session(ctx) or "stdio"
        self._sessions[key] = ctx.session
        self._sessions.move_to_end(key)
        while len(self._sessions) > REMEMBERED_SESSIONS:
            self._sessions.popitem(last=False)

    async def _list_tools(self, ctx: Context, params: types.PaginatedRequestParams | None) -> types.ListToolsResult:
        self._remember(ctx)
        policy = self.registry.policy_for(identity_of(ctx).policy)
        tools = self.registry.tools_of(policy)
        page, next_cursor = page_of(sorted(tools), params.cursor if params else None, self.page_size)
        routed = self.workspaces is not None and self.workspaces.contents.homed is not None
        apps = client_supports_apps(ctx)
        listed = [tool_model(n, tools[n], policy, routed, tool_ui(tools[n].name) if apps else None) for n in page]
        if apps and next_cursor is None and self._app_tool(ctx, tools):
            assert self.app_tools is not None
            listed.append(self.app_tools.model())
        return types.ListToolsResult(tools=listed, next_cursor=next_cursor)

    def _app_tool(self, ctx: Context, tools: dict[str, Any]) -> bool:
        """Whether this caller is offered the app-only `tasks` tool (views only, under a policy that runs tasks)."""
        return self.app_tools is not None and TASKS_TOOL not in tools and self.app_tools.offered(ctx)

    async def _list_resources(
        self, ctx: Context, params: types.PaginatedRequestParams | None
    ) -> types.ListResourcesResult:
        listed = await self.resources.list(ctx, params)
        if client_supports_apps(ctx) and (params is None or params.cursor is None):
            return listed.model_copy(update={"resources": [*self.views.listed(), *listed.resources]})
        return listed

    async def _read_resource(self, ctx: Context, params: types.ReadResourceRequestParams) -> types.ReadResourceResult:
        view = self.views.read(str(params.uri))
        return view if view is not None else await self.resources.read(ctx, params)

    async def _call_tool(self, ctx: Context, params: types.CallToolRequestParams) -> Any:
        self._remember(ctx)
        if params.name == TASKS_TOOL and client_supports_apps(ctx):
            tools = self.registry.tools_of(self.registry.policy_for(identity_of(ctx).policy))
            if self._app_tool(ctx, tools) and self.app_tools is not None:
                return await self.app_tools.call(ctx, params.arguments or {})
        as_task = False
        if self.task_protocol is not None:
            tool = self.registry.tools_of(self.registry.policy_for(identity_of(ctx).policy)).get(params.name)
            as_task = self.task_protocol.as_task(ctx, params, tool.name if tool is not None else None)
        answer = await self._call(ctx, params, as_task)
        if isinstance(answer, TaskRecord):
            assert self.task_protocol is not None
            return self.task_protocol.created_answer(ctx, answer)
        return answer

    def _new_call(self, ctx: Context, params: types.CallToolRequestParams, as_task: bool) -> Call:
        """The call as it arrives, with how to reach its client while it runs."""
        identity = identity_of(ctx)
        call = self.calls.new_call(
            params.name, params.arguments or {}, identity, client_name(ctx), session_of(ctx, self.instance)
        )
        waited = [0.0]  # progress only ever grows: a run's seconds count on from the time spent waiting

        async def progress(elapsed_s: float, stdout_bytes: int, stderr_bytes: int, last_line: str) -> None:
            if as_task:  # the request has been answered: tasks/get and the output resource tell how it goes
                return
            message = f"{elapsed_s:.0f} s elapsed; {stdout_bytes} bytes of stdout, {stderr_bytes} of stderr so far"
            if last_line:
                message += f"; last line: {last_line}"
            await ctx.session.report_progress(waited[0] + elapsed_s, None, message)

        async def waiting(ahead: int, waited_s: float) -> None:
            waited[0] = waited_s
            await ctx.session.report_progress(waited_s, None, f"waiting for a slot ({ahead} ahead)")

        async def approval(
            needed: Approval, policy: Policy, record: dict[str, Any]
        ) -> types.InputRequiredResult | None:
            return await self.approvals.ask(ctx, params, identity.limits_key, needed, policy, record)

        question, unable = host_question(ctx, as_task)
        return replace(call, progress=progress, waiting=waiting, approval=approval, question=question, unable=unable)

    async def _call(self, ctx: Context, params: types.CallToolRequestParams, as_task: bool) -> Any:
        """Run a call: its result, a question to answer it with, or (as a task) the task's record once created."""
        call = self._new_call(ctx, params, as_task)
        identity = call.identity

        async def run(task: TaskStart | None = None, question: Question | None = None) -> Any:
            asking = replace(call, question=question, unable="") if question is not None else call
            try:
                end = await self.calls.call(replace(asking, task=task))
            except UnknownTool as exc:
                raise MCPError(INVALID_PARAMS, str(exc)) from None
            if end.question is not None:
                asked: types.InputRequiredResult = end.question
                return asked
            if end.workspace_changed:
                await self._resources_changed(ctx, tell_session=task is None)
            assert end.outcome is not None and end.limits is not None
            limits, outcome = end.limits, end.outcome
            if outcome.view is not None and not client_supports_apps(ctx):  # exactly as before views, for everyone else
                outcome = replace(outcome, view=None)
            kept: list[Any] | None = [] if self.shared_files is not None else None
            rendered = render(
                outcome, self.store, limits.returned_images, limits.returned_image_bytes, identity.tenant, kept,
                self.host_folders,
            )  # fmt: skip
            if self.shared_files is not None and kept:  # readable on every replica before the answer leaves
                await anyio.to_thread.run_sync(self.shared_files.keep, kept)
            result = _result_model(rendered)
            return result if task is None else result.model_dump(by_alias=True, mode="json", exclude_none=True)

        async def run_asking(question: Question) -> Any:
            return await run(None, question)

        if not as_task and self._parks(ctx, call):  # 2026-07-28: asked about hosts between rounds
            state, response = params.request_state, (params.input_responses or {}).get("network")
            action = response.action if isinstance(response, types.ElicitResult) else "no answer"
            resumed = await self.parked.resume(identity.limits_key, state, action) if state else None
            return resumed if resumed is not None else await self.parked.start(identity.limits_key, run_asking)
        if not as_task or self.tasks is None or self.task_protocol is None or call.tool is None:
            return await run()  # (a call of an unknown tool is answered as such)
        protocol, policy = self.task_protocol, call.policy
        ttl = params.task.ttl if params.task is not None else None

        async def tell_end(record: TaskRecord) -> None:
            await protocol.tell_end(ctx, record)

        try:
            started = await self.tasks.start(
                policy.tasks, policy.name, identity.holder, identity.caller, params.name,
                call.tool_policy.limits.memory_mb * 1024 * 1024, ttl, run, tell_end, branch_calls(call),
            )  # fmt: skip
        except Refusal as refusal:
            outcome = ToolOutcome.refused(refusal, policy.name)
            return _result_model(render(outcome, self.store, tenant=identity.tenant, host_folders=self.host_folders))
        return started.record if started.record is not None else started.answer

    def _parks(self, ctx: Context, call: Call) -> bool:
        """Whether a call runs beside its requests, to ask the person about hosts between rounds: a 2026-07-28
        call of a tool whose policy asks (network.ask), from a client that can ask."""
        if handshake_era(ctx) or not self.parked.running or not elicits(ctx) or call.tool is None:
            return False
        egress = call.tool_policy.egress
        return egress is not None and egress.ask is not None

    async def _resources_changed(self, ctx: Context, tell_session: bool = True) -> None:
        """Tell the caller its workspace files changed (handshake: on its session; 2026: to listeners)."""
        await self._events.publish(ResourcesListChanged())
        if handshake_era(ctx) and tell_session:
            try:
                await ctx.session.send_resource_list_changed()
            except Exception as exc:  # a client without a stream for it still gets its answer
                logger.info("could not send resources/list_changed: %r", exc)


class _TaskServer(Server[Any]):
    """The SDK's server, declaring tasks to handshake-era clients when it serves them (the SDK derives every
    other capability from the handlers it has)."""

    def get_capabilities(self, *args: Any, **kwargs: Any) -> types.ServerCapabilities:
        capabilities = super().get_capabilities(*args, **kwargs)
        if self.get_request_handler("tasks/get") is not None:
            capabilities.tasks = task_capabilities()
        return capabilities


def _result_model(rendered: RenderedResult) -> types.CallToolResult:
    return types.CallToolResult.model_validate(
        {"content": rendered.content, "structuredContent": rendered.structured, "isError": rendered.is_error}
    )
