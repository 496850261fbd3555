"""Spans over OTLP: a server given `--otlp-endpoint` sends each call's spans (the call, its admission, workspace,
container and proxy) to the test's own OTLP/HTTP receiver on loopback, which decodes them with the protocol's own
messages. The call reaches the test's own upstream through the proxy (tests/upstreams)."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import anyio
import anyio.to_thread
import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)

from tests.mcp_harness import connect, stdio_parameters, text_of
from tests.upstreams import Upstreams, shell_network, upstreams_fixture  # noqa: F401 (the upstreams fixture)

pytestmark = pytest.mark.anyio


class Receiver:
    """An OTLP/HTTP trace receiver: every span it was sent, as (name, span id, parent id, trace id, attributes)."""

    def __init__(self) -> None:
        self.spans: list[dict[str, Any]] = []
        self.arrived = threading.Condition()
        self.bodies: list[bytes] = []

    def take(self, body: bytes) -> None:
        request = ExportTraceServiceRequest.FromString(body)
        with self.arrived:
            self.bodies.append(body)
            for resource in request.resource_spans:
                service = {a.key: a.value.string_value for a in resource.resource.attributes}
                for scope in resource.scope_spans:
                    for span in scope.spans:
                        attributes = {a.key: _value(a.value) for a in span.attributes}
                        self.spans.append({
                            "name": span.name, "id": span.span_id.hex(), "parent": span.parent_span_id.hex(),
                            "trace": span.trace_id.hex(), "attributes": attributes, "service": service,
                        })  # fmt: skip
            self.arrived.notify_all()

    def wait_for(self, name: str, timeout_s: float) -> bool:
        with self.arrived:
            return self.arrived.wait_for(lambda: any(s["name"] == name for s in self.spans), timeout_s)


def _value(value: Any) -> Any:
    kind = value.WhichOneof("value")
    return getattr(value, kind) if kind else None


@pytest.fixture
def receiver() -> Iterator[tuple[Receiver, str]]:
    received = Receiver()

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
            if self.path == "/v1/traces":
                received.take(body)
            answer = ExportTraceServiceResponse().SerializeToString()
            self.send_response(200 if self.path == "/v1/traces" else 404)
            self.send_header("Content-Type", "application/x-protobuf")
            self.send_header("Content-Length", str(len(answer)))
            self.end_headers()
            self.wfile.write(answer)

        def log_message(self, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield received, f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


async def test_each_call_sends_its_span_and_its_steps_spans_and_never_its_arguments(
    receiver: tuple[Receiver, str],
    upstreams: Upstreams,
    tmp_path: Path,
) -> None:
    received, endpoint = receiver
    policy = tmp_path / "traced.yaml"
    policy.write_text(json.dumps({"name": "traced", "extends": "default",
                                  "tools": {"execute_command": {"network": shell_network(upstreams)}}}))  # fmt: skip
    parameters = stdio_parameters(
        "--policy", str(policy), "--otlp-endpoint", endpoint, env={"OTEL_BSP_SCHEDULE_DELAY": "100"}
    )
    async with connect(parameters) as client:
        fetched = await client.call_tool("execute_command", {"command": "curl -sS -m 10 http://web.test/secret-path"})
        assert not fetched.is_error and "hello from web /secret-path" in text_of(fetched), text_of(fetched)
        refused = await client.call_tool("analyze_csv", {"filepath": "/etc/passwd", "operations": ["count"]})
        assert refused.is_error
        found = await anyio.to_thread.run_sync(received.wait_for, "tools/call analyze_csv", 30)
        assert found, [s["name"] for s in received.spans]

    calls = {s["attributes"]["sandbox.tool"]: s for s in received.spans if s["name"].startswith("tools/call ")}
    shell = calls["execute_command"]
    assert shell["service"]["service.name"] == "sandbox-server" and shell["parent"] == ""
    assert shell["attributes"]["sandbox.outcome"] == "ok" and shell["attributes"]["sandbox.policy"] == "traced"
    assert shell["attributes"]["sandbox.usage.network_in_bytes"] > 0
    assert shell["attributes"]["sandbox.usage.cpu_s"] >= 0
    steps = {s["name"] for s in received.spans if s["parent"] == shell["id"] and s["trace"] == shell["trace"]}
    assert {"admission", "workspace", "container", "proxy"} <= steps, steps
    assert calls["analyze_csv"]["attributes"]["sandbox.outcome"] == "refused"
    assert calls["analyze_csv"]["attributes"]["sandbox.field"] == "mounts"  # /etc is no readable root
    # Names, ids and numbers only: the command, its path and its output are in no span.
    assert all(b"secret-path" not in body and b"/etc/passwd" not in body for body in received.bodies)
