"""Waiting on file descriptors with poll(2): select(2) cannot watch a descriptor numbered 1024 or above, which a
server holding many sandboxes' pipes reaches (every refill then failed with "filedescriptor out of range")."""

from __future__ import annotations

import select
from collections.abc import Iterable
from typing import Protocol

__all__ = ["HasFileno", "readable"]

_READ = select.POLLIN | select.POLLPRI | select.POLLHUP | select.POLLERR
"""What makes a descriptor worth reading: data, or its other end gone (a read then says so)."""


class HasFileno(Protocol):
    def fileno(self) -> int: ...


def readable(sources: Iterable[int | HasFileno], timeout_s: float | None = None) -> set[int]:
    """The descriptors among `sources` that a read would not block on, within `timeout_s` (None: until one is);
    ValueError for a closed source, as select raises."""
    poller = select.poll()
    for source in sources:
        poller.register(source, _READ)
    timeout_ms = None if timeout_s is None else max(0, int(timeout_s * 1000 + 0.999))
    return {fd for fd, events in poller.poll(timeout_ms) if not events & select.POLLNVAL}
