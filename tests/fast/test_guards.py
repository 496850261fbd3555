"""Pure logic of the guards: audit rotation and host admission."""

import json
from pathlib import Path

import psutil
import pytest

from sandbox_server.access.admission import Admission, Waiting
from sandbox_server.access.audit import AuditLog
from sandbox_server.errors import Refusal
from sandbox_server.policy import HostAdmission, RateLimits


def test_audit_log_appends_json_lines_and_rotates_by_size(tmp_path: Path) -> None:
    log = AuditLog(tmp_path / "audit.jsonl", max_bytes=4096, keep=2)
    for index in range(200):
        log.write({"call": index, "padding": "x" * 40})
    current = [json.loads(line) for line in (tmp_path / "audit.jsonl").read_text().splitlines()]
    rotated = [json.loads(line) for line in (tmp_path / "audit.jsonl.1").read_text().splitlines()]
    assert current[0]["event"] == "audit_rotated_away"  # the oldest file went: said where the oldest kept starts
    current = current[1:]
    assert current[-1]["call"] == 199
    assert rotated[-1]["call"] == current[0]["call"] - 1
    assert (tmp_path / "audit.jsonl.2").exists() and not (tmp_path / "audit.jsonl.3").exists()
    assert all(path.stat().st_size <= 4096 for path in tmp_path.iterdir())


def test_a_saturated_host_refuses_new_sandboxes_and_says_which_field() -> None:
    admission = Admission(RateLimits(), HostAdmission(min_available_memory_mb=10**9, max_load_per_cpu=8), "p")
    with pytest.raises(Refusal) as refused:
        admission.admit("client")
    assert refused.value.message.startswith("busy: the host has")
    assert refused.value.field == "host.min_available_memory_mb" and refused.value.kind == "busy"
    assert admission.running == 0


def test_the_hosts_available_memory_is_read_again_only_once_its_reading_is_old() -> None:
    from sandbox_server.sandbox.host_memory import READ_EVERY_S, Reading, available_bytes

    reads: list[float] = []
    now = [100.0]

    def read() -> int:
        reads.append(now[0])
        return len(reads)

    reading = Reading(read, lambda: now[0])
    assert reading() == 1 and reading() == 1  # a burst's calls share one reading
    now[0] += READ_EVERY_S / 2
    assert reading() == 1
    now[0] += READ_EVERY_S
    assert reading() == 2 and reads == [100.0, 100.0 + READ_EVERY_S * 1.5]
    now[0] -= 10  # a clock that went back never keeps an old reading
    assert reading() == 3
    assert 0 < available_bytes() <= psutil.virtual_memory().total


def test_admission_forgets_clients_idle_for_a_minute() -> None:
    now = [1000.0]
    admission = Admission(
        RateLimits(), HostAdmission(min_available_memory_mb=0, max_load_per_cpu=10**6), "p", lambda: now[0]
    )
    for number in range(300):
        admission.admit(f"client-{number}").release()
    assert admission.remembered == 300
    now[0] += 61
    admission.admit("late").release()
    assert admission.remembered == 1


def _queue(concurrent: int = 1, wait_s: float = 30, length: int = 64) -> Admission:
    rate = RateLimits(calls_per_minute=10_000, concurrent_calls=concurrent, queue_wait_s=wait_s, queue_length=length)
    return Admission(rate, HostAdmission(min_available_memory_mb=0, max_load_per_cpu=10**6), "p")


@pytest.mark.anyio
async def test_a_queued_call_runs_when_a_slot_frees_callers_in_turn_each_oldest_first() -> None:
    import anyio

    admission = _queue()
    running = admission.admit("a")
    order: list[str] = []

    async def call(client: str, name: str) -> None:
        ticket = await admission.enter(client)
        order.append(name)
        ticket.release()

    async with anyio.create_task_group() as group:
        for number, (client, name) in enumerate((("a", "a1"), ("a", "a2"), ("a", "a3"), ("b", "b1")), start=1):
            group.start_soon(call, client, name)
            with anyio.fail_after(5):  # each waits before the next asks, so the queue's order is known
                while admission.waiting < number:
                    await anyio.sleep(0.01)
        assert admission.waiting == 4 and order == []
        running.release()
    assert order == ["a1", "b1", "a2", "a3"]  # b's one call does not wait behind all of a's
    assert admission.waiting == 0 and admission.running == 0


@pytest.mark.anyio
async def test_a_queued_call_is_told_how_many_calls_take_their_turns_before_its_own() -> None:
    import anyio

    admission = _queue()
    running = admission.admit("a")
    told: dict[str, list[int]] = {}
    complete = anyio.Event()

    def telling(name: str) -> Waiting:
        async def waiting(ahead: int, waited_s: float) -> None:
            if complete.is_set():  # (what it is told once every call below waits)
                told.setdefault(name, []).append(ahead)

        return waiting

    async def call(client: str, name: str) -> None:
        (await admission.enter(client, waiting=telling(name))).release()

    async with anyio.create_task_group() as group:
        for number, (client, name) in enumerate((("a", "a1"), ("a", "a2"), ("a", "a3"), ("b", "b1")), start=1):
            group.start_soon(call, client, name)
            with anyio.fail_after(5):
                while admission.waiting < number:
                    await anyio.sleep(0.01)
        complete.set()
        with anyio.fail_after(5):  # each asks again once a second
            while len(told) < 4:
                await anyio.sleep(0.05)
        running.release()
    # the turns come a1, b1, a2, a3: b's one call has one call ahead of it, not all three of a's
    assert {name: heard[0] for name, heard in told.items()} == {"a1": 0, "b1": 1, "a2": 2, "a3": 3}, told


@pytest.mark.anyio
async def test_a_full_queue_refuses_at_once_saying_its_length() -> None:
    import anyio

    admission = _queue(length=2)
    running = admission.admit("a")
    async with anyio.create_task_group() as group:
        group.start_soon(admission.enter, "b")
        group.start_soon(admission.enter, "c")
        with anyio.fail_after(5):
            while admission.waiting < 2:
                await anyio.sleep(0.01)
        with pytest.raises(Refusal) as refused:
            await admission.enter("d")
        group.cancel_scope.cancel()
    assert refused.value.field == "rate.queue_length" and refused.value.kind == "busy"
    assert "2 calls waiting, the most the queue holds (field rate.queue_length)" in refused.value.message
    running.release()


@pytest.mark.anyio
async def test_a_cancelled_or_timed_out_queued_call_leaves_the_queue() -> None:
    import anyio

    admission = _queue(wait_s=0.2)
    running = admission.admit("a")
    heard: list[tuple[int, float]] = []

    async def waiting(ahead: int, waited_s: float) -> None:
        heard.append((ahead, waited_s))

    with pytest.raises(Refusal) as timed_out:
        await admission.enter("b", waiting=waiting)
    assert timed_out.value.field == "rate.queue_wait_s" and admission.waiting == 0
    assert heard and heard[0][0] == 0
    assert "waited 0.2 s" in timed_out.value.message  # the queue's wait alone: a call's timeout is its program's
    async with anyio.create_task_group() as group:
        group.start_soon(admission.enter, "c")
        with anyio.fail_after(5):
            while admission.waiting < 1:
                await anyio.sleep(0.01)
        group.cancel_scope.cancel()
    assert admission.waiting == 0
    running.release()
    assert admission.running == 0
    admission.admit("d").release()  # the slot went back, not to a cancelled call


def test_a_loaded_host_refuses_the_callers_running_their_share_of_the_calls_and_admits_the_others() -> None:
    rate = RateLimits(calls_per_minute=10_000, concurrent_calls=8)
    admission = Admission(rate, HostAdmission(min_available_memory_mb=0, max_load_per_cpu=10**6), "p")
    heavy = [admission.admit("heavy"), admission.admit("heavy")]
    admission.reconfigure(rate, HostAdmission(min_available_memory_mb=0, max_load_per_cpu=-1), "p")  # loaded
    with pytest.raises(Refusal) as refused:
        admission.admit("heavy")
    assert refused.value.field == "host.max_load_per_cpu" and refused.value.kind == "busy"
    assert "this caller runs 2 of the 2 calls running" in refused.value.message, refused.value.message
    light = [admission.admit("light"), admission.admit("light")]  # below its share (none, then 1 of 3)
    with pytest.raises(Refusal):
        admission.admit("light")  # 2 of 4 over two callers: its share, as heavy's
    for ticket in heavy + light:
        ticket.release()
    with pytest.raises(Refusal) as nobodys:
        admission.admit("anyone")  # nothing runs here: the load is not a caller's, and no one may add to it
    assert nobodys.value.field == "host.max_load_per_cpu" and "calls running" not in nobodys.value.message
