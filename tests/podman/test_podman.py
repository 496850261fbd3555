"""On Podman's Docker-compatible service: the suite's second pass (`scripts/run test` runs the execute_command,
run_python and doctor tests again with DOCKER_HOST at Podman's socket, and these with them).

What differs from Docker is named by `doctor` and listed in docs/sandbox.md; each difference is shown here to be
exactly what the list says, and the limits beside it to hold."""

from __future__ import annotations

import json

import pytest
from mcp import Client

from sandbox_server.sandbox.docker_runtime import DockerRuntime
from tests.conftest import run_cli

pytestmark = pytest.mark.anyio

TMP_INODES = 64 * 256
"""The inode cap Docker gives the default policy's /tmp (tmp_mb 64): max(1024, tmp_mb * 256)."""


@pytest.fixture(scope="module")
def anyio_backend() -> str:
    return "asyncio"


def test_doctor_names_podman_and_what_differs(runtime: DockerRuntime) -> None:
    assert runtime.dialect.podman, "this pass must run on Podman (DOCKER_HOST at its socket)"
    result = run_cli("doctor", "--json")
    report = json.loads(result.stdout)
    checks = {check["name"]: check for check in report["checks"]}
    assert result.returncode == 0 and report["healthy"], result.stdout + result.stderr
    assert checks["engine"]["detail"].startswith(f"Podman {runtime.dialect.version} "), checks["engine"]
    differences = checks["engine differences"]
    assert not differences["ok"] and not differences["required"], differences
    assert "nr_inodes" in differences["detail"] and "limits.workspace_inodes" in differences["detail"]
    assert "ignores a container's runtime" in differences["detail"]
    assert checks["runtime runsc (gVisor)"]["detail"] == "cannot be chosen through this engine"
    assert "probe under runsc" not in checks
    for name in ("seccomp filter", "memory limit enforced", "pids limit enforced", "read-only root", "network none"):
        assert checks[f"probe: {name}"]["ok"], checks[f"probe: {name}"]


async def test_the_size_caps_hold_and_the_inode_cap_is_the_difference(module_session: Client) -> None:
    filled = await module_session.call_tool(
        "execute_command", {"command": "for i in 1 2 3; do dd if=/dev/zero of=/tmp/f$i bs=1M count=30 || exit 1; done"}
    )
    assert filled.is_error and "No space left on device" in filled.structured_content["stderr"], filled
    # Docker's tmpfs stops at TMP_INODES files; Podman's takes more (docs/sandbox.md, "On Podman").
    flood = f"cd /tmp && i=0; while [ $i -lt {TMP_INODES + 1000} ]; do : > f$i || break; i=$((i+1)); done; echo $i"
    made = await module_session.call_tool("execute_command", {"command": flood, "timeout_s": 60})
    assert not made.is_error and made.structured_content["stdout"] == f"{TMP_INODES + 1000}\n", made


async def test_the_shipped_seccomp_profile_is_the_one_applied(module_session: Client) -> None:
    # io_uring_setup, which the engine's own default profile allows, is refused by the shipped one.
    code = (
        "import ctypes, os\nlibc = ctypes.CDLL(None, use_errno=True)\nparams = ctypes.create_string_buffer(120)\n"
        "print(libc.syscall(425, 8, params), os.strerror(ctypes.get_errno()))"
    )
    result = await module_session.call_tool("run_python", {"code": code})
    assert result.structured_content["stdout"] == "-1 Operation not permitted\n", result


def test_a_policy_naming_gvisor_is_refused_not_run_on_runc(runtime: DockerRuntime) -> None:
    # Podman's Docker-compatible API drops HostConfig.Runtime: run, `strict` would get runc without a word.
    assert runtime.info().runtimes == ("runc",)
    result = run_cli("call", "--policy", "strict", "execute_command", "--arg", "command=dmesg")
    assert result.returncode != 0, result.stdout
    assert "defaults.runtime: 'runsc' is not available on this host's engine (it has: runc)" in result.stderr
    assert "Podman's Docker-compatible API ignores a container's runtime: use Docker for it" in result.stderr
