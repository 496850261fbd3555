// Tool calls through the official MCP tasks client (@modelcontextprotocol/ext-tasks), asking for tasks, in the
// era named ("2025-11-25" or "2026-07-28"), over Streamable HTTP (an http:// target) or stdio (a JSON array: the
// server's command line). Prints what it saw as JSON lines, the last one the whole story.
//
//   node call.mjs <target> <era> <arguments of one execute_command call> [beside]
//
// With "beside", while that task runs a second task is started and cancelled (a line says so, with the stdio
// server's pid, and the script waits for a line on stdin before going on), and an ordinary call is made.
//
// In the 2026-07-28 era the package asks its host for a raw request path (the SDK client's codecs do not
// carry the tasks extension's answers): here, one HTTP POST per request, framed as that era's transport
// says (a JSON-RPC envelope around the package's request; the protocol version, method and tool name as
// headers; the answer as JSON or the last message of an event stream).
import { createInterface } from "node:readline";
import { Client, StreamableHTTPClientTransport } from "@modelcontextprotocol/client";
import { StdioClientTransport } from "@modelcontextprotocol/client/stdio";
import { createTaskSessionFromClient, resultFromTaskOutcome } from "@modelcontextprotocol/ext-tasks/client";

const MODERN = "2026-07-28";
const EXTENSION = "io.modelcontextprotocol/tasks";
const [target, era, argumentsJson, scenario] = process.argv.slice(2);
const url = target.startsWith("http") ? target : undefined;
const clientInfo = { name: "ext-tasks-check", version: "1.0.0" };
const capabilities = era === MODERN ? { extensions: { [EXTENSION]: {} } } : {};

/** The last JSON-RPC message of an answer, whether the server sent JSON or an event stream. */
function answerOf(contentType, body) {
  if (!contentType.includes("text/event-stream")) return JSON.parse(body);
  const events = body
    .split(/\r?\n\r?\n/)
    .map((event) =>
      event
        .split(/\r?\n/)
        .filter((line) => line.startsWith("data:"))
        .map((line) => line.slice(5).trimStart())
        .join("\n"),
    )
    .filter((data) => data.length > 0)
    .map((data) => JSON.parse(data))
    .filter((message) => "result" in message || "error" in message);
  return events.at(-1);
}

let nextId = 1;

async function rawDispatch(request, options = {}) {
  const headers = {
    "content-type": "application/json",
    accept: "application/json, text/event-stream",
    "mcp-protocol-version": MODERN,
    "mcp-method": request.method,
  };
  if (request.method === "tools/call") headers["mcp-name"] = request.params.name;
  const response = await fetch(url, {
    method: "POST",
    headers,
    body: JSON.stringify({ jsonrpc: "2.0", id: `raw-${nextId++}`, ...request }),
    ...(options.signal ? { signal: options.signal } : {}),
  });
  const message = answerOf(response.headers.get("content-type") ?? "", await response.text());
  if (message === undefined) throw new Error(`no answer to ${request.method} (HTTP ${response.status})`);
  return "error" in message ? { kind: "error", error: message.error } : { kind: "result", result: message.result };
}

const client = new Client(clientInfo, {
  capabilities,
  ...(era === MODERN ? { versionNegotiation: { mode: { pin: MODERN } } } : {}),
});
let transport;
if (url !== undefined) transport = new StreamableHTTPClientTransport(new URL(url));
else {
  if (era === MODERN) throw new Error("the 2026-07-28 raw request path is written for HTTP only");
  const [command, ...args] = JSON.parse(target);
  transport = new StdioClientTransport({ command, args, env: process.env, stderr: "inherit" });
}
await client.connect(transport);
const session = createTaskSessionFromClient(client, {
  endpointId: "sandbox-server-test",
  ...(era === MODERN
    ? { rawDispatch, v2RequestFraming: { protocolVersion: MODERN, clientInfo, clientCapabilities: capabilities } }
    : {}),
});
const say = (line) => console.log(JSON.stringify(line));
const messages = [];
try {
  const execution = await session.callTool("execute_command", JSON.parse(argumentsJson), {
    task: { preference: "require" },
  });
  const settled = execution.settle({
    onEvent(event) {
      if (event.type === "task") messages.push(`${event.task.status}: ${event.task.statusMessage ?? ""}`);
    },
  });
  const story = { era: client.getProtocolEra(), kind: execution.kind, messages };
  if (scenario === "beside") {
    const second = await session.callTool(
      "execute_command",
      { command: "sleep 100", timeout_s: 110 },
      { task: { preference: "require" } },
    );
    await second.cancel();
    story.second = { kind: second.kind, status: (await second.result()).status };
    say({ cancelled: story.second, pid: transport.pid ?? null, running: messages.at(-1) ?? "" });
    const lines = createInterface({ input: process.stdin });
    await lines[Symbol.asyncIterator]().next();
    lines.close();
    process.stdin.destroy();
    const ordinary = await client.callTool({ name: "execute_command", arguments: { command: "echo ordinary" } });
    story.ordinary = { stdout: ordinary.structuredContent.stdout, messagesBefore: messages.length };
  }
  story.result = resultFromTaskOutcome((await settled).outcome);
  say(story);
} finally {
  await session.close();
  await client.close();
}
