"""Containers are always destroyed: also when the server itself dies mid-call."""

import os
import select
import signal
import time
from pathlib import Path

import anyio
import psutil
import pytest

from sandbox_server.sandbox import mounts
from sandbox_server.sandbox.engine.removal import LABELS_VARIABLE, OWNER_LABEL
from sandbox_server.sandbox.engine.runtime import DockerRuntime
from sandbox_server.sandbox.spec import SANDBOX_LABEL
from tests.conftest import a_sleep_of_its_own, containers_of, containers_running, labels_of, run_cli
from tests.mcp_harness import command_of, connect, http_server, http_server_process

pytestmark = pytest.mark.anyio


@pytest.mark.alone  # (any server that starts sweeps what dead servers left: another test's would take the stray)
async def test_a_server_killed_mid_call_leaves_a_stray_that_the_next_server_reaps(runtime: DockerRuntime) -> None:
    running = anyio.Event()
    command = a_sleep_of_its_own(300)  # another worker's test may leave a `sleep 300` of its own running

    async def on_progress(progress: float, total: float | None, message: str | None) -> None:
        running.set()

    with http_server_process() as server:
        url, process = server.url, server.process
        with pytest.raises(Exception):  # noqa: B017 (the connection dies with the server, whichever way it surfaces)
            async with connect(url) as session, anyio.create_task_group() as group:
                group.start_soon(
                    lambda: session.call_tool("execute_command", {"command": command}, progress_callback=on_progress)
                )
                with anyio.fail_after(10):
                    await running.wait()
                [busy] = containers_running(command)
                # Its reaper killed first (as a supervisor killing every process of the server does): what it
                # would remove as soon as the server ends is left for the next server's start-up sweep.
                reaper = next(p for p in psutil.Process(process.pid).children() if "reap-after" in command_of(p))
                reaper.kill()  # (it runs nothing more once sent: a SIGKILL is never handled)
                process.kill()
                process.wait()
                reaper.wait()  # (a zombie until its parent, the server, has gone or reaps it)
        strays = containers_of(process.pid)
        assert busy in strays, "a SIGKILLed server and its reaper cannot clean up: its sandbox must still be there"
    with http_server():  # listening means the start-up reaper has run
        assert not set(strays) & set(runtime.sandbox_containers())


async def test_a_second_sigterm_while_stopping_leaves_no_container_and_no_mount(tmp_path: Path) -> None:
    with http_server_process("--state-dir", str(tmp_path)) as server:
        async with connect(server.url) as session:  # a kept workspace, mounted on the host
            result = await session.call_tool("execute_command", {"command": "echo kept > note"})
            assert not result.is_error
        assert str(tmp_path) in Path("/proc/mounts").read_text()
        server.process.send_signal(signal.SIGTERM)
        server.wait_for_line("SIGTERM: shutting down")
        server.process.send_signal(signal.SIGTERM)  # a supervisor that does not wait
        assert server.process.wait(timeout=30) == 0
    assert not containers_of(server.process.pid)
    assert str(tmp_path) not in Path("/proc/mounts").read_text(), "workspaces left mounted on the host"


def test_a_sigterm_as_the_workspaces_mount_while_the_server_starts_leaves_no_mount(tmp_path: Path) -> None:
    """A supervisor may stop a server as soon as its port opens, while its parts are still being made: a signal
    the moment its workspaces' first mount appears (the kernel's mount table says when) stops it, and whatever
    it mounted goes with it."""
    with http_server_process("--state-dir", str(tmp_path), "--no-pool") as server:
        with open("/proc/self/mountinfo", "rb") as table:
            changes = select.poll()
            changes.register(table, select.POLLPRI)
            deadline = time.monotonic() + 60
            while not mounts.mounted(tmp_path):
                assert time.monotonic() < deadline, server.lines
                table.seek(0)
                table.read()  # read to its end: the next change of the table wakes the poll
                if not mounts.mounted(tmp_path):
                    changes.poll(1000)
        server.process.send_signal(signal.SIGTERM)
        assert server.process.wait(timeout=60) == 0, server.lines
        server.reader.join(timeout=10)  # its log read to the end
        # (a start past its parts' opening before the signal lands, on a host the suite holds busy, stops as any)
        assert any(
            "SIGTERM while starting: stopped" in line or "SIGTERM: shutting down" in line for line in server.lines
        ), server.lines
    assert not mounts.mounted(tmp_path), f"left mounted: {mounts.mounted(tmp_path)}; the server logged {server.lines}"


async def test_every_sandbox_a_server_makes_carries_the_operators_labels() -> None:
    """SANDBOX_CONTAINER_LABELS: an operator finds a deployment's sandboxes with the engine's own filters (the
    suite's workers find theirs so)."""
    running = anyio.Event()

    async def on_progress(progress: float, total: float | None, message: str | None) -> None:
        running.set()

    labels = f"{os.environ[LABELS_VARIABLE]}, team=data ,cost-centre=42"
    with http_server_process("--no-pool", env={LABELS_VARIABLE: labels}) as server:
        async with connect(server.url) as session, anyio.create_task_group() as group:
            call = session.call_tool("execute_command", {"command": "sleep 300"}, progress_callback=on_progress)
            group.start_soon(lambda: call)
            with anyio.fail_after(30):
                await running.wait()
            [busy] = containers_of(server.process.pid, running=True)
            said = labels_of(busy)
            assert said["team"] == "data" and said["cost-centre"] == "42", said
            assert said[SANDBOX_LABEL] == "1" and f":{server.process.pid}:" in said[OWNER_LABEL], said
            group.cancel_scope.cancel()


def test_a_label_that_is_no_key_value_pair_stops_the_server_before_it_starts_naming_it() -> None:
    done = run_cli("serve", env={LABELS_VARIABLE: "team=data,cost-centre"})
    assert done.returncode == 2, done.stderr
    assert "SANDBOX_CONTAINER_LABELS: 'cost-centre' is not a label of the operator's own" in done.stderr
