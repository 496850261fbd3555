"""`sandbox-server doctor` proves the limits on this host, and says what to do when it cannot."""

import json

from sandbox_server.sandbox.docker_runtime import DockerRuntime
from tests.conftest import left_by_exited_servers, run_cli


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
    assert not left_by_exited_servers()


def test_doctor_without_an_engine_fails_and_says_how_to_start_it(tmp_path) -> None:
    result = run_cli("doctor", env={"DOCKER_HOST": f"unix://{tmp_path}/no-engine.sock"})
    assert result.returncode == 1
    assert "no Docker engine answers" in result.stdout
    assert "scripts/engine-up" in result.stdout
    assert "NOT healthy" in result.stdout
