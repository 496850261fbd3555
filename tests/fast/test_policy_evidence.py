"""Judging calls without running them: the shipped policies pass the cases beside them, a loosened policy fails
its cases in a diff-like report, a trail's kept facts are judged as the whole arguments are, and a replay reads
records of every age."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from sandbox_server.calls.judge import Judge, judged_facts
from sandbox_server.cli.main import main
from sandbox_server.errors import ConfigError, UsageError
from sandbox_server.ops.policy_tests import load_cases
from sandbox_server.ops.replay import NOT_RECORDED, replay_trail
from sandbox_server.ops.usage import parse_since
from sandbox_server.policy.loader import load_policy
from sandbox_server.policy.references import cases_path, policy_path, shipped_policies
from sandbox_server.tools import all_tools

NAMES = [tool.name for tool in all_tools()]


def test_every_shipped_policy_carries_cases_and_passes_them(capsys: pytest.CaptureFixture[str]) -> None:
    assert set(shipped_policies()) == {"data-science", "default", "evaluation", "strict", "toolchain"}
    assert main(["policy", "test"]) == 0
    said = capsys.readouterr().out
    for name in shipped_policies():
        assert f"policy '{name}': " in said and "FAIL" not in said, said


def test_a_loosened_policy_fails_its_cases_naming_what_was_expected_and_what_it_got(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    loosened = tmp_path / "strict.yaml"
    text = policy_path("strict").read_text()
    loosened.write_text(
        text.replace("allow: [cat,", "allow: [curl, cat,").replace("max_timeout_s: 20", "max_timeout_s: 60")
    )
    cases = cases_path(policy_path("strict"))
    assert main(["policy", "test", str(loosened), "--cases", str(cases)]) == 1
    said = capsys.readouterr().out
    failed = "  FAIL a program off the allow list is refused\n    - expected: refused (commands.allow)\n    + got:      allowed\n"
    assert failed in said, said
    assert "FAIL twenty seconds is the most a call may ask for" in said and said.count("FAIL") == 2, said
    assert main(["policy", "test", str(loosened), "--cases", str(cases), "--json"]) == 1
    report = json.loads(capsys.readouterr().out)
    assert [f["case"] for f in report[0]["failed"]] == [
        "a program off the allow list is refused",
        "twenty seconds is the most a call may ask for",
    ]


def test_a_cases_file_of_the_wrong_shape_is_refused_naming_the_case_and_field(tmp_path: Path) -> None:
    cases = tmp_path / "p.tests.yaml"
    cases.write_text(
        "cases:\n  - tool: execute_command\n    expect: maybe\n  - tool: x\n    host: a\n    arguments: {}\n"
    )
    with pytest.raises(ConfigError) as refused:
        load_cases(cases)
    assert "cases[0].expect: 'maybe' is not one of" in str(refused.value), refused.value
    assert "cases[1]" in str(refused.value)
    with pytest.raises(ConfigError, match="no test cases at"):
        load_cases(tmp_path / "none.tests.yaml")


CALLS: list[tuple[str, dict[str, Any]]] = [
    ("execute_command", {"command": "ls -la | wc -l"}),
    ("execute_command", {"command": "cd /tmp && sudo -n rm -rf x; echo done"}),
    ("execute_command", {"command": "curl", "args": ["-s", "https://example.com/?token=secret"]}),
    ("execute_command", {"command": "/usr/bin/grep", "args": ["x"], "timeout_s": 21}),
    ("execute_command", {"command": "echo", "args": [], "workdir": "/etc"}),
    ("execute_command", {"command": "ls", "args": [], "files": [{"path": f"{n}", "content": "x"} for n in range(21)]}),
    ("execute_command", {"command": "ls", "args": [], "files": [{"path": "run", "content": "", "executable": True}]}),
    ("run_python", {"code": "print(1)", "timeout_s": 700}),
    ("analyze_csv", {"filepath": "/data/a.csv", "operations": ["describe"]}),
    ("analyze_csv", {"filepath": "/etc/passwd", "operations": ["describe"]}),
    ("workspaces", {"action": "list"}),
]


APPROVING = "extends: default\napproval: {commands: [rm, '*sudo*', curl], tools: [analyze_csv]}\n"


@pytest.mark.parametrize("name", ["default", "strict", "data-science", "toolchain", "approving"])
def test_what_a_trail_keeps_of_a_call_is_judged_as_its_whole_arguments_are(name: str, tmp_path: Path) -> None:
    if name == "approving":
        (tmp_path / "approving.yaml").write_text(APPROVING)
        name = str(tmp_path / "approving.yaml")
    judge = Judge(load_policy(name, NAMES), all_tools())
    for tool, arguments in CALLS:
        whole, kept = judge.call(tool, arguments), judge.recorded(tool, judged_facts(tool, arguments, False), None)
        assert (whole.decision, whole.field) == (kept.decision, kept.field), (name, tool, arguments, whole, kept)


def test_a_trail_keeps_no_argument_of_a_program_and_no_code() -> None:
    facts = judged_facts("execute_command", {"command": "curl", "args": ["https://x/?token=secret"]}, False)
    assert facts == {"arguments": {"command": "curl", "args": []}}
    line = judged_facts("execute_command", {"command": 'TOKEN=s3cret curl -H "$TOKEN" x | sudo tee f'}, True)
    assert line == {"arguments": {"command": "curl ; sudo ; tee ; f"}, "long": True}  # as approvals read a line
    code = judged_facts("run_python", {"code": "password = 'x'", "files": [{"path": "a", "content": "eA==",
                                                                            "encoding": "base64"}]}, False)  # fmt: skip
    assert code == {"arguments": {}, "files": 1, "files_bytes": 1, "executable_files": 0}


def _trail(path: Path, records: list[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(record) + "\n" for record in records) + "not json\n")
    return path


def test_records_of_every_age_are_replayed_as_far_as_they_allow(tmp_path: Path) -> None:
    strict = load_policy("strict", NAMES)
    base = {"policy": "strict", "caller": "ada", "outcome": "ok"}
    trail = _trail(tmp_path / "audit.jsonl", [
        {**base, "time": "2026-01-01T00:00:00+00:00", "tool": "execute_command", "arguments_bytes": 30},  # old
        {**base, "time": "2026-11-01T00:00:00+00:00", "tool": "execute_command",
         "arguments": {"command": "ls | wc -l"}},  # arguments kept whole: the shell is now refused
        {**base, "time": "2026-11-02T00:00:00+00:00", "tool": "execute_command",
         "judged": {"arguments": {"command": "ls", "args": []}}},
        {**base, "time": "2026-11-03T00:00:00+00:00", "tool": "execute_command", "outcome": "refused",
         "field": "commands.allow", "judged": {"arguments": {"command": "curl", "args": []}}},
        {"time": "2026-11-03T00:00:01+00:00", "event": "task_started"},
        {**base, "policy": "default", "time": "2026-11-04T00:00:00+00:00", "tool": "run_python"},
    ])  # fmt: skip
    found = replay_trail(trail, strict)
    assert (found.judged, found.unchanged, found.unreadable) == (4, 3, 1)
    assert [c.where for c in found.changes["now_refused"]] == ["audit.jsonl:2"]
    assert found.unjudged == {NOT_RECORDED: 1} and found.other_policies == {"default": 1}
    later = replay_trail(trail, strict, from_policy="*", since=parse_since("2026-11-02"))
    assert later.judged == 3 and later.first_time.startswith("2026-11-02")
    with pytest.raises(UsageError, match="--since 'yesterday'"):
        parse_since("yesterday")


def test_a_host_is_judged_by_the_allow_list_as_the_proxy_matches_it(tmp_path: Path) -> None:
    policy = tmp_path / "net.yaml"
    policy.write_text(
        "extends: default\ntools:\n  execute_command:\n    network:\n      allow: [pypi.org, '*.example.com:8443']\n"
    )
    judge = Judge(load_policy(str(policy), NAMES), all_tools())
    said = {(h, p): judge.host("execute_command", h, p).said() for h, p in [
        ("pypi.org", 443), ("PyPI.org.", 80), ("pypi.org", 8080), ("files.pypi.org", 443),
        ("a.example.com", 8443), ("example.com", 8443), ("a.example.com", 443)]}  # fmt: skip
    assert said == {
        ("pypi.org", 443): "allowed", ("PyPI.org.", 80): "allowed", ("pypi.org", 8080): "refused (network.allow)",
        ("files.pypi.org", 443): "refused (network.allow)", ("a.example.com", 8443): "allowed",
        ("example.com", 8443): "allowed", ("a.example.com", 443): "refused (network.allow)",
    }  # fmt: skip
    assert judge.host("run_python", "pypi.org", 443).said() == "refused (network)"


def test_a_calls_measured_peak_time_and_output_are_held_against_the_new_caps(tmp_path: Path) -> None:
    ran = {"policy": "strict", "time": "2026-11-01T00:00:00+00:00", "tool": "execute_command", "outcome": "ok",
           "judged": {"arguments": {"command": "ls", "args": []}}, "limits": {"timeout_s": 30, "memory_mb": 512,
           "output_bytes": 100000}, "usage": {"wall_s": 0.5, "peak_memory_bytes": 300 * 2**20}, "run_ms": 12000,
           "stdout_bytes": 50000, "stderr_bytes": 10}  # fmt: skip
    found = replay_trail(_trail(tmp_path / "audit.jsonl", [ran]), load_policy("strict", NAMES))
    said = [change.said for change in found.changes["cut_short"]]
    assert said == [
        "ran 12 s; the new timeout is 10 s (limits.timeout_s): it would time out",
        "its memory peaked at 300.0 MiB, above the new cap of 128 MiB (limits.memory_mb): it would be killed",
        "it wrote 50000 bytes to one stream, above the new cap of 32000 (limits.output_bytes): its answer would be cut",
    ], said
