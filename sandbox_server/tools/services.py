"""Services from a tool's point of view: execute_command's `service` argument starts one; the `services` tool lists
the workspace's, reads one's log, stops or restarts one."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from typing import Any

import anyio.to_thread

from sandbox_server.errors import Refusal
from sandbox_server.policy import Policy, ToolPolicy
from sandbox_server.sandbox.spec import SandboxSpec
from sandbox_server.tools.base import MANAGING_ANNOTATIONS, WORKSPACE_ARGUMENT, ToolContext, ToolOutcome, result_schema
from sandbox_server.words import duration

__all__ = ["ServicesTool", "start_service"]

LOG_BYTES = 16_000
"""The end of a service's log a `log` answer shows (at most the policy's output cap)."""


async def start_service(
    args: Mapping[str, Any], ctx: ToolContext, spec: SandboxSpec, tool: str, arguments: Mapping[str, Any] | None = None
) -> ToolOutcome:
    """Start `spec`'s program as the service `args["service"]` names; answer how to reach it. `arguments`, the
    call's as it gave them, are what its workspace keeps to start it again (default: `args`)."""
    arguments = args if arguments is None else arguments
    wanted = args["service"]
    if ctx.services is None:
        raise Refusal("refused: this server starts no services", "services.tools")
    if spec.stdin:
        raise Refusal("refused: a service reads no `stdin` (it runs until stopped); give it files instead", "stdin")
    if spec.files:  # written into the workspace by a call of their own, as a call's files are, then it starts
        written = await ctx.runtime.run(replace(spec, argv=("true",), stdin=b"", call_workdir=""), ctx.hooks)
        if written.exit_code != 0 or written.workspace_problem:
            why = written.workspace_problem or f"exit code {written.exit_code}"
            raise Refusal(f"refused: the service's `files` could not be written to its workspace ({why})", "files")
        spec = replace(spec, files=())
    settings = ctx.services.settings
    limits = replace(spec.limits, memory_mb=settings.memory_mb, cpus=settings.cpus)
    # The program runs as the container's first process (under its init), in the folder asked for.
    argv = (
        spec.argv if not spec.call_workdir else ("/bin/sh", "-c", 'cd "$0" && exec "$@"', spec.call_workdir, *spec.argv)
    )
    service = await ctx.services.start(
        replace(spec, argv=argv, limits=limits), wanted["name"], int(wanted["port"]), str(args.get("command", "")),
        tool, wanted.get("ready_path"), ctx.proxy, arguments,
    )  # fmt: skip
    described = service.describe(ctx.services.services.links.link(service))
    reach = f"the workspace's next calls reach it at {described['url']}"
    if "preview" in described:
        reach += f"; its caller opens it in a browser at {described['preview']}"
    return ToolOutcome(
        headline=f"service {service.name} is running, listening on port {service.port}",
        is_error=False,
        sections=(("how to reach it", reach),),
        structured={"service": described},
        notes=(
            f"it stops when its session ends, after {duration(settings.idle_s)} without a call in its workspace "
            f"(services.idle_s), or {duration(settings.max_lifetime_s)} after its start (services.max_lifetime_s); "
            "the `services` tool lists, stops and restarts it and reads its log",
            *(
                [f"no preview link: {why}"]
                if (why := ctx.services.services.links.why_not) and "preview" not in described
                else []
            ),
        ),
    )


class ServicesTool:
    """List the workspace's services, read one's log, stop or restart one; runs no sandbox of its own."""

    name = "services"
    title = "The workspace's services"
    description = (
        "The workspace's services (execute_command's `service` starts one): `list` (state, port, address, "
        "uptime), `log`, `stop`, `restart` (answered once it listens again).\n"
        'Example: {"action": "list"}'
    )
    input_schema: dict[str, Any] = {
        "type": "object",
        "title": "services: arguments",
        "properties": {
            "action": {"type": "string", "enum": ["list", "log", "stop", "restart"]},
            "name": {"type": "string", "minLength": 1, "maxLength": 64, "description": "The service (not for list)"},
            "workspace": WORKSPACE_ARGUMENT,
        },
        "required": ["action"],
        "additionalProperties": False,
    }
    output_schema = result_schema(
        "services: result",
        {"log": {"type": "string", "description": "The end of the service's log (action log)"}},
        ["services"],
    )
    annotations: dict[str, Any] = MANAGING_ANNOTATIONS
    sandbox = False
    """It runs no container: no warm pool is kept for it."""

    @staticmethod
    def of_use(policy: Policy) -> bool:
        """Offered only where the policy starts services."""
        return bool(policy.services.tools)

    def refuse(self, args: Mapping[str, Any], policy: ToolPolicy, policy_name: str) -> None:
        """Nothing of its own: which services run is known only in the call's workspace."""

    async def run(self, args: Mapping[str, Any], ctx: ToolContext) -> ToolOutcome:
        scope = ctx.services
        if scope is None or scope.record is None:
            raise Refusal(
                f"refused: policy '{ctx.policy_name}' keeps no workspace (field workspace.persist), so it runs no "
                "services",
                "workspace.persist",
            )
        action = args["action"]
        if action == "list":
            listed = scope.listed()
            lines = [
                f"{s['name']}: {s['state']}, {s['url']}, up {s['uptime_s']:g} s"
                + (f"; for a person to open (once, in one browser): {s['preview']}" if s.get("preview") else "")
                for s in listed
            ]
            headline = f"{len(listed)} service(s) running in this workspace" if listed else "no service runs here"
            return ToolOutcome(headline, False, (("services", "\n".join(lines)),), {"services": listed})
        name = args.get("name")
        service = scope.named(name) if isinstance(name, str) else None
        if service is None and action == "stop" and isinstance(name, str):
            store, workspace_id = scope.services.store, scope.record.id
            if await anyio.to_thread.run_sync(store.drop_service, workspace_id, name):  # kept, but not running
                return ToolOutcome(
                    f"service {name} is not running, and its workspace no longer starts it again",
                    False,
                    structured={"services": scope.listed()},
                )
        if service is None:
            known = ", ".join(s["name"] for s in scope.listed()) or "none"
            raise Refusal(f"refused: no service named {name!r} runs in this workspace (running: {known})", "name")
        if action == "log":
            log = scope.services.maker.log_of(service, min(LOG_BYTES, ctx.policy.limits.output_bytes))
            return ToolOutcome(
                f"the end of service {service.name}'s log ({len(log)} characters)",
                False,
                (("log", log),),
                {"services": scope.listed(), "log": log},
            )
        if action == "stop":
            await scope.services.stop(service, "its caller stopped it")
            return ToolOutcome(f"service {service.name} is stopped", False, structured={"services": scope.listed()})
        await scope.services.restart(service)
        return ToolOutcome(
            f"service {service.name} was restarted and listens on port {service.port} again",
            False,
            structured={"services": scope.listed()},
        )
