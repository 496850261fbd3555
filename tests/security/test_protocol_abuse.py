"""Protocol-level abuse sent raw to the server, past what the SDK's own client would send."""

from __future__ import annotations

import json
import subprocess
import threading
from typing import Any

from tests.mcp_harness import stdio_parameters


def test_32_deeply_nested_json_is_refused_and_the_server_lives(runtime: object) -> None:
    """Sent raw (the SDK's own client refuses to serialise it): never run, and the server answers the next request.

    The SDK's stdio transport drops a line it cannot parse without a -32700 answer; if it
    answers, the answer must be an error.
    """
    depth = 100_000
    deep = '{"jsonrpc":"2.0","id":2,"method":"tools/call","params":{"name":"execute_command","arguments":' \
        '{"command":"true","args":' + "[" * depth + "]" * depth + "}}}"  # fmt: skip
    lines = [
        json.dumps({"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": {
            "protocolVersion": "2025-06-18", "capabilities": {}, "clientInfo": {"name": "battery", "version": "1"}}}),
        json.dumps({"jsonrpc": "2.0", "method": "notifications/initialized"}),
        deep,
        json.dumps({"jsonrpc": "2.0", "id": 3, "method": "tools/list"}),
    ]  # fmt: skip
    parameters = stdio_parameters("--no-pool")
    server = subprocess.Popen(
        [parameters.command, *parameters.args], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL, text=True,
    )  # fmt: skip
    answers: dict[object, dict[str, Any]] = {}
    watchdog = threading.Timer(60, server.kill)  # a server that neither answers nor exits fails the test
    watchdog.start()
    try:
        assert server.stdin is not None and server.stdout is not None
        server.stdin.write("\n".join(lines) + "\n")
        server.stdin.flush()
        # Read until the request after the deep one is answered; stdin stays open meanwhile,
        # since closing it ends the session and may cut a request short.
        for line in server.stdout:
            message = json.loads(line)
            answers[message.get("id")] = message
            if 3 in answers:
                break
    finally:
        watchdog.cancel()
        server.stdin.close()  # type: ignore[union-attr]
        server.wait(timeout=30)
        server.stdout.close()  # type: ignore[union-attr]
    refused: Any = answers.get(2) or answers.get(None)  # a parse error carries no id
    assert refused is None or "error" in refused or refused["result"]["isError"], refused
    assert [tool["name"] for tool in answers[3]["result"]["tools"]] == [
        "analyze_csv",
        "execute_command",
        "run_python",
        "services",
    ]
