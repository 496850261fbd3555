"""MCP Apps (`io.modelcontextprotocol/ui`): views a host renders beside a result, for clients that negotiate them.

A view is one self-contained HTML document shipped in the package (`sandbox_server/views`: its page with the
shared bridge script and style inlined, nothing fetched from anywhere), read as a `ui://sandbox-server/<view>`
resource and linked from its tool by `_meta.ui.resourceUri`. Everything a view shows comes from the result the
host hands it, or from the MCP requests it sends through the host (tools/call, resources/read), which reach the
server as the caller's own and are governed, refused and audited like any other: a view can do nothing its user
could not.

A client that does not negotiate the extension sees none of it: no `_meta.ui` on the tools, no `ui://`
resources, no app-only tool, and results without their `view` part, exactly as before views existed.
"""

from __future__ import annotations

import functools
from importlib import resources
from typing import Any

import mcp_types as types
from mcp.client.extension import ClientExtension
from mcp.server.apps import APP_MIME_TYPE, EXTENSION_ID

__all__ = ["APP_MIME_TYPE", "EXTENSION_ID", "VIEW_PREFIX", "AppsSupport", "Views", "advertise", "tool_ui"]

VIEW_PREFIX = "ui://sandbox-server/"
VIEWS: dict[str, tuple[str, str]] = {
    "table": ("analyze_csv", "The analysis as a sortable, filterable table and an interactive chart"),
    "cell": ("run_python", "The cell's outputs as a notebook shows them, and the variables kept for the next"),
    "task": ("execute_command", "The command's output, live while it runs as a task, with a button to cancel it"),
    "files": ("workspaces", "Your workspaces and the files of the call's, with what its last call changed"),
    "service": ("services", "A service's preview, embedded where the host allows frames, else a link"),
}
"""Each view: the tool it belongs to, and what it shows."""
_VIEW_OF_TOOL = {tool: view for view, (tool, _) in VIEWS.items()}
_SHARED = ("/* bridge.js */", "bridge.js"), ("/* view.css */", "view.css")
"""Marks in each page where the shared script and style are inlined."""


class AppsSupport(ClientExtension):
    """A client of ours that shows views (`call --view`): it declares MCP Apps, so its results carry what their
    views show."""

    identifier = EXTENSION_ID

    def settings(self) -> dict[str, Any]:
        return {"mimeTypes": [APP_MIME_TYPE]}


def tool_ui(tool: str) -> dict[str, Any] | None:
    """A tool's `_meta.ui` for a client that negotiated views: the view its results open in (None: it has none)."""
    view = _VIEW_OF_TOOL.get(tool)
    return {"resourceUri": VIEW_PREFIX + view} if view is not None else None


@functools.cache
def page(view: str) -> str:
    """A view's document, its shared script and style inlined (read once from the package)."""
    folder = resources.files("sandbox_server") / "views"
    text = (folder / f"{view}.html").read_text(encoding="utf-8")
    for mark, name in _SHARED:
        text = text.replace(mark, (folder / name).read_text(encoding="utf-8"))
    return text


class Views:
    """The `ui://` resources: listed and read for clients that negotiated MCP Apps."""

    def __init__(self, preview_origin: str | None = None) -> None:
        self.preview_origin = preview_origin
        """Where services' previews are served: the one origin the service view may frame (None: no previews)."""

    def listed(self) -> list[types.Resource]:
        return [
            types.Resource(uri=VIEW_PREFIX + view, name=f"{view} view", description=about, mime_type=APP_MIME_TYPE)
            for view, (_, about) in VIEWS.items()
        ]

    def read(self, uri: str) -> types.ReadResourceResult | None:
        """A view's document with what the host must allow it (None: no such view)."""
        view = uri.removeprefix(VIEW_PREFIX)
        if not uri.startswith(VIEW_PREFIX) or view not in VIEWS:
            return None
        ui: dict[str, Any] = {"prefersBorder": True}
        if view == "service" and self.preview_origin:
            ui["csp"] = {"frameDomains": [self.preview_origin]}
        contents = types.TextResourceContents(uri=uri, mime_type=APP_MIME_TYPE, text=page(view), _meta={"ui": ui})
        return types.ReadResourceResult(contents=[contents])


def advertise(server: Any) -> None:
    """Declare the extension in the server's capabilities (SEP-2133: under `capabilities.extensions`)."""
    server.extensions[EXTENSION_ID] = {}
