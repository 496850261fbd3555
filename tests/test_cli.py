"""The one-shot `call` command, `setup` and the conformance suite go through the real server and engine."""

import json
import os
import subprocess
from pathlib import Path

import psutil

from sandbox_server.sandbox.engine.runtime import DockerRuntime
from sandbox_server.sandbox.template.cgroups import moves_mount
from tests.conftest import ROOT, left_by_exited_servers, run_cli


def test_call_prints_the_result_and_exits_zero(runtime: DockerRuntime) -> None:
    result = run_cli("call", "execute_command", "--arg", "command=echo from-a-call")
    assert result.returncode == 0, result.stderr
    assert "exit code 0" in result.stdout and "from-a-call" in result.stdout


def test_call_exits_one_on_an_error_result(runtime: DockerRuntime) -> None:
    result = run_cli("call", "execute_command", "--json", '{"command": "exit 4"}')
    assert result.returncode == 1
    assert "exit code 4" in result.stdout


def test_call_takes_arguments_from_a_file_sends_uploads_and_saves_what_comes_back(
    tmp_path: Path, runtime: DockerRuntime
) -> None:
    (tmp_path / "data.csv").write_text("a,b\n1,2\n")
    (tmp_path / "notes.txt").write_bytes(b"\xffbinary\x00")
    code = "import shutil, matplotlib.pyplot as plt\nshutil.copy('in/notes.bin', 'out/sub/notes.bin')\nplt.plot([1, 2])"
    (tmp_path / "args.json").write_text(json.dumps({"code": "import os\nos.makedirs('out/sub')\n" + code}))
    result = run_cli(
        "call", "run_python", "--json", "@args.json", "--upload", "data.csv", "--upload", "notes.txt:in/notes.bin",
        "--save", "saved", cwd=tmp_path,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    assert (tmp_path / "saved/sub/notes.bin").read_bytes() == b"\xffbinary\x00"
    assert (tmp_path / "saved/figure-1.png").read_bytes().startswith(b"\x89PNG")
    listed = run_cli(
        "call", "execute_command", "--json", "-", "--upload", "data.csv", cwd=tmp_path,
        stdin='{"command": "cat", "args": ["data.csv"]}',
    )  # fmt: skip
    assert listed.returncode == 0 and "1,2" in listed.stdout, listed.stdout + listed.stderr


def test_call_with_a_broken_policy_prints_the_servers_reason_on_one_line_and_exits_two(tmp_path: Path) -> None:
    broken = tmp_path / "broken.yaml"
    broken.write_text("defaults:\n  limits: {memory_mb: -5}\n")
    result = run_cli("call", "execute_command", "--policy", str(broken), "--arg", "command=true")
    assert result.returncode == 2
    assert result.stderr.count("\n") == 1 and "Traceback" not in result.stderr, result.stderr
    assert (
        "policy refused" in result.stderr and "defaults.limits.memory_mb: -5 is less than the minimum" in result.stderr
    )


def test_call_without_an_engine_says_so_on_one_line_and_exits_two(tmp_path: Path) -> None:
    result = run_cli(
        "call", "execute_command", "--arg", "command=true", env={"DOCKER_HOST": f"unix://{tmp_path}/no-engine.sock"}
    )
    assert result.returncode == 2
    assert (
        result.stderr.startswith("sandbox-server call: sandbox engine unavailable") and result.stderr.count("\n") == 1
    )


def test_call_finds_a_tool_by_its_own_name_under_a_prefix(runtime: DockerRuntime) -> None:
    result = run_cli("call", "execute_command", "--tool-prefix", "sbx_", "--arg", "command=echo prefixed")
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.startswith("$ execute_command") and "prefixed" in result.stdout


def test_call_of_an_unknown_tool_names_the_tools_and_exits_two(runtime: DockerRuntime) -> None:
    result = run_cli("call", "exec", "--arg", "command=ls")
    assert result.returncode == 2, result.stdout + result.stderr
    assert "Traceback" not in result.stderr and result.stderr.count("\n") == 1, result.stderr
    assert "no tool 'exec' here" in result.stderr
    assert all(name in result.stderr for name in ("execute_command", "run_python", "analyze_csv"))


def test_call_never_echoes_an_uploads_content(tmp_path: Path, runtime: DockerRuntime) -> None:
    (tmp_path / "sales.csv").write_text("region,amount\n" + "north,1.5\n" * 50_000)
    result = run_cli(
        "call", "execute_command", "--arg", "command=wc -l sales.csv", "--upload", "sales.csv", cwd=tmp_path
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "50001 sales.csv" in result.stdout
    assert len(result.stdout) < 2_000, f"the upload was echoed: {len(result.stdout)} characters"
    assert "characters, not shown>" in result.stdout.splitlines()[0]


def test_a_call_leaves_no_workspace_behind_and_says_nothing_is_kept(tmp_path: Path, runtime: DockerRuntime) -> None:
    state = tmp_path / "state"
    result = run_cli("call", "run_python", "--arg", "code=df = 41; open('kept.txt', 'w').write('x')",
                     env={"SANDBOX_STATE_DIR": str(state)})  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    assert "variables kept for the next cell" not in result.stdout  # a promise the next call could not keep
    said = "note: nothing is kept: this server ends with its one call, and the call's workspace (its files and "
    assert said + "run_python's variables) with it" in result.stdout, result.stdout
    left = sorted(path.name for path in (state / "workspaces").glob("*") if path.name.startswith(("ws-", "img-")))
    assert left == []  # it ran in a kept workspace (the default), which went with the server process
    again = run_cli("call", "run_python", "--arg", "code=df", env={"SANDBOX_STATE_DIR": str(state)})
    assert again.returncode == 1 and "NameError: name 'df' is not defined" in again.stdout  # as said
    strict = run_cli("call", "run_python", "--policy", "strict", "--arg", "code=x = 1")
    said = "note: variables are not kept: policy 'strict' keeps no workspace (field workspace.persist), so the next "
    assert said + "cell starts empty" in strict.stdout, strict.stdout


def test_setup_finds_everything_ready_and_does_nothing_more(runtime: DockerRuntime) -> None:
    result = run_cli("setup")
    assert result.returncode == 0, result.stderr
    assert "images: all current, nothing rebuilt" in result.stderr and "Step " not in result.stderr
    # A sandbox joins its cgroups without waiting for the kernel: the cgroup2 hierarchy is mounted favordynmods.
    found = moves_mount(Path("/proc/self/mountinfo").read_text())
    assert found is not None and found[1], found


def test_the_mcp_conformance_suite_passes_its_applicable_scenarios(runtime: DockerRuntime) -> None:
    result = subprocess.run(
        [str(ROOT / "scripts" / "conformance")], capture_output=True, text=True, timeout=600, check=False
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.count(" passed") == 6


def test_the_demo_runs_a_real_session_and_succeeds(runtime: DockerRuntime) -> None:
    result = run_cli("demo")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "tools: analyze_csv, execute_command, files, run_python" in result.stdout
    assert "timed out after 1 s" in result.stdout and result.stdout.count("[image image/png") == 2
    assert "| north | amount | 2 | 162.5 | 81.25 |" in result.stdout
    assert "refused: filepath '../../etc/passwd' is not inside a readable root" in result.stdout
    assert not left_by_exited_servers()


def test_limits_the_hosts_engine_cannot_give_are_refused_by_policy_check_naming_the_field_and_the_host(
    tmp_path: Path, runtime: DockerRuntime
) -> None:
    greedy = tmp_path / "greedy.yaml"
    memory = psutil.virtual_memory().total // 2**20 + 1024  # (the schema's own maximum, 65536, is above it here)
    greedy.write_text(f"extends: default\ndefaults:\n  limits: {{cpus: 64, memory_mb: {memory}}}\n")
    checked = run_cli("policy", "check", str(greedy))
    served = run_cli("call", "execute_command", '{"command": "true"}', "--policy", str(greedy))
    assert checked.returncode == 1, checked.stdout
    assert f"limits.cpus: 64 is more than the {os.cpu_count()} CPU(s) this host's engine has" in checked.stdout
    assert f"limits.memory_mb: {memory} is more than the" in checked.stdout, checked.stdout
    assert served.returncode == 2 and "limits.cpus: 64" in served.stderr, served.stderr  # refused at load too
