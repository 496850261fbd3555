"""The evaluation policy, as a harness uses it (docs/evaluation.md): many programs at once from one client through
the official client, each answered, its outcome read from structuredContent."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import anyio
import pytest

from sandbox_server.sandbox.engine.runtime import DockerRuntime
from tests.mcp_harness import connect, stdio_parameters

pytestmark = pytest.mark.anyio

SLEEPY = "import time\ntime.sleep(1)\nassert sum(range(4)) == 6"
"""A program that passes after a second: 16 of them take 2 at a time (a policy extending evaluation), eight rounds."""


def outcome(answer: dict[str, Any]) -> str:
    """What a harness makes of an answer (docs/evaluation.md says the same)."""
    if "error" in answer:
        return f"refused: {answer['error']['kind']}"
    if answer["oom_killed"]:
        return "killed for memory"
    if answer["timed_out"]:
        return "timed out"
    return "passed" if answer["exit_code"] == 0 else "failed"


async def test_programs_past_the_running_ones_wait_in_the_queue_however_short_their_own_timeout(
    tmp_path: Path, runtime: DockerRuntime
) -> None:
    """Each asks for 5 s; the last of the 16 waits 7 s and more for its turn, and still runs its full second."""
    policy = tmp_path / "harness.yaml"
    policy.write_text("extends: evaluation\nrate: {concurrent_calls: 2}\n")
    answers: list[dict[str, Any]] = []
    async with connect(stdio_parameters("--policy", str(policy))) as session:

        async def one() -> None:
            result = await session.call_tool("run_python", {"code": SLEEPY, "timeout_s": 5})
            assert result.structured_content is not None
            answers.append(result.structured_content)

        async with anyio.create_task_group() as group:
            for _ in range(16):
                group.start_soon(one)
    assert [outcome(answer) for answer in answers] == ["passed"] * 16, answers[0]


async def test_each_outcome_is_told_apart_in_structured_content(runtime: DockerRuntime) -> None:
    programs = {
        "passed": ("assert sorted([3, 1, 2]) == [1, 2, 3]", 5),
        "failed": ("assert sorted([3, 1, 2]) == [3, 2, 1]", 5),
        "timed out": ("while True:\n    pass", 1),
        # 16 MiB a step past the default's 512 MiB: killed as soon as the kernel says so, long before its 20 s
        "killed for memory": ("held = []\nwhile True:\n    held.append(bytearray(16 << 20))", 20),
    }
    seen: dict[str, dict[str, Any]] = {}
    async with connect(stdio_parameters("--policy", "evaluation")) as session:

        async def one(name: str, code: str, timeout_s: int) -> None:
            result = await session.call_tool("run_python", {"code": code, "timeout_s": timeout_s})
            assert result.structured_content is not None
            seen[name] = result.structured_content

        async with anyio.create_task_group() as group:
            for name, (code, timeout_s) in programs.items():
                group.start_soon(one, name, code, timeout_s)
    assert {name: outcome(answer) for name, answer in seen.items()} == {name: name for name in programs}, seen
    assert "AssertionError" in seen["failed"]["stderr"]
    assert 1000 <= seen["timed out"]["duration_ms"] < 5000  # counted from the program's start
    assert seen["killed for memory"]["duration_ms"] < 10_000 and not seen["killed for memory"]["timed_out"]
