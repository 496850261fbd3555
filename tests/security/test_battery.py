"""The hostile-input battery (docs/security.md) through the real server on the default policy.

Each case asserts its expected answer; the `invariants` fixture then asserts that the
server still answers a plain call within 5 s, that none of the case's containers is
left, and that the host's processes, memory and disk are back where they were.
"""

from __future__ import annotations

import base64
import csv
import io
import json
import os
import socket
import time
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import mcp_types as types
import pytest
from mcp import Client

from sandbox_server.sandbox.docker_runtime import DockerRuntime
from tests.mcp_harness import text_of, upload

pytestmark = [pytest.mark.anyio, pytest.mark.usefixtures("invariants")]

Check = Callable[[types.CallToolResult, str, dict[str, Any]], None]


def error_with(*phrases: str) -> Check:
    """isError, and the text holds one of the phrases."""

    def check(result: types.CallToolResult, text: str, data: dict[str, Any]) -> None:
        assert result.is_error, text
        assert any(phrase in text for phrase in phrases), text

    return check


def stdout_is(expected: str) -> Check:
    def check(result: types.CallToolResult, text: str, data: dict[str, Any]) -> None:
        assert data["stdout"] == expected, text

    return check


def shell(command: str, **extra: Any) -> tuple[str, dict[str, Any]]:
    return "execute_command", {"command": command, **extra}


def python(code: str, **extra: Any) -> tuple[str, dict[str, Any]]:
    return "run_python", {"code": code, **extra}


CASES: dict[str, tuple[tuple[str, dict[str, Any]], Check]] = {
    "01 fork bomb": (
        # The shell stays 2 s so the bomb meets the limit before the launcher reads the pids counter.
        shell("bash -c ':(){ :|:& };:; sleep 2'", timeout_s=5),
        error_with(
            "process limit reached: forks failed at 128 processes (policy field limits.pids)", "timed out after 5 s"
        ),
    ),
    "02 thread bomb": (
        python(
            "import threading, time\nwhile True:\n    threading.Thread(target=time.sleep, args=(3600,)).start()",
            timeout_s=5,
        ),
        error_with("process limit reached", "timed out after 5 s"),
    ),
    "03 memory bomb": (
        python("chunks = []\nwhile True:\n    chunks.append(bytearray(2**24))"),
        error_with("out of memory (512 MiB)"),
    ),
    "04 /dev/shm fill": (
        shell("dd if=/dev/zero of=/dev/shm/fill bs=1M count=100"),
        error_with("No space left on device"),
    ),
    "05 workspace and output fill": (
        shell("for i in 1 2 3; do dd if=/dev/zero of=/workspace/out/f$i bs=1M count=60 2>&1 || exit 1; done"),
        error_with("No space left on device"),
    ),
    "06 /tmp inode flood": (
        shell("cd /tmp && i=0; while [ $i -lt 1000000 ]; do : > f$i || break; i=$((i+1)); done; echo $i; exit 1"),
        error_with("No space left on device"),
    ),
    "07 one giant file": (
        shell("head -c 5G /dev/zero > /workspace/giant"),
        error_with("killed by signal 25 SIGXFSZ: a file grew past 64 MiB (policy field limits.file_size_mb)"),
    ),
    "08 write to the root filesystem": (shell("touch /usr/bin/x"), error_with("Read-only file system")),
    "09 stdout flood (yes)": (shell("yes"), error_with("killed: output flood")),
    "09 stdout flood (urandom)": (shell("cat /dev/urandom"), error_with("killed: output flood")),
    "12 ignores SIGTERM": (
        shell("trap '' TERM; while :; do :; done", timeout_s=2),
        error_with("timed out after 2 s"),
    ),
    "13 sleeps past the timeout": (shell("sleep 3600", timeout_s=2), error_with("timed out after 2 s")),
    "14 orphans and daemons": (
        shell("setsid sleep 1000 & nohup sleep 1000 >/dev/null 2>&1 & echo started"),
        stdout_is("started\n"),
    ),  # fmt: skip
    "15 zombies reaped by init": (
        # 3000 orphans whose parents exit at once: only init reaps them; were they left as
        # zombies, forks would fail at the 128-process limit long before the end.
        shell("i=0; while [ $i -lt 3000 ]; do (true &) || exit 1; i=$((i+1)); done; echo $i", timeout_s=60),
        stdout_is("3000\n"),
    ),
    "15 zombies of a live parent stay within the limit": (
        python(
            "import os\nforked = 0\nfor _ in range(1000):\n    try:\n        if os.fork() == 0:\n            os._exit(0)\n"
            "        forked += 1\n    except OSError:\n        pass\nprint(forked)",
            timeout_s=20,
        ),
        error_with("process limit reached: forks failed at 128 processes (policy field limits.pids)"),
    ),
    "16 DNS and egress": (
        shell(
            "ls /sys/class/net; getent hosts example.com || echo no-dns; "
            "(exec 3<>/dev/tcp/1.1.1.1/53) 2>/dev/null || echo no-egress"
        ),  # fmt: skip
        stdout_is("lo\nno-dns\nno-egress\n"),
    ),
    "18 raw socket": (
        python("import socket\nsocket.socket(socket.AF_PACKET, socket.SOCK_RAW)"),
        error_with("PermissionError", "Operation not permitted"),
    ),
    "20 hardlink to a host file": (
        shell("ln /etc/shadow /workspace/x"),
        error_with("Operation not permitted", "Invalid cross-device link"),
    ),
    "23 setuid and privilege": (
        shell("su -c id root </dev/null; mount -t tmpfs none /mnt; id -u; cat /proc/self/status | grep ^CapEff"),
        stdout_is("1000\nCapEff:\t0000000000000000\n"),
    ),
    "24 /proc and /sys writes": (
        shell(
            "echo 1 > /proc/sys/kernel/sysrq || echo refused-sysrq; echo b > /proc/sysrq-trigger || echo refused-trigger;"
            " echo 1 > /sys/kernel/mm/ksm/run || echo refused-sys"
        ),  # fmt: skip
        stdout_is("refused-sysrq\nrefused-trigger\nrefused-sys\n"),
    ),
    "25 mount and unshare": (
        shell(
            "mount -t tmpfs none /tmp 2>/dev/null || echo no-mount; unshare -Urm true 2>/dev/null || echo no-unshare"
        ),
        stdout_is("no-mount\nno-unshare\n"),
    ),
    "26 kernel modules": (
        python(
            "import ctypes, os\nlibc = ctypes.CDLL(None, use_errno=True)\nfd = os.open('/dev/null', os.O_RDONLY)\n"
            "print(libc.syscall(313, fd, b'', 0), os.strerror(ctypes.get_errno()))"
        ),  # fmt: skip
        stdout_is("-1 Operation not permitted\n"),
    ),
    "26 io_uring (allowed by the engine's default profile)": (
        python(
            "import ctypes, os\nlibc = ctypes.CDLL(None, use_errno=True)\nparams = ctypes.create_string_buffer(120)\n"
            "print(libc.syscall(425, 8, params), os.strerror(ctypes.get_errno()))"
        ),  # fmt: skip
        stdout_is("-1 Operation not permitted\n"),
    ),
    "27 no host socket inside": (
        shell("find / \\( -path /proc -o -path /sys \\) -prune -o -type s -print 2>/dev/null; echo end"),
        stdout_is("end\n"),
    ),
    "30 argument injection stays literal": (
        ("execute_command", {"command": "printf", "args": ["%s|", "; id", "$(id)", "`id`", "--help", "a\nb"]}),
        stdout_is("; id|$(id)|`id`|--help|a\nb|"),
    ),
}


@pytest.mark.parametrize("case", list(CASES))
async def test_hostile_input(server: Client, case: str) -> None:
    (tool, arguments), check = CASES[case]
    started = time.monotonic()
    result = await server.call_tool(tool, arguments)
    elapsed = time.monotonic() - started
    timeout = arguments.get("timeout_s", 30)
    assert elapsed < timeout + 2, f"answered after {elapsed:.1f} s"
    check(result, text_of(result), result.structured_content or {})


async def test_10_invalid_utf8_and_nuls_come_back_as_valid_json(server: Client) -> None:
    result = await server.call_tool("execute_command", {"command": "head -c 4096 /dev/urandom; printf 'a\\0b'"})
    assert not result.is_error and result.structured_content is not None
    stdout = result.structured_content["stdout"]
    json.dumps(stdout)  # valid JSON text, whatever came out
    assert "\x00" not in stdout and "\ufffd" in stdout


async def test_11_terminal_escapes_are_stripped(server: Client) -> None:
    command = "printf '\\033]52;c;SGVsbG8=\\007\\033[2J\\342\\200\\256evil\\rX\\n'"
    result = await server.call_tool("execute_command", {"command": command})
    text = text_of(result)
    for forbidden in ("\x1b", "\x07", "\u202e", "\r"):
        assert forbidden not in text
    assert "evil" in text


async def test_17_the_host_loopback_is_not_reachable(server: Client) -> None:
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    port = listener.getsockname()[1]
    try:
        code = (
            "import socket\nfor host in ('127.0.0.1', '172.17.0.1'):\n    try:\n"
            f"        socket.create_connection((host, {port}), timeout=2)\n        print(host, 'connected')\n"
            "    except OSError as exc:\n        print(host, type(exc).__name__)"
        )
        result = await server.call_tool("run_python", {"code": code})
        assert result.structured_content is not None
        lines = result.structured_content["stdout"].splitlines()
        assert lines == ["127.0.0.1 ConnectionRefusedError", "172.17.0.1 OSError"], lines
    finally:
        listener.close()


async def test_19_a_symlink_in_the_output_is_never_followed(server: Client) -> None:
    result = await server.call_tool(
        "execute_command", {"command": "ln -s /etc/shadow out/x; ln -s /etc/passwd out/y; echo ok"}
    )
    text = text_of(result)
    assert "x" in text and "not a regular file" in text or "skipped" in text, text
    for block in result.content:
        assert not isinstance(block, types.EmbeddedResource | types.ResourceLink), block
    assert "root:" not in text


async def test_31_a_huge_argument_is_refused_with_the_limit(server: Client) -> None:
    result = await server.call_tool("execute_command", {"command": "echo " + "x" * (100 * 2**20)})
    assert result.is_error
    assert "limits.argument_bytes" in text_of(result)


FORGE_OUTPUT = '''
import io, os, re, sys, tarfile

def boundary_of_the_launcher():
    """The program shares the launcher's user, so it can read the launcher's memory."""
    pid = os.getppid()
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
    member(tar, "../escape-PROBE", content=b"up")
    member(tar, "/tmp/absolute-PROBE", content=b"abs")
    member(tar, "link", tarfile.SYMTYPE, link="/tmp")
    member(tar, "link/through-PROBE", content=b"through the link")
    member(tar, "hard", tarfile.LNKTYPE, link="/etc/shadow")
    member(tar, "device", tarfile.CHRTYPE)
    member(tar, "fine.txt", content=b"fine")
sys.stdout.flush()
os.write(1, boundary + archive.getvalue() + boundary + b" exit=0 oom_kill=0 pids_max=0\\n")
'''


async def test_21_a_forged_output_archive_writes_nothing_outside(server: Client, tmp_path: Path) -> None:
    """The program forges the launcher's framing; the host reads the tar as hostile data."""
    probe = f"probe{os.getpid()}"
    code = FORGE_OUTPUT.replace("PROBE", probe)
    result = await server.call_tool("run_python", {"code": code})
    text = text_of(result)
    assert "../escape-" in text and "name leaves the output folder" in text, text
    assert "/tmp/absolute-" in text
    assert "link: skipped, links are never followed" in text
    assert "hard: skipped, links are never followed" in text
    assert "device: skipped, not a regular file" in text
    returned = {block.resource.uri.rsplit("/", 1)[-1]: block.resource.text for block in result.content
                if isinstance(block, types.EmbeddedResource) and isinstance(block.resource, types.TextResourceContents)}  # fmt: skip
    assert returned.get("fine.txt") == "fine", returned
    # What went through the link is the archive's bytes under its own name, never a host path.
    assert returned.get(f"through-{probe}") == "through the link"
    leftovers = [path for folder in (Path("/tmp"), Path.cwd().parent, Path.cwd(), tmp_path)
                 for path in folder.glob(f"*{probe}*")]  # fmt: skip
    assert leftovers == []


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
        for index in range(4):
            archive.writestr(f"zeros{index}", bytes(50 * 2**20))  # 200 MiB in about 200 kB
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
    assert not result.is_error and "Latin-1" in text_of(result), text_of(result)
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
