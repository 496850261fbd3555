"""A one-shot MCP client: start the server over stdio, make calls, print what came back.

Used by `sandbox-server call` and `sandbox-server demo`; it goes through the
official MCP client exactly as any other client would.
"""

from __future__ import annotations

import base64
import json
import sys
from collections.abc import Sequence
from typing import Any

import mcp_types as types
from mcp import Client
from mcp.client.stdio import StdioServerParameters

__all__ = ["format_result", "run_calls", "server_parameters"]


def server_parameters(serve_args: Sequence[str] = ()) -> StdioServerParameters:
    """How to start this server as a child process speaking MCP over stdio."""
    return StdioServerParameters(command=sys.executable, args=["-m", "sandbox_server", "serve", *serve_args])


def format_result(result: types.CallToolResult) -> str:
    """A human-readable rendering of a tool result."""
    lines = []
    for index, block in enumerate(result.content):
        if isinstance(block, types.TextContent):
            if index == 1 and result.structured_content is not None:
                continue  # the structured JSON repeats the text block
            lines.append(block.text)
        elif isinstance(block, types.ImageContent):
            lines.append(f"[image {block.mime_type}, {len(base64.b64decode(block.data))} bytes]")
        elif isinstance(block, types.EmbeddedResource):
            resource = block.resource
            text = getattr(resource, "text", None)
            lines.append(f"[file {resource.uri}]" + (f"\n{text.rstrip()}" if text is not None else " (binary)"))
        elif isinstance(block, types.ResourceLink):
            lines.append(f"[file {block.uri}, {block.size} bytes: read with resources/read]")
    return "\n".join(lines)


async def run_calls(
    calls: Sequence[tuple[str, dict[str, Any]]], serve_args: Sequence[str] = (), show_tools: bool = False
) -> list[types.CallToolResult]:
    """Start the server, make each call in one session, print each result; return them."""
    results = []
    async with Client(server_parameters(serve_args), mode="legacy") as client:
        if show_tools:
            listed = await client.list_tools()
            print(f"tools: {', '.join(tool.name for tool in listed.tools)}\n", flush=True)
        for name, arguments in calls:
            print(f"$ {name} {json.dumps(arguments)}", flush=True)
            result = await client.call_tool(name, arguments)
            print(format_result(result) + "\n", flush=True)
            results.append(result)
    return results
