// The page of the test host: the official AppBridge of @modelcontextprotocol/ext-apps (bundled by host.mjs with
// esbuild), framing one view at a time as an MCP Apps host does: a sandboxed iframe (scripts only, an opaque
// origin) whose Content-Security-Policy allows nothing but the document's own inline script and style, data:
// images, and the frames the view's resource asks for. The view's requests go to the Node side (host.mjs), whose
// MCP client carries them to the server.
import { AppBridge, PostMessageTransport } from "@modelcontextprotocol/ext-apps/app-bridge";

window.mount = async ({ html, csp, input, frames, tool, theme, origin, timeZone }) => {
  document.getElementById("view")?.remove();
  const frame = document.createElement("iframe");
  frame.id = "view";
  // `origin`: the view keeps an origin (the page's), as in a host whose views live on a sandbox origin of its own
  frame.setAttribute("sandbox", origin ? "allow-scripts allow-same-origin" : "allow-scripts");
  frame.style.cssText = "width: 960px; height: 760px; border: 0; display: block";
  const frameSources = frames && csp.frameDomains?.length ? csp.frameDomains.join(" ") : "'none'";
  const policy =
    "default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; img-src data:; " +
    `font-src 'none'; connect-src 'none'; frame-src ${frameSources}`;
  const meta = `<meta http-equiv="Content-Security-Policy" content="${policy}">`;
  document.body.append(frame);
  const capabilities = {
    serverTools: {}, serverResources: {}, openLinks: {}, downloadFile: {},
    sandbox: { csp: frames ? csp : {} },
  };
  const bridge = new AppBridge(null, { name: "sandbox-server-test-host", version: "1.0.0" }, capabilities, {
    hostContext: { theme: theme ?? "light", displayMode: "inline", platform: "web", toolInfo: { tool }, ...(timeZone ? { timeZone } : {}) },
  });
  bridge.oncalltool = (params) => window.hostCallTool(params);
  bridge.onreadresource = (params) => window.hostReadResource(params);
  bridge.onopenlink = async (params) => { await window.hostOpenLink(params); return {}; };
  bridge.ondownloadfile = async (params) => { await window.hostDownload(params); return {}; };
  const initialized = new Promise((resolve) => { bridge.oninitialized = resolve; });
  await bridge.connect(new PostMessageTransport(frame.contentWindow, frame.contentWindow));
  frame.srcdoc = html.replace("<head>", `<head>${meta}`);
  await initialized;
  await bridge.sendToolInput({ arguments: input });
  window.bridge = bridge;
  return bridge.getAppVersion();
};
window.deliver = (result) => window.bridge.sendToolResult(result);
window.cancelled = (reason) => window.bridge.sendToolCancelled({ reason });
