"""Warm containers: used once and destroyed, never reused; broken, stale or unwanted ones discarded."""

from __future__ import annotations

import contextlib
import signal
import threading
import time
from pathlib import Path

import anyio
import docker
import psutil
import pytest

from sandbox_server.sandbox.engine.runtime import DockerRuntime
from sandbox_server.sandbox.runc.runtime import RuncRuntime
from sandbox_server.sandbox.spec import SANDBOX_LABEL
from sandbox_server.sandbox.warm_container import process_state, process_tree
from tests.conftest import FULL_POOLS, _init_of, containers_of, kill_from_outside, run_cli
from tests.mcp_harness import audit_records, connect, http_server_process, text_of
from tests.test_replicas import client_of, shell

pytestmark = pytest.mark.anyio

POOLED = """
name: pooled
extends: default
defaults:
  pool: {size: %(size)d, idle_s: %(idle)s}
tools:
  run_python: {enabled: false}
  analyze_csv: {enabled: false}
"""


def _policy(tmp_path: Path, size: int = 2, idle: float = 300) -> Path:
    path = tmp_path / "pooled.yaml"
    path.write_text(POOLED % {"size": size, "idle": idle})
    return path


def _audited_containers(audit: Path) -> list[str]:
    return [record["container_id"] for record in audit_records(audit)]


async def _gone(runtime: DockerRuntime, container_ids: set[str]) -> None:
    with anyio.fail_after(10):
        while container_ids & {cid[:12] for cid in runtime.sandbox_containers()}:
            await anyio.sleep(0.05)


async def test_each_call_takes_a_warm_container_that_is_then_destroyed(tmp_path: Path, runtime: DockerRuntime) -> None:
    audit = tmp_path / "audit.jsonl"
    with http_server_process("--policy", str(_policy(tmp_path)), "--audit-log", str(audit)) as server:
        server.wait_for_line("warm pool ready: 2 container(s)")
        warm = {cid[:12] for cid in containers_of(server.process.pid)}
        assert len(warm) == 2
        async with connect(server.url) as session:
            first = await session.call_tool("execute_command", {"command": "echo secret > /tmp/left; echo one"})
            second = await session.call_tool("execute_command", {"command": "cat /tmp/left 2>&1; echo two"})
        assert first.structured_content is not None and first.structured_content["stdout"] == "one\n"
        assert second.structured_content is not None
        assert "No such file" in second.structured_content["stdout"], "a second call must not see the first's files"
        used = _audited_containers(audit)
        assert len(set(used)) == 2 and set(used) <= warm, (used, warm)
        await _gone(runtime, set(used))
    assert not containers_of(server.process.pid), "the server's shutdown destroys its warm containers"


async def test_a_warm_container_killed_from_outside_is_replaced_and_never_handed_out(
    tmp_path: Path, runtime: DockerRuntime
) -> None:
    audit = tmp_path / "audit.jsonl"
    with http_server_process("--policy", str(_policy(tmp_path, size=1)), "--audit-log", str(audit)) as server:
        server.wait_for_line("warm pool ready: 1 container(s)")
        [victim] = containers_of(server.process.pid)
        kill_from_outside(victim)
        # Without any call, the pool notices the dead container, removes it and makes another.
        await _gone(runtime, {victim[:12]})
        with anyio.fail_after(10):
            while len(containers_of(server.process.pid)) != 1:
                await anyio.sleep(0.05)
        async with connect(server.url) as session:
            result = await session.call_tool("execute_command", {"command": "echo fine"})
        assert not result.is_error and result.structured_content is not None
        assert result.structured_content["stdout"] == "fine\n"
        assert _audited_containers(audit) != [victim[:12]]
        await _gone(runtime, {victim[:12]})


async def test_idle_containers_are_replaced_and_a_policy_without_pool_drains_them(
    tmp_path: Path, runtime: DockerRuntime
) -> None:
    policy = _policy(tmp_path, size=1, idle=0.5)
    with http_server_process("--policy", str(policy)) as server:
        server.wait_for_line("warm pool ready: 1 container(s)")
        [first] = containers_of(server.process.pid)
        with anyio.fail_after(10):
            while first in containers_of(server.process.pid) or not containers_of(server.process.pid):
                await anyio.sleep(0.05)
        policy.write_text(POOLED % {"size": 0, "idle": 300})
        server.wait_for_line("policy pooled")
        with anyio.fail_after(10):
            while containers_of(server.process.pid):
                await anyio.sleep(0.05)
        server.process.send_signal(signal.SIGTERM)
        assert server.process.wait(timeout=10) == 0


async def test_a_burst_grows_the_pool_past_the_concurrency_cap_and_idle_time_shrinks_it_back(
    tmp_path: Path, runtime: DockerRuntime
) -> None:
    policy = tmp_path / "demand.yaml"
    # One call at a time: calls one after another still use one container each, so the pool grows past it.
    pooled = POOLED.replace("pool: {size: %(size)d, idle_s: %(idle)s}", "pool: {min: 1, max: 4, idle_s: 2}")
    policy.write_text(pooled + "rate: {concurrent_calls: 1}\n")
    audit = tmp_path / "audit.jsonl"
    with http_server_process("--policy", str(policy), "--audit-log", str(audit)) as server:
        server.wait_for_line("warm pool ready: 1 container(s)")
        async with connect(server.url) as session:
            for _ in range(3):  # back to back: the first takes the one waiting
                await session.call_tool("execute_command", {"command": "true"})
        used = {cid[:12] for cid in _audited_containers(audit)}

        def waiting() -> int:  # containers no call has used (a used one may linger until its removal)
            return len({cid[:12] for cid in containers_of(server.process.pid)} - used)

        # The first call took the last one waiting: the pool keeps one more from then on (more if a later call found
        # it empty or took its last again, which depends on how fast the fills keep up; never more than max).
        most = 0
        with anyio.fail_after(20):
            while (most := max(most, waiting())) < 2:
                await anyio.sleep(0.05)
        with anyio.fail_after(30):  # each container that waits 2 s unused takes one back
            while (now := waiting()) > 1:
                most = max(most, now)
                await anyio.sleep(0.1)
        assert most <= 4  # the pool's max


async def test_a_pool_with_an_ahead_count_serves_a_later_burst_warm_from_the_first(
    tmp_path: Path, runtime: RuncRuntime
) -> None:
    policy = tmp_path / "ahead.yaml"
    pooled = "pool: {min: 1, ahead: 5, idle_s: 3, runc: {ahead: 8}}"  # deeper where runc itself makes sandboxes
    policy.write_text(POOLED.replace("pool: {size: %(size)d, idle_s: %(idle)s}", pooled))
    depth = 8 if runtime.runc_refused() is None else 5
    audit = tmp_path / "audit.jsonl"
    with http_server_process("--policy", str(policy), "--audit-log", str(audit)) as server:
        server.wait_for_line("warm pool ready: 1 container(s)")
        async with connect(server.url) as session:
            await session.call_tool("execute_command", {"command": "true"})  # served warm: no call found it empty
            used = {cid[:12] for cid in _audited_containers(audit)}

            def waiting() -> set[str]:  # started containers no call has used (a used one may linger until removed)
                return {cid[:12] for cid in containers_of(server.process.pid, running=True)} - used

            with anyio.fail_after(30):  # filled to its depth in the pause after it
                while len(waiting()) < depth:
                    await anyio.sleep(0.05)
            began = time.time()
            for _ in range(depth):  # a burst, one after another: each finds a container made before it
                await session.call_tool("execute_command", {"command": "true"})
        made = runtime.api.events(
            since=began, until=time.time(), decode=True,
            filters={"type": "container", "event": "create", "label": SANDBOX_LABEL},
        )  # fmt: skip
        made_in_burst = {event["id"][:12] for event in made}
        burst = [cid[:12] for cid in _audited_containers(audit)][1:]
        assert len(burst) == depth and not set(burst) & made_in_burst, (burst, made_in_burst)
        used |= set(burst)
        with anyio.fail_after(30):  # refilled after the burst, then 3 s unused: back to its min
            while len(waiting()) > 1:
                await anyio.sleep(0.1)


async def test_the_warm_containers_of_a_killed_server_are_removed_within_seconds(
    tmp_path: Path, runtime: DockerRuntime
) -> None:
    with http_server_process("--policy", str(_policy(tmp_path))) as server:
        server.wait_for_line("warm pool ready: 2 container(s)")
        warm = {cid[:12] for cid in containers_of(server.process.pid)}
        server.process.send_signal(signal.SIGKILL)
        server.process.wait()
        # No server starts to sweep them: the reaper the server started removes them when it sees the server end.
        await _gone(runtime, warm)


@pytest.mark.parametrize("case", ["ended before the reaper watched", "its pid now another process's"])
def test_the_reaper_removes_what_a_server_left_even_when_it_watches_too_late(runtime: DockerRuntime, case: str) -> None:
    import socket
    import subprocess

    import psutil

    from sandbox_server.sandbox.engine.images import catalog
    from sandbox_server.sandbox.engine.removal import OWNER_LABEL, reap_after
    from sandbox_server.sandbox.spec import SANDBOX_LABEL

    stand_in = subprocess.Popen(["sleep", "60"])
    started = int(psutil.Process(stand_in.pid).create_time())
    if case == "ended before the reaper watched":
        stand_in.kill()
        stand_in.wait()
        owner = f"{socket.gethostname()}:{stand_in.pid}:{started}"
    else:  # the number is alive, but not the process the label names: waiting on it would wait forever
        owner = f"{socket.gethostname()}:{stand_in.pid}:{started - 1000}"
    api = docker.from_env().api
    image = next(iter(catalog().values())).reference
    since = int(time.time()) - 1
    left = api.create_container(image, "true", labels={SANDBOX_LABEL: "", OWNER_LABEL: owner})["Id"]
    try:
        reaping = threading.Thread(target=reap_after, args=(stand_in.pid, owner), daemon=True)
        reaping.start()
        reaping.join(timeout=30)
        assert not reaping.is_alive(), "the reaper waited on a process that is not the server"
        # Side by side, another worker's server starting meanwhile reaps what dead servers left too, and the engine
        # answers the second removal "already in progress": removed once the engine says it was destroyed.
        destroyed = api.events(
            since=since, until=int(time.time()) + 30, filters={"container": [left], "event": ["destroy"]}, decode=True
        )
        try:
            assert next(destroyed, None) is not None, "the container the dead server left is still there"
        finally:
            destroyed.close()
        assert left[:12] not in {cid[:12] for cid in runtime.sandbox_containers()}
    finally:
        stand_in.kill()
        stand_in.wait()
        with contextlib.suppress(docker.errors.NotFound, docker.errors.APIError):  # (gone, or going)
            api.remove_container(left, force=True)
        api.close()


def _waiting(server: int) -> list[str]:
    """The server's sandboxes that wait for a call or are being made: not those whose call has ended and which
    wait, stopped, to be removed in a pause (a sandbox made as fast as a fork is refilled before that)."""
    return [
        name for name in containers_of(server)
        if not any(process_state(pid) in "Tt" for pid in process_tree(_init_of(name))[1:])
    ]  # fmt: skip


CALLERS_OWN = """
extends: default
name: %(name)s
tools:
  execute_command:
    pool: {min: 2, ahead: 60, max: 60, idle_s: 300, runc: {ahead: 60, max: 60}}
"""


async def test_two_callers_policies_keep_no_more_sandboxes_waiting_than_the_server_allows(
    tmp_path: Path, runtime: DockerRuntime
) -> None:
    """Two callers by token under policies of their own, each asking for 60 waiting: 165 waited once, the server
    held 1,019 descriptors and every refill failed in select(). All pools together now keep host.pool_sandboxes."""

    server_policy = tmp_path / "server.yaml"
    server_policy.write_text("extends: default\nhost: {pool_sandboxes: 24}\n")
    tokens_file, tokens = tmp_path / "tokens.json", {}
    for name in ("ada", "bob"):
        policy = tmp_path / f"{name}.yaml"
        policy.write_text(CALLERS_OWN % {"name": name})
        added = run_cli("token", "add", name, "--policy", str(policy), "--tokens", str(tokens_file))
        assert added.returncode == 0, added.stderr
        tokens[name] = added.stdout.splitlines()[-1]
    serve = ("--policy", str(server_policy), "--tokens", str(tokens_file))
    with http_server_process(*serve, env=FULL_POOLS) as server:
        for name in ("ada", "bob"):
            async with client_of(server.url, tokens[name]) as session:
                for turn in range(8):
                    result, said = await shell(session, f"echo {name}-{turn}")
                    assert not result.is_error and said["stdout"] == f"{name}-{turn}\n", said
        server.wait_for_line("warm pools hold 24 sandbox(es), waiting or being made: the most the server keeps")
        process = psutil.Process(server.process.pid)
        async with client_of(server.url, tokens["ada"]) as session:
            for _ in range(4):  # each takes one; the pools make it again, within the count
                result, _ = await shell(session, "true")
                assert not result.is_error, text_of(result)
        seen: list[int] = []
        with anyio.fail_after(60):
            while not seen or seen[-1] < 24:
                seen.append(len(_waiting(server.process.pid)))
                await anyio.sleep(0.2)
        assert max(seen) <= 24, seen
        assert process.num_fds() < 24 * 6 + 200, process.num_fds()
        assert not [line for line in server.lines if "out of range" in line or "could not prepare" in line]


async def test_a_server_started_with_fewer_pool_sandboxes_than_its_policy_allows_keeps_no_more(
    tmp_path: Path, runtime: DockerRuntime
) -> None:
    """`serve --pool-sandboxes`: an operator's bound (a small machine's) below the server policy's
    host.pool_sandboxes, which the default policy's pools would otherwise fill after a first call."""
    server_policy = tmp_path / "server.yaml"
    server_policy.write_text("extends: default\nhost: {pool_sandboxes: 24}\n")
    audit = tmp_path / "audit.jsonl"
    serve = ("--policy", str(server_policy), "--pool-sandboxes", "5", "--audit-log", str(audit))
    with http_server_process(*serve, env=FULL_POOLS) as server:
        async with connect(server.url) as session:
            for _ in range(3):
                result = await session.call_tool("execute_command", {"command": "true"})
                assert not result.is_error, text_of(result)
        server.wait_for_line("warm pools hold 5 sandbox(es), waiting or being made: the most the server keeps")
        used = {cid[:12] for cid in _audited_containers(audit)}  # (a used one may linger a moment before it stops)
        seen = []
        for _ in range(10):
            seen.append(len({name[:12] for name in _waiting(server.process.pid)} - used))
            await anyio.sleep(0.1)
        assert 0 < max(seen) <= 5, seen
