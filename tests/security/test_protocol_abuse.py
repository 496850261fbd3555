"""Protocol-level abuse sent raw to the server, past what the SDK's own client would send."""

from __future__ import annotations

import json
import subprocess

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
    done = subprocess.run(
        [parameters.command, *parameters.args], input="\n".join(lines) + "\n", capture_output=True, text=True,
        timeout=60,
    )  # fmt: skip
    answers = {message.get("id"): message for message in map(json.loads, done.stdout.splitlines())}
    refused = answers.get(2) or answers.get(None)  # a parse error carries no id
    assert refused is None or "error" in refused or refused["result"]["isError"], refused
    assert [tool["name"] for tool in answers[3]["result"]["tools"]] == ["analyze_csv", "execute_command", "run_python"]
