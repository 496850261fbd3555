"""The warm pool's bookkeeping with a fake engine: only healthy, fresh containers of the right key handed out, the
pools grown and shrunk with demand, the memory budget and the host's floor kept, the first interpreter started
early; and the host's view of a sandbox's process tree. The pool on the real engine: tests/test_pool.py."""

from __future__ import annotations

import resource
import threading
import time
from typing import Any

import anyio
import pytest

from sandbox_server.sandbox import wire
from sandbox_server.sandbox.pool import FILES_PER_WAITING, PoolTarget, WarmPool, fill_order, most_allowed
from sandbox_server.sandbox.spec import ExecutionResult, SandboxSpec


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


def test_a_pool_whose_containers_runc_itself_makes_keeps_its_depth_on_runc_and_others_their_own() -> None:

    def runc_makes(spec: SandboxSpec) -> bool:
        return spec.runtime == "runc"

    on_runc, gvisor = (SandboxSpec(image="img", argv=("true",), runtime=name) for name in ("runc", "runsc"))
    targets = [PoolTarget(spec, 1, idle_s=60, maximum=4, ahead=5, on_runc=(9, 12)) for spec in (on_runc, gvisor)]
    for made_by_runc, deep in ((runc_makes, {"runc"}), (None, set())):  # None: the engine makes every one
        pool = WarmPool(_FakeEngine(), runc_makes=made_by_runc)
        pool.configure(targets)
        for target in targets:
            key, runc_itself = target.spec.container_key(), target.spec.runtime in deep
            assert pool.wanted(key) == 1  # a server nobody called keeps its min, on every path
            pool.add(pool._targets[key], _FakeWarm(key, time.monotonic()))  # as the pool's fill adds it
            assert pool.take(key) is not None  # in use, its last taken: filled to its depth, and one more
            assert pool.wanted(key) == (10 if runc_itself else 5)
            for _ in range(3):
                assert pool.take(key) is None
            assert pool.wanted(key) == (12 if runc_itself else 5)  # grown by demand to its max, no further


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
    assert pool.memory.held(pool.waiting()) == 200 and not pool.memory.affordable(
        key, pool.waiting(), {}
    )  # a third would pass 250
    pool.take(key)
    assert pool.memory.held(pool.waiting()) == 100 and pool.memory.affordable(key, pool.waiting(), {})
    room[0] = False
    assert not pool.memory.affordable(key, pool.waiting(), {})  # the host is short of memory: nothing more is made


class _MakingEngine(_FakeEngine):
    """Makes containers in the pool's worker threads, as the real engines do."""

    def prepare(self, spec: SandboxSpec) -> _FakeWarm:
        return _FakeWarm(spec.container_key(), time.monotonic())


def test_all_pools_together_keep_no_more_waiting_than_the_server_allows_and_share_it() -> None:
    """Two callers' policies, each asking for 30 waiting: 165 waited once, and the server ran out of descriptors."""

    async def main() -> None:
        pool = WarmPool(_MakingEngine())
        one, two = SandboxSpec(image="one", argv=("true",)), SandboxSpec(image="two", argv=("true",))
        pool.configure([PoolTarget(one, 30, idle_s=60), PoolTarget(two, 30, idle_s=60)], most_waiting=20)
        async with anyio.create_task_group() as group:
            group.start_soon(pool.maintain)
            with anyio.fail_after(10):
                while pool.ready_count() < 20 or not pool.stats.held_back:  # full, and then held back
                    await anyio.sleep(0.01)
            held = pool.stats.held_back
            while pool.stats.held_back < held + 3:  # it looked again, and again made none
                await anyio.sleep(0.01)
            waiting = [key for key, _ in pool.waiting()]
            assert len(waiting) == 20 and waiting.count(one.container_key()) == 10, waiting  # one of each in turn
            assert pool.take(two.container_key()) is not None
            with anyio.fail_after(10):
                while pool.ready_count() < 20:  # what a call took is made again, within the count
                    await anyio.sleep(0.01)
            group.cancel_scope.cancel()
        await pool.close()

    anyio.run(main)


@pytest.mark.parametrize("policy_allows", [20, None])
def test_a_pool_started_with_a_count_of_its_own_keeps_no_more_whatever_the_policy_allows(
    policy_allows: int | None,
) -> None:
    """serve --pool-sandboxes: the operator's count bounds the server policy's host.pool_sandboxes from below."""

    async def main() -> None:
        pool = WarmPool(_MakingEngine(), most_waiting=7)
        one = SandboxSpec(image="one", argv=("true",))
        pool.configure([PoolTarget(one, 30, idle_s=60)], most_waiting=policy_allows)
        async with anyio.create_task_group() as group:
            group.start_soon(pool.maintain)
            with anyio.fail_after(10):
                while pool.ready_count() < 7 or not pool.stats.held_back:
                    await anyio.sleep(0.01)
            held = pool.stats.held_back
            while pool.stats.held_back < held + 3:  # it looked again, and again made none
                await anyio.sleep(0.01)
            assert pool.ready_count() == 7
            group.cancel_scope.cancel()
        await pool.close()

    anyio.run(main)


def test_the_count_of_waiting_sandboxes_stays_within_a_quarter_of_the_open_file_limit() -> None:
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    assert most_allowed(10**9) == soft // 4 // FILES_PER_WAITING and most_allowed(3) == 3


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
