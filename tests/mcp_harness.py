"""Start the real server and connect the official MCP client to it, over stdio or HTTP."""

from __future__ import annotations

import base64
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager

import mcp_types as types
from mcp import Client
from mcp.client.stdio import StdioServerParameters


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


class ServerProcess:
    """A running `serve --transport http` child: its URL, process, and the lines of its log."""

    def __init__(self, url: str, process: subprocess.Popen[bytes]) -> None:
        self.url = url
        self.process = process
        self.lines: list[str] = []
        self._changed = threading.Condition()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.process.stderr is not None
        for raw in self.process.stderr:
            with self._changed:
                self.lines.append(raw.decode(errors="replace"))
                self._changed.notify_all()

    def wait_for_line(self, text: str, timeout_s: float = 10) -> str:
        """Block until the server logs a line containing `text`."""
        with self._changed:
            found = self._changed.wait_for(lambda: next((l for l in self.lines if text in l), None), timeout_s)
        if not found:
            raise AssertionError(f"the server did not log {text!r} within {timeout_s} s; it logged: {self.lines}")
        return found


@contextmanager
def http_server(*serve_args: str, env: dict[str, str] | None = None) -> Iterator[str]:
    """A `serve --transport http` child process; yields its MCP endpoint URL."""
    with http_server_process(*serve_args, env=env) as server:
        yield server.url


@contextmanager
def http_server_process(*serve_args: str, env: dict[str, str] | None = None) -> Iterator[ServerProcess]:
    """A `serve --transport http` child process, with its log readable."""
    port = _free_port()
    process = subprocess.Popen(
        [sys.executable, "-m", "sandbox_server", "serve", "--transport", "http", "--port", str(port), *serve_args],
        env={**os.environ, **(env or {})},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    server: ServerProcess | None = None
    try:
        deadline = time.monotonic() + 30
        while True:
            if process.poll() is not None:
                raise RuntimeError(f"server exited: {process.stderr.read().decode() if process.stderr else ''}")
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise RuntimeError("HTTP server did not start listening within 30 s") from None
                time.sleep(0.05)
        server = ServerProcess(f"http://127.0.0.1:{port}/mcp", process)
        yield server
    finally:
        process.terminate()
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        if server is not None:
            server._reader.join(timeout=10)  # the log reader ends at the pipe's end of file
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
async def connect(target: StdioServerParameters | str, mode: str = "legacy") -> AsyncIterator[Client]:
    """An initialised official MCP client session."""
    async with Client(target, mode=mode) as client:  # type: ignore[arg-type]
        yield client


def text_of(result: types.CallToolResult) -> str:
    """The first content block of a tool result, which is always the text a model reads first."""
    block = result.content[0]
    assert isinstance(block, types.TextContent)
    return block.text


def upload(name: str, content: str | bytes) -> list[dict[str, str]]:
    """The `files` argument of a tool call carrying one file, base64-encoded."""
    data = content.encode("utf-8") if isinstance(content, str) else content
    return [{"path": name, "content": base64.b64encode(data).decode(), "encoding": "base64"}]
