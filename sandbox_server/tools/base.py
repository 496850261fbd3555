"""What every tool is: a description for tools/list and `run(args, ctx) -> ToolOutcome`."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from sandbox_server.errors import ERROR_KINDS, FailureKind, Refusal, RefusalKind
from sandbox_server.network.egress import ProxyEndpoint
from sandbox_server.policy import Policy, ToolPolicy
from sandbox_server.sandbox import wire
from sandbox_server.sandbox.runtime import NO_HOOKS, RunHooks, SandboxRuntime
from sandbox_server.sandbox.spec import InputFile, OutputFile
from sandbox_server.tools.schemas import CHANGES_SCHEMA, NETWORK_SCHEMA, SERVICE_SCHEMA, USAGE_SCHEMA

if TYPE_CHECKING:
    from sandbox_server.services.scope import ServiceScope

__all__ = [
    "Sandboxed",
    "ERROR_SCHEMA",
    "FILES_SCHEMA",
    "SANDBOX_ANNOTATIONS",
    "TIMEOUT_SCHEMA",
    "MANAGING_ANNOTATIONS",
    "WORKSPACE_ARGUMENT",
    "WORKSPACE",
    "Tool",
    "ToolContext",
    "ToolOutcome",
    "annotations_for",
    "result_schema",
]

WORKSPACE = wire.WORKSPACE
"""The sandbox's writable working folder; relative paths in arguments are relative to it."""

FILES_SCHEMA: dict[str, Any] = {
    "type": "array",
    "description": "Written under /workspace first.",
    "x-fields-in-words": "{path, content, encoding?: utf-8|base64, mtime?, executable?}",
    "maxItems": 10000,
    "items": {
        "type": "object",
        "properties": {
            "path": {"type": "string", "minLength": 1, "maxLength": 4096, "description": "Relative to /workspace."},
            "content": {"type": "string"},
            "encoding": {"enum": ["utf-8", "base64"], "default": "utf-8"},
            "mtime": {
                "type": "number",
                "minimum": 0,
                "maximum": 253402300799,
                "description": "Its modification time in seconds since 1970 (default: the time of the call).",
            },
            "executable": {
                "type": "boolean",
                "default": False,
                "description": "Make the file executable (mode 0755), to run it as ./name; the policy's "
                "workspace.exec must allow running programs from /workspace.",
            },
        },
        "required": ["path", "content"],
        "additionalProperties": False,
    },
}


MANAGING_ANNOTATIONS: dict[str, Any] = {
    "readOnlyHint": False,
    "destructiveHint": True,
    "idempotentHint": False,
    "openWorldHint": False,
}
"""The hints of the tools that run no sandbox and manage what the workspace holds (services, workspaces): they
stop or remove things, reach nothing outside."""

WORKSPACE_ARGUMENT: dict[str, Any] = {
    "type": "string",
    "maxLength": 64,
    "description": "A result's `workspace` id or a kept name. Without it, a call over stdio or in a handshake-era HTTP session continues its "
    "connection's workspace; over HTTP in the 2026-07-28 era it starts a new one. With a policy that keeps "
    "nothing, every call starts empty.",
}

TIMEOUT_SCHEMA: dict[str, Any] = {
    "type": "number",
    "exclusiveMinimum": 0,
}
"""Seconds: the tool's description says the policy's default and cap (protocol.listing)."""

SANDBOX_ANNOTATIONS: dict[str, Any] = {
    "readOnlyHint": False,
    "destructiveHint": False,
    "idempotentHint": False,
    "openWorldHint": False,
}
"""Honest hints for a tool that runs code: it may write (but only inside a throwaway sandbox),
is not idempotent, and reaches nothing outside (no network). `annotations_for` adjusts
them to a policy: a writable mount makes a writing tool destructive, a network open-world."""

ERROR_SCHEMA: dict[str, Any] = {
    "type": "object",
    "description": "Present when the call was refused, or failed before the tool could answer.",
    "properties": {
        "kind": {"enum": list(ERROR_KINDS)},
        "message": {"type": "string", "description": "The same text as the result's first line."},
        "policy": {"type": ["string", "null"], "description": "The policy in force."},
        "field": {"type": ["string", "null"], "description": "The policy field or argument that decided it."},
        "retry_after_s": {"type": ["number", "null"], "description": "For busy and rate_limited: when to retry."},
    },
    "required": ["kind", "message"],
    "additionalProperties": False,
}  # fmt: skip


def result_schema(title: str, properties: Mapping[str, Any], required: list[str]) -> dict[str, Any]:
    """A tool's outputSchema: its own answer, or an `error` object when it was refused or failed."""
    return {
        "title": title,
        "type": "object",
        "properties": {
            **properties,
            "error": ERROR_SCHEMA,
            "workspace": {"type": "string", "description": "The kept workspace this call worked in (pass it back)."},
            "changes": CHANGES_SCHEMA,
            "network": NETWORK_SCHEMA,
            "usage": USAGE_SCHEMA,
            "service": SERVICE_SCHEMA,
            "services": {
                "type": "array",
                "items": SERVICE_SCHEMA,
                "description": "The services running in the call's workspace (reach them by `url` from its calls).",
            },
        },
        "anyOf": [{"required": required}, {"required": ["error"]}, {"required": ["service"]}],
    }


def annotations_for(tool: Tool, policy: ToolPolicy) -> dict[str, Any]:
    """The tool's hints under a policy: what the sandbox can reach changes what the tool may do."""
    hints = dict(tool.annotations)
    writes_outside = bool(policy.writable_mounts)
    hints["destructiveHint"] = bool(not hints.get("readOnlyHint") and (hints.get("destructiveHint") or writes_outside))
    hints["openWorldHint"] = policy.egress is not None
    return hints


@dataclass(frozen=True, slots=True)
class ToolContext:
    """What a tool gets besides its arguments."""

    runtime: SandboxRuntime
    policy: ToolPolicy
    policy_name: str = "default"
    hooks: RunHooks = NO_HOOKS
    """What the call hears while its program runs (progress, live output, its sandbox's address)."""
    files: tuple[InputFile, ...] = ()
    """The call's input files, decoded (and refused, when the policy says no) before it was admitted."""
    kept_workspace: bool = False
    """The call runs in a kept workspace (what it leaves there is there in the next call)."""
    proxy: ProxyEndpoint | None = None
    """With an allow list: the internal network the sandbox joins and its proxy."""
    task: bool = False
    """The call runs as a task: it may run for up to limits.max_task_s, and that long when it does not ask."""
    services: ServiceScope | None = None
    """Starting a service in the call's workspace (None: no kept workspace, so no services)."""
    service_network: str | None = None
    """The network of the workspace's running services, which the sandbox joins to reach them by name."""
    service_names: tuple[str, ...] = ()
    """Their names, which the sandbox reaches directly rather than through an egress proxy."""
    branch: Callable[[str, Mapping[str, Any], str], Awaitable[ToolOutcome]] | None = None
    """Runs a call of another tool (its name, its arguments) in the workspace of the given id, as a call of its
    own (checked, admitted, audited): the `workspaces` tool's `branch` (None: no such call may be run)."""


@dataclass(frozen=True, slots=True)
class ToolOutcome:
    """A tool's answer before rendering: the headline is the first line a model reads."""

    headline: str
    is_error: bool
    sections: tuple[tuple[str, str], ...] = ()
    structured: Mapping[str, Any] | None = None
    files: tuple[OutputFile, ...] = ()
    notes: tuple[str, ...] = ()
    audit: Mapping[str, Any] | None = None
    """What the audit line records about the sandbox (container, runtime, limits, outcome)."""
    view: Mapping[str, Any] | None = None
    """What only a view shows (MCP Apps): `structuredContent.view`, for clients that negotiated views alone."""
    outputs: tuple[tuple[str, bytes], ...] = ()
    """A stream the answer shows cut, as it came ("stdout" or "stderr", its bytes): kept as a resource."""

    @classmethod
    def refused(cls, refusal: Refusal, policy_name: str) -> ToolOutcome:
        """Nothing ran: the call was refused, and why (the one conversion of a Refusal)."""
        return cls.failed(refusal.kind, refusal.message, policy_name, refusal.field, refusal.retry_after_s)

    @classmethod
    def failed(
        cls,
        kind: RefusalKind | FailureKind,
        message: str,
        policy_name: str | None = None,
        field: str | None = None,
        retry_after_s: float | None = None,
        *,
        extra: Mapping[str, Any] | None = None,
        audit: Mapping[str, Any] | None = None,
    ) -> ToolOutcome:
        """An error answer whose structured form is `{"error": {...}}` and any `extra` fields."""
        error = {
            "kind": kind,
            "message": message,
            "policy": policy_name,
            "field": field,
            "retry_after_s": retry_after_s,
        }
        return cls(headline=message, is_error=True, structured={"error": error, **(extra or {})}, audit=audit)

    def audit_fields(self) -> dict[str, Any]:
        """What the audit record says of this outcome: refused (why, which field) or ok/error with the sandbox's facts."""
        error = (self.structured or {}).get("error") or {}
        if self.audit is None and self.is_error and error:
            return {
                "outcome": "refused",
                "reason": self.headline,
                "kind": error.get("kind"),
                "field": error.get("field"),
            }
        return {"outcome": "error" if self.is_error else "ok", **(self.audit or {})}


class Sandboxed:
    """What a tool whose calls each run in a sandbox has in common: offered wherever its policy enables it."""

    sandbox = True

    def of_use(self, policy: Policy) -> bool:
        return True


class Tool(Protocol):
    """One tool; modules under tools/ each provide one."""

    @property
    def name(self) -> str: ...
    @property
    def title(self) -> str: ...
    @property
    def description(self) -> str: ...
    @property
    def input_schema(self) -> Mapping[str, Any]: ...
    @property
    def output_schema(self) -> Mapping[str, Any]: ...
    @property
    def annotations(self) -> Mapping[str, Any]: ...
    @property
    def sandbox(self) -> bool:
        """Whether its calls run in a sandbox (False: it manages what calls made, and no warm pool is kept for it)."""
        ...

    def of_use(self, policy: Policy) -> bool:
        """Whether a policy that enables it has a use for it (the managing tools are of use only beside what they
        manage)."""
        ...

    def refuse(self, args: Mapping[str, Any], policy: ToolPolicy, policy_name: str) -> None:
        """Raise the Refusal the tool's own rules find in valid arguments, with no engine (before the call waits
        for a slot)."""
        ...

    async def run(self, args: Mapping[str, Any], ctx: ToolContext) -> ToolOutcome:
        """Run the tool; sandboxed failures are outcomes, not exceptions."""
        ...
