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
