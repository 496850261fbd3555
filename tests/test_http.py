"""The Streamable HTTP transport binds to loopback and refuses foreign origins; callers past the cap wait."""

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import httpx2
import pytest

from sandbox_server.sandbox.engine.runtime import DockerRuntime
from tests.mcp_harness import connect, http_server, text_of

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


QUEUED = "extends: default\nrate: {concurrent_calls: 1, queue_wait_s: 30, queue_length: %(length)d}\n"


async def _at_once(url: str, callers: int) -> list[tuple[Any, list[str]]]:
    """One `sleep 1` call from each of `callers` clients at once (2026-07-28 era): each result, and the progress
    messages its caller heard."""
    answers: list[tuple[Any, list[str]]] = []

    async def caller() -> None:
        heard: list[str] = []

        async def on_progress(progress: float, total: float | None, message: str | None) -> None:
            heard.append(message or "")

        async with connect(url, mode="2026-07-28") as client:
            result = await client.call_tool("execute_command", {"command": "sleep 1"}, progress_callback=on_progress)
        answers.append((result, heard))

    async with anyio.create_task_group() as group:
        for _ in range(callers):
            group.start_soon(caller)
    return answers


@pytest.mark.anyio
async def test_calls_past_the_cap_wait_their_turn_and_a_full_queue_refuses_saying_its_length(
    tmp_path: Path, runtime: DockerRuntime
) -> None:
    policy = tmp_path / "queued.yaml"
    policy.write_text(QUEUED % {"length": 8})
    with http_server("--policy", str(policy), "--state-dir", str(tmp_path / "state")) as url:
        queued = await _at_once(url, 3)
    assert not any(result.is_error for result, _ in queued), [text_of(result) for result, _ in queued]
    assert any(any("waiting for a slot" in message for message in heard) for _, heard in queued)
    policy.write_text(QUEUED % {"length": 1})
    with http_server("--policy", str(policy), "--state-dir", str(tmp_path / "state")) as url:
        full = await _at_once(url, 3)
    refused = [result for result, _ in full if result.is_error]
    assert len(refused) == 1, [text_of(result) for result, _ in full]  # one runs, one waits, the third is refused
    error = (refused[0].structured_content or {})["error"]
    assert error["field"] == "rate.queue_length" and "1 calls waiting" in text_of(refused[0]), text_of(refused[0])
