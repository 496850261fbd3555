"""A one-shot MCP client: start the server over stdio, make calls, print what came back.

Used by `sandbox-server call` and `sandbox-server demo`; it goes through the
official MCP client exactly as any other client would. The server's own log goes
to a temporary file, so when the server cannot start, its reason (not a
traceback of the broken pipe) is what the person reads.
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import re
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any, TextIO
from urllib.parse import unquote, urlsplit

import anyio
import mcp_types as types
from mcp import Client
from mcp.client.stdio import StdioServerParameters, stdio_client
from mcp.shared.exceptions import MCPError
from mcp_types import CONNECTION_CLOSED

from sandbox_server.cli.call_arguments import call_arguments
from sandbox_server.cli.saved_view import saved_page
from sandbox_server.errors import SandboxServerError, UsageError
from sandbox_server.protocol.apps import AppsSupport
from sandbox_server.protocol.meta import OWN_NAME_META, PATH_META
from sandbox_server.protocol.tasks_client import TasksExtension
from sandbox_server.sandbox.archive import safe_relative_path
from sandbox_server.tools.run_python import KEPT_NOTE

__all__ = [
    "DEMO_CALLS",
    "ServerDidNotStart",
    "call_command",
    "demo_command",
    "format_result",
    "run_calls",
    "save_result",
    "server_parameters",
]


class ServerDidNotStart(SandboxServerError):
    """The server exited before answering; the message is its own reason, on one line."""


def server_parameters(serve_args: Sequence[str] = ()) -> StdioServerParameters:
    """How to start this server as a child process speaking MCP over stdio, in this process's environment
    (DOCKER_HOST and the SANDBOX_ settings reach it; the client's default environment would drop them)."""
    return StdioServerParameters(
        command=sys.executable, args=["-m", "sandbox_server", "serve", *serve_args], env=dict(os.environ)
    )


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
            text = resource.text if isinstance(resource, types.TextResourceContents) else None
            lines.append(f"[file {resource.uri}]" + (f"\n{text.rstrip()}" if text is not None else " (binary)"))
        elif isinstance(block, types.ResourceLink):
            lines.append(f"[file {block.uri}, {block.size} bytes: read with resources/read]")
    return "\n".join(lines)


def _output_name(uri: str) -> str | None:
    """The file's path under the sandbox's output folder, from its resource URI."""
    path = unquote(urlsplit(uri).path)
    _, found, rest = path.partition("/out/")
    return safe_relative_path(rest) if found else None


async def save_result(client: Client, result: types.CallToolResult, folder: Path) -> list[Path]:
    """Write the result's files and images under `folder` (never outside it); returns what was written."""
    written: list[Path] = []
    images = 0
    for block in result.content:
        data: bytes | None = None
        name: str | None = None
        if isinstance(block, types.ImageContent):
            images += 1
            shown = (block.meta or {}).get(PATH_META)
            name = safe_relative_path(shown) if isinstance(shown, str) else None
            name = name or f"image-{images}.{block.mime_type.rsplit('/', 1)[-1]}"
            data = base64.b64decode(block.data)
        elif isinstance(block, types.EmbeddedResource):
            resource = block.resource
            name = _output_name(str(resource.uri))
            if isinstance(resource, types.TextResourceContents):
                data = resource.text.encode("utf-8")
            else:
                data = base64.b64decode(resource.blob)
        elif isinstance(block, types.ResourceLink):
            name = _output_name(str(block.uri))
            read = await client.read_resource(str(block.uri))
            item = read.contents[0]
            data = item.text.encode() if isinstance(item, types.TextResourceContents) else base64.b64decode(item.blob)
        if name is None or data is None:
            continue
        target = folder / name
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(data)
        written.append(target)
    return written


OWN_LINE = re.compile(r"^(?:\S+ )?sandbox-server: (.*)$")
"""A line of the server's own log (dated, or undated where journald dates it), its words in the group."""


def _reason(log: TextIO) -> str:
    """The server's own last words, on one line."""
    log.seek(0)
    lines = [line.rstrip() for line in log.read().splitlines() if line.strip()]
    said = [OWN_LINE.match(line) for line in lines]
    start = max((i for i, line in enumerate(said) if line), default=None)
    if start is None:
        return "the server exited before answering" + (f": {lines[-1]}" if lines else " and said nothing")
    return " ".join([said[start].group(1), *(line.strip() for line in lines[start + 1 :])])  # type: ignore[union-attr]


def _tool(exposed: str, tools: Sequence[types.Tool]) -> types.Tool:
    return next(tool for tool in tools if tool.name == exposed)


def _resolve(name: str, tools: Sequence[types.Tool]) -> str:
    """The exposed name of a tool given by its exposed or its own name (a policy may prefix names)."""
    if any(tool.name == name for tool in tools):
        return name
    own = [tool.name for tool in tools if (tool.meta or {}).get(OWN_NAME_META) == name]
    return own[0] if len(own) == 1 else name


ONE_SHOT = (
    "note: nothing is kept: this server ends with its one call, and the call's workspace (its files{}) with it; "
    "a client of `sandbox-server serve` continues a workspace from call to call"
)


def one_shot(result: types.CallToolResult, text: str) -> str:
    """A result as a one-shot call prints it: whatever its server would have kept is said to be gone with it."""
    if (result.structured_content or {}).get("workspace") is None:
        return text
    lines = text.splitlines()
    kept = [line for line in lines if line.startswith(f"note: {KEPT_NOTE}")]
    said = ONE_SHOT.format(" and run_python's variables" if kept else "")
    return "\n".join([line for line in lines if line not in kept] + [said])


async def run_calls(
    calls: Sequence[tuple[str, dict[str, Any]]],
    serve_args: Sequence[str] = (),
    show_tools: bool = False,
    save_to: Path | None = None,
    as_task: bool = False,
    alone: bool = False,
    view_to: Path | None = None,
) -> list[types.CallToolResult]:
    """Start the server, make each call in one session, print each result; return them. A call made `alone`
    says that nothing of it is kept once its server ends.

    Raises ServerDidNotStart with the server's own reason when it exits before answering.
    """
    results = []
    unknown: str | None = None
    with tempfile.TemporaryFile("w+", encoding="utf-8", errors="replace") as log:
        try:
            transport = stdio_client(server_parameters(serve_args), errlog=log)
            # A task is the 2026-07-28 era's: the client names the tasks extension, and follows a task to its end.
            era: dict[str, Any] = {"mode": "2026-07-28", "extensions": [TasksExtension(_said)]} if as_task else {}
            if view_to is not None:  # a client that shows views: its results carry what the view shows
                era["extensions"] = [*era.get("extensions", []), AppsSupport()]
            async with Client(transport, **({"mode": "legacy"} | era)) as client:
                listed = await client.list_tools()
                names = [tool.name for tool in listed.tools]
                if show_tools:
                    print(f"tools: {', '.join(names)}\n", flush=True)
                for name, arguments in calls:
                    exposed = _resolve(name, listed.tools)
                    if exposed not in names:  # said plainly, with the names, after the session has ended
                        unknown = f"no tool {name!r} here; the server's policy offers: {', '.join(names)}"
                        break
                    print(f"$ {name} {json.dumps(_shown_arguments(arguments), ensure_ascii=False)}", flush=True)
                    result = await client.call_tool(exposed, arguments)
                    text = format_result(result)
                    print((one_shot(result, text) if alone else text) + "\n", flush=True)
                    if save_to is not None:
                        for path in await save_result(client, result, save_to):
                            print(f"saved {os.fspath(path)}", flush=True)
                    if view_to is not None:
                        await _save_view(client, _tool(exposed, listed.tools), arguments, result, view_to)
                    results.append(result)
        except Exception as exc:
            if results or not _server_exited(exc):
                raise
            raise ServerDidNotStart(_reason(log)) from None
    if unknown is not None:
        raise UsageError(unknown)
    return results


async def _save_view(
    client: Client, tool: types.Tool, call: dict[str, Any], result: types.CallToolResult, to: Path
) -> None:
    """The result in its tool's view, as one page to open in a browser here (the view read as a client reads it)."""
    uri = ((tool.meta or {}).get("ui") or {}).get("resourceUri")
    if not isinstance(uri, str):
        print(f"no view: {tool.name} has none (analyze_csv, run_python, execute_command, … have one)", flush=True)
        return
    contents = (await client.read_resource(uri)).contents[0]
    document = contents.text if isinstance(contents, types.TextResourceContents) else ""
    answer = result.model_dump(by_alias=True, exclude_none=True, mode="json")
    to.write_text(saved_page(tool.name, call, answer, document), encoding="utf-8")
    print(f"view saved: {to.resolve().as_uri()} (open it in a browser)", flush=True)


_last_said: dict[str, str] = {}


async def _said(task: dict[str, Any]) -> None:
    """A task's state, on stderr each time it changes (the result alone goes to stdout)."""
    line = f"task {task['taskId'][:8]}: {task['status']}: {task.get('statusMessage', '')}"
    if _last_said.get(task["taskId"]) != line:
        _last_said[task["taskId"]] = line
        print(line, file=sys.stderr, flush=True)


def _shown_arguments(arguments: dict[str, Any]) -> dict[str, Any]:
    """The arguments as echoed before a call: each sent file's content replaced by its length (an upload can be
    megabytes of base64, which nobody reads on a terminal)."""
    files = arguments.get("files")
    if not isinstance(files, list):
        return arguments
    shown = [
        {**item, "content": f"<{len(item['content'])} characters, not shown>"}
        if isinstance(item, dict) and isinstance(item.get("content"), str) and len(item["content"]) > 200
        else item
        for item in files
    ]
    return {**arguments, "files": shown}


def _server_exited(exc: BaseException) -> bool:
    """Whether an exception (or any inside an exception group) says the connection to the server closed."""
    if isinstance(exc, BaseExceptionGroup):
        return any(_server_exited(inner) for inner in exc.exceptions)
    if isinstance(exc, MCPError):
        return exc.error.code == CONNECTION_CLOSED
    return isinstance(exc, (anyio.ClosedResourceError, anyio.BrokenResourceError, BrokenPipeError, ConnectionError))


def call_command(args: argparse.Namespace) -> int:
    """`sandbox-server call`: one call through a real session; 0 ok, 1 an error result, 2 not run."""
    if args.arguments is not None and args.json is not None:
        raise UsageError("give the arguments once: as JSON after the tool, or with --json")
    given = args.json if args.json is not None else args.arguments
    arguments = call_arguments(args.tool, args.arg, given, args.upload)
    serve_args = ["--policy", args.policy, *(["--tool-prefix", args.tool_prefix] if args.tool_prefix else [])]
    save_to = Path(args.save) if args.save else None
    view_to = Path(args.view) if args.view else None
    if args.task and "timeout_s" not in arguments:  # a task may run as long as the policy lets one run
        arguments["timeout_s"] = _max_task_s(args.policy, args.tool)
    try:
        results = anyio.run(run_calls, [(args.tool, arguments)], serve_args, False, save_to, args.task, True, view_to)
    except ServerDidNotStart as exc:
        print(f"sandbox-server call: the server did not start: {exc}", file=sys.stderr)
        return 2
    error = (results[0].structured_content or {}).get("error") or {}
    if error.get("kind") == "engine_unavailable":
        print(f"sandbox-server call: {error['message']}", file=sys.stderr)
        return 2
    return 1 if results[0].is_error else 0


def _max_task_s(policy: str, tool: str) -> int | float:
    """The longest a task of this tool may run under the policy (limits.max_task_s)."""
    from sandbox_server.policy.loader import load_policy
    from sandbox_server.tools import all_tools

    loaded = load_policy(policy, [t.name for t in all_tools()])
    longest = loaded.for_tool(tool).max_task_s
    return int(longest) if longest.is_integer() else longest


DEMO_CALLS: list[tuple[str, dict[str, object]]] = [
    ("execute_command", {"command": 'uname -sm; id; echo "network interfaces: $(ls /sys/class/net)"'}),
    (
        "execute_command",
        {
            "command": "sort -t, -k2 -n scores.csv | tee out/sorted.csv | tail -n 1",
            "files": [{"path": "scores.csv", "content": "ada,93\nlinus,71\ngrace,88\n"}],
        },
    ),
    ("execute_command", {"command": "echo", "args": ["$(id)", "; rm -rf /", "`whoami`"]}),
    ("execute_command", {"command": "touch /usr/bin/evil"}),
    ("execute_command", {"command": "sleep 30", "timeout_s": 1}),
    (
        "run_python",
        {
            "code": "import pandas as pd, matplotlib.pyplot as plt\n"
            "df = pd.read_csv('scores.csv', names=['who', 'score'])\n"
            "df.plot.bar(x='who', y='score')\n"
            "df.describe().loc[['mean', 'max']]",
            "files": [{"path": "scores.csv", "content": "ada,93\nlinus,71\ngrace,88\n"}],
        },
    ),
    (
        "analyze_csv",
        {
            "filepath": "sales.csv",
            "operations": ["sum", "average", "count"],
            "group_by": ["region"],
            "plot": {"kind": "bar", "y": "amount"},
            "files": [
                {
                    "path": "sales.csv",
                    "content": 'region,amount,note\nnorth,120.5,"big, early"\nsouth,80,\nnorth,42,late\n'
                    "east,,missing\nsouth,19.5,\n",
                }
            ],
        },
    ),
    ("analyze_csv", {"filepath": "../../etc/passwd", "operations": ["count"]}),
]


def demo_command(args: argparse.Namespace) -> int:
    """`sandbox-server demo`: a real session with a few calls; 0 when each answered as expected."""
    print("A real MCP session: this command starts `sandbox-server serve` over stdio and calls it.\n", flush=True)
    results = anyio.run(run_calls, DEMO_CALLS, (), True)
    expected_errors = [False, False, False, True, True, False, False, True]
    if [result.is_error for result in results] != expected_errors:
        print("demo: unexpected results, see above", file=sys.stderr)
        return 1
    print("demo: every call ran in its own fresh container, and each was removed afterwards.")
    return 0
