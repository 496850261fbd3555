// The view's side of MCP Apps (io.modelcontextprotocol/ui, protocol 2026-01-26): JSON-RPC 2.0 over postMessage
// with the host that framed it. Kept small enough to read whole: it answers the host's requests it knows, hands
// the tool's input, result and cancellation to the page, and sends the page's requests (tools/call,
// resources/read, ui/open-link, ui/download-file) to the host, which carries them to the server as the user's own.
// It never builds markup from data: `h` sets text, and attributes only from the page's own names.
"use strict";
const view = (() => {
  const pending = new Map();
  const handlers = {};
  let nextId = 1;
  let host = { capabilities: {}, context: {} };

  function post(message) {
    window.parent.postMessage({ jsonrpc: "2.0", ...message }, "*");
  }

  function request(method, params) {
    const id = nextId++;
    post({ id, method, params });
    return new Promise((resolve, reject) => pending.set(id, { resolve, reject }));
  }

  window.addEventListener("message", (event) => {
    const message = event.data;
    if (event.source !== window.parent || !message || message.jsonrpc !== "2.0") return;
    if (message.method === undefined) {
      const waiting = pending.get(message.id);
      if (!waiting) return;
      pending.delete(message.id);
      if (message.error) waiting.reject(new Error(message.error.message));
      else waiting.resolve(message.result);
      return;
    }
    if (message.method === "ping" || message.method === "ui/resource-teardown") {
      post({ id: message.id, result: {} });
      return;
    }
    if (message.method === "ui/notifications/host-context-changed") {
      host.context = { ...host.context, ...message.params };
      theme(host.context);
    }
    const handler = handlers[message.method];
    if (handler) handler(message.params || {});
    else if (message.id !== undefined) post({ id: message.id, error: { code: -32601, message: "method not found" } });
  });

  function theme(context) {
    if (context.theme) document.documentElement.dataset.theme = context.theme;
    const variables = (context.styles && context.styles.variables) || {};
    for (const [name, value] of Object.entries(variables)) {
      if (name.startsWith("--") && typeof value === "string") document.documentElement.style.setProperty(name, value);
    }
  }

  function watchSize() {
    let last = "";
    const tell = () => {
      const height = Math.ceil(document.documentElement.getBoundingClientRect().height);
      const width = Math.ceil(window.innerWidth);
      if (`${width}x${height}` === last) return;
      last = `${width}x${height}`;
      post({ method: "ui/notifications/size-changed", params: { width, height } });
    };
    new ResizeObserver(tell).observe(document.body);
    tell();
  }

  async function start(name) {
    const answer = await request("ui/initialize", {
      appInfo: { name: `sandbox-server ${name} view`, version: "1" },
      appCapabilities: {},
      protocolVersion: "2026-01-26",
    });
    host = { capabilities: answer.hostCapabilities || {}, context: answer.hostContext || {} };
    theme(host.context);
    post({ method: "ui/notifications/initialized", params: {} });
    watchSize();
    return host;
  }

  function h(tag, attributes, ...children) {
    const element = document.createElement(tag);
    for (const [name, value] of Object.entries(attributes || {})) {
      if (name.startsWith("on")) element.addEventListener(name.slice(2), value);
      else if (value !== undefined && value !== null && value !== false) element.setAttribute(name, value);
    }
    for (const child of children.flat(Infinity)) {
      if (child === null || child === undefined || child === false) continue;
      element.append(child instanceof Node ? child : String(child));
    }
    return element;
  }

  // A tool's answer as text, for a refusal or an error that has no structured part.
  function said(result) {
    return (result.content || []).filter((block) => block.type === "text").map((block) => block.text).join("\n");
  }

  async function callTool(name, args) {
    const result = await request("tools/call", { name, arguments: args });
    if (result.isError) throw new Error(said(result).split("\n")[0] || `${name} failed`);
    return result;
  }

  return {
    start,
    h,
    said,
    callTool,
    on: (method, handler) => { handlers[method] = handler; },
    readResource: (uri) => request("resources/read", { uri }),
    openLink: (url) => request("ui/open-link", { url }),
    download: (resource) => request("ui/download-file", { contents: [{ type: "resource", resource }] }),
    get host() { return host; },
  };
})();

// Numbers and sizes as people read them.
function shown(value) {
  if (value === null || value === undefined) return "";
  if (typeof value === "number") {
    return Number.isInteger(value) ? value.toLocaleString("en") : value.toLocaleString("en", { maximumFractionDigits: 4 });
  }
  return String(value);
}

// A time as people read it: in the host's time zone when it gives one (hostContext.timeZone), else in UTC, and
// the zone said either way.
function when(iso) {
  if (!iso) return "";
  const zone = view.host.context.timeZone || "UTC";
  const shown = { year: "numeric", month: "2-digit", day: "2-digit", hour: "2-digit", minute: "2-digit", second: "2-digit" };
  try {
    return new Intl.DateTimeFormat("sv-SE", { ...shown, timeZone: zone, timeZoneName: "short" }).format(new Date(iso));
  } catch {
    return `${new Date(iso).toISOString().replace("T", " ").slice(0, 19)} UTC`;
  }
}

function bytes(size) {
  const units = ["B", "KB", "MB", "GB"];
  let unit = 0;
  while (size >= 1024 && unit < units.length - 1) { size /= 1024; unit++; }
  return `${unit ? size.toFixed(1) : size} ${units[unit]}`;
}

function clear(element, ...children) {
  element.replaceChildren(...children.flat(Infinity).filter((child) => child !== null && child !== undefined));
}
