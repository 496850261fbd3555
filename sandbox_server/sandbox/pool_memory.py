"""The warm pool's memory: what its waiting containers hold (read from the host in the pauses between calls), what
one more of each kind will cost, and whether it fits the pool's budget, with what running tasks and services hold
beside it (`held.HeldMemory`), and the host's floor."""

from __future__ import annotations

import math
from collections.abc import Callable, Hashable, Iterable, Mapping
from typing import Any

from sandbox_server.sandbox.held import HeldMemory

__all__ = ["PoolMemory"]


class PoolMemory:
    """One warm pool's memory, by container kind (its key)."""

    def __init__(self, held_elsewhere: HeldMemory | None = None) -> None:
        self.budget = math.inf
        """Bytes all waiting containers together may hold."""
        self.host_room: Callable[[], bool] = lambda: True
        """Whether the host has memory to spare for another warm container."""
        self.held_elsewhere = held_elsewhere if held_elsewhere is not None else HeldMemory()
        """Memory the budget also covers that the pool does not hold (running tasks' and services' containers)."""
        self._read: dict[int, int] = {}
        """Resident bytes of the waiting containers (by id()), as the last reading found them."""
        self._per_kind: dict[Hashable, int] = {}
        """The most one container of each key was seen to hold: what making another will cost."""

    def held(self, waiting: Iterable[tuple[Hashable, object]]) -> int:
        """What these waiting containers hold, as last read (one not read yet: what one of its kind held)."""
        return sum(self._read.get(id(warm), self._per_kind.get(key, 0)) for key, warm in waiting)

    def affordable(self, key: Hashable, waiting: Iterable[tuple[Hashable, object]], making: Mapping[Any, int]) -> bool:
        """Whether one more container of this key fits the budget and the host's floor, beside those `waiting` and
        those being made (`making`: how many of each key)."""
        being_made = sum(count * self._per_kind.get(kind, 0) for kind, count in making.items())
        held = self.held(waiting) + self.held_elsewhere()
        return held + being_made + self._per_kind.get(key, 0) <= self.budget and self.host_room()

    @staticmethod
    def read(
        waiting: Iterable[tuple[Hashable, Any]], measure: Callable[[Any], int]
    ) -> list[tuple[Hashable, object, int]]:
        """What each of these containers holds, read from the host (blocking: from a worker thread)."""
        return [(key, warm, measure(warm)) for key, warm in waiting]

    def take_reading(self, reading: Iterable[tuple[Hashable, object, int]]) -> None:
        """What each waiting container holds now, read from the host."""
        reading = list(reading)
        self._read = {id(warm): held for _, warm, held in reading}
        for key, _, held in reading:
            self._per_kind[key] = max(self._per_kind.get(key, 0), held)
