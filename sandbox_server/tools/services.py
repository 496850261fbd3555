"""A call that starts a service: the same command, limits and hardening, in a container that outlives the call."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from typing import Any

from sandbox_server.errors import Refusal
from sandbox_server.sandbox.spec import SandboxSpec
from sandbox_server.tools.base import ToolContext, ToolOutcome

__all__ = ["start_service"]


async def start_service(args: Mapping[str, Any], ctx: ToolContext, spec: SandboxSpec, tool: str) -> ToolOutcome:
    """Start `spec`'s program as the service `args["service"]` names; answer how to reach it."""
    wanted = args["service"]
    if ctx.services is None:
        raise Refusal("refused: this server starts no services", "services.tools")
    if spec.files or spec.stdin:
        raise Refusal(
            "refused: a service takes no `files` or `stdin`; write its files with a call first (they stay in the "
            "workspace), then start it",
            "service",
        )
    settings = ctx.services.settings
    limits = replace(spec.limits, memory_mb=settings.memory_mb, cpus=settings.cpus)
    # The program runs as the container's first process (under its init), in the folder asked for.
    argv = (
        spec.argv if not spec.call_workdir else ("/bin/sh", "-c", 'cd "$0" && exec "$@"', spec.call_workdir, *spec.argv)
    )
    service = await ctx.services.start(
        replace(spec, argv=argv, limits=limits), wanted["name"], int(wanted["port"]), str(args.get("command", "")), tool
    )
    described = service.describe(ctx.services.services.preview_of(service))
    reach = f"the workspace's next calls reach it at {described['url']}"
    if "preview" in described:
        reach += f"; its caller opens it in a browser at {described['preview']}"
    return ToolOutcome(
        headline=f"service {service.name} is running, listening on port {service.port}",
        is_error=False,
        sections=(("how to reach it", reach),),
        structured={"service": described},
        notes=(
            f"it stops when its session ends, after {settings.idle_s:g} s without a call in its workspace "
            f"(services.idle_s), or {settings.max_lifetime_s:g} s after its start (services.max_lifetime_s)",
        ),
    )
