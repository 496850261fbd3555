// An MCP Apps host for the tests: the official AppBridge (host.js, bundled here with esbuild) in Debian's headless
// Chromium, driven through playwright-core; its MCP client the official TypeScript one, over Streamable HTTP to
// the server under test, declaring the Apps extension (and, for tasks, using the official tasks client).
//
//   node host.mjs <server url>
//
// Commands arrive on stdin as JSON lines and each is answered by one JSON line on stdout ({"error": ...} when it
// failed): open a tool's view (the host calls the tool, reads its ui:// resource, frames it, hands it the input
// and the result; given `ready`, a selector, it says how long the call took and the view until the selector
// matched), then act in the view (click, fill, select, hover, drag) and read it (text, attr, boxes, screenshot; scroll a box),
// and ask what the view asked of the host (its tool calls, reads, links, downloads) and what the browser refused.
// Boxes are in the view's own coordinates, which are the screenshot's: the frame sits at the page's corner.
import http from "node:http";
import { createInterface } from "node:readline";
import { fileURLToPath } from "node:url";
import { build } from "esbuild";
import { chromium } from "playwright-core";
import { Client, StreamableHTTPClientTransport } from "@modelcontextprotocol/client";
import { createTaskSessionFromClient, resultFromTaskOutcome } from "@modelcontextprotocol/ext-tasks/client";

const APPS = "io.modelcontextprotocol/ui";
const APP_MIME = "text/html;profile=mcp-app";
const [url, pagePort] = process.argv.slice(2);
const seen = { calls: [], reads: [], links: [], downloads: [], refused: [], errors: [] };

const bundled = await build({
  entryPoints: [fileURLToPath(new URL("host.js", import.meta.url))],
  bundle: true, write: false, format: "iife", platform: "browser", logLevel: "silent",
});
const page_html = `<!doctype html><html><head><meta charset="utf-8"><title>test host</title></head>` +
  `<body style="margin:0;background:#fff"><script>${bundled.outputFiles[0].text}</script></body></html>`;
const web = http.createServer((request, response) => {
  response.writeHead(200, { "content-type": "text/html; charset=utf-8" });
  response.end(page_html);
});
await new Promise((resolve) => web.listen(Number(pagePort ?? 0), "127.0.0.1", resolve));

const client = new Client({ name: "apps-test-host", version: "1.0.0" }, {
  capabilities: { extensions: { [APPS]: { mimeTypes: [APP_MIME] } } },
});
await client.connect(new StreamableHTTPClientTransport(new URL(url)));
const tasks = createTaskSessionFromClient(client, { endpointId: "apps-test-host" });

const browser = await chromium.launch({
  executablePath: "/usr/bin/chromium",
  args: ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
    "--disable-component-update", "--disable-sync", "--font-render-hinting=none"],
});
const page = await browser.newPage({ viewport: { width: 960, height: 760 } });
page.on("console", (message) => {
  if (/Content Security Policy|Refused to/.test(message.text())) seen.refused.push(message.text());
});
page.on("pageerror", (error) => seen.errors.push(String(error)));
await page.exposeFunction("hostCallTool", async (params) => {
  seen.calls.push(params);
  return await client.callTool(params);
});
await page.exposeFunction("hostReadResource", async (params) => {
  seen.reads.push(params.uri);
  return await client.readResource(params);
});
await page.exposeFunction("hostOpenLink", async (params) => { seen.links.push(params.url); });
await page.exposeFunction("hostDownload", async (params) => { seen.downloads.push(params); });
await page.goto(`http://127.0.0.1:${web.address().port}/`);

const view = () => page.frameLocator("#view");
let running = null;

async function open({ tool, arguments: input, frames = true, task = false, ready, theme, origin = false, timeZone }) {
  const listed = await client.listTools();
  const found = listed.tools.find((t) => t.name === tool);
  const uri = found?._meta?.ui?.resourceUri;
  if (!uri) throw new Error(`${tool} has no view: ${JSON.stringify(found?._meta)}`);
  const read = await client.readResource({ uri });
  const [contents] = read.contents;
  if (contents.mimeType !== APP_MIME) throw new Error(`${uri} is ${contents.mimeType}`);
  const csp = contents._meta?.ui?.csp ?? {};
  const app = await page.evaluate(
    (args) => window.mount(args), { html: contents.text, csp, input, frames, tool: found, theme, origin, timeZone },
  );
  if (task) {
    const execution = await tasks.callTool(tool, input, { task: { preference: "require" } });
    running = execution.settle({}).then(async ({ outcome }) => {
      let result;
      try {
        result = resultFromTaskOutcome(outcome);
      } catch (error) {  // a cancelled task has no result: the view is told it was cancelled
        if (error.name !== "TaskCancelledError") throw error;
        await page.evaluate((reason) => window.cancelled(reason), "the task was cancelled");
        return { cancelled: true };
      }
      await page.evaluate((r) => window.deliver(r), result);
      return { result };
    });
    return { uri, app, kind: execution.kind, csp };
  }
  const called = performance.now();
  const result = await client.callTool({ name: tool, arguments: input });
  const delivered = performance.now();
  await page.evaluate((r) => window.deliver(r), result);
  if (ready !== undefined) await view().locator(ready).first().waitFor({ state: "attached" });
  const timings = { call_ms: delivered - called, render_ms: ready !== undefined ? performance.now() - delivered : null };
  return { uri, app, result, csp, timings };
}

// Another page of the same site (another port of 127.0.0.1) that frames a URL, as a hostile page would: what the
// frame shows, and what the browser refused.
async function intrude({ url: framed }) {
  const other = http.createServer((request, response) => {
    response.writeHead(200, { "content-type": "text/html; charset=utf-8" });
    response.end(`<!doctype html><body><iframe id="f" src="${framed}" style="width:600px;height:300px"></iframe></body>`);
  });
  await new Promise((resolve) => other.listen(0, "127.0.0.1", resolve));
  const intruder = await browser.newPage();
  const refused = [];
  intruder.on("console", (message) => { if (/Refused to|frame-ancestors/.test(message.text())) refused.push(message.text()); });
  try {
    await intruder.goto(`http://127.0.0.1:${other.address().port}/`);
    const handle = await intruder.waitForSelector("#f");
    const frame = await handle.contentFrame();
    await frame.waitForLoadState("load");
    const text = await frame.evaluate(() => document.body?.innerText ?? "").catch(() => "");
    return { text, url: frame.url(), refused };
  } finally {
    await intruder.close();
    other.close();
  }
}

// The tools as a client's tool picker shows them: each tool's first icon at `size` pixels beside its title, one row
// a tool, on a light or a dark theme; the screenshot is the list's, and each row's box says where its icon is.
async function picker({ path, size = 32, dark = false }) {
  const tools = (await client.listTools()).tools;
  const listed = await browser.newPage({ viewport: { width: 480, height: 60 + tools.length * (size + 12) } });
  const row = (tool) => `<li style="display:flex;align-items:center;gap:10px;margin:6px">` +
    `<img width="${size}" height="${size}" src="${tool.icons?.[0]?.src ?? ""}" alt="">${tool.title ?? tool.name}</li>`;
  try {
    await listed.setContent(`<!doctype html><body style="margin:0;font:14px sans-serif;` +
      `background:${dark ? "#1e1e1e" : "#fff"};color:${dark ? "#ddd" : "#111"}"><ul id="tools" ` +
      `style="list-style:none;margin:0;padding:4px">${tools.map(row).join("")}</ul></body>`);
    await listed.waitForFunction(() => [...document.images].every((image) => image.complete));
    const boxes = await listed.locator("#tools img").evaluateAll((images) => images.map((image) => {
      const r = image.getBoundingClientRect();
      return { box: [r.x, r.y, r.width, r.height], drawn: image.naturalWidth > 0 };
    }));
    await listed.screenshot({ path });
    return { path, tools: tools.map((tool) => tool.name), icons: boxes };
  } finally {
    await listed.close();
  }
}

// A page `call --view` saved, opened as a person opens it (a file in the browser, no host, no server): what its
// view shows once ready, a screenshot of the page, and what the browser refused or the page threw.
async function saved({ url, path }) {
  const opened = await browser.newPage({ viewport: { width: 1000, height: 800 } });
  const problems = [];
  opened.on("pageerror", (error) => problems.push(String(error)));
  opened.on("console", (message) => { if (/Refused to|Content Security Policy/.test(message.text())) problems.push(message.text()); });
  try {
    await opened.goto(url);
    const shown = opened.frameLocator("#view");
    await shown.locator("body[data-ready]").waitFor({ timeout: 30000 });
    const text = await shown.locator("body").innerText();
    const rows = await shown.locator("tbody tr").count();
    await opened.screenshot({ path });
    return { text, rows, path, problems };
  } finally {
    await opened.close();
  }
}

const commands = {
  open,
  intrude,
  picker,
  saved,
  settled: async () => await running,
  tools: async () => (await client.listTools()).tools,
  resources: async () => (await client.listResources()).resources,
  call: async ({ tool, arguments: input }) => await client.callTool({ name: tool, arguments: input }),
  wait: async ({ selector, text, frame, timeout = 30000 }) => {
    const found = (frame === undefined ? view() : view().frameLocator(frame)).locator(selector).first();
    if (text === undefined) await found.waitFor({ timeout });
    else await found.filter({ hasText: text }).waitFor({ timeout });
    return true;
  },
  click: async ({ selector }) => { await view().locator(selector).first().click(); return true; },
  fill: async ({ selector, value }) => { await view().locator(selector).first().fill(value); return true; },
  select: async ({ selector, value }) => { await view().locator(selector).first().selectOption(value); return true; },
  hover: async ({ selector }) => { await view().locator(selector).first().hover(); return true; },
  drag: async ({ selector, from, to }) => {
    const box = await view().locator(selector).first().boundingBox();
    await page.mouse.move(box.x + box.width * from, box.y + box.height / 2);
    await page.mouse.down();
    await page.mouse.move(box.x + box.width * to, box.y + box.height / 2, { steps: 8 });
    await page.mouse.up();
    return true;
  },
  text: async ({ selector }) => await view().locator(selector).allInnerTexts(),
  scroll: async ({ selector, left = 0, top = 0 }) => {
    await view().locator(selector).first().evaluate((e, [x, y]) => { e.scrollLeft = x; e.scrollTop = y; }, [left, top]);
    return true;
  },
  attr: async ({ selector, name }) =>
    await view().locator(selector).evaluateAll((els, n) => els.map((e) => e.getAttribute(n)), name),
  boxes: async ({ selector }) => await view().locator(selector).evaluateAll((els) => els.map((e) => {
    const r = e.getBoundingClientRect();
    return [r.x, r.y, r.width, r.height];
  })),
  screenshot: async ({ path }) => { await page.locator("#view").screenshot({ path }); return path; },
  seen: async () => seen,
};

const lines = createInterface({ input: process.stdin });
console.log(JSON.stringify({ ready: true }));
for await (const line of lines) {
  const command = JSON.parse(line);
  if (command.cmd === "close") break;
  try {
    console.log(JSON.stringify({ ok: await commands[command.cmd](command) }));
  } catch (error) {
    console.log(JSON.stringify({ error: String(error?.stack ?? error) }));
  }
}
lines.close();
await tasks.close();
await browser.close();
await client.close();
web.close();
process.exit(0);
