"""The Streamable HTTP transport binds to loopback and refuses foreign origins."""

from collections.abc import Iterator

import httpx2
import pytest

from sandbox_server.sandbox.docker_runtime import DockerRuntime
from tests.mcp_harness import http_server

INITIALIZE = {
    "jsonrpc": "2.0",
    "id": 1,
    "method": "initialize",
    "params": {"protocolVersion": "2025-11-25", "capabilities": {}, "clientInfo": {"name": "t", "version": "1"}},
}
HEADERS = {"Accept": "application/json, text/event-stream", "Content-Type": "application/json"}


@pytest.fixture(scope="module")
def url(runtime: DockerRuntime) -> Iterator[str]:
    """A fresh HTTP server for these tests."""
    with http_server() as endpoint:
        yield endpoint


def test_a_foreign_origin_is_refused(url: str) -> None:
    response = httpx2.post(url, json=INITIALIZE, headers={**HEADERS, "Origin": "http://evil.example"}, timeout=10)
    assert response.status_code == 403


def test_a_loopback_origin_is_served(url: str) -> None:
    origin = url.rsplit("/", 1)[0]
    response = httpx2.post(url, json=INITIALIZE, headers={**HEADERS, "Origin": origin}, timeout=10)
    assert response.status_code == 200
    assert "sandbox-server" in response.text


def test_a_taken_port_is_said_in_one_line_naming_the_option(runtime: DockerRuntime) -> None:
    import socket

    from tests.conftest import run_cli

    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        result = run_cli("serve", "--transport", "http", "--port", str(port), "--no-pool", timeout_s=60)
    assert result.returncode == 1
    assert "Traceback" not in result.stderr and result.stderr.count("\n") == 1, result.stderr
    assert f"cannot listen on 127.0.0.1:{port}: Address already in use" in result.stderr and "--port" in result.stderr


@pytest.mark.parametrize("stop", ["SIGINT", "SIGTERM"])
def test_a_normal_stop_is_quiet_and_the_log_names_the_url(stop: str, runtime: DockerRuntime) -> None:
    import signal

    import anyio

    from tests.mcp_harness import connect, http_server_process

    async def one_call(url: str) -> None:
        async with connect(url) as session:
            result = await session.call_tool("execute_command", {"command": "echo served"})
            assert result.structured_content is not None and result.structured_content["stdout"] == "served\n"

    with http_server_process("--no-pool") as server:
        server.wait_for_line(f"serving MCP over Streamable HTTP at {server.url}")
        anyio.run(one_call, server.url)
        server.process.send_signal(getattr(signal, stop))
        assert server.process.wait(timeout=30) == 0
        server.reader.join(timeout=10)
    log = "".join(server.lines)
    assert f"{stop}: shutting down" in log and "Traceback" not in log and "Error" not in log, log
