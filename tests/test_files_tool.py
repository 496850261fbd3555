"""The `files` tool: read with line numbers and ranges, write, edit by exact match with the diff back, find and
grep, on the workspace the shell's calls use; every refusal names its field."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from sandbox_server.sandbox.engine.runtime import DockerRuntime
from tests.mcp_harness import CheckedClient, answer, connect, stdio_parameters

pytestmark = pytest.mark.anyio

SMALL = """\
extends: default
defaults:
  limits: {input_file_bytes: 4096, output_bytes: 20000}
"""


async def _files(session: CheckedClient, **arguments: Any) -> dict[str, Any]:
    return await answer(session, "files", arguments)


async def test_an_agent_reads_writes_edits_finds_and_greps_the_workspace_its_shell_uses(
    tmp_path: Path, runtime: DockerRuntime
) -> None:
    async with connect(stdio_parameters("--state-dir", str(tmp_path / "state"))) as session:
        written = await _files(
            session, action="write", path="pkg/calc.py", content="def add(a, b):\n    return a - b\n"
        )
        await answer(
            session,
            "execute_command",
            {"command": "mkdir -p tests && printf 'from pkg.calc import add\\n' > tests/t.py"},
        )
        found = await _files(session, action="find", pattern="**/*.py")
        grepped = await _files(session, action="grep", pattern=r"return a [-+] b")
        edited = await _files(session, action="edit", path="pkg/calc.py", old="a - b", new="a + b")
        shell_sees = await answer(session, "execute_command", {"command": "cat pkg/calc.py"})
        again = await _files(session, action="write", path="/workspace/pkg/calc.py", content="x\n" * 50)
        part = await _files(session, action="read", path="pkg/calc.py", offset=10, limit=3)
    assert written["created"] and written["size"] == 32, written
    assert written["changes"]["created"] == ["pkg/calc.py"] and edited["changes"]["modified"] == ["pkg/calc.py"]
    for looked in (found, grepped, part):  # a read, find or grep changes nothing, and is not walked for changes
        assert not any(looked["changes"][kind] for kind in ("created", "modified", "deleted", "renamed")), looked
    assert found["paths"] == ["pkg/calc.py", "tests/t.py"], found
    assert grepped["matches"] == [{"path": "pkg/calc.py", "line": 2, "text": "    return a - b"}], grepped
    assert edited["diff"].splitlines() == [
        "--- a/pkg/calc.py",
        "+++ b/pkg/calc.py",
        "@@ -1,2 +1,2 @@",
        " def add(a, b):",
        "-    return a - b",
        "+    return a + b",
    ], edited["diff"]
    assert "+    return a + b" in edited["text"]
    assert shell_sees["stdout"] == "def add(a, b):\n    return a + b\n"
    assert again["created"] is False
    assert part["content"] == "    10\tx\n    11\tx\n    12\tx" and part["lines"] == 50 and part["more"] is True
    assert "read on with offset 13" in part["text"] and part["text"].startswith("pkg/calc.py: lines 10-12 of 50")


async def test_each_refusal_names_its_field(tmp_path: Path, runtime: DockerRuntime) -> None:
    policy = tmp_path / "small.yaml"
    policy.write_text(SMALL)
    serve = ("--policy", str(policy), "--state-dir", str(tmp_path / "state"))
    async with connect(stdio_parameters(*serve)) as session:
        await _files(session, action="write", path="a.txt", content="same\nsame\nonce\n")
        twice = await _files(session, action="edit", path="a.txt", old="same", new="other")
        missing = await _files(session, action="edit", path="a.txt", old="absent", new="x")
        outside = await _files(session, action="read", path="../etc/passwd")
        absolute = await _files(session, action="read", path="/etc/passwd")
        too_big = await _files(session, action="write", path="big.txt", content="x" * 5000)
        no_old = await _files(session, action="edit", path="a.txt", new="x")
        folder = await _files(session, action="read", path="/workspace")
        kept = await _files(session, action="read", path="a.txt")
    assert twice["is_error"] and twice["error"]["field"] == "old" and "2 times (lines 1, 2)" in twice["text"]
    assert missing["error"]["field"] == "old" and "not in a.txt" in missing["text"]
    for refused in (outside, absolute):
        assert refused["is_error"] and refused["error"]["field"] == "path", refused
    assert too_big["error"]["field"] == "limits.input_file_bytes" and "4096" in too_big["text"]
    assert no_old["error"]["field"] == "old"
    assert folder["error"]["field"] == "path" and "is a folder" in folder["text"]
    assert kept["content"] == "     1\tsame\n     2\tsame\n     3\tonce"  # nothing was changed by the refusals


async def test_a_link_out_of_the_workspace_reads_the_sandboxs_own_files_never_the_hosts(
    tmp_path: Path, runtime: DockerRuntime
) -> None:
    secret = tmp_path / "host-secret.txt"
    secret.write_text("the host's own\n")
    async with connect(stdio_parameters("--state-dir", str(tmp_path / "state"))) as session:
        await answer(session, "execute_command", {"command": f"ln -s {secret} leak && ln -s /etc/hostname name"})
        leak = await _files(session, action="read", path="leak")
        write_through = await _files(session, action="write", path="name", content="mine\n")
    assert leak["is_error"] and "does not exist" in leak["text"]
    assert write_through["is_error"] and write_through["error"]["field"] == "path"
    assert secret.read_text() == "the host's own\n"
