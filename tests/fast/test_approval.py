"""Which calls a policy's approval section asks a person about, and what the question shows: pure logic."""

from __future__ import annotations

from typing import Any

from sandbox_server.access.approval import approval_needed, approval_notice
from sandbox_server.policy import ApprovalSettings, ToolPolicy
from sandbox_server.sandbox.spec import Mount

ASKING = ApprovalSettings(commands=("rm", "curl*", "*sudo*"), tools=("analyze_csv",))
PLAIN = ToolPolicy()
WRITING = ToolPolicy(mounts=(Mount("/srv/in", "/data", True), Mount("/srv/out", "/results", False)))


def needed(tool: str, settings: ApprovalSettings = ASKING, policy: ToolPolicy = PLAIN, **arguments: Any) -> Any:
    return approval_needed(settings, "team", tool, policy, arguments)


def test_command_patterns_match_the_program_as_written_or_by_name_and_the_whole_line() -> None:
    assert needed("execute_command", command="rm -rf data").reason == "the command matches 'rm'"
    assert needed("execute_command", command="/usr/bin/rm", args=["x"]).reason == "the command matches 'rm'"
    assert needed("execute_command", command="curl", args=["-s", "x"]).field == "approval.commands"
    assert needed("execute_command", command="echo hi | sudo tee x").reason == "the command matches '*sudo*'"
    assert needed("execute_command", command="echo rm") is None  # `rm` is an argument here, and the line is more
    assert needed("execute_command", command="ls 'unbalanced") is None  # not a shell line shlex reads: by words
    assert needed("run_python", code="import os; os.remove('x')") is None  # command patterns are execute_command's


def test_a_whole_tool_and_writable_mounts_ask_for_every_call() -> None:
    assert needed("analyze_csv", filepath="a.csv").field == "approval.tools"
    mounts = ApprovalSettings(writable_mounts=True)
    asked = needed("run_python", mounts, WRITING, code="1")
    assert asked.field == "approval.writable_mounts" and "/srv/out as /results" in asked.reason
    assert "/srv/in" not in asked.reason  # read-only mounts are not a reason
    assert needed("run_python", mounts, ToolPolicy(mounts=(Mount("/srv/in", "/data", True),)), code="1") is None


def test_the_question_shows_exactly_what_will_run_and_which_field_asks() -> None:
    files = [{"path": "a.txt", "content": "x"}, {"path": "b/c.txt", "content": "y"}]
    shell = needed("execute_command", command="rm", args=["-f", "a b.txt"], files=files, workspace="ws-1")
    assert "$ rm -f 'a b.txt'" in shell.message and "with 2 file(s) sent in: a.txt, b/c.txt" in shell.message
    assert "in workspace ws-1" in shell.message and "Policy 'team' asks a person first" in shell.message
    code = "print('x')\n" * 1000
    cell = needed("run_python", ApprovalSettings(tools=("run_python",)), code=code).message
    assert code[:4000] in cell and "more characters not shown" in cell


def test_tool_descriptions_say_what_will_be_asked() -> None:
    assert "commands matching rm, curl*, *sudo* (approval.commands)" in (
        approval_notice(ASKING, "execute_command", PLAIN) or ""
    )
    assert "every call (approval.tools)" in (approval_notice(ASKING, "analyze_csv", PLAIN) or "")
    assert approval_notice(ASKING, "run_python", PLAIN) is None
    assert "host folders" in (approval_notice(ApprovalSettings(writable_mounts=True), "run_python", WRITING) or "")


def test_command_patterns_see_every_program_a_shell_line_runs() -> None:
    asking = ApprovalSettings(commands=("rm *",))
    spellings = [
        "/bin/rm x",
        "true; rm x",
        "true && rm x",
        "false || rm x",
        "echo x | xargs rm -f",
        "sh -c 'rm x'",
        'bash -c "echo; /usr/bin/rm x"',
        "echo $(rm x)",
        "echo `rm x`",
        "FOO=1 env BAR=2 rm x",
        "sudo -u root rm x",
        "nice -n 5 timeout 3 rm x",
        "find . -name '*.tmp' -exec rm {} ;",
        "eval 'rm x'",
        "(cd /tmp; rm x)",
        "if true; then rm x; fi",
        "true\nrm x",
    ]
    for line in spellings:
        asked = needed("execute_command", asking, command=line)
        assert asked is not None and asked.reason == "the command matches 'rm *'", line
    assert needed("execute_command", asking, command="sh", args=["-c", "true; rm x"]) is not None
    assert needed("execute_command", asking, command="echo rm x") is None  # an argument, not a program
    # Documented as unseen: what a program does by itself.
    assert needed("execute_command", asking, command="find . -delete") is None
