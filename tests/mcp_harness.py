"""Start the real server and connect the official MCP client to it, over stdio or HTTP."""

from __future__ import annotations

import base64
import ctypes
import json
import os
import select
import socket
import struct
import subprocess
import sys
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio
import docker
import docker.errors
import mcp_types as types
import psutil
from jsonschema import Draft202012Validator
from mcp import Client
from mcp.client.stdio import StdioServerParameters

from sandbox_server.protocol.meta import OWN_NAME_META
from sandbox_server.sandbox.engine.removal import OWNER_LABEL
from sandbox_server.sandbox.runc.state import IN_CREATE, IN_MOVED_TO, STATE, inotify_watch, owner_of
from sandbox_server.sandbox.runc.state import listed as listed_by_runc
from sandbox_server.sandbox.spec import SANDBOX_LABEL
from sandbox_server.tools import all_tools

CHECKED: list[tuple[str, bool]] = []
"""(tool, is_error) of every result the harness validated against its tool's outputSchema, in this test run."""


class CheckedClient(Client):
    """The official client, validating every tool result, isError ones included, against the listed outputSchema.

    The SDK's client validates only successful results; the specification asks that every
    result with structured content conform, so the suite checks refusals and failures too.
    """

    async def call_tool(
        self, name: str, arguments: dict[str, Any] | None = None, *args: Any, **kwargs: Any
    ) -> types.CallToolResult:
        result = await super().call_tool(name, arguments, *args, **kwargs)
        for schema in await self._output_schemas(name):
            check_result(name, result, schema)
        CHECKED.append((name, bool(result.is_error)))
        return result

    async def _output_schemas(self, name: str) -> list[dict[str, Any]]:
        """The listed outputSchema (concise), and the tool's full one, which the listing leaves its bounds out of."""
        cursor = None
        while True:
            page = await self.list_tools(cursor=cursor)
            for tool in page.tools:
                if tool.name == name:
                    assert tool.output_schema is not None, f"tool {name} lists no outputSchema"
                    own = FULL_SCHEMAS.get(str((tool.meta or {}).get(OWN_NAME_META, name)))
                    return [tool.output_schema, *([own] if own is not None else [])]
            cursor = page.next_cursor
            if cursor is None:
                raise AssertionError(f"tool {name} is not listed")


FULL_SCHEMAS = {tool.name: dict(tool.output_schema) for tool in all_tools()}
"""Each tool's full outputSchema, by its own name (a prefixed listing names it in `_meta`)."""


def check_result(name: str, result: types.CallToolResult, schema: dict[str, Any]) -> None:
    """Assert a result carries structuredContent valid against its tool's outputSchema."""
    assert result.structured_content is not None, f"{name}: a result without structuredContent: {result.content}"
    errors = [e.message for e in Draft202012Validator(schema).iter_errors(result.structured_content)]
    assert not errors, (
        f"{name}: structuredContent does not match the outputSchema: {errors}; {result.structured_content}"
    )


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


SERVING = "serving MCP over Streamable HTTP at"
"""What an HTTP server logs once its parts are made (tests wait for it, not for its port, bound before them)."""


class ServerProcess:
    """A running `serve --transport http` child: its URL, process, and the lines of its log."""

    def __init__(self, url: str, process: subprocess.Popen[bytes]) -> None:
        self.url = url
        self.process = process
        self.lines: list[str] = []
        self.ended = False
        """Its log ended: the process is gone."""
        self._changed = threading.Condition()
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        assert self.process.stderr is not None
        for raw in self.process.stderr:
            with self._changed:
                self.lines.append(raw.decode(errors="replace"))
                self._changed.notify_all()
        with self._changed:
            self.ended = True
            self._changed.notify_all()

    def wait_for_line(self, text: str, timeout_s: float = 30, after: int = 0) -> str:
        """Block until the server logs a line containing `text` (among its lines from index `after` on). The
        line comes at once on an idle host; 30 s leaves room for a start the suite's workers side by side hold
        back, and is spent only by a test that fails."""
        with self._changed:
            self._changed.wait_for(lambda: self._line(text, after) is not None or self.ended, timeout_s)
            found = self._line(text, after)
        if found is None:
            within = "before it exited" if self.ended else f"within {timeout_s} s"
            raise AssertionError(f"the server did not log {text!r} {within}; it logged: {self.lines}")
        return found

    def _line(self, text: str, after: int) -> str | None:
        return next((line for line in self.lines[after:] if text in line), None)


@contextmanager
def http_server(*serve_args: str, env: dict[str, str] | None = None) -> Iterator[str]:
    """A `serve --transport http` child process; yields its MCP endpoint URL."""
    with http_server_process(*serve_args, env=env) as server:
        yield server.url


@contextmanager
def http_server_process(*serve_args: str, env: dict[str, str] | None = None) -> Iterator[ServerProcess]:
    """A `serve --transport http` child process, with its log readable."""
    port = free_port()
    process = subprocess.Popen(
        [sys.executable, "-m", "sandbox_server", "serve", "--transport", "http", "--port", str(port), *serve_args],
        env={**os.environ, **(env or {})},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    server: ServerProcess | None = None
    try:
        server = ServerProcess(f"http://127.0.0.1:{port}/mcp", process)
        server.wait_for_line(SERVING)  # its parts made (its state folder held, its pools begun), not only its port
        yield server
    finally:
        stop_server(process)
        if server is not None:
            server.reader.join(timeout=10)  # the log reader ends at the pipe's end of file
        if process.stderr is not None:
            process.stderr.close()


def stdio_parameters(*serve_args: str, env: dict[str, str] | None = None) -> StdioServerParameters:
    """How the client starts the server over stdio."""
    return StdioServerParameters(
        command=sys.executable,
        args=["-m", "sandbox_server", "serve", *serve_args],
        env={**os.environ, **(env or {})},
    )


@asynccontextmanager
async def connect(target: Any, mode: str = "legacy", **options: Any) -> AsyncIterator[CheckedClient]:
    """An initialised official MCP client session (stdio parameters, a URL, or an in-process server)."""
    client = CheckedClient(target, mode=mode, **options)
    async with client:
        yield client


async def answer(client: Client, tool: str, arguments: dict[str, Any]) -> dict[str, Any]:
    """A tool call's answer as one dict: its text, whether it is an error, and its structured content."""
    result = await client.call_tool(tool, arguments)
    assert result.structured_content is not None, text_of(result)
    return {"text": text_of(result), "is_error": result.is_error, **result.structured_content}


TRAILS_OWN = ("audit_seal", "audit_rotated_away")
"""The records a trail writes of itself (its seals, and where rotation left it), among the calls and events."""


def audit_records(path: Path) -> list[dict[str, Any]]:
    """The records of an audit log's one file, oldest first: its calls and the events of tasks, services and
    workspaces, without the trail's own seals and rotation notes."""
    found = [json.loads(line) for line in path.read_text().splitlines()]
    return [record for record in found if record.get("event") not in TRAILS_OWN]


def text_of(result: types.CallToolResult) -> str:
    """The first content block of a tool result, which is always the text a model reads first."""
    block = result.content[0]
    assert isinstance(block, types.TextContent)
    return block.text


def upload(name: str, content: str | bytes) -> list[dict[str, str]]:
    """The `files` argument of a tool call carrying one file, base64-encoded."""
    data = content.encode("utf-8") if isinstance(content, str) else content
    return [{"path": name, "content": base64.b64encode(data).decode(), "encoding": "base64"}]


def close_stream(stream: Any) -> None:
    """Close a streamed answer of the engine's API and the connection under it."""
    stream.close()
    stream._response.close()


def first_sandboxes(api: docker.APIClient, waiting: Callable[[], set[str]], within_s: float = 120) -> set[str]:
    """What `waiting` finds once it finds anything: looked for now, then again each time a sandbox starts (for at
    most `within_s`: the engine ends the event stream then, and the test fails instead of hanging)."""
    until = int(time.time() + within_s)
    events = api.events(filters={"event": "start", "label": SANDBOX_LABEL}, until=until, decode=True)
    try:
        if found := waiting():
            return found
        for _ in events:
            if found := waiting():
                return found
    finally:
        close_stream(events)
    raise AssertionError(f"no such sandbox started within {within_s:g} s (the engine's event stream ended)")


def first_runc_sandboxes(waiting: Callable[[], set[str]], within_s: float = 120) -> set[str]:
    """What `waiting` finds once it finds anything, among the sandboxes runc runs: looked for now, then each time
    runc starts one (it renames its pid file into the sandbox's bundle, seen with inotify), for at most
    `within_s`."""
    libc = ctypes.CDLL(None, use_errno=True)
    bundles = STATE / "bundles"
    bundles.mkdir(parents=True, exist_ok=True)
    watch = inotify_watch(bundles, IN_CREATE)
    folders: dict[int, str] = {}
    deadline = time.monotonic() + within_s
    try:
        while True:
            if found := waiting():
                return found
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([watch], [], [], left)[0]:
                raise AssertionError(f"no such sandbox started within {within_s:g} s")
            events = os.read(watch, 65536)
            while events:  # struct inotify_event: wd, mask, cookie, len, then the name
                folder, _mask, _cookie, size = struct.unpack_from("iIII", events)
                name = events[16 : 16 + size].rstrip(b"\0").decode()
                events = events[16 + size :]
                if folder not in folders and name:  # a new bundle: its pid file is watched for
                    added = libc.inotify_add_watch(watch, os.fsencode(bundles / name), IN_MOVED_TO)
                    folders[added] = name
    finally:
        os.close(watch)


@dataclass
class Person:
    """Stands for the person a client asks (its elicitation callback): answers every question with `answer`, and
    remembers what it was shown."""

    answer: str = "accept"
    shown: list[str] = field(default_factory=list)

    async def __call__(self, context: Any, params: types.ElicitRequestParams) -> types.ElicitResult:
        assert isinstance(params, types.ElicitRequestFormParams)
        self.shown.append(params.message)
        return types.ElicitResult(action=self.answer, content={} if self.answer == "accept" else None)  # type: ignore[arg-type]


async def preloaded(
    api: docker.APIClient, server: str | Path, image: str = "sandbox-server/python-data:latest"
) -> None:
    """Until every waiting container of `image` that the server whose command line holds `server` (a path of the
    test's own) made has imported all its interpreter preloads, and there is at least one (a call that comes
    sooner stops the preloading, and the imports left are the program's, on its clock). Other servers of the
    suite keep pools of their own: theirs say nothing of this one's."""
    with anyio.fail_after(60):
        while True:
            said = []
            for listed in api.containers(filters={"label": SANDBOX_LABEL, "ancestor": image}):
                if not _made_by(listed["Labels"].get(OWNER_LABEL, ""), str(server)):
                    continue
                try:
                    reading = api.exec_create(listed["Id"], ["cat", "/tmp/.sandbox-warm/errors"], user="1000:1000")
                    said.append(api.exec_start(reading))
                except docker.errors.APIError:  # a used one, being removed
                    continue
            unpacked = str(api.inspect_image(image)["Id"]).removeprefix("sha256:")[:24]
            for name in listed_by_runc(STATE):  # and the sandboxes runc runs itself, read through their init's root
                bundle = STATE / "bundles" / name
                try:
                    if (
                        not _made_by(owner_of(name), str(server))
                        or unpacked not in (bundle / "config.json").read_text()
                    ):
                        continue  # another server's, or another image's
                    if not (bundle / "pid").exists():
                        said.append(b"")  # made, not started yet: not ready either
                        continue
                    root = Path(f"/proc/{int((bundle / 'pid').read_text())}/root")
                    if not root.is_dir():
                        continue  # a used one, being removed
                except (OSError, ValueError):  # removed meanwhile
                    continue
                try:
                    said.append((root / "tmp/.sandbox-warm/errors").read_bytes())
                except OSError:  # started, its launcher not there yet: as the engine's exec says, not ready
                    said.append(b"")
            if said and all(b"preloaded in" in text and b"a call came" not in text for text in said):
                return
            await anyio.sleep(0.1)


def command_of(process: psutil.Process) -> list[str]:
    """A process's command line ([] for one that ended meanwhile: a zombie not yet reaped, or gone)."""
    try:
        return process.cmdline()
    except psutil.Error:
        return []


def _made_by(owner: str, server: str) -> bool:
    """Whether an owner label names a live process of this host whose command line holds `server`."""
    _, _, rest = owner.partition(":")
    try:
        return any(server in part for part in psutil.Process(int(rest.partition(":")[0])).cmdline())
    except (ValueError, psutil.Error):
        return False


def stop_server(process: subprocess.Popen[bytes]) -> None:
    """Stop a server as a supervisor that does not wait for it to drain: SIGTERM (an HTTP server then lets what
    runs finish, for up to serve --grace-s), SIGTERM again a moment later (stop now), SIGKILL after 30 s (a
    server that stops takes a second or two, or more while the suite's workers hold the host busy; one killed
    leaves its mounts behind, which the test's folder check reports)."""
    process.terminate()
    try:
        process.wait(timeout=1)
    except subprocess.TimeoutExpired:
        process.terminate()
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
