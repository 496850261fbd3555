"""Admission control: rate limits, a concurrency cap and host load, answered at once.

Nothing here queues: a call that may not start now is refused (a Refusal) saying
which limit, which policy field and when to retry.
"""

from __future__ import annotations

import math
import os
import threading
import time
from collections import defaultdict, deque
from collections.abc import Callable
from dataclasses import dataclass

import psutil

from sandbox_server.errors import Refusal
from sandbox_server.policy import HostAdmission, RateLimits

__all__ = ["Admission", "Ticket"]

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


class Admission:
    """Decides, without waiting, whether a call may start a sandbox now."""

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

    def reconfigure(self, rate: RateLimits, host: HostAdmission, policy_name: str) -> None:
        """New limits for calls admitted from now on; running calls keep their slots."""
        with self._lock:
            self.rate, self.host, self.policy_name = rate, host, policy_name

    @property
    def running(self) -> int:
        """Sandboxes admitted and not yet released."""
        return self._running

    def admit(self, client: str, rate: RateLimits | None = None, policy_name: str | None = None) -> Ticket:
        """A ticket; raises the Refusal to send back at once when the call may not start now.

        `rate` and `policy_name` are the caller's own policy's (an authenticated caller's token may name
        one): its calls per minute and concurrent calls count for this client alone. The server's
        policy's concurrent calls bound every client together.
        """
        rate, policy_name = rate or self.rate, policy_name or self.policy_name
        now = self._clock()
        with self._lock:
            if len(self._calls) > REMEMBERED_CLIENTS:
                self._forget_idle(now)
            window = self._calls[client]
            while window and window[0] <= now - 60:
                window.popleft()
            if len(window) >= rate.calls_per_minute:
                retry = max(1, math.ceil(window[0] + 60 - now))
                raise Refusal(
                    f"rate limited: {rate.calls_per_minute} calls/min (policy '{policy_name}', "
                    f"field rate.calls_per_minute); retry in {retry} s",
                    "rate.calls_per_minute",
                    kind="rate_limited",
                    retry_after_s=retry,
                )
            for running, limit, name in (
                (self._running_by[client], rate.concurrent_calls, policy_name),
                (self._running, self.rate.concurrent_calls, self.policy_name),
            ):
                if running >= limit:
                    raise Refusal(
                        f"busy: {limit} calls already running (policy '{name}', field rate.concurrent_calls); "
                        "retry in 1 s",
                        "rate.concurrent_calls",
                        kind="busy",
                        retry_after_s=1,
                    )
            self._refuse_when_saturated()
            window.append(now)
            self._running += 1
            self._running_by[client] += 1
        return Ticket(lambda: self._release(client))

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

    def _refuse_when_saturated(self) -> None:
        available_mb = psutil.virtual_memory().available // (1024 * 1024)
        if available_mb < self.host.min_available_memory_mb:
            raise Refusal(
                f"busy: the host has {available_mb} MiB of memory available, below "
                f"{self.host.min_available_memory_mb} MiB (policy '{self.policy_name}', "
                "field host.min_available_memory_mb); retry in 5 s",
                "host.min_available_memory_mb",
                kind="busy",
                retry_after_s=5,
            )
        load_per_cpu = os.getloadavg()[0] / (psutil.cpu_count() or 1)
        if load_per_cpu > self.host.max_load_per_cpu:
            raise Refusal(
                f"busy: host load is {load_per_cpu:.1f} per CPU, above {self.host.max_load_per_cpu:g} "
                f"(policy '{self.policy_name}', field host.max_load_per_cpu); retry in 5 s",
                "host.max_load_per_cpu",
                kind="busy",
                retry_after_s=5,
            )
