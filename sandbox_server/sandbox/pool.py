"""Warm containers: made ahead of calls, each used by exactly one call, then destroyed.

One queue per container key (image and every container setting of a tool's
policy). A call whose key has a healthy, fresh container takes it and skips
create/attach/start; one that finds none while the engine is making one of its key
takes that one when it comes (a cold one made beside it would come no sooner); any
other starts cold at once, never waiting for the pool. A server makes the first
container of each pool whose interpreter imports libraries before its event loop runs
(head_start), so a first call finds its libraries imported or nearly.
A container that is never taken is replaced after its idle time. A container that
said anything or whose stream ended before its call (broken) is discarded, never
handed out. A new policy drains the queues it no longer wants; close() destroys
all. Isolation between calls is that of a cold container: a warm one has run
nothing but the launcher (and, in python-data images, an interpreter importing its
libraries), blocked on reading its request.

Each pool follows demand between its target's `size` (its minimum) and `maximum`: a
call that finds it empty doubles what it keeps, a container that waited its whole idle
time unused takes one back. A pool with an `ahead` count is filled to it from its first
call on: the engine makes a few containers a second while calls one after another use
dozens, so only containers made before a burst serve it. It never holds more memory than
its budget (the warm containers' resident memory, read from the host), and makes none
while the host has less memory available than its floor. It makes containers in the
pauses between calls (engine work beside back-to-back calls would slow each of them),
unless none is left waiting. All pools together, every caller's policy's included, keep at most the
server policy's `host.pool_sandboxes` waiting (fewer where the server was started with `--pool-sandboxes`),
within a quarter of the process's open-file limit.
"""

from __future__ import annotations

import functools
import logging
import math
import resource
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace
from typing import Generic, Protocol, TypeVar

import anyio
import anyio.to_thread

from sandbox_server.errors import SandboxServerError, ServerStopping
from sandbox_server.sandbox.activity import Activity
from sandbox_server.sandbox.held import HeldMemory
from sandbox_server.sandbox.making import Early, Making
from sandbox_server.sandbox.pool_memory import PoolMemory
from sandbox_server.sandbox.runtime import NO_HOOKS, RunHooks
from sandbox_server.sandbox.spec import ExecutionResult, SandboxSpec

__all__ = ["PoolStats", "PoolTarget", "WarmPool"]

log = logging.getLogger("sandbox_server.pool")

Key = tuple[object, ...]
FILL_CONCURRENCY = 2
"""Containers prepared at the same time; more only queues up in the engine."""
LOW_WATER = 1
"""A pool with fewer containers waiting than this is filled at once, even while calls run. While one still
waits, the next call is served warm, and making its replacement beside the running call would slow that call
(a gVisor container costs the two cores of a small host some 300 ms to make: a strict call made beside one took
16 ms longer at its median)."""
DEFER_S = 2.0
"""The longest a pool with enough containers waiting defers making more while calls run back to back."""
MAX_BACKOFF_S = 30.0
FULL = "warm pools hold %d sandbox(es), waiting or being made: the most the server keeps (host.pool_sandboxes, or serve --pool-sandboxes, within a quarter of its open-file limit)"
FILES_PER_WAITING = 6
"""The server's open files for one waiting sandbox, with room: runc's three pipes and its process handle (the
engine's attach socket for one of the engine's)."""
SWEEP_S = 1.0
"""How often waiting containers are checked for a stream that ended (killed, engine restarted).
A check is a zero-timeout select on each stream: no engine round trip."""


class Warm(Protocol):
    """What the pool needs to know of a warm container."""

    @property
    def key(self) -> Key: ...
    @property
    def ready_at(self) -> float: ...


WarmT = TypeVar("WarmT", bound=Warm)


class WarmEngine(Protocol[WarmT]):
    """The engine side: make, check, throw away, and run in a warm container (of its own kind)."""

    def prepare(self, spec: SandboxSpec) -> WarmT: ...
    def healthy(self, warm: WarmT) -> bool: ...
    def memory(self, warm: WarmT) -> int: ...
    def discard(self, warm: WarmT) -> None: ...
    def discard_later(self, warm: WarmT) -> None: ...
    async def run(
        self, spec: SandboxSpec, hooks: RunHooks = NO_HOOKS, warm: WarmT | None = None
    ) -> ExecutionResult: ...


@dataclass(frozen=True, slots=True)
class PoolTarget:
    """Keep `size` to `maximum` containers made from `spec`'s container settings, none older than `idle_s`."""

    spec: SandboxSpec
    size: int
    idle_s: float
    maximum: int = 0
    """The most this pool grows to under demand (never below `size`)."""
    ahead: int = 0
    """What the pool keeps once a call used it, until its containers wait idle_s unused (0: only `size`)."""
    on_runc: tuple[int, int] | None = None
    """Its (ahead, maximum) where runc itself makes its containers, which cost less to keep (None: the same)."""

    @property
    def most(self) -> int:
        """The pool's ceiling."""
        return max(self.size, self.maximum, self.ahead)

    @property
    def key(self) -> Key:
        """The container key this target fills."""
        return self.spec.container_key()

    def at_depth(self, runc_makes: Callable[[SandboxSpec], bool]) -> PoolTarget:
        """This target as its pool keeps it: at its depth on runc where runc itself makes its containers."""
        if self.on_runc is None or not runc_makes(self.spec):
            return self
        ahead, maximum = self.on_runc
        return replace(self, ahead=ahead, maximum=maximum, on_runc=None)


@dataclass(slots=True)
class PoolStats:
    """Counters, for the benchmark and the logs."""

    hits: int = 0
    misses: int = 0
    made: int = 0
    discarded_stale: int = 0
    discarded_broken: int = 0
    failures: int = 0
    held_back: int = 0
    """Containers not made because the memory budget or the host's memory floor said no."""


class WarmPool(Generic[WarmT]):
    """A SandboxRuntime that runs each call in a warm container when one is ready, cold otherwise."""

    def __init__(
        self,
        engine: WarmEngine[WarmT],
        activity: Activity | None = None,
        held_elsewhere: HeldMemory | None = None,
        runc_makes: Callable[[SandboxSpec], bool] | None = None,
        most_waiting: int | None = None,
    ) -> None:
        self._engine = engine
        self._operators_most = most_waiting
        """The most sandboxes waiting the server was started with (serve --pool-sandboxes), whatever its policy
        allows (None: as its policy says)."""
        self._runc_makes = runc_makes or (lambda spec: False)
        """Whether runc itself makes a spec's containers (a target's `on_runc` depth then applies)."""
        self._activity = activity or Activity()
        self._targets: dict[Key, PoolTarget] = {}
        self._ready: dict[Key, deque[WarmT]] = {}
        self._filling: dict[Key, int] = {}
        self._wakeup = anyio.Event()
        self._retry_at = 0.0
        self._closed = False
        self._announced: set[Key] = set()
        self._want: dict[Key, int] = {}
        """How many each pool keeps now, between its size and its maximum."""
        self._swept_at = -math.inf
        self._making_s: dict[Key, float] = {}
        """How long making a container of each key took the last time: the room in a pause a fill needs."""
        self._making: Making[WarmT] = Making()
        """Containers the engine is making right now, and the calls waiting for one."""
        self._started_early: list[tuple[PoolTarget, Early[WarmT]]] = []
        """Containers head_start() is making, for maintain() to receive."""
        self.memory = PoolMemory(held_elsewhere)
        self._most_waiting = most_allowed(None)
        self._said_full = False
        """What the waiting containers hold, and whether one more fits (the budget, the host's floor)."""
        self.stats = PoolStats()

    def configure(
        self,
        targets: Iterable[PoolTarget],
        memory_budget: float = math.inf,
        host_room: Callable[[], bool] | None = None,
        most_waiting: int | None = None,
    ) -> None:
        """Keep these pools from now on; containers of pools no longer wanted are destroyed. `most_waiting` bounds
        the sandboxes of all of them together (waiting and being made), within what the open-file limit allows."""
        self.memory.budget = memory_budget
        if self._operators_most is not None and (most_waiting is None or self._operators_most < most_waiting):
            most_waiting = self._operators_most
        self._most_waiting = most_allowed(most_waiting)
        self._said_full = False
        if host_room is not None:
            self.memory.host_room = host_room
        wanted: dict[Key, PoolTarget] = {}
        for target in (target.at_depth(self._runc_makes) for target in targets):
            if target.size > 0:
                known = wanted.get(target.key)
                wanted[target.key] = target if known is None or target.size > known.size else known
        for key in list(self._ready):
            if key not in wanted or wanted[key] != self._targets.get(key):
                for warm in self._ready.pop(key):
                    self._engine.discard_later(warm)
        self._targets = wanted
        self._announced &= set(wanted)
        self._want = {key: self._want[key] for key in wanted if key in self._want}
        self._wakeup.set()

    def ready_count(self) -> int:
        """Warm containers waiting now."""
        return sum(len(queue) for queue in self._ready.values())

    def wanted(self, key: Key) -> int:
        """How many containers the pool of this key keeps now."""
        target = self._targets.get(key)
        if target is None:
            return 0
        return min(target.most, max(target.size, self._want.get(key, target.size)))

    def _grow(self, key: Key, by_doubling: bool) -> None:
        current = self.wanted(key)
        self._want[key] = min(self._targets[key].most, current * 2 if by_doubling else current + 1)

    def _shrink(self, key: Key) -> None:
        if key in self._targets:
            self._want[key] = max(self._targets[key].size, self.wanted(key) - 1)

    async def run(self, spec: SandboxSpec, hooks: RunHooks = NO_HOOKS) -> ExecutionResult:
        """Run one call in a warm container of its key if one is ready or about to be, else in a cold one."""
        key = spec.container_key()
        soon = self._making.soon(key)
        warm = self.take(key, missed=not soon)
        if warm is None and soon:
            waiting = lambda: self.take(key, missed=False) if self._ready.get(key) else None  # noqa: E731
            if (warm := await self._making.arriving(key, 1.5 * self._making_s.get(key, 0.0), waiting)) is None:
                warm = self.take(key)  # none came in time: a miss, as any
        return await self._engine.run(spec, hooks, warm=warm)

    def take(self, key: Key, missed: bool = True) -> WarmT | None:
        """A healthy warm container of this key not older than its idle time, or None (a miss, which grows the
        pool, unless the caller waits for one being made); stale and broken ones met on the way are discarded."""
        queue = self._ready.get(key)
        target = self._targets.get(key)
        now = time.monotonic()
        if target is not None and self.wanted(key) < target.ahead:  # in use: fill it for the calls to come
            self._want[key] = target.ahead
        while queue:
            warm = queue.popleft()
            if target is None or now - warm.ready_at > target.idle_s:
                self.stats.discarded_stale += 1
            elif not self._engine.healthy(warm):
                self.stats.discarded_broken += 1
            else:
                self.stats.hits += 1
                self._activity.changed()  # a fill waiting for a pause looks again at what is left
                if not queue:  # the last one: demand is catching up with the pool
                    self._grow(key, by_doubling=False)
                self._wakeup.set()
                return warm
            self._engine.discard_later(warm)
        if missed and target is not None:  # the pool keeps twice as many from now on
            self.stats.misses += 1
            self._grow(key, by_doubling=True)
            self._wakeup.set()
        return None

    def head_start(self) -> None:
        """Before the event loop runs (the server still loading): start making the first container of each pool
        whose interpreter imports libraries while it waits, in a thread of its own, so a first call finds one
        ready; maintain() receives them."""
        for key, target in self._targets.items():
            if target.spec.preloads:
                self._filling[key] = self._filling.get(key, 0) + 1
                self._making.begin(key)
                self._started_early.append((target, Early(self._engine.prepare, target.spec)))

    async def _receive(self, target: PoolTarget, early: Early[WarmT]) -> None:
        """A container head_start() made, queued as a fill's would be."""
        try:
            warm = await early.made()
        except ServerStopping:
            return
        except Exception as exc:
            self.stats.failures += 1
            log.warning("could not prepare a warm container: %s", exc)
            return
        finally:
            self._filling[target.key] -= 1
            self._making.end(target.key)
            self._wakeup.set()
        self.add(target, warm)

    async def maintain(self) -> None:
        """Keep every pool full and fresh until cancelled (run it in the server's task group)."""
        async with anyio.create_task_group() as group:
            for early in self._started_early:
                group.start_soon(self._receive, *early)
            self._started_early = []
            limiter = anyio.CapacityLimiter(FILL_CONCURRENCY)
            while True:
                self._wakeup = anyio.Event()
                now = time.monotonic()
                self._expire(now)
                if now >= self._swept_at + SWEEP_S:
                    self._swept_at = now
                    await self._sweep()
                if now >= self._retry_at:
                    held: set[Key] = set()
                    missing = {
                        key: self.wanted(key) - len(self._ready.get(key, ())) - self._filling.get(key, 0)
                        for key in self._targets
                    }
                    empty = {key for key in self._targets if not self._ready.get(key)}
                    for key, target in fill_order(self._targets, missing, empty, self._making_s):
                        if key in held:
                            continue
                        if self.ready_count() + sum(self._filling.values()) >= self._most_waiting:
                            self.stats.held_back += 1
                            if not self._said_full:  # once per configuration
                                self._said_full = True
                                log.info(FULL, self._most_waiting)
                            break  # every pool together holds as many as the server allows
                        if not self.memory.affordable(key, self.waiting(), self._filling):  # nor more this turn
                            held.add(key)
                            self.stats.held_back += 1
                            continue
                        self._filling[key] = self._filling.get(key, 0) + 1
                        group.start_soon(self._fill, target, limiter)
                with anyio.move_on_after(self._next_deadline(now)):
                    await self._wakeup.wait()

    def _expire(self, now: float) -> None:
        for key, queue in self._ready.items():
            target = self._targets[key]
            while queue and now - queue[0].ready_at > target.idle_s:
                self.stats.discarded_stale += 1
                self._engine.discard_later(queue.popleft())
                self._shrink(key)  # it waited its whole idle time unused: one fewer is enough

    async def _sweep(self) -> None:
        """Discard waiting containers that broke, and read what the others hold: in a worker thread, and only in a
        pause between calls (a few ms for dozens of containers)."""
        self._discard_broken()
        if self._activity.quiet():
            self.memory.take_reading(
                await anyio.to_thread.run_sync(self.memory.read, self.waiting(), self._engine.memory)
            )

    def _discard_broken(self) -> None:
        """Discard waiting containers that broke (their stream ended or spoke), so they are replaced now."""
        for queue in self._ready.values():
            for warm in list(queue):
                if not self._engine.healthy(warm):
                    queue.remove(warm)
                    self.stats.discarded_broken += 1
                    self._engine.discard_later(warm)

    def waiting(self) -> list[tuple[Key, WarmT]]:
        """Every container waiting now, with its key."""
        return [(key, warm) for key, queue in self._ready.items() for warm in queue]

    def _next_deadline(self, now: float) -> float:
        deadlines = [queue[0].ready_at + self._targets[key].idle_s - now for key, queue in self._ready.items() if queue]
        if any(self._ready.values()):
            deadlines.append(SWEEP_S)
        if now < self._retry_at:
            deadlines.append(self._retry_at - now)
        return max(0.05, min(deadlines)) if deadlines else math.inf

    async def _fill(self, target: PoolTarget, limiter: anyio.CapacityLimiter) -> None:
        key = target.key
        low = functools.partial(self._running_low, key)
        try:
            async with limiter:
                lasting = self._making_s.get(key, 0.0)
                pause = functools.partial(self._activity.wait_for_pause, DEFER_S, unless=low, lasting_s=lasting)
                await anyio.to_thread.run_sync(pause, abandon_on_cancel=True)
                if self._targets.get(key) != target or time.monotonic() < self._retry_at:
                    return
                with anyio.CancelScope(shield=True):  # a container being made is always received, never lost
                    started = time.monotonic()
                    self._making.begin(key)
                    try:
                        warm = await anyio.to_thread.run_sync(self._engine.prepare, target.spec)
                    finally:
                        self._making.end(key)  # a call waiting for it looks again
                    self._making_s[key] = time.monotonic() - started
        except ServerStopping:  # (nothing to retry, nothing to say)
            return
        except Exception as exc:  # the pool is an optimisation: calls still run cold, the server goes on
            self.stats.failures += 1
            backoff = min(MAX_BACKOFF_S, 2.0 ** min(self.stats.failures, 5))
            self._retry_at = time.monotonic() + backoff
            detail = str(exc) if isinstance(exc, SandboxServerError) else repr(exc)
            log.warning("could not prepare a warm container (retrying in %.0f s): %s", backoff, detail)
            return
        finally:
            self._filling[key] -= 1
            self._wakeup.set()
        # No await between receiving the container and queueing it: close() must always find it.
        self.add(target, warm)

    def _running_low(self, key: Key) -> bool:
        return self._closed or len(self._ready.get(key, ())) < LOW_WATER

    def add(self, target: PoolTarget, warm: WarmT) -> None:
        """Queue a container made for `target`; discarded when the pool closed or no longer wants it."""
        key = target.key
        if self._closed or self._targets.get(key) != target:
            self._engine.discard_later(warm)
            return
        self.stats.made += 1
        self.stats.failures = 0
        queue = self._ready.setdefault(key, deque())
        queue.append(warm)
        if len(queue) == target.size and key not in self._announced:
            self._announced.add(key)
            log.info("warm pool ready: %d container(s) of %s", target.size, target.spec.image)

    async def close(self) -> None:
        """Destroy every waiting container (after maintain() was cancelled), and what head_start() made if
        maintain() never ran to receive it (the server did not start)."""
        early, self._started_early = self._started_early, []
        for _, made in early:
            await anyio.to_thread.run_sync(made.drop, self._engine.discard)
        self._closed = True
        waiting = [warm for queue in self._ready.values() for warm in queue]
        self._ready.clear()
        self._targets = {}
        async with anyio.create_task_group() as group:
            for warm in waiting:
                group.start_soon(anyio.to_thread.run_sync, self._engine.discard, warm)


def most_allowed(most_waiting: int | None) -> int:
    """The most sandboxes all pools together keep: `most_waiting` (None: no count of its own), within a quarter of
    this process's open-file limit at FILES_PER_WAITING each, so that waiting sandboxes never take the descriptors
    calls, connections and workspaces need."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    by_files = math.inf if soft == resource.RLIM_INFINITY else soft // 4 // FILES_PER_WAITING
    return int(min(by_files, math.inf if most_waiting is None else most_waiting))


def fill_order(
    targets: dict[Key, PoolTarget], missing: dict[Key, int], empty: set[Key], making_s: dict[Key, float]
) -> list[tuple[Key, PoolTarget]]:
    """The containers to make now, one of each pool in turn: an empty pool first, then the one whose containers
    take longest to be ready (an interpreter that imports libraries), so the shell's pool does not take every
    slot while python-data's first interpreter, which a first call waits longest for, waits its turn."""

    def first(key: Key) -> tuple[bool, float]:
        return key not in empty, -making_s.get(key, 1.0 if targets[key].spec.preloads else 0.1)

    order = sorted((key for key, count in missing.items() if count > 0), key=first)
    turns = max(missing.values(), default=0)
    return [(key, targets[key]) for turn in range(turns) for key in order if missing[key] > turn]
