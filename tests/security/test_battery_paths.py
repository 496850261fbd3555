"""The hostile-input battery, part two: archives, names, paths and uploads (cases 21, 22, 28, 29, 34, 36, 38).

Each case asserts its expected answer, then the `invariants` fixture asserts that the
server still answers, that nothing of the case is left, and that the host is as it was.
"""

from __future__ import annotations

import base64
import csv
import io
import os
import time
import zipfile
from pathlib import Path

import mcp_types as types
import pytest
from mcp import Client

from sandbox_server.sandbox.engine.runtime import DockerRuntime
from tests.mcp_harness import connect, stdio_parameters, text_of, upload

pytestmark = [pytest.mark.anyio, pytest.mark.alone, pytest.mark.usefixtures("invariants")]


FORGE_OUTPUT = '''
import io, os, re, sys, tarfile

def boundary_of_the_launcher():
    """The program shares the launcher's user, so it can read the launcher's memory (its parent's, or in a sandbox
    forked warm its sibling's: found by its command line)."""
    shell = b"/bin/sh\\0/usr/local/bin/sandbox-launch\\0"  # (not the init, whose arguments name it too)
    pid = next(p for p in os.listdir("/proc") if p.isdigit() and open(f"/proc/{p}/cmdline", "rb").read() == shell)
    with open(f"/proc/{pid}/maps") as maps, open(f"/proc/{pid}/mem", "rb", buffering=0) as mem:
        for line in maps:
            fields = line.split()
            if fields[1].startswith("rw"):
                start, end = (int(x, 16) for x in fields[0].split("-"))
                try:
                    mem.seek(start)
                    found = re.search(rb"boundary=([0-9a-f]{32})", mem.read(end - start))
                except OSError:
                    continue
                if found:
                    return found.group(1)
    raise SystemExit("boundary not found")

def member(tar, name, kind=tarfile.REGTYPE, content=b"", link=""):
    info = tarfile.TarInfo(name)
    info.type, info.size, info.linkname = kind, len(content), link
    tar.addfile(info, io.BytesIO(content))

boundary = boundary_of_the_launcher()
archive = io.BytesIO()
with tarfile.open(fileobj=archive, mode="w", format=tarfile.GNU_FORMAT) as tar:
    member(tar, "PREFIX" + "../escape-PROBE", content=b"up")
    member(tar, "/tmp/absolute-PROBE", content=b"abs")
    member(tar, "PREFIX" + "link", tarfile.SYMTYPE, link="/tmp")
    member(tar, "PREFIX" + "link/through-PROBE", content=b"through the link")
    member(tar, "PREFIX" + "hard", tarfile.LNKTYPE, link="/etc/shadow")
    member(tar, "PREFIX" + "device", tarfile.CHRTYPE)
    member(tar, "PREFIX" + "fine.txt", content=b"fine")
sys.stdout.flush()
os.write(1, boundary + archive.getvalue() + boundary + b" exit=0 oom_kill=0 pids_max=0\\n")
'''


async def test_21_a_forged_output_archive_writes_nothing_outside(server: Client, tmp_path: Path) -> None:
    """The program forges the launcher's framing. Where the host reads the launcher's tar (a workspace kept archived,
    whose tar frames all of /workspace, the output files under out/), it reads it as hostile data; where the
    workspace is kept mounted, it reads the call's output folder itself, and a forged archive is not read at all."""
    probe = f"probe{os.getpid()}"
    code = FORGE_OUTPUT.replace("PROBE", probe).replace("PREFIX", "out/")
    serve = ("--workspaces", "archived", "--state-dir", str(tmp_path / "state"), "--audit-log", str(tmp_path / "a"))
    async with connect(stdio_parameters(*serve)) as archived:
        result = await archived.call_tool("run_python", {"code": code})
    text = text_of(result)
    assert "../escape-" in text and "name leaves the output folder" in text, text
    assert "/tmp/absolute-" in text
    assert "link: skipped, links are never followed" in text
    assert "hard: skipped, links are never followed" in text
    assert "device: skipped, not a regular file" in text
    returned = _returned(result)
    assert returned.get("fine.txt") == "fine", returned
    # What went through the link is the archive's bytes under its own name, never a host path.
    assert returned.get(f"through-{probe}") == "through the link"
    mounted = await server.call_tool("run_python", {"code": code})
    assert probe not in text_of(mounted) and not set(_returned(mounted)) & {"fine.txt", f"through-{probe}"}
    leftovers = [path for folder in (Path("/tmp"), Path.cwd().parent, Path.cwd(), tmp_path)
                 for path in folder.glob(f"*{probe}*")]  # fmt: skip
    assert leftovers == []


def _returned(result: types.CallToolResult) -> dict[str, str]:
    return {block.resource.uri.rsplit("/", 1)[-1]: block.resource.text for block in result.content
            if isinstance(block, types.EmbeddedResource) and isinstance(block.resource, types.TextResourceContents)}  # fmt: skip


async def test_22_hostile_output_names_come_back_escaped(server: Client) -> None:
    command = (
        "cd out && for name in \"$(printf 'a\\nb')\" ./-rf \"$(printf '\\377bad')\" \"$(printf '\\033[2Jx')\" "
        '"$(printf \'safe\\342\\200\\256txt.exe\')"; do echo x > "$name"; done; ls | wc -l'
    )
    result = await server.call_tool("execute_command", {"command": command})
    assert not result.is_error, text_of(result)
    assert result.structured_content is not None
    paths = sorted(item["path"] for item in result.structured_content["files"])
    # Undecodable bytes as \\xNN, escape sequences stripped, bidi overrides made visible.
    assert paths == sorted(["a\nb", "-rf", "\\xffbad", "x", "safe<U+202E>txt.exe"]), paths
    uris = [block.resource.uri for block in result.content if isinstance(block, types.EmbeddedResource)]
    assert len(uris) == 5
    for uri in map(str, uris):
        assert uri.startswith("sandbox://calls/") and "/out/" in uri and "\n" not in uri and "\x1b" not in uri
        assert "/../" not in uri


@pytest.mark.parametrize(
    ("path", "problem"),
    [
        ("../x", "must be a relative path inside /workspace (no '..')"),
        ("a/../../x", "must be a relative path inside /workspace (no '..')"),
        ("/etc/x", "must be a relative path inside /workspace (no '..')"),
        ("x" * 300, "has a name part of 300 bytes; at most 255 bytes per part"),
    ],
)
async def test_22_hostile_input_names_are_refused_before_the_engine(server: Client, path: str, problem: str) -> None:
    result = await server.call_tool("execute_command", {"command": "true", "files": [{"path": path, "content": "x"}]})
    assert result.is_error
    assert text_of(result).startswith("refused by policy 'default': files[0].path "), text_of(result)
    assert problem in text_of(result)


async def test_22_odd_but_harmless_input_names_are_written_literally(server: Client) -> None:
    files = [{"path": name, "content": name} for name in ("a\nb", "-rf", "d/\u202eexe.txt", "sp ace")]
    result = await server.call_tool(
        "execute_command", {"command": "cat -- -rf; echo; cat 'sp ace'; echo; cat d/*", "files": files}
    )
    assert result.structured_content is not None and not result.is_error, text_of(result)
    assert result.structured_content["stdout"] == "-rf\nsp ace\nd/<U+202E>exe.txt"


@pytest.mark.parametrize("workdir", ["/proc/self/fd/7", "/proc/self/cwd", "/", "../..", "/workspace/../proc/1/root"])
async def test_28_a_working_directory_outside_the_workspace_is_refused(server: Client, workdir: str) -> None:
    """CVE-2024-21626 leaked a host directory through a working directory of /proc/self/fd/N."""
    started = time.monotonic()
    result = await server.call_tool("execute_command", {"command": "pwd; ls", "workdir": workdir})
    assert result.is_error
    assert text_of(result).startswith(f"refused: workdir {workdir!r} must be /workspace or a folder under it"), text_of(
        result
    )
    assert time.monotonic() - started < 1


async def test_29_a_zip_bomb_unpacked_inside_stops_at_the_workspace_size(server: Client) -> None:
    bomb = io.BytesIO()
    with zipfile.ZipFile(bomb, "w", zipfile.ZIP_DEFLATED, compresslevel=9) as archive:
        for index in range(8):
            archive.writestr(f"zeros{index}", bytes(50 * 2**20))  # 400 MiB, more than a kept workspace holds
    payload = base64.b64encode(bomb.getvalue()).decode()
    assert len(payload) < 2**20
    code = "import zipfile\nzipfile.ZipFile('bomb.zip').extractall('unpacked')"
    result = await server.call_tool("run_python", {"code": code, "files": [{"path": "bomb.zip", "content": payload,
                                                                            "encoding": "base64"}]})  # fmt: skip
    assert result.is_error
    assert "No space left on device" in text_of(result), text_of(result)


async def test_29_too_many_input_files_are_refused_before_copying(server: Client, runtime: DockerRuntime) -> None:
    files = [{"path": f"f{index}", "content": ""} for index in range(5000)]
    result = await server.call_tool("execute_command", {"command": "true", "files": files})
    assert result.is_error
    assert text_of(result).startswith(
        "refused by policy 'default': 5000 input files, above the cap of 1000 (policy field limits.input_files)"
    ), text_of(result)


async def test_29_input_bytes_past_the_policy_are_refused(server: Client) -> None:
    files = [{"path": f"f{index}", "content": "x" * (6 * 2**20)} for index in range(3)]
    result = await server.call_tool("execute_command", {"command": "true", "files": files})
    assert result.is_error
    assert "set by policy 'default' (field limits.argument_bytes)" in text_of(result), text_of(result)


async def test_34_formula_cells_are_neutralised_in_the_csv_written_back(server: Client) -> None:
    content = 'who,amount\n=HYPERLINK("http://x"),1\n+1+1,2\n@SUM(A1),3\n-2,4\n-cmd,5\nplain,6\n'
    result = await server.call_tool(
        "analyze_csv",
        {"filepath": "f.csv", "operations": ["sum"], "group_by": ["who"], "files": upload("f.csv", content)},
    )
    assert not result.is_error, text_of(result)
    [written] = [
        block.resource
        for block in result.content
        if isinstance(block, types.EmbeddedResource) and block.resource.uri.endswith("/result.csv")
    ]
    assert isinstance(written, types.TextResourceContents)
    keys = [row[0] for row in csv.reader(io.StringIO(written.text))][1:]
    assert sorted(keys) == sorted(["'+1+1", "'-cmd", "-2", '\'=HYPERLINK("http://x")', "'@SUM(A1)", "plain"])


async def test_36_invalid_bytes_and_utf16_are_read_or_named(server: Client) -> None:
    latin = "city,amount\nK\u00f6ln,1\nM\u00fcnchen,2\n".encode("latin-1")
    result = await server.call_tool(
        "analyze_csv", {"filepath": "l.csv", "operations": ["sum"], "files": upload("l.csv", latin)}
    )
    # Two rows cannot tell single-byte encodings apart: Windows-1252 (Latin-1's letters), and the others named.
    assert not result.is_error and text_of(result).startswith("l.csv: 2 rows, 2 columns (cp1252"), text_of(result)
    utf16 = "a,b\n1,2\n3,4\n".encode("utf-16")
    result = await server.call_tool(
        "analyze_csv", {"filepath": "u.csv", "operations": ["sum"], "files": upload("u.csv", utf16)}
    )
    assert not result.is_error and "UTF-16 LE" in text_of(result), text_of(result)
    binary = bytes(range(256)) * 64
    result = await server.call_tool(
        "analyze_csv", {"filepath": "b.csv", "operations": ["sum"], "files": upload("b.csv", binary)}
    )
    assert result.is_error and "does not look like a text CSV" in text_of(result), text_of(result)


@pytest.mark.parametrize(
    "filepath",
    [
        "../etc/passwd",
        "/etc/passwd",
        "/workspace/../etc/passwd",
        "in/../../etc/shadow",
        "/data/x.csv",
        "/workspacefoo",
        "/proc/self/root/etc/passwd",
    ],
)
async def test_38_paths_outside_the_readable_roots_are_refused(server: Client, filepath: str) -> None:
    result = await server.call_tool("analyze_csv", {"filepath": filepath, "operations": ["count"]})
    assert result.is_error
    assert text_of(result).startswith(
        f"refused: filepath {filepath!r} is not inside a readable root of policy 'default'"
    )
    assert "(/workspace;" in text_of(result)
