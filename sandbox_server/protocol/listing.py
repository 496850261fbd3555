"""tools/list: the tools a caller's policy offers, one page at a time, each said plainly: what it can reach and
what needs a person's approval."""

from __future__ import annotations

import base64
import functools
from collections.abc import Mapping
from importlib import resources
from typing import Any

import mcp_types as types
from mcp.shared.exceptions import MCPError
from mcp_types.jsonrpc import INVALID_PARAMS

from sandbox_server.access.approval import approval_notice
from sandbox_server.policy import Policy
from sandbox_server.protocol.concise import concise_arguments, concise_hints, concise_results
from sandbox_server.protocol.meta import APPROVAL_META, OWN_NAME_META
from sandbox_server.protocol.paging import paginate
from sandbox_server.tools import Tool
from sandbox_server.tools.base import annotations_for

__all__ = ["WORKSPACE_HEADER", "icons_of", "page_of", "shipped_icon", "tool_model"]


WORKSPACE_HEADER = "Workspace"
"""Replicas with homes: the tools' `workspace` argument carries `x-mcp-header`, so 2026-07-28 clients mirror it as
`Mcp-Param-Workspace` and a load balancer sends a workspace's calls to the replica it lives on (deploy/haproxy.cfg).
Only there: the SDK refuses a call whose header is missing once the schema asks for it (protocol.forwarding
supplies it from the body for a client that did not list the tool first)."""


def tool_model(
    exposed: str, tool: Tool, policy: Policy, workspace_header: bool = False, ui: dict[str, Any] | None = None
) -> types.Tool:
    """A tool as a caller under `policy` sees it (`workspace_header`: its workspace argument mirrored as a header;
    `ui`: the view its results open in, for a client that negotiated MCP Apps)."""
    tool_policy = policy.for_tool(tool.name)
    hints = annotations_for(tool, tool_policy)
    description, meta = tool.description, dict[str, Any]({OWN_NAME_META: tool.name} if exposed != tool.name else {})
    if "timeout_s" in tool.input_schema.get("properties", {}):
        description += _here(tool.name, policy)
    writable = [f"{m.host_path} (as {m.sandbox_path})" for m in tool_policy.writable_mounts]
    if writable:
        description += f"\nUnder policy '{policy.name}' it can write to host folders: {', '.join(writable)}."
    if tool_policy.egress is not None:
        description += f"\nUnder policy '{policy.name}' it reaches the network, only the hosts its allow list names."
    notice = approval_notice(policy.approval, tool.name, tool_policy)
    if notice is not None:
        description += "\n" + notice
        meta[APPROVAL_META] = notice
    output_schema, arguments = concise_results(tool.output_schema), concise_arguments(tool.input_schema)
    if ui is not None:
        meta["ui"] = ui
        output_schema["properties"] = {**output_schema.get("properties", {}), "view": VIEW_SCHEMA}
    return types.Tool(
        name=exposed,
        title=tool.title,
        description=description,
        input_schema=_with_header(arguments) if workspace_header else arguments,
        output_schema=output_schema,
        annotations=types.ToolAnnotations.model_validate(concise_hints(hints)),  # its title is the tool's own
        # 2025-11-25: a client may ask for any call as a task when the policy runs tasks
        execution=types.ToolExecution(task_support="optional" if policy.tasks.running > 0 else "forbidden"),
        icons=icons_of(tool.name),
        _meta=meta or None,
    )


@functools.cache
def shipped_icon(name: str) -> types.Icon | None:
    """An SVG icon shipped with the package (views/`name`), as a data: URI a client shows without fetching anything;
    its type is the URI's own, and an SVG serves any size."""
    found = resources.files("sandbox_server.views").joinpath(name)
    if not found.is_file():
        return None
    return types.Icon(src="data:image/svg+xml;base64," + base64.b64encode(found.read_bytes().strip()).decode())


def icons_of(tool: str) -> list[types.Icon] | None:
    """A tool's icon (2025-11-25 on): one small stroke drawing each, in the views' accent, which reads on light
    and dark themes alike; a tool of another maker's (none shipped) has none."""
    icon = shipped_icon(f"icons/{tool}.svg")
    return [icon] if icon is not None else None


def _here(tool: str, policy: Policy) -> str:
    """What the policy serving the tool makes of it: the policy's own words (for the shell, whose image is the
    policy's choice; the shipped default's are the tool's own), and the time a call has and may ask for."""
    tool_policy = policy.for_tool(tool)
    said = f"\nPolicy '{policy.name}'"
    if tool == "execute_command" and policy.description and policy.name != "default":
        said += f" ({policy.description.rstrip('.')})"
    return f"{said}: {tool_policy.limits.timeout_s:g} s a call, `timeout_s` up to {tool_policy.max_timeout_s:g}."


VIEW_SCHEMA: dict[str, Any] = {
    "type": "object",
    "description": "What only the result's view shows (its MCP Apps view; absent for clients without views)",
}


def _with_header(schema: Mapping[str, Any]) -> dict[str, Any]:
    properties = schema.get("properties") or {}
    if "workspace" not in properties:
        return dict(schema)
    return {
        **schema,
        "properties": {**properties, "workspace": {**properties["workspace"], "x-mcp-header": WORKSPACE_HEADER}},
    }


def page_of(names: list[str], cursor: str | None, page_size: int) -> tuple[list[str], str | None]:
    """One page of a listing and the next page's cursor; a bad cursor is the client's error."""
    try:
        return paginate(names, cursor, page_size)
    except ValueError:
        raise MCPError(INVALID_PARAMS, f"invalid cursor {cursor!r}: use the nextCursor of a previous page") from None
