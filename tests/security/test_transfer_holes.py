"""Exports and imports attacked through the real server and the command line: a forged export is refused by
what it declares, within seconds and within a bounded memory and disk, whatever it claims; imports and exports
are bounded as forks are; an export of sparse files stops at the workspace's size and leaves nothing behind;
an empty workspace round-trips as an empty workspace."""

from __future__ import annotations

import base64
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import psutil
import pytest

from sandbox_server.sandbox.engine.runtime import DockerRuntime
from tests import hostile_exports as hostile
from tests.mcp_harness import CheckedClient, command_of, connect, stdio_parameters, text_of

pytestmark = pytest.mark.anyio

MIB = 1 << 20
MEMORY_CGROUPS = Path("/sys/fs/cgroup/memory")
KEEPING = "extends: default\nworkspace: {persist: true, size_mb: 16, files: 2000}\n"


def _forged() -> dict[str, bytes]:
    """Each hostile export, small on disk, by what it forges."""
    long_name = "workspace/" + "/".join(["deep"] * 30) + "/leaf.txt"
    return {
        "sparse-1tib": hostile.export_of([hostile.gnu_sparse_member("workspace/disk-filler", 1 << 40)]),
        "pax-sparse": hostile.export_of([hostile.pax_sparse_member("workspace/disk-filler", 4 << 30)]),
        "pax-250mib": hostile.export_of(hostile.pax_comment_blocks("workspace/c.txt", 250 * MIB)),
        "entries-100k": hostile.export_of(hostile.folder_member(f"workspace/e{i}") for i in range(100_000)),
        "nested": _nested_manifest(),
        "all-dropped": hostile.export_of([hostile.file_member("workspace/../up.txt", b"x")]),
        "file-then-link": hostile.export_of(
            [
                hostile.file_member("workspace/a", b"x"),
                hostile.link_member("workspace/a", "."),
                hostile.file_member(long_name, b"far"),
            ]
        ),
    }


def _nested_manifest() -> bytes:
    import io

    import zstandard

    out = io.BytesIO()
    with zstandard.ZstdCompressor(write_checksum=True).stream_writer(out, closefd=False) as packed:
        packed.write(hostile.file_member("manifest.json", b"[" * 30_000 + b"]" * 30_000) + bytes(1024))
    return out.getvalue()


REFUSED = {
    "sparse-1tib": "is sparse, which is refused",
    "pax-sparse": "is sparse, which is refused",
    "pax-250mib": "an extended header of 262144",
    "entries-100k": "more than the workspace can (16777216 bytes, 2000 entries)",
    "nested": "manifest.json is not JSON",
}


def _cli_import(
    archive: Path, state: Path, policy: Path, name: str
) -> tuple[subprocess.CompletedProcess[str], float, int]:
    """The real command line's import, with how long it took and its peak memory (bytes): read from a memory
    cgroup of its own, since a child's own count (ru_maxrss) starts from its parent's size at the fork."""
    group = MEMORY_CGROUPS / f"sandbox-server-test-{os.getpid()}-{time.monotonic_ns()}"
    group.mkdir()
    try:
        began = time.monotonic()
        done = subprocess.run(
            [sys.executable, "-m", "sandbox_server", "workspace", "import", str(archive), "--name", name,
             "--state-dir", str(state), "--policy", str(policy)],
            capture_output=True, text=True, timeout=120, check=False,
            preexec_fn=lambda: (group / "cgroup.procs").write_text(str(os.getpid())),
        )  # fmt: skip
        took = time.monotonic() - began
        return done, took, int((group / "memory.max_usage_in_bytes").read_text())
    finally:
        group.rmdir()


def _server_peak(pid: int) -> int:
    """A process's peak resident memory so far (VmHWM), in bytes."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmHWM")


def _stdio_server(state: Path) -> int:
    """The stdio server this test started (others of the suite may run beside it): the one on its state folder."""
    commands = [(p, command_of(p)) for p in psutil.Process().children(recursive=True)]
    [server] = [p for p, command in commands if "serve" in command and str(state) in command]
    return server.pid


async def _call(session: CheckedClient, tool: str, **arguments: Any) -> dict[str, Any]:
    result = await session.call_tool(tool, arguments)
    assert result.structured_content is not None, text_of(result)
    return {**result.structured_content, "is_error": result.is_error, "text": text_of(result)}


def _left_behind(state: Path) -> list[str]:
    return sorted(str(path.relative_to(state)) for path in state.rglob(".import-*"))


async def test_forged_exports_are_refused_by_what_they_declare_within_seconds_and_bounded_memory(
    tmp_path: Path, runtime: DockerRuntime
) -> None:
    policy, state = tmp_path / "keeping.yaml", tmp_path / "state"
    policy.write_text(KEEPING)
    forged = _forged()
    for name, data in forged.items():
        (tmp_path / f"{name}.tar.zst").write_bytes(data)
    assert all(len(data) < 4 * MIB for data in forged.values()), {k: len(v) for k, v in forged.items()}
    # The command line: each refused in seconds, its memory far below what the archive declares.
    for name, said in REFUSED.items():
        done, took, peak = _cli_import(tmp_path / f"{name}.tar.zst", state, policy, name)
        assert done.returncode != 0 and "refused: not imported: " in done.stderr and said in done.stderr, (
            name,
            done.stderr,
        )
        assert took < 20 and peak < 200 * MIB, (name, took, peak)
    for name in ("all-dropped", "file-then-link"):
        done, _, _ = _cli_import(tmp_path / f"{name}.tar.zst", state, policy, name)
        assert done.returncode == 0 and f"imported as {name}" in done.stderr + done.stdout, (name, done.stderr)
    assert _left_behind(state) == []
    # The tool, through the real server: the same refusals, the server's memory bounded, nothing left behind.
    async with connect(stdio_parameters("--policy", str(policy), "--state-dir", str(state))) as session:
        files = [
            {"path": f"in/{name}.tar.zst", "content": base64.b64encode(data).decode(), "encoding": "base64"}
            for name, data in forged.items()
        ]
        uploaded = await _call(session, "execute_command", command="ls in | wc -l", files=files)
        assert uploaded["stdout"] == f"{len(forged)}\n", uploaded["text"]
        server = _stdio_server(state)
        before = _server_peak(server)
        for name, said in REFUSED.items():
            began = time.monotonic()
            answer = await _call(session, "workspaces", action="import", path=f"in/{name}.tar.zst", name=f"t-{name}")
            assert answer["is_error"] and "refused: not imported: " in answer["text"], (name, answer["text"])
            assert said in answer["text"] and answer["error"]["field"] == "archive", (name, answer["text"])
            assert time.monotonic() - began < 20, name
        grown = _server_peak(server) - before
        dropped = await _call(session, "workspaces", action="import", path="in/all-dropped.tar.zst", name="t-dropped")
        linked = await _call(session, "workspaces", action="import", path="in/file-then-link.tar.zst", name="t-link")
        inside = await _call(session, "execute_command", command="find . -type f | sort", workspace="t-link")
        empty = await _call(
            session,
            "execute_command",
            command="find . -mindepth 1 -not -path './.sandbox*' -not -path './out*'",
            workspace="t-dropped",
        )
    assert grown < 64 * MIB, grown
    assert not dropped["is_error"] and not linked["is_error"], (dropped["text"], linked["text"])
    long_path = "./" + "/".join(["deep"] * 30) + "/leaf.txt"
    assert inside["stdout"].split() == ["./a", long_path], inside["stdout"]  # not under workspace/, no header kept
    assert empty["stdout"].split() == [], empty["stdout"]
    assert _left_behind(state) == []


async def test_an_empty_workspace_exports_and_imports_as_an_empty_workspace(
    tmp_path: Path, runtime: DockerRuntime
) -> None:
    policy, archive = tmp_path / "keeping.yaml", tmp_path / "empty.tar.zst"
    policy.write_text(KEEPING)
    one, two = tmp_path / "one", tmp_path / "two"
    async with connect(stdio_parameters("--policy", str(policy), "--state-dir", str(one))) as session:
        await _call(session, "execute_command", command="true")
        await _call(session, "workspaces", action="keep", name="nothing")
    exported = subprocess.run(
        [sys.executable, "-m", "sandbox_server", "workspace", "export", "nothing", "-o", str(archive),
         "--state-dir", str(one), "--policy", str(policy)], capture_output=True, text=True, check=False,
    )  # fmt: skip
    assert exported.returncode == 0, exported.stderr
    done, _, _ = _cli_import(archive, two, policy, "nothing")
    assert done.returncode == 0, done.stderr
    async with connect(stdio_parameters("--policy", str(policy), "--state-dir", str(two))) as session:
        listed = await _call(session, "execute_command", command="ls -A | grep -v '^out$' | wc -l", workspace="nothing")
        by_tool = await _call(session, "workspaces", action="export", workspace="nothing")
    assert not listed["is_error"] and listed["stdout"].strip() in ("0", "1"), listed["text"]
    assert not by_tool["is_error"], by_tool["text"]


def _small_export(path: Path, zeros: int = 0) -> None:
    """An export of one short file, and `zeros` bytes of zeros in another (small once compressed, whole once
    imported)."""
    members = [hostile.file_member("workspace/data.txt", b"from elsewhere\n")]
    if zeros:
        members.append(hostile.file_member("workspace/zeros.bin", bytes(zeros)))
    path.write_bytes(hostile.export_of(members))


async def test_imports_are_bounded_as_forks_are_by_the_client_count_and_the_hosts_cap(
    tmp_path: Path, runtime: DockerRuntime
) -> None:
    policy, state, archive = tmp_path / "capped.yaml", tmp_path / "state", tmp_path / "ok.tar.zst"
    policy.write_text(
        "extends: default\nworkspace: {persist: true, size_mb: 16, files: 2000, max_per_client: 2}\n"
        "host: {workspace_storage_mb: 36}\n"
    )  # an import counts at its workspace's whole size (21.8 MiB) as it is made, then at what it holds (8 MiB)
    _small_export(archive, zeros=8 * 2**20)
    upload = {"path": "ok.tar.zst", "content": base64.b64encode(archive.read_bytes()).decode(), "encoding": "base64"}
    async with connect(stdio_parameters("--policy", str(policy), "--state-dir", str(state))) as session:
        await _call(session, "execute_command", command="true", files=[upload])
        first = await _call(session, "workspaces", action="import", path="ok.tar.zst")
        unnamed = await _call(session, "workspaces", action="import", path="ok.tar.zst")
        fork = await _call(session, "workspaces", action="fork")
        named = await _call(session, "workspaces", action="import", path="ok.tar.zst", name="n1")
        past_host = await _call(session, "workspaces", action="import", path="ok.tar.zst", name="n2")
        inside = await _call(session, "execute_command", command="cat data.txt", workspace="n1")
    assert not first["is_error"] and not named["is_error"], (first["text"], named["text"])
    for refused, field in ((unnamed, "workspace.max_per_client"), (fork, "workspace.max_per_client")):
        assert refused["is_error"] and refused["error"]["field"] == field, refused["text"]
        assert "this client holds 2 workspaces" in refused["text"], refused["text"]
    assert past_host["is_error"] and past_host["error"]["field"] == "host.workspace_storage_mb", past_host["text"]
    assert "above the host's cap of 37748736" in past_host["text"], past_host["text"]
    assert inside["stdout"] == "from elsewhere\n"
    assert _left_behind(state) == []
    # The command line is bounded the same way (named imports, past what the server's session left).
    done = [_cli_import(archive, state, policy, name)[0] for name in ("c1", "c2", "c3", "c4")]
    denied = [each for each in done if each.returncode != 0]
    assert denied and all("host.workspace_storage_mb" in each.stderr for each in denied), [d.stderr for d in done]
    listed = subprocess.run(
        [sys.executable, "-m", "sandbox_server", "workspace", "list", "--state-dir", str(state), "--policy", str(policy)],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    assert 0 < len(listed.stdout.splitlines()) <= 3, listed.stdout


async def test_exports_count_in_the_callers_share_and_one_of_sparse_files_stops_at_the_workspaces_size(
    tmp_path: Path, runtime: DockerRuntime
) -> None:
    policy, state = tmp_path / "share.yaml", tmp_path / "state"
    policy.write_text(
        "extends: default\nworkspace: {persist: true, size_mb: 16, files: 2000, storage_per_caller_mb: 64}\n"
    )  # the workspace holds 7.6 MiB; each export counts at the workspace's whole size (21.8 MiB) while written,
    # then at its own (7.6 MiB): five fit
    async with connect(stdio_parameters("--policy", str(policy), "--state-dir", str(state))) as session:
        await _call(session, "execute_command", command="for i in 1 2 3 4 5 6 7 8; do truncate -s 15M s$i.bin; done")
        began = time.monotonic()
        sparse = await _call(session, "workspaces", action="export")
        took = time.monotonic() - began
        [exports] = list(state.rglob("exports"))
        after_sparse = sorted(path.name for path in exports.iterdir())
        await _call(session, "execute_command", command="rm s*.bin; head -c 8000000 /dev/urandom > data.bin")
        answers = [await _call(session, "workspaces", action="export") for _ in range(7)]
    assert sparse["is_error"] and sparse["error"]["field"] == "workspace.size_mb", sparse["text"]
    assert "claim more than the 16777216 bytes its workspace holds" in sparse["text"] and took < 10, took
    assert after_sparse == [], after_sparse  # the failed export left no file
    made = [each for each in answers if not each["is_error"]]
    assert len(made) == 5 and all(each["is_error"] for each in answers[5:]), [each["text"] for each in answers]
    assert answers[5]["error"]["field"] == "workspace.storage_per_caller_mb", answers[5]["text"]
    assert "workspaces, snapshots and exports would take" in answers[5]["text"]
    assert len(list(exports.glob("*.tar.zst"))) == 5
