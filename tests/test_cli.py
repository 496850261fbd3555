"""The one-shot `call` command and the conformance suite go through real MCP sessions."""

import subprocess

from sandbox_server.sandbox.docker_runtime import DockerRuntime
from tests.conftest import ROOT, left_by_exited_servers, run_cli


def test_call_prints_the_result_and_exits_zero(runtime: DockerRuntime) -> None:
    result = run_cli("call", "execute_command", "--arg", "command=echo from-a-call")
    assert result.returncode == 0, result.stderr
    assert "exit code 0" in result.stdout and "from-a-call" in result.stdout


def test_call_exits_one_on_an_error_result(runtime: DockerRuntime) -> None:
    result = run_cli("call", "execute_command", "--json", '{"command": "exit 4"}')
    assert result.returncode == 1
    assert "exit code 4" in result.stdout


def test_the_mcp_conformance_suite_passes_its_applicable_scenarios(runtime: DockerRuntime) -> None:
    result = subprocess.run(
        [str(ROOT / "scripts" / "conformance")], capture_output=True, text=True, timeout=600, check=False
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.count(" passed") == 6


def test_the_demo_runs_a_real_session_and_succeeds(runtime: DockerRuntime) -> None:
    result = run_cli("demo")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "tools: analyze_csv, execute_command, run_python" in result.stdout
    assert "timed out after 1 s" in result.stdout and result.stdout.count("[image image/png") == 2
    assert "| north | amount | 2 | 162.5 | 81.25 |" in result.stdout
    assert "refused: filepath '../../etc/passwd' is not inside a readable root" in result.stdout
    assert not left_by_exited_servers()
