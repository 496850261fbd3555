// One tool call through the official MCP tasks client (@modelcontextprotocol/ext-tasks) over Streamable HTTP,
// in the 2025-11-25 era, asking for a task; prints what it saw as one JSON line.
import { Client, StreamableHTTPClientTransport } from "@modelcontextprotocol/client";
import { createTaskSessionFromClient, resultFromTaskOutcome } from "@modelcontextprotocol/ext-tasks/client";

const [url, argumentsJson] = process.argv.slice(2);
const client = new Client({ name: "ext-tasks-check", version: "1.0.0" }, { capabilities: {} });
await client.connect(new StreamableHTTPClientTransport(new URL(url)));
const session = createTaskSessionFromClient(client, { endpointId: "sandbox-server-test" });
const messages = [];
try {
  const execution = await session.callTool("execute_command", JSON.parse(argumentsJson), {
    task: { preference: "require" },
  });
  const { outcome } = await execution.settle({
    onEvent(event) {
      if (event.type === "task") messages.push(`${event.task.status}: ${event.task.statusMessage ?? ""}`);
    },
  });
  console.log(JSON.stringify({ kind: execution.kind, messages, result: resultFromTaskOutcome(outcome) }));
} finally {
  await session.close();
  await client.close();
}
