"""Protocol-level abuse sent raw to the server, past what the SDK's own client would send."""

from __future__ import annotations

import json
import subprocess
import threading
from typing import Any

from tests.mcp_harness import stdio_parameters

HANDSHAKE = [
    json.dumps({"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": {
        "protocolVersion": "2025-06-18", "capabilities": {}, "clientInfo": {"name": "battery", "version": "1"}}}),
    json.dumps({"jsonrpc": "2.0", "method": "notifications/initialized"}),
]  # fmt: skip


def _exchange(lines: list[str], last_id: int) -> list[dict[str, Any]]:
    """Send a stdio server the handshake and `lines` raw; its answers, in order, until the one to `last_id`.

    Stdin stays open meanwhile, since closing it ends the session and may cut a request short; a server that
    neither answers nor exits is killed after 60 s, failing the test."""
    parameters = stdio_parameters("--no-pool")
    server = subprocess.Popen(
        [parameters.command, *parameters.args], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL, text=True,
    )  # fmt: skip
    answers: list[dict[str, Any]] = []
    watchdog = threading.Timer(60, server.kill)
    watchdog.start()
    try:
        assert server.stdin is not None and server.stdout is not None
        server.stdin.write("\n".join([*HANDSHAKE, *lines]) + "\n")
        server.stdin.flush()
        for line in server.stdout:
            answers.append(json.loads(line))
            if answers[-1].get("id") == last_id:
                break
    finally:
        watchdog.cancel()
        server.stdin.close()  # type: ignore[union-attr]
        server.wait(timeout=30)
        server.stdout.close()  # type: ignore[union-attr]
    return answers


def test_32_deeply_nested_json_is_refused_and_the_server_lives(runtime: object) -> None:
    """Sent raw (the SDK's own client refuses to serialise it): never run, and the server answers the next request.

    If it answers the deep line, the answer must be an error (the next test says which)."""
    depth = 100_000
    deep = '{"jsonrpc":"2.0","id":2,"method":"tools/call","params":{"name":"execute_command","arguments":' \
        '{"command":"true","args":' + "[" * depth + "]" * depth + "}}}"  # fmt: skip
    by_id = {
        answer.get("id"): answer
        for answer in _exchange([deep, json.dumps({"jsonrpc": "2.0", "id": 3, "method": "tools/list"})], 3)
    }
    refused: Any = by_id.get(2) or by_id.get(None)  # a parse error carries no id
    assert refused is None or "error" in refused or refused["result"]["isError"], refused
    assert [tool["name"] for tool in by_id[3]["result"]["tools"]] == [
        "analyze_csv",
        "execute_command",
        "files",
        "run_python",
        "services",
        "workspaces",
    ]


def test_every_unreadable_message_over_stdio_is_answered_with_the_json_rpc_error_and_the_server_stays_up(
    runtime: object,
) -> None:
    """Malformed JSON, 20,000-deep JSON, a lone surrogate, a batch of 500 requests and a bare string: each answered
    (-32700 for what does not parse, -32600 for what is not a message), in order, and the next request too."""
    batch = json.dumps([{"jsonrpc": "2.0", "id": 100 + n, "method": "ping"} for n in range(500)])
    unreadable = [
        ('{"jsonrpc": "2.0", "id": 2, "method": ', -32700),
        ("[" * 20_000 + "]" * 20_000, -32700),
        ('{"jsonrpc":"2.0","id":3,"method":"tools/list","params":{"cursor":"\\ud800"}}', -32700),
        (batch, -32600),
        ('"just a string"', -32600),
        ('{"jsonrpc": "2.0", "id": 4, "method": 5}', -32600),
    ]
    tools = json.dumps({"jsonrpc": "2.0", "id": 9, "method": "tools/list"})
    answers = _exchange([*(line for line, _ in unreadable), tools], 9)
    errors = [a for a in answers if a.get("id") is None and "error" in a]
    assert [e["error"]["code"] for e in errors] == [code for _, code in unreadable], errors
    assert "batch" in errors[3]["error"]["message"], errors[3]
    assert not [a for a in answers if isinstance(a.get("id"), int) and 100 <= a["id"] < 600]  # no batch member ran
    assert len(answers[-1]["result"]["tools"]) == 6, answers[-1]
