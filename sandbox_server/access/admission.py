"""Admission control: rate limits, a concurrency cap with a fair queue, and host load.

Calls per minute and a saturated host are answered at once (a Refusal saying which limit,
which policy field and when to retry). A call beyond the concurrency cap waits its turn in
a queue, fair between callers (each caller's oldest call first, callers in turn), for at most
`rate.queue_wait_s` (its own timeout is the program's, counted from when it starts); it is refused only when the
queue is full or that wait passes, and the refusal says how long the queue was.
"""

from __future__ import annotations

import functools
import math
import os
import threading
import time
from collections import OrderedDict, defaultdict, deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import anyio
import psutil

from sandbox_server.errors import Refusal
from sandbox_server.policy import HostAdmission, RateLimits
from sandbox_server.sandbox.host_memory import available_bytes

__all__ = ["Admission", "Ticket", "Waiting"]

Waiting = Callable[[int, float], Awaitable[None]]
"""Told, while a call waits for a slot, how many calls are ahead of it and how long it has waited (about once a
second)."""

REMEMBERED_CLIENTS = 256
"""Past this many clients with a window of calls, those idle for a minute are forgotten."""


@dataclass(slots=True)
class Ticket:
    """Permission to run one sandbox; release it when the call ends."""

    _release: Callable[[], None]
    _released: bool = False

    def release(self) -> None:
        """Give the concurrency slot back (idempotent)."""
        if not self._released:
            self._released = True
            self._release()


@dataclass(eq=False, slots=True)
class _Waiter:
    client: str
    limit: int
    """The caller's own policy's concurrent calls."""
    granted: anyio.Event = field(default_factory=anyio.Event)
    ticket: Ticket | None = None


class Admission:
    """Decides whether a call may start a sandbox now, or when its turn comes."""

    def __init__(
        self, rate: RateLimits, host: HostAdmission, policy_name: str, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.rate = rate
        self.host = host
        self.policy_name = policy_name
        self._clock = clock
        self._lock = threading.Lock()
        self._calls: defaultdict[str, deque[float]] = defaultdict(deque)
        self._running = 0
        self._running_by: defaultdict[str, int] = defaultdict(int)
        self._queues: OrderedDict[str, deque[_Waiter]] = OrderedDict()
        """Calls waiting for a slot, per caller; the callers in the order their turns come."""
        self._waiting = 0

    def reconfigure(self, rate: RateLimits, host: HostAdmission, policy_name: str) -> None:
        """New limits for calls admitted from now on; running calls keep their slots."""
        with self._lock:
            self.rate, self.host, self.policy_name = rate, host, policy_name

    @property
    def running(self) -> int:
        """Sandboxes admitted and not yet released."""
        return self._running

    @property
    def waiting(self) -> int:
        """Calls waiting in the queue for a slot."""
        return self._waiting

    async def enter(
        self,
        client: str,
        rate: RateLimits | None = None,
        policy_name: str | None = None,
        waiting: Waiting | None = None,
        starts_sandbox: bool = True,
    ) -> Ticket:
        """A ticket, at once or once the call's turn comes; the Refusal to send back when it may not run.

        A call that finds every slot taken waits in the queue for at most the server policy's
        `rate.queue_wait_s` (not its own timeout: that is its program's, from its start), telling `waiting` how
        many calls are ahead of it; cancelled, it leaves the queue. A call that starts no sandbox (bookkeeping:
        listing, keeping, comparing, deleting workspaces) is never refused for the host's load or memory.
        """
        rate, policy_name = rate or self.rate, policy_name or self.policy_name
        with self._lock:
            now = self._clock()
            window = self._window(client, rate, policy_name, now)
            if not self._waiting and self._room(client, rate.concurrent_calls):
                if starts_sandbox:
                    self._refuse_when_saturated(client)
                window.append(now)
                return self._take(client)
            wait = self.rate.queue_wait_s
            if wait <= 0 or self._waiting >= self.rate.queue_length:
                raise self._busy(client, rate, policy_name, wait)
            if starts_sandbox:
                self._refuse_when_saturated(client)
            window.append(now)  # a call that waits counts as started for the calls per minute
            waiter = _Waiter(client, rate.concurrent_calls)
            self._queues.setdefault(client, deque()).append(waiter)
            self._waiting += 1
        started = anyio.current_time()
        try:
            with anyio.move_on_after(wait):
                while not waiter.granted.is_set():
                    if waiting is not None:
                        await waiting(self._ahead_of(waiter), anyio.current_time() - started)
                    with anyio.move_on_after(1):
                        await waiter.granted.wait()
        except BaseException:
            if waiter.ticket is not None:  # its turn came as it was cancelled: the slot goes to the next
                waiter.ticket.release()
            raise
        finally:
            with self._lock:
                if waiter.ticket is None:  # timed out or cancelled: out of the queue
                    self._queues[client].remove(waiter)
                    if not self._queues[client]:
                        del self._queues[client]
                    self._waiting -= 1
        if waiter.ticket is None:
            raise Refusal(
                f"busy: waited {wait:g} s for one of {self.rate.concurrent_calls} slots (policy '{self.policy_name}', "
                f"field rate.concurrent_calls), and {self._waiting} calls still wait (field rate.queue_wait_s: "
                f"{self.rate.queue_wait_s:g} s); retry later",
                "rate.queue_wait_s",
                kind="busy",
                retry_after_s=max(1.0, wait),
            )
        return waiter.ticket

    def _ahead_of(self, waiter: _Waiter) -> int:
        """The calls whose turns come before this one's, as the queue stands: callers take turns in their order
        (its caller's earlier calls, and in each turn before its own one call of every other caller that has one
        left)."""
        with self._lock:
            try:
                turn = self._queues[waiter.client].index(waiter)
            except (KeyError, ValueError):  # its turn came as it asked
                return 0
            ahead, before = turn, True
            for client, queue in self._queues.items():
                if client == waiter.client:
                    before = False
                else:
                    ahead += min(len(queue), turn + before)
            return ahead

    def _busy(self, client: str, rate: RateLimits, policy_name: str, wait: float) -> Refusal:
        queue = f"{self._waiting} calls waiting, the most the queue holds (field rate.queue_length)"
        if wait <= 0:
            queue = "no call may wait (field rate.queue_wait_s: 0)"
        full = self._running_by[client] >= rate.concurrent_calls
        limit, name = (rate.concurrent_calls, policy_name) if full else (self.rate.concurrent_calls, self.policy_name)
        return Refusal(
            f"busy: {limit} calls already running (policy '{name}', field rate.concurrent_calls) and {queue}; "
            "retry in 1 s",
            "rate.concurrent_calls" if wait <= 0 else "rate.queue_length",
            kind="busy",
            retry_after_s=1,
        )

    def _room(self, client: str, limit: int) -> bool:
        return self._running < self.rate.concurrent_calls and self._running_by[client] < limit

    def _take(self, client: str) -> Ticket:
        self._running += 1
        self._running_by[client] += 1
        return Ticket(lambda: self._release(client))

    def _window(self, client: str, rate: RateLimits, policy_name: str, now: float, more: int = 1) -> deque[float]:
        """The caller's calls of the last minute (a Refusal, at once, when it may not make `more` more)."""
        if len(self._calls) > REMEMBERED_CLIENTS:
            self._forget_idle(now)
        window = self._calls[client]
        while window and window[0] <= now - 60:
            window.popleft()
        if len(window) + more > rate.calls_per_minute:
            retry = max(1, math.ceil(window[0] + 60 - now)) if window else 60
            asked = f"{more} calls need {more} of the " if more > 1 else ""
            raise Refusal(
                f"rate limited: {asked}{rate.calls_per_minute} calls/min (policy '{policy_name}', "
                f"field rate.calls_per_minute); retry in {retry} s",
                "rate.calls_per_minute",
                kind="rate_limited",
                retry_after_s=retry,
            )
        return window

    def _dispatch(self) -> None:
        """Give free slots to waiting calls: callers in turn, each caller's oldest call first."""
        while self._waiting and self._running < self.rate.concurrent_calls:
            client = next((c for c, queue in self._queues.items() if self._room(c, queue[0].limit)), None)
            if client is None:
                return  # every waiting caller is at its own limit
            waiter = self._queues[client].popleft()
            if self._queues[client]:
                self._queues.move_to_end(client)  # its next call waits for the other callers' turns
            else:
                del self._queues[client]
            self._waiting -= 1
            waiter.ticket = self._take(client)
            waiter.granted.set()

    def admit(self, client: str, rate: RateLimits | None = None, policy_name: str | None = None) -> Ticket:
        """A ticket now, or the Refusal to send back at once (this never waits; `enter` does).

        `rate` and `policy_name` are the caller's own policy's (an authenticated caller's token may name
        one): its calls per minute and concurrent calls count for this client alone. The server's
        policy's concurrent calls bound every client together.
        """
        rate, policy_name = rate or self.rate, policy_name or self.policy_name
        with self._lock:
            window = self._window(client, rate, policy_name, self._clock())
            if self._waiting or not self._room(client, rate.concurrent_calls):
                raise self._busy(client, rate, policy_name, 0)
            self._refuse_when_saturated(client)
            window.append(self._clock())
            return self._take(client)

    def _forget_idle(self, now: float) -> None:
        """Forget the clients that made no call in the last minute (they have nothing left to count)."""
        for client in [c for c, window in self._calls.items() if not window or window[-1] <= now - 60]:
            del self._calls[client]

    @property
    def remembered(self) -> int:
        """How many clients' recent calls are remembered."""
        return len(self._calls)

    def _release(self, client: str) -> None:
        with self._lock:
            self._running -= 1
            self._running_by[client] -= 1
            if not self._running_by[client]:
                del self._running_by[client]
            self._dispatch()

    def check_rate(self, client: str, rate: RateLimits, policy_name: str, calls: int) -> None:
        """Refuse (a Refusal) at once when the caller's calls per minute have no room for `calls` more (a branch's,
        before it forks for them); counts nothing: each of them is admitted as it runs."""
        with self._lock:
            self._window(client, rate, policy_name, self._clock(), calls)

    def check_host(self) -> None:
        """Refuse (a Refusal) when the host is saturated: a call that takes no slot still needs room."""
        self._refuse_when_saturated()

    def _refuse_when_saturated(self, client: str | None = None) -> None:
        """Refuse when the host is short of memory; when its load is past the policy's, refuse a caller that runs
        at least its fair share of the calls running here (all of them over the callers running any, itself
        counted): the load is theirs, and a caller running fewer, none most often, still gets its turn. Without
        `client` (a task, a branch), refuse on the load alone."""
        available_mb = available_bytes() // (1024 * 1024)
        if available_mb < self.host.min_available_memory_mb:
            raise Refusal(
                f"busy: the host has {available_mb} MiB of memory available, below "
                f"{self.host.min_available_memory_mb} MiB (policy '{self.policy_name}', "
                "field host.min_available_memory_mb); retry in 5 s",
                "host.min_available_memory_mb",
                kind="busy",
                retry_after_s=5,
            )
        load_per_cpu = os.getloadavg()[0] / _cpus()
        if load_per_cpu <= self.host.max_load_per_cpu:
            return
        mine = self._running_by.get(client, 0) if client is not None else 0
        callers = len(self._running_by) + (client is not None and client not in self._running_by)
        if client is None or mine * callers >= self._running:
            share = f"; this caller runs {mine} of the {self._running} calls running" if self._running else ""
            raise Refusal(
                f"busy: host load is {load_per_cpu:.1f} per CPU, above {self.host.max_load_per_cpu:g} "
                f"(policy '{self.policy_name}', field host.max_load_per_cpu){share}; retry in 5 s",
                "host.max_load_per_cpu",
                kind="busy",
                retry_after_s=5,
            )


@functools.cache
def _cpus() -> int:
    """The host's CPUs, counted once (a count per call read /sys each time)."""
    return psutil.cpu_count() or 1
