"""The hostile-input battery (docs/security.md) through the real server on the default policy.

Each case asserts its expected answer; the `invariants` fixture then asserts that the
server still answers a plain call within 5 s, that none of the case's containers is
left, and that the host's processes, memory and disk are back where they were.
"""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Callable
from typing import Any

import mcp_types as types
import pytest
from mcp import Client

from tests.mcp_harness import text_of

pytestmark = [pytest.mark.anyio, pytest.mark.alone, pytest.mark.usefixtures("invariants")]

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
        shell("for i in 1 2 3 4 5; do dd if=/dev/zero of=/workspace/out/f$i bs=1M count=60 2>&1 || exit 1; done"),
        # Answered when the program ends, though its output folder is far past the returned files' cap.
        error_with("exit code 1 ", "No space left on device", "output files cut short"),
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
