"""Calls in flight, so the engine work done beside them can wait for a pause between them.

Making warm containers and removing used ones costs the engine (and, on a small host, the
CPU) far more than a warm call does. Done while calls arrive back to back, that work
would slow each of them several times over; done in the pauses between a model's calls,
it costs the calls nothing. Such work waits for a pause, but only so long: a pool that is
running out, or a removal backlog that grows, does not wait.

Work that takes a while (making a container: 0.1 to 0.3 s of engine time) can still
run into the next call when calls come at a steady pace. Calls' starts are remembered,
and such work starts in a pause only when it fits before the next call is due at that
pace, or once that call is late (the pace broke: a model thinking, a user reading); work
that fits no pause at that pace (a gVisor container between strict calls 0.4 s apart)
starts as the pause begins, as before.
"""

from __future__ import annotations

import statistics
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager

__all__ = ["PAUSE_S", "Activity"]

PAUSE_S = 0.1
"""No call for this long is a pause: longer than a client takes between back-to-back calls."""
PACE_CALLS = 8
"""The gaps between this many latest calls' starts give the pace calls come at (their median)."""


class Activity:
    """Counts the calls running now; background work waits (in its own thread) for a pause."""

    def __init__(self) -> None:
        self._changed = threading.Condition()
        self._running = 0
        self._last_end = 0.0
        self._last_start = 0.0
        self._gaps: deque[float] = deque(maxlen=PACE_CALLS)

    @contextmanager
    def call(self) -> Iterator[None]:
        """Mark one call running for the duration of the block."""
        with self._changed:
            now = time.monotonic()
            if self._last_start:
                self._gaps.append(now - self._last_start)
            self._last_start = now
            self._running += 1
        try:
            yield
        finally:
            with self._changed:
                self._running -= 1
                self._last_end = time.monotonic()
                self._changed.notify_all()

    def stir(self) -> None:
        """A call is on its way (it has not reached the engine yet): no pause for PAUSE_S from now."""
        with self._changed:
            self._last_end = max(self._last_end, time.monotonic())

    def changed(self) -> None:
        """Something a waiter's `unless` reads has changed: let the waiters look again."""
        with self._changed:
            self._changed.notify_all()

    def quiet(self) -> bool:
        """No call runs now, nor has one for PAUSE_S."""
        with self._changed:
            return self._running == 0 and time.monotonic() >= self._last_end + PAUSE_S

    def wait_for_pause(
        self, at_most_s: float, unless: Callable[[], bool] = lambda: False, lasting_s: float = 0.0
    ) -> None:
        """Return once no call has run for PAUSE_S (and, for work `lasting_s` long, once it fits before the next
        call is due at the calls' pace), once `unless()` is true, or after at_most_s."""
        give_up = time.monotonic() + at_most_s
        with self._changed:
            while True:
                now = time.monotonic()
                if now >= give_up or unless():
                    return
                if self._running == 0:
                    quiet_at = max(self._last_end + PAUSE_S, self._room_at(now, lasting_s))
                    if now >= quiet_at:
                        return
                    self._changed.wait(min(quiet_at, give_up) - now)
                else:
                    self._changed.wait(give_up - now)

    def _room_at(self, now: float, lasting_s: float) -> float:
        """When work lasting this long may start in this pause: now if it ends before the next call is due at the
        calls' pace (or there is no pace yet), else once that call is late by a pause. Work too long for any
        pause at this pace starts at once: waiting for a late call could mean waiting for ever."""
        if not lasting_s or len(self._gaps) < 2:
            return now
        due = self._last_start + statistics.median(self._gaps)
        if self._last_end + PAUSE_S + lasting_s > due:
            return now
        return now if now + lasting_s <= due else due + PAUSE_S
