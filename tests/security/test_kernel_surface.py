"""What the sandbox's kernel surface refuses, proven from inside on every path that makes sandboxes: the engine's,
runc's own, and gVisor's (strict). Each probe would succeed, or fail otherwise than refused, without the filter:
AF_VSOCK reaches a hypervisor's services past `network: none`, a 32-bit system call slips past a filter written
for 64-bit numbers, and the calls the engine's default keeps for capabilities a sandbox never holds."""

from __future__ import annotations

from pathlib import Path

import pytest

from sandbox_server.sandbox.engine.runtime import DockerRuntime
from tests.mcp_harness import answer, connect, stdio_parameters

pytestmark = pytest.mark.anyio

PROBE = r"""
import ctypes, errno, mmap, socket, subprocess, sys

libc = ctypes.CDLL(None, use_errno=True)
def outcome(result):
    return "ok" if result >= 0 else errno.errorcode.get(ctypes.get_errno(), "?")
try:
    socket.socket(40, socket.SOCK_STREAM).close()  # AF_VSOCK
    print("vsock ok")
except OSError as error:
    print("vsock", errno.errorcode.get(error.errno, "?"))
# x86-64 numbers: with no filter each succeeds for a process with no capability
print("fanotify_init", outcome(libc.syscall(300, 0x200, 0)))  # FAN_REPORT_FID: allowed unprivileged since 5.13
print("move_pages", outcome(libc.syscall(279, 0, 0, None, None, None, 0)))
print("set_mempolicy", outcome(libc.syscall(238, 0, None, 0)))
print("personality", outcome(libc.syscall(135, 0x40000)))  # ADDR_NO_RANDOMIZE
print("linux32", outcome(libc.syscall(135, 0x8)))  # PER_LINUX32, as `linux32 uname -m` asks: the engine allows it
libc.syscall(135, 0)
# socket(AF_VSOCK, SOCK_STREAM, 0) through the i386 ABI (int 0x80, number 359), in a child: it is killed
i386 = '''
import ctypes, mmap
code = mmap.mmap(-1, 4096, prot=mmap.PROT_READ | mmap.PROT_WRITE | mmap.PROT_EXEC)
code.write(bytes.fromhex("53bb28000000b867010000b90100000031d2cd805bc3"))
print(ctypes.CFUNCTYPE(ctypes.c_int)(ctypes.addressof(ctypes.c_char.from_buffer(code)))(), flush=True)
'''
done = subprocess.run([sys.executable, "-c", i386], capture_output=True, text=True)
print("i386", done.returncode, done.stdout.strip() or "-")
"""


def _facts(stdout: str) -> dict[str, str]:
    return {line.split(" ", 1)[0]: line.split(" ", 1)[1] for line in stdout.splitlines() if " " in line}


@pytest.mark.parametrize("path", ["engine", "runc"])
async def test_vsock_32_bit_calls_and_the_engines_capability_calls_are_refused_from_inside(
    path: str, tmp_path: Path, runtime: DockerRuntime
) -> None:
    serve = ("--policy", "default", "--sandboxes", path, "--no-pool", "--state-dir", str(tmp_path / "state"))
    async with connect(stdio_parameters(*serve)) as session:
        said = await answer(session, "run_python", {"code": PROBE})
    assert not said["is_error"], said["text"]
    facts = _facts(said["stdout"])
    assert facts["vsock"] == "EPERM", facts  # the filter's answer, not the kernel's EAFNOSUPPORT of a host without it
    for call in ("fanotify_init", "move_pages", "set_mempolicy", "personality"):
        assert facts[call] == "EPERM", (call, facts)
    assert facts["linux32"] == "ok", facts
    assert facts["i386"] == "-31 -", facts  # SIGSYS: the kernel killed it at the call, which never ran


async def test_gvisors_sandbox_opens_no_vsock_and_runs_no_32_bit_call(tmp_path: Path, runtime: DockerRuntime) -> None:
    serve = ("--policy", "strict", "--no-pool", "--state-dir", str(tmp_path / "state"))
    async with connect(stdio_parameters(*serve)) as session:
        said = await answer(session, "run_python", {"code": PROBE})
    assert not said["is_error"], said["text"]
    facts = _facts(said["stdout"])
    assert facts["vsock"] != "ok", facts
    code, printed = facts["i386"].split(" ", 1)
    assert printed == "-" or int(printed) < 0, facts  # never a socket
