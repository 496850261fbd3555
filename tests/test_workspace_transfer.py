"""A kept workspace exported to one file and imported into another state folder (`sandbox-server workspace
export/import`), between the two ways of keeping: its files and run_python's variables arrive byte-equal; a
folder a server holds is refused, and so is an archive that is not a whole export."""

from __future__ import annotations

import base64
import io
import json
import os
import tarfile
from pathlib import Path
from typing import Any

import pytest

from sandbox_server.sandbox.engine.runtime import DockerRuntime
from sandbox_server.workspaces.transfer import write_export
from tests.conftest import run_cli
from tests.mcp_harness import CheckedClient, connect, stdio_parameters, text_of

pytestmark = pytest.mark.anyio

KEEPING = "extends: default\nworkspace: {persist: true, size_mb: 16, files: 2000}\n"
DIGEST = "sha256sum blob d/x.bin | cut -c1-64"


async def _call(session: CheckedClient, tool: str, **arguments: Any) -> dict[str, Any]:
    result = await session.call_tool(tool, arguments)
    assert result.structured_content is not None, text_of(result)
    return {**result.structured_content, "is_error": result.is_error, "text": text_of(result)}


def _where(policy: Path, state: Path, kind: str) -> tuple[str, ...]:
    return ("--policy", str(policy), "--state-dir", str(state), "--workspaces", kind)


@pytest.mark.parametrize(("source", "target"), [("mounted", "archived"), ("archived", "mounted")])
async def test_an_exported_workspace_imported_elsewhere_holds_its_files_and_variables_byte_equal(
    source: str, target: str, tmp_path: Path, runtime: DockerRuntime
) -> None:
    policy, archive = tmp_path / "keeping.yaml", tmp_path / "trip.tar.zst"
    policy.write_text(KEEPING)
    one, two = _where(policy, tmp_path / "one", source), _where(policy, tmp_path / "two", target)
    async with connect(stdio_parameters(*one)) as session:
        made = await _call(
            session, "execute_command",
            command=f"head -c 300000 /dev/urandom > blob; chmod +x blob; mkdir d; head -c 5000 /dev/urandom > d/x.bin; {DIGEST}",
        )  # fmt: skip
        await _call(session, "run_python", code="kept = {'rows': [1, 2, 3]}\nimport numpy as np\narr = np.arange(5)")
        await _call(session, "workspaces", action="keep", name="trip")
        held = run_cli("workspace", "export", "trip", "-o", str(archive), *one)
    exported = run_cli("workspace", "export", "trip", "-o", str(archive), *one)
    imported = run_cli("workspace", "import", str(archive), "--name", "trip", *two)
    listed = run_cli("workspace", "list", *two)
    # Copied and removed on the command line as the tool does: a snapshot, its restore, a fork deleted again.
    snapshot = run_cli("workspace", "snapshot", "trip", "--name", "trip-v1", *two)
    restored = run_cli("workspace", "restore", "trip-v1", "--name", "trip-again", *two)
    forked = run_cli("workspace", "fork", "trip", "--name", "trip-spare", *two)
    wrong = run_cli("workspace", "restore", "trip", *two)
    deleted = run_cli("workspace", "delete", "trip-spare", *two)
    after = run_cli("workspace", "list", *two)
    async with connect(stdio_parameters(*two)) as session:
        files = await _call(
            session, "execute_command", command=f"{DIGEST}; test -x blob && echo runs", workspace="trip"
        )
        cell = await _call(session, "run_python", code="print(kept, arr.tolist())", workspace="trip")
        again = await _call(session, "run_python", code="print(kept, arr.tolist())", workspace="trip-again")
    for done in (snapshot, restored, forked, deleted):
        assert done.returncode == 0, done.stderr
    assert "snapshot: snapshot trip-v1" in snapshot.stdout and "restore: workspace trip-again" in restored.stdout
    assert wrong.returncode != 0 and "'trip' is a workspace, not a snapshot" in wrong.stderr, wrong.stderr
    kept_now = {(row["name"], row["snapshot"]) for row in map(json.loads, after.stdout.splitlines())}
    assert kept_now == {("trip", False), ("trip-v1", True), ("trip-again", False)}, after.stdout
    assert again["stdout"] == "{'rows': [1, 2, 3]} [0, 1, 2, 3, 4]\n", again["text"]
    assert held.returncode != 0 and "in use by another sandbox-server" in held.stderr, held.stderr
    assert exported.returncode == 0 and "exported trip" in exported.stdout, exported.stderr
    assert imported.returncode == 0 and "imported as trip" in imported.stdout, imported.stderr
    [row] = [json.loads(line) for line in listed.stdout.splitlines()]
    assert (row["name"], row["snapshot"], row["origin"]) == ("trip", False, made["workspace"]), listed.stdout
    assert files["stdout"] == made["stdout"] + "runs\n", (files["text"], made["text"])
    assert cell["stdout"] == "{'rows': [1, 2, 3]} [0, 1, 2, 3, 4]\n", cell["text"]


def test_an_archive_past_the_policys_workspace_or_not_an_export_is_refused_at_import(tmp_path: Path) -> None:
    policy = tmp_path / "keeping.yaml"
    policy.write_text(KEEPING)
    where = _where(policy, tmp_path / "state", "archived")
    payload = io.BytesIO()
    with tarfile.open(fileobj=payload, mode="w") as tar:
        big = tarfile.TarInfo("big.bin")
        big.size = 20 * 2**20
        tar.addfile(big, io.BytesIO(bytes(range(256)) * (big.size // 256)))
    large, broken = tmp_path / "large.tar.zst", tmp_path / "broken.tar.zst"
    with open(large, "wb") as out:
        write_export(
            out, {"id": "ws-elsewhere"}, lambda add: add(big, io.BytesIO(payload.getvalue()[512:][: big.size]))
        )
    small = tarfile.TarInfo("small.bin")
    small.size = 200_000
    whole = io.BytesIO()
    write_export(whole, {"id": "ws-elsewhere"}, lambda add: add(small, io.BytesIO(os.urandom(small.size))))
    broken.write_bytes(whole.getvalue()[: len(whole.getvalue()) // 2])
    too_large = run_cli("workspace", "import", str(large), "--name", "big", *where)
    cut_short = run_cli("workspace", "import", str(broken), "--name", "big", *where)
    assert too_large.returncode != 0 and "workspace.size_mb" in too_large.stderr, too_large.stderr
    assert "refused: not imported" in too_large.stderr
    assert cut_short.returncode != 0 and "not a readable zstd-compressed tar" in cut_short.stderr, cut_short.stderr


async def test_a_snapshot_exported_through_the_tool_is_read_in_parts_and_imported_elsewhere(
    tmp_path: Path, runtime: DockerRuntime
) -> None:
    policy, archive = tmp_path / "keeping.yaml", tmp_path / "v1.tar.zst"
    policy.write_text(KEEPING)
    one, two = _where(policy, tmp_path / "one", "auto"), _where(policy, tmp_path / "two", "auto")
    digest = "sha256sum big.bin | cut -c1-64"
    async with connect(stdio_parameters(*one)) as session:
        made = await _call(session, "execute_command", command=f"head -c 1500000 /dev/urandom > big.bin; {digest}")
        await _call(session, "run_python", code="note = 'kept in v1'")
        await _call(session, "workspaces", action="snapshot", name="v1")
        await _call(session, "execute_command", command="rm big.bin")
        exported = await _call(session, "workspaces", action="export", snapshot="v1")
        uri, parts = exported["export"]["uri"], []
        following: str | None = f"{uri}?offset=0"
        while following is not None:
            part = (await session.read_resource(following)).contents[0]
            parts.append(base64.b64decode(getattr(part, "blob", "")))
            following = (part.meta or {})["org.sandbox-server/part"]["next"]
        whole = await session.call_tool("workspaces", {"action": "list"})
    archive.write_bytes(b"".join(parts))
    imported = run_cli("workspace", "import", str(archive), "--name", "v1-here", *two)
    async with connect(stdio_parameters(*two)) as session:
        files = await _call(session, "execute_command", command=digest, workspace="v1-here")
        cell = await _call(session, "run_python", code="print(note)", workspace="v1-here")
        # The same file uploaded into a workspace and imported through the tool: a workspace of its own.
        upload = {
            "path": "in/v1.tar.zst",
            "content": base64.b64encode(archive.read_bytes()).decode(),
            "encoding": "base64",
        }
        await _call(session, "execute_command", command="head -c 4096 /dev/urandom > junk.bin", files=[upload])
        by_tool = await _call(session, "workspaces", action="import", path="in/v1.tar.zst", name="v1-tool")
        junk = await _call(session, "workspaces", action="import", path="junk.bin", name="junk")
        missing = await _call(session, "workspaces", action="import", path="nowhere.tar.zst")
        # Another caller's exports live beside the workspaces on the host: no path climbs to them.
        climbing = await _call(session, "workspaces", action="import", path="../../exports/x.tar.zst")
        tool_files = await _call(session, "execute_command", command=digest, workspace="v1-tool")
        tool_cell = await _call(session, "run_python", code="print(note)", workspace="v1-tool")
    assert not by_tool["is_error"] and "is imported as workspace v1-tool" in by_tool["text"], by_tool["text"]
    assert by_tool["imported"] == tool_files["workspace"]
    assert tool_files["stdout"] == made["stdout"] and tool_cell["stdout"] == "kept in v1\n", tool_cell["text"]
    assert junk["is_error"] and "refused: not imported: " in junk["text"], junk["text"]
    assert missing["is_error"] and "holds no file 'nowhere.tar.zst'" in missing["text"], missing["text"]
    assert (junk["error"]["field"], missing["error"]["field"]) == ("archive", "path")
    assert climbing["is_error"] and "is not a path inside the workspace" in climbing["text"], climbing["text"]
    assert not exported["is_error"] and "snapshot v1 is exported" in exported["text"], exported["text"]
    assert len(parts) >= 3 and exported["export"]["size_bytes"] == archive.stat().st_size, len(parts)
    assert not whole.is_error
    assert imported.returncode == 0, imported.stderr
    assert files["stdout"] == made["stdout"] and cell["stdout"] == "kept in v1\n", (files["text"], cell["text"])


async def test_a_plain_tar_or_a_folder_is_imported_as_a_workspace_checked_as_any_archive(
    tmp_path: Path, runtime: DockerRuntime
) -> None:
    policy = tmp_path / "keeping.yaml"
    policy.write_text(KEEPING)
    where = _where(policy, tmp_path / "state", "mounted")
    tarball = tmp_path / "project.tar.gz"
    with tarfile.open(tarball, "w:gz") as tar:
        for name, content in (("./proj/src/main.c", b"int main(void) { return 0; }\n"), ("../evil", b"out\n")):
            entry = tarfile.TarInfo(name)
            entry.size = len(content)
            tar.addfile(entry, io.BytesIO(content))
    folder = tmp_path / "checkout"
    (folder / "pkg").mkdir(parents=True)
    (folder / "pkg" / "mod.py").write_text("VALUE = 42\n")
    (folder / "README").write_text("hello\n")
    garbage = tmp_path / "garbage.bin"
    garbage.write_bytes(os.urandom(4096))
    from_tar = run_cli("workspace", "import", str(tarball), "--name", "proj", *where)
    from_folder = run_cli("workspace", "import", "--from", str(folder), "--name", "checkout", *where)
    refused = run_cli("workspace", "import", str(garbage), "--name", "junk", *where)
    both = run_cli("workspace", "import", str(tarball), "--from", str(folder), *where)
    assert from_tar.returncode == 0 and "imported as proj" in from_tar.stdout, from_tar.stderr
    assert from_folder.returncode == 0, from_folder.stderr
    assert refused.returncode != 0 and "neither an export nor a readable tar" in refused.stderr, refused.stderr
    assert both.returncode != 0 and "not both" in both.stderr
    async with connect(stdio_parameters(*where)) as session:
        project = await _call(
            session, "execute_command", command="find . -path ./out -prune -o -type f -print | sort", workspace="proj"
        )
        checkout = await _call(
            session,
            "execute_command",
            command="cat README; python3 -c 'import pkg.mod as m; print(m.VALUE)'",
            workspace="checkout",
        )
    assert project["stdout"] == "./proj/src/main.c\n", project["text"]
    assert checkout["stdout"] == "hello\n42\n", checkout["text"]
