"""Memory held by containers that outlive a call (running tasks' and services'): the warm pool leaves room for it.

Each part that runs such containers is handed the one `HeldMemory` when it is made and says there how to read
what its containers may hold; the warm pool, made before them, reads the sum. So the pool and those parts need
not know one another.
"""

from __future__ import annotations

from collections.abc import Callable

__all__ = ["HeldMemory"]


class HeldMemory:
    """The bytes containers outside the warm pool may hold together, as the parts that run them count them."""

    def __init__(self) -> None:
        self._counters: list[Callable[[], int]] = []

    def counts(self, counter: Callable[[], int]) -> None:
        """A part's own count of what its running containers may hold, read on every call from then on."""
        self._counters.append(counter)

    def __call__(self) -> int:
        return sum(counter() for counter in self._counters)
