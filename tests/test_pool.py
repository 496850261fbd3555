"""Warm containers: used once and destroyed, never reused; broken, stale or unwanted ones discarded."""

from __future__ import annotations

import contextlib
import json
import signal
import threading
import time
from pathlib import Path
from typing import Any

import anyio
import docker
import pytest

from sandbox_server.sandbox import wire
from sandbox_server.sandbox.docker_runtime import DockerRuntime
from sandbox_server.sandbox.pool import PoolTarget, WarmPool, fill_order
from sandbox_server.sandbox.spec import SANDBOX_LABEL, ExecutionResult, SandboxSpec
from tests.conftest import containers_of, kill_from_outside
from tests.mcp_harness import connect, http_server_process

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
    return [json.loads(line)["container_id"] for line in audit.read_text().splitlines()]


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


class _FakeWarm:
    def __init__(self, key: tuple[object, ...], ready_at: float, broken: bool = False) -> None:
        self.key, self.ready_at, self.broken = key, ready_at, broken


class _FakeEngine:
    """Pure bookkeeping: which warm containers were handed out and which were thrown away."""

    def __init__(self) -> None:
        self.discarded: list[_FakeWarm] = []
        self.handed: list[_FakeWarm | None] = []

    def prepare(self, spec: SandboxSpec) -> _FakeWarm:
        return _FakeWarm(spec.container_key(), anyio.current_time())

    def healthy(self, warm: Any) -> bool:
        return not warm.broken

    def memory(self, warm: Any) -> int:
        return 100

    def discard(self, warm: Any) -> None:
        self.discarded.append(warm)

    discard_later = discard

    async def run(self, spec: SandboxSpec, hooks: Any = None, warm: Any = None) -> ExecutionResult:
        self.handed.append(warm)
        return ExecutionResult(exit_code=0, stdout=b"", stderr=b"", duration_ms=0)


def test_the_pool_hands_out_only_healthy_fresh_containers_of_the_right_key() -> None:

    engine = _FakeEngine()
    pool = WarmPool(engine)
    spec = SandboxSpec(image="img", argv=("true",))
    other = SandboxSpec(image="other", argv=("true",))
    target = PoolTarget(spec, 3, idle_s=60)
    pool.configure([target])
    now = time.monotonic()
    stale, broken, good = _FakeWarm(spec.container_key(), now - 120), _FakeWarm(spec.container_key(), now, True), \
        _FakeWarm(spec.container_key(), now)  # fmt: skip
    for warm in (stale, broken, good):
        pool.add(target, warm)
    assert pool.take(other.container_key()) is None
    assert pool.take(spec.container_key()) is good
    assert engine.discarded == [stale, broken]
    assert pool.take(spec.container_key()) is None
    assert (pool.stats.hits, pool.stats.misses, pool.stats.discarded_stale, pool.stats.discarded_broken) == (1, 1, 1, 1)
    leftover = _FakeWarm(spec.container_key(), now)
    pool.add(target, leftover)
    pool.configure([PoolTarget(other, 1, idle_s=60)])
    assert engine.discarded[-1] is leftover and pool.ready_count() == 0


def test_a_pool_grows_when_calls_find_it_empty_and_shrinks_after_idle_time() -> None:

    engine = _FakeEngine()
    pool = WarmPool(engine)
    spec = SandboxSpec(image="img", argv=("true",))
    key = spec.container_key()
    target = PoolTarget(spec, 1, idle_s=60, maximum=6)
    pool.configure([target])
    assert pool.wanted(key) == 1
    assert pool.take(key) is None and pool.wanted(key) == 2  # a miss doubles it
    assert pool.take(key) is None and pool.take(key) is None and pool.wanted(key) == 6  # never past its maximum
    now = time.monotonic()
    pool.add(target, _FakeWarm(key, now))
    assert pool.take(key) is not None and pool.wanted(key) == 6
    for _ in range(3):
        pool.add(target, _FakeWarm(key, now - 120))
    pool._expire(now)  # each container that waited its whole idle time unused takes one back
    assert pool.wanted(key) == 3 and pool.ready_count() == 0
    for _ in range(5):
        pool.add(target, _FakeWarm(key, now - 120))
    pool._expire(now)
    assert pool.wanted(key) == 1  # never below its size


def test_a_pool_with_an_ahead_count_fills_to_it_from_its_first_call_until_idle_time_takes_it_back() -> None:

    pool = WarmPool(_FakeEngine())
    spec = SandboxSpec(image="img", argv=("true",))
    key = spec.container_key()
    target = PoolTarget(spec, 1, idle_s=60, ahead=5)
    pool.configure([target])
    assert pool.wanted(key) == 1  # a server nobody called keeps its min
    now = time.monotonic()
    pool.add(target, _FakeWarm(key, now))
    assert pool.take(key) is not None and pool.wanted(key) == 5  # served warm, and filled for the calls to come
    for _ in range(5):
        pool.add(target, _FakeWarm(key, now - 120))
    pool._expire(now)  # nobody called for its idle time: back to its min
    assert pool.wanted(key) == 1
    assert pool.take(key) is None and pool.wanted(key) == 5  # in use again
    assert target.most == 5


def test_a_pool_makes_no_container_past_its_memory_budget_or_the_hosts_floor() -> None:

    engine = _FakeEngine()  # every container holds 100 bytes
    pool = WarmPool(engine)
    spec = SandboxSpec(image="img", argv=("true",))
    key = spec.container_key()
    target = PoolTarget(spec, 1, idle_s=60, maximum=8)
    room = [True]
    pool.configure([target], memory_budget=250, host_room=lambda: room[0])
    for _ in range(2):
        pool.add(target, _FakeWarm(key, time.monotonic()))
    anyio.run(pool._sweep)  # reads what each holds
    assert pool.memory_bytes() == 200 and not pool._affordable(key)  # a third would pass 250
    pool.take(key)
    assert pool.memory_bytes() == 100 and pool._affordable(key)
    room[0] = False
    assert not pool._affordable(key)  # the host is short of memory: nothing more is made


class _GatedEngine(_FakeEngine):
    """Makes containers only once let: what a call finds while the engine is still making them."""

    def __init__(self) -> None:
        super().__init__()
        self.gate, self.entered = threading.Event(), threading.Event()
        self.asked: list[str] = []

    def prepare(self, spec: SandboxSpec) -> _FakeWarm:
        self.asked.append(spec.image)
        self.entered.set()
        self.gate.wait(10)
        return _FakeWarm(spec.container_key(), time.monotonic())


PRELOADED = SandboxSpec(image="python-data", argv=("true",), env=((wire.PRELOAD_ENV, "pandas"),))
PLAIN = SandboxSpec(image="shell", argv=("true",))


def test_the_first_interpreter_is_started_before_the_server_listens_and_a_first_call_waits_for_it() -> None:
    """head_start() makes the first container of a preloading pool before the event loop runs; a call that finds
    none ready while it is being made takes it when it comes, rather than a cold one made beside it."""
    engine = _GatedEngine()
    pool = WarmPool(engine)
    early = PoolTarget(PRELOADED, 1, idle_s=60)
    pool.configure([PoolTarget(PLAIN, 1, idle_s=60), early])
    pool.head_start()
    assert engine.entered.wait(5)  # the thread has asked the engine, only for the preloading pool
    assert engine.asked == ["python-data"]

    async def scenario() -> None:
        async with anyio.create_task_group() as group:
            group.start_soon(pool.maintain)
            called = anyio.Event()

            async def call() -> None:
                await pool.run(PRELOADED)
                called.set()

            group.start_soon(call)
            await anyio.wait_all_tasks_blocked()
            assert not called.is_set() and not engine.handed  # waiting for the one being made
            engine.gate.set()
            with anyio.fail_after(5):
                await called.wait()
            group.cancel_scope.cancel()

    anyio.run(scenario)
    [handed] = engine.handed
    assert handed is not None and handed.key == early.key  # warm: the one head_start() made
    assert pool.stats.misses == 0  # and not counted as a miss (the pool does not double for it)


def test_a_pool_fills_one_of_each_kind_in_turn_the_slowest_to_be_ready_first() -> None:
    plain, preloaded = PoolTarget(PLAIN, 2, idle_s=60), PoolTarget(PRELOADED, 2, idle_s=60)
    targets = {plain.key: plain, preloaded.key: preloaded}
    order = fill_order(targets, {plain.key: 2, preloaded.key: 2}, {plain.key, preloaded.key}, {})
    assert [target.spec.image for _, target in order] == ["python-data", "shell"] * 2
    order = fill_order(targets, {plain.key: 1, preloaded.key: 1}, {plain.key}, {})  # an empty pool first
    assert [target.spec.image for _, target in order] == ["shell", "python-data"]


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
    tmp_path: Path, runtime: DockerRuntime
) -> None:
    policy = tmp_path / "ahead.yaml"
    ahead = POOLED.replace("pool: {size: %(size)d, idle_s: %(idle)s}", "pool: {min: 1, ahead: 5, idle_s: 3}")
    policy.write_text(ahead)
    audit = tmp_path / "audit.jsonl"
    with http_server_process("--policy", str(policy), "--audit-log", str(audit)) as server:
        server.wait_for_line("warm pool ready: 1 container(s)")
        async with connect(server.url) as session:
            await session.call_tool("execute_command", {"command": "true"})  # served warm: no call found it empty
            used = {cid[:12] for cid in _audited_containers(audit)}

            def waiting() -> set[str]:  # started containers no call has used (a used one may linger until removed)
                return {cid[:12] for cid in containers_of(server.process.pid, running=True)} - used

            with anyio.fail_after(30):  # filled to 5 in the pause after it
                while len(waiting()) < 5:
                    await anyio.sleep(0.05)
            began = time.time()
            for _ in range(5):  # a burst, one after another: each finds a container made before it
                await session.call_tool("execute_command", {"command": "true"})
        made = runtime.api.events(
            since=began, until=time.time(), decode=True,
            filters={"type": "container", "event": "create", "label": SANDBOX_LABEL},
        )  # fmt: skip
        made_in_burst = {event["id"][:12] for event in made}
        burst = [cid[:12] for cid in _audited_containers(audit)][1:]
        assert len(burst) == 5 and not set(burst) & made_in_burst, (burst, made_in_burst)
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
    import threading

    import psutil

    from sandbox_server.sandbox.images import catalog
    from sandbox_server.sandbox.removal import OWNER_LABEL, reap_after
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
    left = api.create_container(image, "true", labels={SANDBOX_LABEL: "", OWNER_LABEL: owner})["Id"]
    try:
        reaping = threading.Thread(target=reap_after, args=(stand_in.pid, owner), daemon=True)
        reaping.start()
        reaping.join(timeout=30)
        assert not reaping.is_alive(), "the reaper waited on a process that is not the server"
        assert left[:12] not in {cid[:12] for cid in runtime.sandbox_containers()}
    finally:
        stand_in.kill()
        stand_in.wait()
        with contextlib.suppress(docker.errors.NotFound):
            api.remove_container(left, force=True)
        api.close()


def test_a_process_tree_is_read_from_the_kernels_children_lists() -> None:
    import subprocess

    import psutil

    from sandbox_server.sandbox.warm_container import process_tree

    script = "sleep 30 & (sleep 30 & echo started; wait) & wait"  # started: all four exist
    with subprocess.Popen(["sh", "-c", script], stdout=subprocess.PIPE) as parent:
        try:
            assert parent.stdout is not None and parent.stdout.readline() == b"started\n"
            expected = [parent.pid, *(child.pid for child in psutil.Process(parent.pid).children(recursive=True))]
            assert len(expected) >= 4 and sorted(process_tree(parent.pid)) == sorted(expected)
        finally:
            for process in psutil.Process(parent.pid).children(recursive=True):
                process.kill()
            parent.kill()
    assert process_tree(parent.pid) == []
