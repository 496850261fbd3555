"""Engine work beside calls waits for a pause between them: pure logic, fake engines.

What it buys (back-to-back calls as fast as spaced ones) is measured in `bench warm`.
"""

from __future__ import annotations

import functools
import threading
import time
from typing import Any

import anyio
import pytest

from sandbox_server.sandbox.activity import PAUSE_S, Activity
from sandbox_server.sandbox.engine import removal
from sandbox_server.sandbox.pool import PoolTarget, WarmPool
from sandbox_server.sandbox.spec import SandboxSpec
from tests.fast.test_pool_logic import _FakeEngine, _FakeWarm

WINDOW_S = 0.5
"""How long a call is held open to show that nothing happened beside it (an absence has no event to await)."""


def _waiter(activity: Activity, at_most_s: float, unless: Any = lambda: False) -> tuple[threading.Thread, list[float]]:
    returned: list[float] = []

    def wait() -> None:
        activity.wait_for_pause(at_most_s, unless)
        returned.append(time.monotonic())

    thread = threading.Thread(target=wait)
    thread.start()
    return thread, returned


def test_a_waiter_returns_only_a_pause_after_the_last_call_ended() -> None:
    activity = Activity()
    with activity.call():
        thread, returned = _waiter(activity, 30)
        time.sleep(WINDOW_S)
        assert not returned, "it returned while a call ran"
    ended = time.monotonic()
    thread.join(10)
    assert returned and returned[0] >= ended + PAUSE_S * 0.9
    started = time.monotonic()
    activity.wait_for_pause(30)  # long after the call: at once
    assert time.monotonic() - started < PAUSE_S


def test_a_waiter_stops_waiting_when_told_or_when_its_time_is_up() -> None:
    activity = Activity()
    urgent = threading.Event()
    with activity.call():
        thread, returned = _waiter(activity, 30, unless=urgent.is_set)
        urgent.set()
        activity.changed()
        thread.join(10)
        assert returned, "an urgent waiter does not wait for the call to end"
        started = time.monotonic()
        activity.wait_for_pause(0.2)
        assert 0.18 <= time.monotonic() - started < 5


def test_lasting_work_starts_in_a_pause_only_when_it_ends_before_the_next_call_is_due() -> None:
    activity = Activity()
    pace_s = 0.6
    for _ in range(4):  # a client calling every 0.6 s
        began = time.monotonic()
        with activity.call():
            pass
        time.sleep(pace_s - (time.monotonic() - began))
    began = time.monotonic()
    with activity.call():
        pass
    due = began + pace_s
    activity.wait_for_pause(30, lasting_s=0.2)  # fits before the next call: at the pause's start
    assert time.monotonic() - began < 0.3
    time.sleep(0.4)
    activity.wait_for_pause(30, lasting_s=0.2)  # no longer fits this pause: only once the next call is late
    assert time.monotonic() >= due + PAUSE_S * 0.9
    assert activity.quiet()


def test_lasting_work_that_fits_no_pause_at_the_calls_pace_starts_as_the_pause_begins() -> None:
    activity = Activity()
    for _ in range(4):  # a client calling every 0.3 s, and work of 0.5 s: waiting for room would be for ever
        began = time.monotonic()
        with activity.call():
            pass
        time.sleep(0.3 - (time.monotonic() - began))
    with activity.call():
        ended = time.monotonic()
    activity.wait_for_pause(30, lasting_s=0.5)
    assert ended + PAUSE_S * 0.9 <= time.monotonic() < ended + 0.25


class _RecordingEngine(_FakeEngine):
    """Records, for each container made, whether a call was running at the time."""

    def __init__(self, running: list[bool]) -> None:
        super().__init__()
        self.running = running
        self.made_during_call: list[bool] = []

    def prepare(self, spec: SandboxSpec) -> Any:
        self.made_during_call.append(self.running[0])
        return _FakeWarm(spec.container_key(), time.monotonic())


@pytest.mark.anyio
async def test_the_pool_fills_in_pauses_unless_it_runs_low() -> None:
    activity = Activity()
    running = [False]
    engine = _RecordingEngine(running)
    pool = WarmPool(engine, activity)
    spec = SandboxSpec(image="img", argv=("true",))
    key = spec.container_key()
    target = PoolTarget(spec, 2, idle_s=60)  # the default policy's pool: one left after a call is enough
    pool.configure([target])
    async with anyio.create_task_group() as group:
        group.start_soon(pool.maintain)
        with anyio.fail_after(10):
            while pool.ready_count() < target.size:
                await anyio.sleep(0.01)
        assert engine.made_during_call == [False] * target.size
        with activity.call():
            running[0] = True
            assert pool.take(key) is not None  # one left: the replacement waits for a pause
            await anyio.sleep(WINDOW_S)
            assert len(engine.made_during_call) == target.size
            assert pool.take(key) is not None  # none left: it is made now, beside the call
            with anyio.fail_after(10):
                while len(engine.made_during_call) < target.size + 1:
                    await anyio.sleep(0.01)
            assert engine.made_during_call[-1] is True
            running[0] = False
        with anyio.fail_after(10):
            while pool.ready_count() < target.size:
                await anyio.sleep(0.01)
        group.cancel_scope.cancel()
    await pool.close()


class _FakeApi:
    def __init__(self) -> None:
        self.removed: list[tuple[str, float]] = []

    def remove_container(self, container_id: str, **_: Any) -> None:
        self.removed.append((container_id, time.monotonic()))


def test_used_containers_are_removed_in_a_pause_unless_they_pile_up() -> None:
    activity = Activity()
    api = _FakeApi()
    remover = removal.Remover(lambda: api, activity)
    try:
        with activity.call():
            remover.remove_later("one")
            time.sleep(WINDOW_S)
            assert not api.removed, "removed beside a running call"
            for index in range(removal.BACKLOG + 2):
                remover.remove_later(f"more-{index}")
            deadline = time.monotonic() + 10
            while not api.removed and time.monotonic() < deadline:
                time.sleep(0.01)
            assert api.removed, "a backlog past BACKLOG is removed even while calls run"
        ended = time.monotonic()
    finally:
        remover.close()
    assert {cid for cid, _ in api.removed} == {"one", *(f"more-{i}" for i in range(removal.BACKLOG + 2))}
    assert any(at >= ended for _, at in api.removed)


class _SlowApi(_FakeApi):
    """An engine that takes 0.1 s to remove a container."""

    def remove_container(self, container_id: str, **_: Any) -> None:
        time.sleep(0.1)
        super().remove_container(container_id)


def test_a_stopping_server_removes_its_backlog_side_by_side() -> None:
    activity = Activity()
    api = _SlowApi()
    remover = removal.Remover(lambda: api, activity)
    freed: list[str] = []
    with activity.call():  # a burst: every removal waits for the pause that never comes before the stop
        for index in range(16):
            remover.remove_later(f"used-{index}", then=functools.partial(freed.append, f"used-{index}"))
        started = time.monotonic()
        remover.close()
    took = time.monotonic() - started
    assert sorted(cid for cid, _ in api.removed) == sorted(freed) == sorted(f"used-{i}" for i in range(16))
    assert took < 0.6, f"{took:.2f} s: two at a time would take 0.8 s"
