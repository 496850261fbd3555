"""`sandbox-server call … --view FILE`: a result opened in its view (MCP Apps) on this machine, without a host.

The page holds the view's document as the server gave it, framed as hosts frame views (a sandboxed frame of its
own), and a few lines of host: they answer the view's handshake, hand it the call's arguments and result, open
its links and save its downloads. What the view would ask of the server (another workspace's files, a task to
cancel) is answered that this page is a saved result: it reaches no server.
"""

from __future__ import annotations

import html
import json
from typing import Any

__all__ = ["saved_page"]


HOST = """
const frame = document.getElementById("view");
const send = (message) => frame.contentWindow.postMessage({ jsonrpc: "2.0", ...message }, "*");
const dark = window.matchMedia("(prefers-color-scheme: dark)").matches;
function save(contents) {
  for (const item of contents || []) {
    const resource = item.resource || item;
    const bytes = resource.blob !== undefined
      ? Uint8Array.from(atob(resource.blob), (c) => c.charCodeAt(0)) : new TextEncoder().encode(resource.text || "");
    const link = document.createElement("a");
    link.href = URL.createObjectURL(new Blob([bytes], { type: resource.mimeType || "application/octet-stream" }));
    link.download = (resource.uri || "download").split("/").pop();
    link.click();
  }
}
window.addEventListener("message", (event) => {
  const message = event.data;
  if (event.source !== frame.contentWindow || !message || message.jsonrpc !== "2.0") return;
  const reply = (body) => send({ id: message.id, ...body });
  switch (message.method) {
    case "ui/initialize":
      reply({ result: {
        protocolVersion: message.params.protocolVersion,
        hostInfo: { name: "sandbox-server saved view", version: "1" },
        hostCapabilities: { openLinks: {}, downloadFile: {} },
        hostContext: { theme: dark ? "dark" : "light", displayMode: "inline",
                       timeZone: Intl.DateTimeFormat().resolvedOptions().timeZone },
      } });
      break;
    case "ui/notifications/initialized":
      send({ method: "ui/notifications/tool-input", params: { arguments: SAVED.arguments } });
      send({ method: "ui/notifications/tool-result", params: SAVED.result });
      break;
    case "ui/notifications/size-changed":
      frame.style.height = `${Math.max(window.innerHeight - 32, message.params.height)}px`;
      break;
    case "ui/open-link":
      window.open(message.params.url, "_blank", "noopener");
      reply({ result: {} });
      break;
    case "ui/download-file":
      save(message.params.contents);
      reply({ result: {} });
      break;
    default:
      if (message.id !== undefined) {
        reply({ error: { code: -32601, message: `${message.method}: this page is a saved result; it reaches no server` } });
      }
  }
});
"""


def saved_page(tool: str, arguments: dict[str, Any], result: dict[str, Any], view: str) -> str:
    """One HTML page showing `result` (a CallToolResult as JSON) in `view` (the view's document)."""
    saved = json.dumps({"arguments": arguments, "result": result}, ensure_ascii=False).replace("</", "<\\/")
    return (
        '<!doctype html><html><head><meta charset="utf-8">'
        f"<title>{html.escape(tool)}: a saved sandbox-server result</title>"
        "<style>body{margin:0;font:13px system-ui,sans-serif;color:#555}"
        "p{margin:6px 10px}iframe{display:block;border:0;width:100%;height:calc(100vh - 32px)}</style></head><body>"
        f"<p>{html.escape(tool)}, as its view shows it: a saved result (what needs the server is not here)</p>"
        f'<iframe id="view" sandbox="allow-scripts" srcdoc="{html.escape(view, quote=True)}"></iframe>'
        f"<script>const SAVED = {saved};\n{HOST}</script></body></html>\n"
    )
