"""Engine faults (battery cases 39 and 40): the engine restarted mid-call, a sandbox killed from outside.

The engine down when the server starts is tests/test_execute_command.py's
`test_an_engine_that_is_down_is_an_error_result_not_a_crash`.
"""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

import anyio
import psutil
import pytest
from mcp import Client

from sandbox_server.sandbox.runc.runtime import RuncRuntime
from sandbox_server.sandbox.runc.state import is_runc
from tests.conftest import containers_running, kill_from_outside
from tests.mcp_harness import text_of

pytestmark = [pytest.mark.anyio, pytest.mark.alone, pytest.mark.usefixtures("invariants")]

ENGINE_UP = Path(__file__).resolve().parents[2] / "scripts" / "engine-up"


async def _running(command: str) -> str:
    """The container of ours whose program runs `command`, once it does."""
    with anyio.fail_after(15):
        while not (found := containers_running(command)):
            await anyio.sleep(0.05)
    return found[0]


def _stop_engine() -> None:
    engines = [process for process in psutil.process_iter(["name"]) if process.info["name"] == "dockerd"]
    assert len(engines) == 1, "this case restarts the local engine: one dockerd must run on this machine"
    [engine] = engines
    engine.terminate()
    engine.wait(60)


async def test_39_an_engine_restarted_mid_call_is_an_error_then_the_server_serves_again(
    server: Client, runtime: RuncRuntime
) -> None:
    """A sandbox the engine runs dies with it, and the call says so; one runc runs itself (serve --sandboxes runc)
    is not the engine's, and its call finishes as if nothing happened."""
    made: list[str] = []
    seconds = 6 if runtime.runc_refused() is None else 60  # (the engine's: cut short)

    async def restart_mid_call() -> None:
        made.append(await _running(f"sleep {seconds}"))
        await anyio.to_thread.run_sync(_stop_engine)

    try:
        async with anyio.create_task_group() as group:
            group.start_soon(restart_mid_call)
            started = time.monotonic()
            result = await server.call_tool("execute_command", {"command": f"sleep {seconds}; echo slept"})
        if is_runc(made[0]):
            assert not result.is_error and time.monotonic() - started >= seconds, text_of(result)
        else:
            assert result.is_error
            # Whether the stopping engine still answers when the stream ends is the engine's race: either it
            # no longer answers, or it says it killed the container (it stops every container on its way out).
            assert text_of(result).startswith(
                ("sandbox engine unavailable: no Docker engine answers", "killed: the sandbox was killed from outside")
            ), text_of(result)
            assert time.monotonic() - started < 30
            down = await server.call_tool("execute_command", {"command": "echo down"})
            assert down.is_error and text_of(down).startswith("sandbox engine unavailable"), text_of(down)
    finally:
        subprocess.run([str(ENGINE_UP)], check=True, capture_output=True, timeout=120)
    back = await server.call_tool("execute_command", {"command": "echo back"})  # the same server, not restarted
    assert not back.is_error and back.structured_content is not None, text_of(back)
    assert back.structured_content["stdout"] == "back\n"
    # What the stopped engine left behind (the call's container, the warm ones) is removed
    # once it answers again: the invariants check that nothing of the case is left.


async def test_40_a_sandbox_killed_from_outside_says_so(server: Client) -> None:
    async def kill_mid_call() -> None:
        victim = await _running("sleep 300")
        await anyio.to_thread.run_sync(kill_from_outside, victim)

    async with anyio.create_task_group() as group:
        group.start_soon(kill_mid_call)
        result = await server.call_tool("execute_command", {"command": "sleep 300"})
    assert result.is_error
    assert text_of(result).startswith("killed: the sandbox was killed from outside before the program finished")
