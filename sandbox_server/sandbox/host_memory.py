"""The host's available memory as the server's checks read it: each call's admission (host.min_available_memory_mb)
and each warm container a pool would make. psutil reads and parses all of /proc/meminfo for it, some 0.3 to 0.5 ms
on the event loop, and a burst of calls asked twice per call; a reading is now used for READ_EVERY_S.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable

import psutil

__all__ = ["READ_EVERY_S", "Reading", "available_bytes"]

READ_EVERY_S = 0.2
"""How long one reading stands: memory taken in that time is seen by the next reading (each sandbox's own limit is
the kernel's, whatever this says)."""


class Reading:
    """A number read from the host, read again only once READ_EVERY_S has passed since the last reading."""

    def __init__(self, read: Callable[[], int], clock: Callable[[], float]) -> None:
        self._read, self._clock = read, clock
        self._lock = threading.Lock()
        self._at, self._value = -math.inf, 0

    def __call__(self) -> int:
        with self._lock:
            now = self._clock()
            if now - self._at >= READ_EVERY_S or now < self._at:
                self._at, self._value = now, self._read()
            return self._value


available_bytes = Reading(lambda: int(psutil.virtual_memory().available), time.monotonic)
"""The bytes of memory the host has available, read at most once per READ_EVERY_S."""
