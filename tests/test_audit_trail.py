"""The audit trail a real server writes holds its chain, checked by `sandbox-server audit verify` while the server
runs and after; lines edited, removed or added in a copy are found where they are."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from sandbox_server.access.audit_verify import trail_files
from sandbox_server.sandbox.engine.runtime import DockerRuntime
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


async def test_a_servers_trail_is_sealed_and_a_rewrite_with_every_link_recomputed_is_found(
    tmp_path: Path, runtime: DockerRuntime
) -> None:
    """The holes of a trail its writer can rewrite: with the links recomputed an edit passed `audit verify`, and
    `usage` counted a forged caller without a word. The server seals its trail; the key to verify it is written once,
    beside it, for the operator to move elsewhere."""
    from sandbox_server.access.audit import CHAIN_FIELD, FIRST, line_digest
    from sandbox_server.access.audit_seal import SealingKey, sealing_key_path
    from sandbox_server.access.audit_verify import verify_trail

    audit = tmp_path / "trail" / "audit.jsonl"
    policy = tmp_path / "sealed.yaml"
    policy.write_text("extends: default\naudit: {seal_interval_s: 1}\n")
    async with connect(stdio_parameters("--policy", str(policy), "--audit-log", str(audit))) as session:
        for number in range(4):
            await session.call_tool("execute_command", {"command": f"echo {number}"})
    key_file = tmp_path / "trail" / "audit.jsonl.verification-key"
    assert oct(key_file.stat().st_mode & 0o777) == "0o400"
    moved = tmp_path / "elsewhere.key"
    moved.write_text(key_file.read_text())  # kept off the machine, as the log says
    key_file.unlink()
    said = run_cli("audit", "verify", str(audit), "--key", str(moved), "--json")
    verdict = json.loads(said.stdout)
    assert said.returncode == 0 and verdict["holds"] and verdict["seals"] >= 1, verdict
    assert verdict["unvouched_lines"] == 0, verdict  # the last lines sealed as the server stopped
    assert verdict["sealed_through"]["line"] == verdict["lines"], verdict
    plain = run_cli("audit", "verify", str(audit), "--key", str(moved))
    assert f"sealed through audit.jsonl line {verdict['lines']}, 0 line(s) after it" in plain.stdout, plain.stdout

    lines = audit.read_text().splitlines(keepends=True)
    calls = [n for n, line in enumerate(lines) if '"tool":"execute_command"' in line]
    rewritten, previous = [], FIRST
    for number, line in enumerate(lines):  # the first call's caller changed, every link after it recomputed
        record = json.loads(line) | {CHAIN_FIELD: previous}
        if number == calls[0]:
            record["client"] = "mallory"
        text = json.dumps(record, separators=(",", ":"))
        rewritten.append(text + "\n")
        previous = line_digest(text.encode())
    audit.write_text("".join(rewritten))
    writer = SealingKey.load(sealing_key_path(audit))
    assert writer is not None
    found = verify_trail(audit)
    assert "the last seal is gone" in found.breaks[0].reason, found.breaks  # the writer's key names the old seal
    writer.sealed_line = previous if '"audit_seal"' in rewritten[-1] else writer.sealed_line
    writer.save()  # as an intruder holding the machine would: its key is the writer's
    unkeyed = run_cli("audit", "verify", str(audit))
    assert unkeyed.returncode == 0, unkeyed.stdout  # the chain alone is fooled, and says its seals were not checked
    assert "not checked: no verification key (--key)" in unkeyed.stdout, unkeyed.stdout
    keyed = run_cli("audit", "verify", str(audit), "--key", moved.read_text().strip())
    assert keyed.returncode == 1 and "does not hold: a line before it was changed" in keyed.stdout, keyed.stdout
    usage = run_cli("usage", "--audit-log", str(audit))
    assert usage.returncode == 0 and "were not checked (no verification key beside it)" in usage.stderr, usage.stderr
    key_file.write_text(moved.read_text())  # the key beside the trail: usage and replay check the seals and warn
    usage = run_cli("usage", "--audit-log", str(audit))
    assert "warning: the audit trail at" in usage.stderr and "does not hold" in usage.stderr, usage.stderr
    replayed = run_cli("policy", "replay", str(audit), "--policy", "default")
    assert "warning: the audit trail at" in replayed.stderr, replayed.stderr
