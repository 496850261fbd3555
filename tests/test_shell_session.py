"""The shell a coding agent expects: in a kept workspace, each call's sandbox is fresh and its shell's state is the
one the previous call left (its folder, exported variables, functions, aliases and options)."""

from __future__ import annotations

import base64
from pathlib import Path
from typing import Any

import mcp_types as types
import pytest

from sandbox_server.sandbox.engine.runtime import DockerRuntime
from tests.mcp_harness import CheckedClient, answer, connect, http_server, stdio_parameters, text_of

pytestmark = pytest.mark.anyio


async def _run(session: CheckedClient, command: str, **extra: Any) -> dict[str, Any]:
    return await answer(session, "execute_command", {"command": command, **extra})


async def test_a_session_remembers_its_folder_variables_functions_aliases_and_options(
    tmp_path: Path, runtime: DockerRuntime
) -> None:
    serve = ("--state-dir", str(tmp_path / "state"))
    async with connect(stdio_parameters(*serve)) as session:
        first = await _run(
            session,
            "mkdir -p src && cd src && export CC=clang GREETING='two words' && unset LANG && "
            "greet() { echo \"hello $1\"; } && alias ll='ls -1' && set -o pipefail && shopt -s extglob && "
            "touch one.c two.h",
        )
        second = await _run(
            session,
            'pwd; echo "CC=$CC GREETING=$GREETING LANG=${LANG-unset}"; greet agent; ll; '
            "false | true; echo pipefail=$?; echo !(one.c)",
        )
        exited = await _run(session, "cd /workspace/src && export AFTER=1 && exit 3")
        after_exit = await _run(session, 'pwd; echo "AFTER=$AFTER"')
        elsewhere = await _run(session, "pwd; cd /workspace", workdir="/workspace")
        still = await _run(session, "pwd")
        left = await _run(session, "cd /tmp && pwd")
        back = await _run(session, "pwd")
        clean = await _run(session, 'pwd; echo "CC=${CC-unset}"; type greet 2>&1; false | true; echo $?', reset=True)
    assert not first["is_error"], first["text"]
    assert second["stdout"].splitlines() == [
        "/workspace/src",
        "CC=clang GREETING=two words LANG=unset",
        "hello agent",
        "one.c",
        "two.h",
        "pipefail=1",
        "two.h",
    ], second
    assert second["stderr"] == ""
    assert exited["exit_code"] == 3 and after_exit["stdout"] == "/workspace/src\nAFTER=1\n"
    assert elsewhere["stdout"] == "/workspace\n" and still["stdout"] == "/workspace/src\n"  # workdir: a one-off
    assert left["stdout"] == "/tmp\n" and back["stdout"] == "/workspace\n"  # only folders of the workspace carry
    assert clean["stdout"].splitlines()[0:2] == ["/workspace", "CC=unset"]
    assert "not found" in clean["stdout"] and clean["stdout"].endswith("0\n")


async def test_only_what_a_call_changed_in_its_environment_is_carried(tmp_path: Path, runtime: DockerRuntime) -> None:
    """A variable the call started with and left as it was is not saved, so the next call gets the value its policy
    and image give it then, never an older copy."""
    serve = ("--state-dir", str(tmp_path / "state"))
    async with connect(stdio_parameters(*serve)) as session:
        await _run(session, "export MINE=1; echo $PATH")
        changed = await _run(session, "export HOME=/workspace/home")
        seen = await _run(session, 'echo "$HOME $MINE"; cat /workspace/.sandbox/shell.sh')
    assert not changed["is_error"]
    assert seen["stdout"].startswith("/workspace/home 1\n")
    saved = seen["stdout"].splitlines()[1:]
    assert 'declare -x HOME="/workspace/home"' in saved and 'declare -x MINE="1"' in saved
    assert not [line for line in saved if "PATH" in line or "LANG" in line], saved


async def test_a_session_over_http_in_the_stateless_era_follows_its_workspace(
    tmp_path: Path, runtime: DockerRuntime
) -> None:
    with http_server("--state-dir", str(tmp_path / "state")) as url:
        async with connect(url, mode="2026-07-28") as session:
            first = await _run(session, "mkdir -p a/b && cd a/b && export STEP=1")
            second = await _run(session, 'pwd; echo "$STEP"', workspace=first["workspace"])
            fresh = await _run(session, 'pwd; echo "${STEP-none}"')
    assert second["stdout"] == "/workspace/a/b\n1\n"
    assert fresh["stdout"] == "/workspace\nnone\n"


async def test_what_a_call_leaves_running_and_what_will_not_run_from_tmp_are_said(
    tmp_path: Path, runtime: DockerRuntime
) -> None:
    async with connect(stdio_parameters("--state-dir", str(tmp_path / "state"))) as session:
        started = await _run(session, "nohup sleep 100 >/dev/null 2>&1 &")
        gone = await _run(session, "pgrep -c sleep || true")
        from_tmp = await _run(session, "cp /bin/true /tmp/mine && /tmp/mine")
        from_workspace = await _run(session, "cp /bin/true ./mine && ./mine")
        url = await _run(session, "echo 'http://h/?a=1&b=2'")
    assert not started["is_error"] and "start it with the `service` argument" in started["text"], started["text"]
    assert gone["stdout"] == "0\n"
    assert from_tmp["exit_code"] == 126 and "/tmp is mounted noexec" in from_tmp["text"], from_tmp["text"]
    assert "build and run programs under /workspace" in from_tmp["text"]
    assert from_workspace["exit_code"] == 0 and "noexec" not in from_workspace["text"]
    assert "service" not in url["text"]


async def test_a_program_that_wants_a_terminal_gets_one_and_its_output_reads_as_drawn(
    tmp_path: Path, runtime: DockerRuntime
) -> None:
    async with connect(stdio_parameters("--state-dir", str(tmp_path / "state"))) as session:
        plain = await _run(session, "test -t 1 && echo terminal || echo pipe")
        sized = await _run(session, "test -t 0 && test -t 1 && stty size", tty={"columns": 120, "rows": 40})
        bar = await _run(session, r"printf '\033[32m 10%%\r 50%%\r100%%\033[0m done\n'", tty=True)
        repl = await _run(session, "python3 -q", tty=True, stdin="x = 6 * 7\nprint(x)\n")
    assert plain["stdout"] == "pipe\n"
    assert sized["stdout"] == "40 120\n", sized
    assert bar["stdout"] == "100% done\n", bar
    assert ">>> print(x)\n42\n" in repl["stdout"] and repl["exit_code"] == 0, repl
    assert "\x1b" not in repl["stdout"] and "\r" not in repl["stdout"]


async def test_a_long_log_shows_its_start_and_end_and_is_kept_whole_to_read_in_parts(
    tmp_path: Path, runtime: DockerRuntime
) -> None:
    """A 901-test run's log of 200 KB: the answer keeps its head and tail, says what was cut, and the whole log is
    a resource read in parts."""
    policy = tmp_path / "small.yaml"
    policy.write_text("extends: default\ndefaults:\n  limits: {output_bytes: 100000}\n")
    command = "for i in $(seq 1 901); do printf 'test_%04d (tests.Case) ... ok %s\\n' $i $(printf '%0180d' 0); done"
    async with connect(stdio_parameters("--policy", str(policy), "--state-dir", str(tmp_path / "s"))) as session:
        result = await session.call_tool("execute_command", {"command": command})
        link = next(block for block in result.content if isinstance(block, types.ResourceLink))
        whole, uri = b"", f"{link.uri}?offset=0"
        while uri:
            part = (await session.read_resource(uri)).contents[0]
            assert isinstance(part, types.BlobResourceContents)
            whole += base64.b64decode(part.blob)
            uri = (part.meta or {})["org.sandbox-server/part"]["next"]
    text = text_of(result)
    lines = whole.decode().splitlines()
    assert len(lines) == 901 and lines[0].startswith("test_0001 ") and lines[-1].startswith("test_0901 ")
    assert link.size == len(whole) > 100_000 and str(link.uri).endswith("/stdout")
    assert "test_0001 " in text and "test_0901 " in text and "bytes truncated" in text
    assert f"the whole stdout ({len(whole)} bytes) is kept at {link.uri}" in text


TESTED = "def add(a, b):\n    return a - b\n"
TEST = "from calc import add\nassert add(2, 2) == 4, 'add is wrong'\nprint('ok')\n"


@pytest.mark.parametrize("era", ["legacy", "2026-07-28"])
async def test_an_agents_session_in_both_eras(era: str, tmp_path: Path, runtime: DockerRuntime) -> None:
    """cd, an export and a function carried; a failing test found by grep and fixed by an exact edit whose diff
    comes back; a REPL under a terminal."""
    with http_server("--state-dir", str(tmp_path / "state")) as url:
        async with connect(url, mode=era) as session:
            kept: dict[str, Any] = {}

            async def call(tool: str, **arguments: Any) -> dict[str, Any]:
                done = await answer(session, tool, {**arguments, **kept})
                if era != "legacy":
                    kept["workspace"] = done["workspace"]  # the stateless era continues by the id
                return done

            await call("files", action="write", path="proj/calc.py", content=TESTED)
            await call("files", action="write", path="proj/test_calc.py", content=TEST)
            setup = await call(
                "execute_command",
                command="cd proj && export PYTHONDONTWRITEBYTECODE=1 && t() { python3 test_calc.py; }",
            )
            failing = await call("execute_command", command="t")
            found = await call("files", action="grep", pattern=r"return a - b")
            edited = await call("files", action="edit", path=found["matches"][0]["path"], old="a - b", new="a + b")
            passing = await call("execute_command", command="t && pwd && ls")
            repl = await call(
                "execute_command", command="python3 -q", tty=True, stdin="from calc import add\nadd(40, 2)\n"
            )
    assert not setup["is_error"], setup["text"]
    assert failing["exit_code"] == 1 and "add is wrong" in failing["stderr"], failing["text"]
    assert found["matches"] == [{"path": "proj/calc.py", "line": 2, "text": "    return a - b"}]
    assert "-    return a - b\n+    return a + b" in edited["diff"]
    assert passing["stdout"] == "ok\n/workspace/proj\ncalc.py\ntest_calc.py\n", passing["text"]
    assert ">>> add(40, 2)\n42\n" in repl["stdout"], repl["stdout"]
