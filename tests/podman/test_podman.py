"""On Podman's Docker-compatible service: the suite's second pass (`scripts/run test` runs the execute_command,
run_python and doctor tests again with DOCKER_HOST at Podman's socket, and these with them).

What differs from Docker is named by `doctor` and listed in docs/sandbox.md; each difference is shown here to be
exactly what the list says, and the limits beside it to hold."""

from __future__ import annotations

import json
from pathlib import Path

import docker
import mcp_types as types
import pytest
from mcp import Client

from sandbox_server.sandbox.engine.runtime import DockerRuntime
from sandbox_server.sandbox.engine.services import SERVICE_LABEL
from tests.conftest import run_cli

pytestmark = pytest.mark.anyio

TMP_INODES = 64 * 256
"""The inode cap Docker gives the default policy's /tmp (tmp_mb 64): max(1024, tmp_mb * 256)."""


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


async def test_services_and_allow_lists_are_refused_saying_why(module_session: Client, tmp_path: Path) -> None:
    # Podman's networks take none of Docker's bridge options (no gateway, no traffic between sandboxes) and resolve
    # no service names: rather than a weaker network, none.
    started = await module_session.call_tool(
        "execute_command", {"command": "exec python3 -m http.server 8000", "service": {"name": "web", "port": 8000}}
    )
    assert started.is_error, started
    text = started.content[0].text if isinstance(started.content[0], types.TextContent) else ""
    assert text.startswith("refused: Podman's networks take none of the Docker bridge options"), text
    assert "services are refused" in text and started.structured_content["error"]["field"] == "services", started
    assert not [c for c in docker.from_env().api.containers(all=True, filters={"label": SERVICE_LABEL})]
    policy = tmp_path / "open.yaml"
    policy.write_text("extends: default\nname: open\ndefaults:\n  network: {allow: [pypi.org]}\n")
    result = run_cli("policy", "check", str(policy))
    assert result.returncode != 0, result.stdout
    assert "defaults.network: Podman's networks take none of the Docker bridge options" in result.stdout + result.stderr
    assert "use Docker for this policy, or set network: none" in result.stdout + result.stderr
