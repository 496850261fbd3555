"""The audit trail a real server writes holds its chain, checked by `sandbox-server audit verify` while the server
runs and after; lines edited, removed or added in a copy are found where they are."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from sandbox_server.access.audit_verify import trail_files
from sandbox_server.sandbox.docker_runtime import DockerRuntime
from tests.conftest import run_cli
from tests.mcp_harness import connect, stdio_parameters

pytestmark = pytest.mark.anyio


async def test_a_servers_trail_holds_and_an_edit_a_deletion_and_an_insertion_are_each_found(
    tmp_path: Path, runtime: DockerRuntime
) -> None:
    audit = tmp_path / "audit.jsonl"
    policy = tmp_path / "small.yaml"
    policy.write_text("extends: default\naudit: {max_bytes: 4096, keep: 9}\ndefaults: {limits: {timeout_s: 2}}\n")
    async with connect(stdio_parameters("--policy", str(policy), "--audit-log", str(audit))) as session:
        for number in range(6):
            await session.call_tool("execute_command", {"command": f"echo {number}"})
        await session.call_tool("execute_command", {"command": "sleep 5"})  # timed out: a refusal's line too
        await session.call_tool("execute_command", {"command": "exit 3"})
        running = run_cli("audit", "verify", str(audit))  # while the server holds the trail
        assert running.returncode == 0 and running.stdout.startswith("the chain holds: "), running.stdout
    files = trail_files(audit)
    assert len(files) >= 2, files  # rotated by size on the way
    after = run_cli("audit", "verify", str(audit), "--json")
    verdict = json.loads(after.stdout)
    assert after.returncode == 0 and verdict["holds"] and verdict["lines"] >= 8, verdict
    assert verdict["files"] == [file.name for file in files]
    lines = [line for file in files for line in file.read_text().splitlines(keepends=True)]  # one file, in order
    for name, text, line in (
        ("edited", lines[:3] + [lines[3].replace('"outcome":"', '"outcome":"x')] + lines[4:], 5),
        ("deleted", lines[:3] + lines[4:], 4),
        ("inserted", lines[:3] + [lines[2]] + lines[3:], 4),  # line 3 again, after itself: its link is to line 2
    ):
        copy = tmp_path / name / "audit.jsonl"
        copy.parent.mkdir()
        copy.write_text("".join(text))
        said = run_cli("audit", "verify", str(copy))
        assert said.returncode == 1, (name, said.stdout)
        assert said.stdout.splitlines()[0].startswith(f"broken at audit.jsonl line {line}: does not follow line "), (
            name, said.stdout,
        )  # fmt: skip
