"""Policy files: shipped ones pass, broken ones are refused with file and field, extends merges."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import anyio
import pytest
from jsonschema import Draft202012Validator

from sandbox_server.access.admission import Admission
from sandbox_server.errors import ConfigError, Refusal
from sandbox_server.policy import HostAdmission, RateLimits
from sandbox_server.policy.loader import HostFacts, load_policy, policy_errors
from sandbox_server.policy.references import policy_path
from sandbox_server.sandbox.seccomp import build_profile, known_syscalls, profile_path
from sandbox_server.state.folder import default_state_dir
from sandbox_server.tools import all_tools
from tests.conftest import run_cli

TOOLS = [tool.name for tool in all_tools()]
BOTH = HostFacts(frozenset({"runc", "runsc"}))


def _write(folder: Path, name: str, text: str) -> Path:
    path = folder / name
    path.write_text(text)
    return path


def test_every_shipped_policy_passes_policy_check() -> None:
    result = run_cli("policy", "check", "default", "strict", "data-science")
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.count(": ok") == 3


def test_policy_check_of_a_folder_s_yaml_checks_each_policy_and_knows_its_test_cases_by_their_name(
    tmp_path: Path,
) -> None:
    from sandbox_server.shipped import policies_dir

    shipped = sorted(str(path) for path in policies_dir().glob("*.yaml"))  # as `policy check policies/*.yaml`
    result = run_cli("policy", "check", *shipped)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.count(": ok\n") == len(shipped) // 2
    assert "default.tests.yaml: test cases of default.yaml: 11 case(s), well formed" in result.stdout
    _write(tmp_path, "team.yaml", "extends: default\n")
    cases = _write(tmp_path, "team.tests.yaml", "cases:\n  - {name: one, tool: execute_command, expect: maybe}\n")
    broken = run_cli("policy", "check", str(tmp_path / "team.yaml"), str(cases))
    assert broken.returncode == 1 and f"{tmp_path / 'team.yaml'}: ok" in broken.stdout, broken.stdout
    assert f"{cases}: test cases: cases refused:" in broken.stdout and "expect" in broken.stdout, broken.stdout


def test_a_broken_policy_is_refused_with_every_error_and_its_field_path(tmp_path: Path) -> None:
    path = _write(
        tmp_path,
        "broken.yaml",
        "defaults:\n  limits:\n    memory_mb: 'lots'\n    pids: 2\n  colour: blue\n"
        "tools:\n  nonexistent_tool: {enabled: false}\n"
        "approval:\n  commands: ['']\n  writable_mounts: sometimes\n",
    )
    result = run_cli("policy", "check", str(path))
    assert result.returncode == 1
    assert f"{path}: defaults.limits.memory_mb: 'lots' is not of type 'integer'" in result.stdout
    assert f"{path}: defaults.limits.pids: 2 is less than the minimum of 8" in result.stdout
    assert "colour" in result.stdout and "Unevaluated properties are not allowed" in result.stdout
    assert f"{path}: approval.commands[0]: '' should be non-empty" in result.stdout
    assert f"{path}: approval.writable_mounts: 'sometimes' is not of type 'boolean'" in result.stdout


def test_a_mistake_under_defaults_is_said_once_naming_the_tools_it_reaches(tmp_path: Path) -> None:
    path = _write(
        tmp_path,
        "once.yaml",
        "extends: default\ndefaults:\n  limits: {timeout_s: 100, max_timeout_s: 50}\n"
        "tools:\n  run_python: {limits: {timeout_s: 10, max_timeout_s: 20}}\n"
        "  analyze_csv: {commands: {shell: true, allow: [ls]}}\n",
    )
    result = run_cli("policy", "check", str(path))
    lines = [line.strip() for line in result.stdout.splitlines()[1:]]
    assert lines == [
        f"{path}: defaults.limits.max_timeout_s: 50 is below limits.timeout_s (100) (so for execute_command, files, "
        "analyze_csv)",  # run_python sets its own
        f"{path}: tools.analyze_csv.commands.shell: must be false when commands.allow or commands.deny is set: a "
        "shell runs anything",
    ], result.stdout


def test_every_error_of_a_file_comes_in_one_run_each_with_a_way_out(tmp_path: Path) -> None:
    path = _write(
        tmp_path,
        "newcomer.yaml",
        "extends: default\nmounts: [{host: /tmp, sandbox: /data}]\nnetwrk: none\n"
        "tools:\n  run_pyton: {enabled: false}\n  execute_command: {limts: {timeout_s: 5}}\n"
        "rate: {calls_per_minut: 5}\napproval: {tools: [analyse_csv]}\n",
    )
    result = run_cli("policy", "check", str(path))
    assert result.returncode == 1
    lines = result.stdout.splitlines()
    assert lines[0] == f"{path}: 5 error(s)", result.stdout
    # a schema error and the name checks together: the misspelled tool is not held back until the rest is fixed
    assert "'mounts' belongs under defaults or tools.<tool>" in result.stdout
    assert "did you mean 'network' (which belongs under defaults or tools.<tool>) instead of 'netwrk'?" in result.stdout
    assert f"{path}: rate: " in result.stdout and "did you mean 'calls_per_minute'" in result.stdout
    assert (
        f"{path}: tools.execute_command: " in result.stdout
        and "did you mean 'limits' instead of 'limts'?" in result.stdout
    )
    assert f"{path}: tools.run_pyton: no such tool 'run_pyton' (did you mean 'run_python'?" in result.stdout
    assert f"{path}: approval.tools[0]: no such tool 'analyse_csv' (did you mean 'analyze_csv'?" in result.stdout
    served = run_cli("serve", "--policy", str(path), timeout_s=60)  # serve refuses it the same way, all at once
    assert served.returncode != 0 and "did you mean 'run_python'?" in served.stderr
    assert "'mounts' belongs under defaults" in served.stderr


def test_semantic_errors_name_the_field(tmp_path: Path) -> None:
    path = _write(
        tmp_path,
        "p.yaml",
        "defaults:\n  runtime: runsc\n  commands: {shell: true, allow: [ls]}\n"
        "  limits: {timeout_s: 50, max_timeout_s: 10}\n"
        "  mounts: [{host: /no/such/folder, sandbox: /data}]\n"
        "tools:\n  nonexistent_tool: {enabled: false}\n"
        "approval:\n  tools: [run_python, shell_tool]\n",
    )
    errors = policy_errors(path, TOOLS, HostFacts(frozenset({"runc"})))
    text = "\n".join(errors)
    assert f"{path}: defaults.runtime: 'runsc' is not available on this host's engine" in text
    assert f"{path}: defaults.commands.shell: must be false when commands.allow" in text
    assert f"{path}: defaults.limits.max_timeout_s: 10 is below limits.timeout_s (50)" in text
    assert f"{path}: defaults.mounts[0].host: /no/such/folder does not exist" in text
    assert f"{path}: tools.nonexistent_tool: no such tool" in text
    assert f"{path}: approval.tools[1]: no such tool 'shell_tool'" in text and "approval.tools[0]" not in text


def test_the_shipped_seccomp_profile_is_current_and_refuses_io_uring() -> None:
    shipped = json.loads(profile_path().read_text())
    assert shipped == build_profile(known_syscalls()), "regenerate it: python -m sandbox_server.sandbox.seccomp"
    allowed = {name for rule in shipped["syscalls"] if rule["action"] == "SCMP_ACT_ALLOW" for name in rule["names"]}
    assert not {name for name in allowed if name.startswith("io_uring")}
    assert {"read", "write", "execve", "clone", "futex", "mmap"} <= allowed
    assert not {"unshare", "setns", "mount", "bpf", "keyctl", "finit_module"} & allowed
    # What the engine's default keeps from a sandbox with no capability stays refused here.
    refused = {"fanotify_init", "move_pages", "set_mempolicy", "mbind", "migrate_pages", "pidfd_getfd", "chroot"}
    assert not refused & allowed
    assert [entry["subArchitectures"] for entry in shipped["archMap"]] == [[], []]  # no i386 nor x32 calls
    rules = {name: rule for rule in shipped["syscalls"] for name in rule["names"] if rule.get("args")}
    assert rules["socket"]["args"] == [{"index": 0, "value": 40, "valueTwo": 0, "op": "SCMP_CMP_NE"}]  # no AF_VSOCK
    personas = [r["args"][0]["value"] for r in shipped["syscalls"] if r["names"] == ["personality"]]
    assert sorted(personas) == [0, 8, 0x20000, 0x20008, 0xFFFFFFFF]  # ADDR_NO_RANDOMIZE (0x40000) not among them
    tool = load_policy("default", TOOLS, BOTH).for_tool("execute_command")
    assert tool.seccomp_profile is not None and json.loads(tool.seccomp_profile) == shipped


def test_a_seccomp_profile_under_runsc_is_refused_as_it_would_not_apply(tmp_path: Path) -> None:
    path = _write(tmp_path, "p.yaml", "extends: default\ndefaults:\n  runtime: runsc\n")
    errors = policy_errors(path, TOOLS, BOTH)
    assert f"{path}: defaults.seccomp_profile: runsc does not apply a container seccomp profile" in "\n".join(errors)
    assert load_policy("strict", TOOLS, BOTH).for_tool("execute_command").seccomp_profile is None


def test_extends_merges_mappings_and_replaces_lists(tmp_path: Path) -> None:
    _write(tmp_path, "base.yaml", "defaults:\n  limits: {memory_mb: 256, pids: 64}\n  env: {set: {A: '1', B: '2'}}\n")
    child = _write(
        tmp_path,
        "child.yaml",
        "extends: base.yaml\ndefaults:\n  limits: {memory_mb: 128}\n"
        "tools:\n  execute_command:\n    limits: {timeout_s: 5}\n",
    )
    policy = load_policy(str(child), TOOLS, BOTH)
    assert policy.name == "child"
    assert policy.default.limits.memory_mb == 128 and policy.default.limits.pids == 64
    assert dict(policy.default.env) == {"A": "1", "B": "2"}
    tool = policy.for_tool("execute_command")
    assert tool.limits.timeout_s == 5 and tool.limits.memory_mb == 128


def test_a_pool_grows_past_the_concurrency_cap_and_a_files_defaults_pool_is_every_tools(tmp_path: Path) -> None:
    default = load_policy("default", TOOLS, BOTH)
    shell, python = default.for_tool("execute_command"), default.for_tool("run_python")
    # Calls one after another use one container each: the shell pool may hold more than run at once.
    assert (shell.pool_size, shell.pool_most) == (2, 40) and shell.pool_most > default.rate.concurrent_calls
    assert (python.pool_size, python.pool_most) == (2, 8)
    # A file's defaults.pool replaces the pools of the policy it extends, for every tool it does not name.
    child = _write(tmp_path, "child.yaml", "extends: default\ndefaults:\n  pool: {min: 1, max: 4, idle_s: 2}\n")
    policy = load_policy(str(child), TOOLS, BOTH)
    assert {(t.pool_size, t.pool_most, t.pool_idle_s) for t in map(policy.for_tool, TOOLS)} == {(1, 4, 2)}
    named = _write(tmp_path, "named.yaml", "extends: child.yaml\ntools:\n  execute_command:\n    pool: {max: 30}\n")
    policy = load_policy(str(named), TOOLS, BOTH)
    assert policy.for_tool("execute_command").pool_most == 30 and policy.for_tool("run_python").pool_most == 4
    assert load_policy("strict", TOOLS, BOTH).for_tool("execute_command").pool_most == 2
    # Where runc itself makes the sandboxes (cheaper to keep waiting), the default's shell pool is deeper.
    assert (shell.pool_on_runc, python.pool_on_runc) == ((100, 100), None)
    assert {policy.for_tool(tool).pool_on_runc for tool in TOOLS} == {None}  # not inherited past a pool of its own
    deeper = _write(
        tmp_path,
        "deeper.yaml",
        "extends: child.yaml\ntools:\n  execute_command:\n    pool: {ahead: 3, runc: {ahead: 10}}\n",
    )
    assert load_policy(str(deeper), TOOLS, BOTH).for_tool("execute_command").pool_on_runc == (
        10,
        4,
    )  # its max, as elsewhere


def test_an_extends_cycle_is_refused(tmp_path: Path) -> None:
    _write(tmp_path, "a.yaml", "extends: b.yaml\n")
    _write(tmp_path, "b.yaml", "extends: a.yaml\n")
    with pytest.raises(ConfigError, match="comes back to itself"):
        load_policy(str(tmp_path / "a.yaml"), TOOLS, BOTH)


def test_strict_extends_default_with_gvisor_and_no_shell() -> None:
    policy = load_policy("strict", TOOLS, BOTH)
    tool = policy.for_tool("execute_command")
    assert tool.runtime == "runsc" and tool.allow_shell is False
    assert tool.limits.memory_mb == 128 and tool.limits.nofile == 64
    assert "ls" in tool.commands_allow


def test_policy_schema_command_prints_a_valid_2020_12_schema() -> None:
    result = run_cli("policy", "schema")
    assert result.returncode == 0
    printed = json.loads(result.stdout)
    Draft202012Validator.check_schema(printed)
    assert printed["$defs"]["limits"]["properties"]["memory_mb"]["default"] == 512


def test_policy_diff_and_explain_show_the_container_settings() -> None:
    diff = run_cli("policy", "diff", "default", "strict")
    assert diff.returncode == 1  # they differ, as diff(1) says
    assert "tools.execute_command.container.runtime: 'runc' -> 'runsc'" in diff.stdout
    assert "tools.execute_command.container.mem_limit: 536870912 -> 134217728" in diff.stdout
    assert "tools.execute_command.limits.memory_mb: 512 -> 128" in diff.stdout  # the files' own names
    assert "tools.execute_command.commands.shell: True -> False" in diff.stdout
    assert ".policy." not in diff.stdout and "commands_allow" not in diff.stdout and "allow_shell" not in diff.stdout
    same = run_cli("policy", "diff", "default", str(policy_path("default")))
    assert same.returncode == 0 and same.stdout == "no differences in effect\n", same.stdout
    explain = run_cli("policy", "explain", "default")
    settings = json.loads(explain.stdout)["tools"]["execute_command"]["container"]
    assert settings["cap_drop"] == ["ALL"] and settings["read_only"] is True and settings["network_mode"] == "none"


def test_explain_shows_a_pool_as_the_nearest_file_writes_it_and_an_allow_lists_network_as_it_runs(
    tmp_path: Path,
) -> None:
    toolchain = json.loads(run_cli("policy", "explain", "toolchain").stdout)
    pool = toolchain["tools"]["execute_command"]["pool"]
    assert pool == {"min": 2, "max": 8, "ahead": 0, "idle_s": 300.0}, pool  # toolchain.yaml's, not default's 40/100
    assert toolchain["set_by"]["tools.execute_command.pool.max"].endswith("toolchain.yaml")
    assert "tools.execute_command.pool.ahead" not in toolchain["set_by"]
    assert load_policy("toolchain", TOOLS, BOTH).for_tool("execute_command").pool_most == 8
    assert load_policy("default", TOOLS, BOTH).for_tool("execute_command").pool_on_runc == (100, 100)
    networked = _write(
        tmp_path,
        "pypi.yaml",
        "extends: default\ntools:\n  run_python:\n    network: {allow: [pypi.org, 'files.example:8443']}\n",
    )
    explained = json.loads(run_cli("policy", "explain", str(networked)).stdout)["tools"]["run_python"]
    assert explained["network"] == {"allow": ["pypi.org", "files.example:8443"]}
    assert explained["container"]["network_mode"].startswith("sandbox-egress-"), explained["container"]
    assert "allow list's proxy" in explained["container"]["network_mode"]


def test_policy_explain_and_diff_show_every_section_which_file_set_each_setting_and_the_offered_tools_alone(
    tmp_path: Path,
) -> None:
    mine = _write(tmp_path, "mine.yaml", "extends: default\nrate: {calls_per_minute: 7}\nservices: {tools: []}\n")
    explained = json.loads(run_cli("policy", "explain", str(mine)).stdout)
    for section in ("rate", "host", "audit", "workspace", "approval", "tasks", "services"):
        assert section in explained, section
    assert explained["services"]["tools"] == [] and explained["workspace"]["persist"] is True
    assert explained["audit"]["path"] is None  # as written; and where the trail goes all the same:
    assert explained["audit"]["written_to"].startswith(f"{default_state_dir() / 'audit.jsonl'} (the state folder's")
    assert list(explained["tools"]) == [
        "execute_command",
        "files",
        "run_python",
        "analyze_csv",
        "workspaces",
    ]  # no services
    assert explained["tools"]["workspaces"] == {"runs_no_sandbox": True}
    set_by = explained["set_by"]
    assert set_by["rate.calls_per_minute"] == set_by["services.tools"] == str(mine)
    assert set_by["defaults.limits.memory_mb"].endswith("default.yaml")  # from what it extends
    assert "rate.concurrent_calls" not in set_by or not set_by["rate.concurrent_calls"].endswith("mine.yaml")
    diff = run_cli("policy", "diff", "default", str(mine)).stdout.splitlines()
    assert diff == [
        "tools.services: offered -> not offered",
        "rate.calls_per_minute: 120 -> 7",
        "services.tools: ['execute_command', 'run_python'] -> []",
    ], diff


def test_admission_rate_window_and_concurrency_are_answered_at_once() -> None:
    now = [1000.0]
    admission = Admission(
        RateLimits(calls_per_minute=2, concurrent_calls=1), HostAdmission(0, 1000), "p", lambda: now[0]
    )
    first = admission.admit("a")
    with pytest.raises(Refusal) as busy:
        admission.admit("b")
    assert busy.value.message.startswith("busy: 1 calls already running")
    assert (busy.value.kind, busy.value.field, busy.value.retry_after_s) == ("busy", "rate.concurrent_calls", 1)
    first.release()
    first.release()  # idempotent
    now[0] += 10
    admission.admit("a").release()
    with pytest.raises(Refusal) as limited:
        admission.admit("a")
    assert limited.value.message == "rate limited: 2 calls/min (policy 'p', field rate.calls_per_minute); retry in 50 s"
    assert (limited.value.kind, limited.value.retry_after_s) == ("rate_limited", 50)
    now[0] += 51
    admission.admit("a").release()


def test_a_tool_prefix_is_a_policy_field_with_a_safe_alphabet(tmp_path: Path) -> None:
    good = _write(tmp_path, "prefixed.yaml", "extends: default\ntool_prefix: sbx_\n")
    assert load_policy(str(good), TOOLS, BOTH).tool_prefix == "sbx_"
    bad = _write(tmp_path, "bad-prefix.yaml", "extends: default\ntool_prefix: 'sbx execute;'\n")
    [error] = policy_errors(bad, TOOLS, BOTH)
    assert error == (
        f"{bad}: tool_prefix: 'sbx execute;' is not allowed here: it must be at most 32 letters, digits, '_', '.' "
        "and '-'"
    )


def test_mounts_written_as_another_tool_writes_them_are_refused_in_words(tmp_path: Path) -> None:
    """Docker's {source, target} and a folder outside /data, /mnt and /srv: the fields a mount takes and the places
    it may appear, said in words (no regular expression)."""
    path = _write(tmp_path, "mounts.yaml", (
        "extends: data-science\ntools:\n  run_python:\n    mounts:\n"
        f"      - {{source: {tmp_path}, target: /data}}\n      - {{host: {tmp_path}, sandbox: /mydata}}\n"
    ))  # fmt: skip
    errors = policy_errors(path, TOOLS, BOTH)
    fields = "(the fields here: host, sandbox, mode (optional))"
    assert errors == [
        f"{path}: tools.run_python.mounts[0]: Additional properties are not allowed ('source', 'target' were "
        "unexpected): the fields here: host, sandbox, mode (optional)",
        f"{path}: tools.run_python.mounts[0]: 'host' is a required property {fields}",
        f"{path}: tools.run_python.mounts[0]: 'sandbox' is a required property {fields}",
        f"{path}: tools.run_python.mounts[1].sandbox: '/mydata' is not allowed here: it must be /data, /mnt or /srv, "
        "or a folder below one of them named with letters, digits, '.', '_' and '-' (e.g. /data/sales)",
    ]
    assert not any("^" in error for error in errors)


def test_every_pattern_of_the_schema_is_said_in_words() -> None:
    from sandbox_server.policy.documents import schema

    def patterns(node: object) -> list[dict[str, object]]:
        if isinstance(node, dict):
            found = [node] if "pattern" in node else []
            return found + [p for value in node.values() for p in patterns(value)]
        return [p for value in node for p in patterns(value)] if isinstance(node, list) else []

    found = patterns(schema())
    assert len(found) >= 10 and all(isinstance(node.get("x-in-words"), str) for node in found), found


def test_a_tools_mounts_that_leave_out_defaults_are_said_by_check_and_explain(tmp_path: Path) -> None:
    path = _write(tmp_path, "scratch.yaml", (
        f"extends: data-science\ndefaults:\n  mounts: [{{host: {tmp_path}, sandbox: /data}}]\n"
        f"tools:\n  run_python:\n    mounts: [{{host: {tmp_path}, sandbox: /mnt/scratch}}]\n"
        f"  analyze_csv:\n    mounts: [{{host: {tmp_path}, sandbox: /data}}, {{host: {tmp_path}, sandbox: /srv/x}}]\n"
    ))  # fmt: skip
    note = (
        "tools.run_python.mounts replaces defaults.mounts whole: /data is not mounted for run_python "
        "(list it in tools.run_python.mounts to keep it)"
    )
    assert load_policy(str(path), TOOLS, BOTH).notes == (note,)  # analyze_csv keeps /data: nothing to say
    checked = run_cli("policy", "check", str(path))
    assert checked.returncode == 0 and checked.stdout.splitlines()[1:] == [f"  note: {note}"], checked.stdout
    explained = run_cli("policy", "explain", str(path))
    assert json.loads(explained.stdout)["notes"] == [note]
    assert load_policy("data-science", TOOLS, BOTH).notes == ()


@pytest.mark.anyio
async def test_a_reload_refused_is_logged_once_however_often_the_file_is_saved_with_the_same_mistake(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    from sandbox_server.policy.watcher import watch_policy

    policy = _write(tmp_path, "live.yaml", "extends: default\n")
    looked = [anyio.Event() for _ in range(4)]  # set as the watcher begins its 1st, 2nd, … reload (one at a time)
    changed = anyio.Event()

    def host() -> HostFacts:
        next((event for event in looked if not event.is_set()), anyio.Event()).set()
        return HostFacts()

    async def on_change(new: Any) -> None:
        changed.set()

    broken = "extends: default\ndefaults: {limits: {memory_mb: -5}}  # saved %d\n"
    with caplog.at_level(logging.WARNING, logger="sandbox_server"):
        async with anyio.create_task_group() as group:
            names = [tool.name for tool in all_tools()]
            await group.start(watch_policy, str(policy), policy, names, host, on_change, 0.01)
            for turn in range(3):  # an editor saving it again and again: the file changes, its mistake does not
                policy.write_text(broken % turn)
                with anyio.fail_after(10):
                    await looked[turn].wait()  # reload `turn` began: the one before it has ended
            policy.write_text("extends: default\nrate: {calls_per_minute: 9}\n")
            with anyio.fail_after(10):
                await changed.wait()
            group.cancel_scope.cancel()
    refused = [r.getMessage() for r in caplog.records if "policy change ignored" in r.getMessage()]
    assert len(refused) == 1 and "memory_mb: -5" in refused[0], refused


def test_a_tokens_policy_that_is_the_servers_own_file_by_another_path_is_the_servers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from sandbox_server.access.tokens import Caller, policies_said
    from sandbox_server.policy.references import same_policy, stored_reference
    from sandbox_server.shipped import policies_dir

    _write(tmp_path, "team.yaml", "extends: default\n")
    (tmp_path / "link.yaml").symlink_to(tmp_path / "team.yaml")
    monkeypatch.chdir(tmp_path)
    callers = [
        Caller("alice", stored_reference("./team.yaml"), "0" * 64, "2026-12-01"),  # as `token add` kept it
        Caller("dave", str(tmp_path / "link.yaml"), "1" * 64, "2026-12-01"),
    ]
    lines, warning = policies_said(callers, "./team.yaml")
    assert warning is None and len(lines) == 2, (lines, warning)
    _, warning = policies_said([*callers, Caller("bob", "strict", "2" * 64, "2026-12-01")], "team.yaml")
    assert warning is not None and warning.startswith("1 caller(s) run under another policy"), warning
    assert same_policy("default", str(policies_dir() / "default.yaml")) and not same_policy("default", "strict")
