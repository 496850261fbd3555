"""`sandbox-server doctor` proves the limits on this host, and says what to do when it cannot."""

import contextlib
import json
import time
from dataclasses import replace
from pathlib import Path

import pytest

from sandbox_server.ops.posture import SandboxView, compare, read_view
from sandbox_server.policy.loader import load_policy
from sandbox_server.sandbox import wire
from sandbox_server.sandbox.engine.runtime import DockerRuntime
from sandbox_server.sandbox.spec import Mount
from tests.conftest import ENGINE, left_by_exited_servers, networks_left_by_exited_servers, run_cli


def test_doctor_is_healthy_and_proves_the_limits(runtime: DockerRuntime) -> None:
    result = run_cli("doctor", "--json")
    assert result.returncode == 0, result.stdout + result.stderr
    report = json.loads(result.stdout)
    checks = {check["name"]: check for check in report["checks"]}
    assert report["healthy"] is True
    for name in (
        "probe: non-root user",
        "probe: no capabilities",
        "probe: network none",
        "probe: read-only root",
        "probe: memory limit enforced",
        "probe: pids limit enforced",
    ):
        assert checks[name]["ok"], checks[name]
    assert "oom_killed=True" in checks["probe: memory limit enforced"]["detail"]
    warm = checks["warm interpreter"]
    assert warm["ok"] and "preloaded in" in warm["detail"] and "MiB" in warm["detail"], warm
    # The default policy's run_python and analyze_csv share one pool: 2 waiting, up to 8 under demand.
    assert "the policy's pools keep 2 of them" in warm["detail"] and "grow to 8" in warm["detail"], warm
    assert "within host.pool_memory_mb 2048 MiB" in warm["detail"], warm
    named = checks["python-data libraries"]["detail"]
    assert named.startswith("numpy 2.") and ", pandas 2." in named and "scikit-learn" in named, named
    runc = checks["sandboxes by runc"]  # made one, or says why the engine makes them all
    if ENGINE == "podman":
        assert not runc["ok"] and not runc["required"] and "the engine is Podman" in runc["detail"], runc
    else:
        assert runc["ok"] and "`true` in a sandbox forked from its image template exited 0" in runc["detail"], runc
        assert "`true` in a gVisor sandbox runsc made exited 0" in runc["detail"], runc
    assert not left_by_exited_servers()


@pytest.mark.anyio
async def test_doctor_says_which_module_a_warm_interpreter_could_not_import(runtime: DockerRuntime) -> None:
    from sandbox_server.ops.doctor import WarmPlan, warm_interpreter_check

    check = await warm_interpreter_check(runtime, WarmPlan(("pandas", "no_such_module")))
    assert not check.ok and not check.required
    assert "preload no_such_module: ModuleNotFoundError" in check.detail and "drop them" in check.fix


def test_doctor_without_an_engine_fails_and_says_how_to_start_it(tmp_path: Path) -> None:
    result = run_cli("doctor", env={"DOCKER_HOST": f"unix://{tmp_path}/no-engine.sock"})
    assert result.returncode == 1
    assert "no Docker engine answers" in result.stdout
    assert "sandbox-server setup" in result.stdout
    assert "NOT healthy" in result.stdout


@pytest.mark.parametrize(
    ("policy", "expected"),
    [
        ("default", ["user", "capabilities (all dropped)", "no-new-privileges", "seccomp_profile", "limits.memory_mb",
                     "limits.pids", "limits.cpus", "network", "limits.nofile", "limits.file_size_mb", "read-only root",
                     "limits.tmp_mb", "limits.workspace_mb", "limits.shm_mb", "workspace.exec", "/tmp noexec"]),
        ("strict", ["user", "no-new-privileges", "seccomp_profile", "limits.memory_mb", "limits.pids", "network"]),
        ("data-science", ["mounts[0].mode", "limits.memory_mb"]),
    ],
)  # fmt: skip
def test_posture_reads_from_the_host_what_the_kernel_applied(runtime: DockerRuntime, policy: str,
                                                             expected: list[str]) -> None:  # fmt: skip
    result = run_cli("doctor", "--posture", "--policy", policy, "--json")
    report = json.loads(result.stdout)
    posture = {check["name"]: check for check in report["checks"] if check["name"].startswith("posture ")}
    assert report["healthy"] is True, [check for check in report["checks"] if not check["ok"]]
    # Tools whose containers are alike are checked once (the files tool's are the shell's, where workspaces are
    # kept); strict's run_python preloads less than its analyze_csv.
    data_tools = ("run_python", "analyze_csv") if policy == "strict" else ("run_python+analyze_csv",)
    shell = "execute_command" if policy == "strict" else "execute_command+files"
    for tool in (shell, *data_tools):
        for field in expected:
            assert posture[f"posture {policy}/{tool}: {field}"]["ok"]
    assert result.returncode == 0
    assert not left_by_exited_servers()


def _waiting(runtime: DockerRuntime, container_id: str) -> list[int]:
    """The sandbox's processes once its launcher waits for its request (read from the host's /proc: nothing to
    await), not while its start still runs a program of its own (on a loaded host, a moment after it is made)."""
    deadline = time.monotonic() + 10
    while True:
        pids = runtime.host_pids(container_id)
        lines = []
        for pid in pids:
            with contextlib.suppress(OSError):
                lines.append(Path(f"/proc/{pid}/cmdline").read_bytes())
        # the launcher itself (`sh sandbox-launch`), not the shell before it that sets the limits (`sh -c … launch`)
        settled = lines and all(line.split(b"\0")[1:2] == [wire.LAUNCHER.encode()] for line in lines)
        if settled or time.monotonic() > deadline:
            return pids
        time.sleep(0.01)


def _said(view: SandboxView) -> list[str]:
    """Each process read, as the host saw it then (for a failure's message)."""
    lines = []
    for process in view.processes:
        try:
            said = Path(f"/proc/{process.pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            said = "(ended)"
        lines.append(f"{process.pid} nofile={process.nofile} uid={process.uid}: {said}")
    return lines


def test_posture_names_every_field_the_kernel_did_not_apply(runtime: DockerRuntime, tmp_path: Path) -> None:
    """A real default sandbox, read from the host, held against a policy that wants other limits."""
    tool = load_policy("default", ["analyze_csv", "execute_command", "files", "run_python"]).for_tool("execute_command")
    warm = runtime.prepare(tool.container_spec())
    try:
        view = read_view(_waiting(runtime, warm.container_id))
    finally:
        runtime.discard(warm)
    unapplied = [f"{check.name}: {check.detail}" for check in compare(view, tool, "same") if not check.ok]
    assert compare(view, tool, "same") and not unapplied, (unapplied, _said(view))
    wanted = replace(
        tool,
        user="1001:1001",
        limits=replace(tool.limits, memory_mb=256, pids=64, cpus=0.5, nofile=128, tmp_mb=32, workspace_exec=False),
        mounts=(Mount(str(tmp_path), "/data"),),
    )
    failed = {check.name.split(": ", 1)[1]: check.detail for check in compare(view, wanted, "other") if not check.ok}
    assert set(failed) == {"user", "limits.memory_mb", "limits.memory_mb (no swap)", "limits.pids", "limits.cpus",
                           "limits.nofile", "limits.tmp_mb", "mounts[0].mode", "workspace.exec"}, failed  # fmt: skip
    assert failed["limits.memory_mb"] == (
        "policy field limits.memory_mb wants 268435456 bytes; the kernel applied 536870912 bytes"
    )
    assert failed["mounts[0].mode"].endswith("the kernel applied /data not mounted")
    assert failed["workspace.exec"].endswith("wants /workspace noexec; the kernel applied /workspace exec")


def test_posture_tries_an_allow_list_through_its_own_proxy_against_an_upstream_of_its_own(
    runtime: DockerRuntime, tmp_path: Path
) -> None:
    """The policy's proxy, from its own allow list, with the check's upstream behind it: a listed host answers, an
    unlisted one is refused before it reaches the upstream its name leads to, and nothing goes around the proxy.
    Two allow lists: HTTPS through CONNECT (port 443) and plain HTTP on a port of its own."""
    policy = tmp_path / "allow.yaml"
    policy.write_text(
        "extends: default\n"
        "tools:\n"
        "  execute_command: {network: {allow: [pypi.org, files.pythonhosted.org]}}\n"
        "  run_python: {network: {allow: ['mirror.example.org:8080']}}\n"
    )
    result = run_cli("doctor", "--posture", "--policy", str(policy), "--json")
    report = json.loads(result.stdout)
    checks = {check["name"]: check for check in report["checks"]}
    assert report["healthy"] is True, json.dumps([check for check in report["checks"] if not check["ok"]], indent=1)
    for tool, where in (("execute_command", "pypi.org:443"), ("run_python", "mirror.example.org:8080")):
        name = f"posture allow/{tool}"
        assert checks[f"{name}: network proxy"]["detail"].startswith("answers at "), checks
        assert checks[f"{name}: network.allow (a listed host)"]["detail"] == (
            f"{where} through the proxy: status 200, page"
        )
        unlisted = checks[f"{name}: network.allow (an unlisted host)"]["detail"]
        assert "status 403, refusal; the upstream never saw it" in unlisted, unlisted
        assert checks[f"{name}: network (no way around the proxy)"]["detail"].endswith(": closed")
        assert checks[f"{name}: network (sandboxes apart)"]["ok"]
        assert checks[f"{name}: network"]["detail"] == "interfaces ['eth0', 'lo']"
    # analyze_csv has no network under this policy: its sandbox has loopback alone.
    assert checks["posture allow/analyze_csv: network"]["detail"] == "interfaces ['lo']"
    assert not left_by_exited_servers() and not networks_left_by_exited_servers()
