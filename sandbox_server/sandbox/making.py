"""Warm containers the engine is making right now, and the calls that wait for one of them; the first ones a
server makes before its event loop runs.

A call that finds its pool empty while a container of its key is being made takes that one when it
comes: a cold container made beside it would come no sooner, and the two would share the cores. At
most as many calls wait as containers are being made; the rest start cold at once.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Hashable
from typing import Generic, TypeVar

import anyio
import anyio.to_thread

__all__ = ["ARRIVING_S", "Early", "Making"]

T = TypeVar("T")
S = TypeVar("S")

ARRIVING_S = 1.0
"""The least a call that finds no container waits for the one the engine is making (more when making one took
longer the last time)."""


class Making(Generic[T]):
    """Per container key: how many the engine is making, and the calls waiting for them."""

    def __init__(self) -> None:
        self._count: dict[Hashable, int] = {}
        self._awaited: dict[Hashable, int] = {}
        self._arrival: dict[Hashable, anyio.Event] = {}

    def begin(self, key: Hashable) -> None:
        """The engine starts making a container of this key (from any thread, before the event loop too)."""
        self._count[key] = self._count.get(key, 0) + 1

    def end(self, key: Hashable) -> None:
        """It is done, made or failed (in the event loop): a call waiting for it looks again."""
        self._count[key] -= 1
        self._arrival.pop(key, anyio.Event()).set()

    def soon(self, key: Hashable) -> bool:
        """Whether a call of this key may wait for one being made (one not already waited for)."""
        return self._count.get(key, 0) > self._awaited.get(key, 0)

    async def arriving(self, key: Hashable, within_s: float, take: Callable[[], T | None]) -> T | None:
        """What `take` gives once a container of this key is done, within `within_s`; None when none is being
        made any more, or none came in time."""
        self._awaited[key] = self._awaited.get(key, 0) + 1
        try:
            with anyio.move_on_after(max(ARRIVING_S, within_s)):
                while True:
                    if (found := take()) is not None:
                        return found
                    if self._count.get(key, 0) == 0:
                        return None
                    await self._arrival.setdefault(key, anyio.Event()).wait()
            return None
        finally:
            self._awaited[key] -= 1


class Early(Generic[T]):
    """A container made in a thread of its own from before the event loop runs (the server still loading)."""

    def __init__(self, prepare: Callable[[S], T], spec: S) -> None:
        self._made: list[T] = []
        self._failed: list[Exception] = []
        self._thread = threading.Thread(target=self._make, args=(prepare, spec), name="warm-head-start", daemon=True)
        self._thread.start()

    def _make(self, prepare: Callable[[S], T], spec: S) -> None:
        try:
            self._made.append(prepare(spec))
        except Exception as exc:  # said when it is received, as any fill's failure
            self._failed.append(exc)

    def drop(self, discard: Callable[[T], None]) -> None:
        """Wait for it and discard what was made (a server that stops before it received it)."""
        self._thread.join()
        for warm in self._made:
            discard(warm)
        self._made.clear()

    async def made(self) -> T:
        """The container once made (always received, never lost to a cancellation); its failure raised."""
        with anyio.CancelScope(shield=True):
            await anyio.to_thread.run_sync(self._thread.join)
        if self._failed:
            raise self._failed[0]
        return self._made[0]
