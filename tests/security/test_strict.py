"""The battery's cases where the `strict` policy differs: gVisor (runsc) between the program and
the host kernel, uid 65534, no shell, an allow list of programs, 128 MiB, 32 processes.

Each case runs through the real server on `strict`; the `invariants` fixture then checks
the plain call, the containers and the host, as for the default policy.
"""

from __future__ import annotations

import socket
import time
from collections.abc import AsyncIterator

import pytest
from mcp import Client

from sandbox_server.sandbox.engine.runtime import DockerRuntime
from tests.mcp_harness import connect, stdio_parameters, text_of
from tests.security.conftest import warm_pools_ready

pytestmark = [pytest.mark.anyio, pytest.mark.alone, pytest.mark.usefixtures("invariants")]


@pytest.fixture(scope="module")
async def server(runtime: DockerRuntime) -> AsyncIterator[Client]:
    async with connect(stdio_parameters("--policy", "strict")) as session:
        await warm_pools_ready(4)  # gVisor containers have many host processes: count them in from the start
        yield session


@pytest.fixture(scope="module")
def plain_call() -> tuple[str, dict[str, object]]:
    """Strict has no shell: the invariants' plain call gives its arguments."""
    return "execute_command", {"command": "echo", "args": ["ok"]}


PROBES = {
    "01 fork bomb": (
        "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass",
        # Under gVisor a fork copies the whole interpreter: memory may run out before processes do.
        ("process limit reached", "timed out after 5 s", "out of memory (128 MiB)"),
    ),
    "03 memory bomb": ("chunks = []\nwhile True:\n    chunks.append(bytearray(2**24))", ("out of memory (128 MiB)",)),
    "12 busy loop past the timeout": ("while True:\n    pass", ("timed out after 5 s",)),
}


@pytest.mark.parametrize("case", list(PROBES))
async def test_strict_resource_limits_hold_under_gvisor(server: Client, case: str) -> None:
    code, phrases = PROBES[case]
    started = time.monotonic()
    result = await server.call_tool("run_python", {"code": code, "timeout_s": 5})
    assert time.monotonic() - started < 5 + 2 + 3  # gVisor starts slower than runc
    assert result.is_error and any(phrase in text_of(result) for phrase in phrases), text_of(result)
    if case == "03 memory bomb":  # killed by the kernel for memory, said as the engine says it: SIGKILL's 137
        assert (result.structured_content or {}).get("exit_code") == 137, result.structured_content


ESCAPES = """
import ctypes, os, socket
libc = ctypes.CDLL(None, use_errno=True)
def attempt(name, action):
    try:
        outcome = action()
        print(name, "refused" if outcome in (-1, None) else f"ALLOWED {outcome}")
    except OSError as exc:
        print(name, "refused")
def write(path):
    with open(path, "w") as handle:
        handle.write("1")
print("uid", os.getuid(), os.geteuid())
attempt("sysrq", lambda: write("/proc/sys/kernel/sysrq"))
attempt("sysrq-trigger", lambda: write("/proc/sysrq-trigger"))
attempt("raw-socket", lambda: socket.socket(socket.AF_PACKET, socket.SOCK_RAW) and 0)
attempt("mount", lambda: libc.mount(b"none", b"/tmp", b"tmpfs", 0, None))
attempt("egress", lambda: socket.create_connection(("1.1.1.1", 53), timeout=2) and 0)
attempt("host-loopback", lambda: socket.create_connection(("127.0.0.1", PORT), timeout=2) and 0)
attempt("root-write", lambda: write("/usr/bin/x"))
print("sockets", [p for p in ("/var/run/docker.sock", "/run/docker.sock") if os.path.exists(p)])
"""


async def test_strict_escapes_are_refused_under_gvisor(server: Client) -> None:
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    try:
        code = ESCAPES.replace("PORT", str(listener.getsockname()[1]))
        result = await server.call_tool("run_python", {"code": code})
    finally:
        listener.close()
    assert result.structured_content is not None, text_of(result)
    assert result.structured_content["stdout"].splitlines() == [
        "uid 65534 65534",
        "sysrq refused",
        "sysrq-trigger refused",
        "raw-socket refused",
        "mount refused",
        "egress refused",
        "host-loopback refused",
        "root-write refused",
        "sockets []",
    ], text_of(result)


async def test_strict_refuses_a_shell_and_programs_off_its_list(server: Client) -> None:
    shell = await server.call_tool("execute_command", {"command": "id; cat /etc/shadow"})
    assert shell.is_error and "policy 'strict' does not allow a shell (field commands.shell)" in text_of(shell)
    off_list = await server.call_tool("execute_command", {"command": "python3", "args": ["-c", "print(1)"]})
    assert off_list.is_error and "commands.allow" in text_of(off_list), text_of(off_list)


RUN_FROM_WORKSPACE = """
import os, subprocess
with open("run.sh", "w") as script:
    script.write("#!/bin/sh\\necho ran\\n")
os.chmod("run.sh", 0o755)
try:
    subprocess.run(["./run.sh"], check=True)
except PermissionError:
    print("refused", oct(os.stat("run.sh").st_mode & 0o777))
"""


async def test_strict_runs_no_program_from_the_workspace(server: Client) -> None:
    upload = await server.call_tool("execute_command", {
        "command": "cat", "args": ["run.sh"],
        "files": [{"path": "run.sh", "content": "#!/bin/sh\necho ran\n", "executable": True}],
    })  # fmt: skip
    assert upload.is_error and "(field workspace.exec)" in text_of(upload), text_of(upload)
    # Made executable inside the sandbox, it still may not run: the kernel refuses (noexec).
    result = await server.call_tool("run_python", {"code": RUN_FROM_WORKSPACE})
    assert result.structured_content is not None, text_of(result)
    assert result.structured_content["stdout"] == "refused 0o755\n", text_of(result)


async def test_strict_stops_an_output_flood(server: Client) -> None:
    result = await server.call_tool("execute_command", {"command": "cat", "args": ["/dev/urandom"]})
    assert result.is_error and "killed: output flood" in text_of(result), text_of(result)
