"""A workspace's services started again by the first call that works in it after they stopped without being told
to (its caller paused it, its server restarted or was killed, its session ended while it is named): each as the
call that started it asked, checked again, as any call is, under the calling caller's policy as it is now.

The call goes on whatever happens to them; its answer says, in a note per service, which started again and why
one did not. A service that started and then did not become ready is dropped from the record (its end says so);
one refused before it started (a cap, a tool its policy no longer offers) is tried again by the next call, until
its caller stops it with the `services` tool.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from typing import Any

import anyio
import anyio.to_thread

from sandbox_server.calls.arguments import check_arguments
from sandbox_server.calls.call import Call
from sandbox_server.calls.registry import ToolRegistry
from sandbox_server.errors import EngineError, Refusal
from sandbox_server.network.egress import ProxyEndpoint
from sandbox_server.policy import ToolPolicy
from sandbox_server.sandbox.runtime import NO_HOOKS
from sandbox_server.services.scope import ServiceScope
from sandbox_server.tools import ToolContext
from sandbox_server.tools.arguments import check_call
from sandbox_server.workspaces.kept import KeptWorkspace

__all__ = ["resume_services", "resumes"]

ProxyOf = Callable[[ToolPolicy, str], Awaitable[ProxyEndpoint | None]]


def resumes(call: Call) -> bool:
    """Whether a call starts its workspace's stopped services first: every call but the `workspaces` tool's, which
    does so for `resume` alone (a `pause` or a `delete` must not start what it is about to stop)."""
    assert call.tool is not None
    return call.tool.name != "workspaces" or call.arguments.get("action") == "resume"


async def resume_services(
    registry: ToolRegistry, proxy_of: ProxyOf, call: Call, kept: KeptWorkspace, scope: ServiceScope
) -> tuple[str, ...]:
    """Start the workspace's recorded services that do not run, and mark it no longer paused: a note for each."""
    if not kept.record.services and not kept.record.paused:
        return ()
    services = scope.services
    async with services.resuming.setdefault(
        kept.record.id, anyio.Lock()
    ):  # side-by-side calls: the first starts them, the rest find them
        kept.record = await anyio.to_thread.run_sync(kept.store.unpause, kept.record)
        running = {s.name for s in services.running(kept.record.id)}
        notes = []
        for entry in kept.record.services:
            if entry.get("name") not in running:
                notes.append(await _start_again(registry, proxy_of, call, kept, scope, entry))
    return tuple(notes)


async def _start_again(
    registry: ToolRegistry,
    proxy_of: ProxyOf,
    call: Call,
    kept: KeptWorkspace,
    scope: ServiceScope,
    entry: Mapping[str, Any],
) -> str:
    name, tool_name = str(entry.get("name")), str(entry.get("tool"))
    arguments = dict(entry.get("arguments") or {})
    policy = call.policy
    tool = registry.tools_of(policy).get(registry.prefix + tool_name)
    not_again = f"service {name} was not started again"
    if tool is None:
        return (
            f"{not_again}: policy '{policy.name}' offers no tool {tool_name!r} now (the services tool's stop drops it)"
        )
    tool_policy = policy.for_tool(tool.name)
    try:
        check_arguments(tool.name, registry.validators[tool.name], arguments, policy)
        files = check_call(tool, arguments, tool_policy, policy.name, False)
        proxy = await proxy_of(tool_policy, policy.name)
        ctx = ToolContext(
            kept, tool_policy, policy.name, NO_HOOKS, files, True, proxy, False, scope, scope.network, scope.names
        )
        outcome = await tool.run(arguments, ctx)
    except Refusal as refused:
        return f"{not_again}: {refused.message}"
    except EngineError as exc:
        return f"{not_again}: sandbox engine error: {exc}"
    if outcome.is_error:
        return f"{not_again}: {outcome.headline}"
    return f"service {name} started again as its call asked ({tool_name}), listening on port {entry.get('port')}"
