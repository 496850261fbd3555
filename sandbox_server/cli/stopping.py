"""SIGTERM while a server starts, before its event loop takes signals over.

The signal unwinds the start as an exception (`StopAsked`), so each part already started is closed on the way
out. A part being opened cannot be closed by whoever opens it until it is in hand, so from the first part that
holds host resources (the workspaces' mounts) a signal is kept (`Stopping.hold`) and raised where every part is
in hand and closed however the serving ends (`Stopping.release`).
"""

from __future__ import annotations

import signal
from types import FrameType

__all__ = ["STOPPING", "StopAsked", "Stopping"]


class StopAsked(BaseException):
    """SIGTERM came before the server took signals over: what started is undone on the way out."""


class Stopping:
    """The SIGTERM handler while a server starts."""

    def __init__(self) -> None:
        self._held = False
        self._asked: str | None = None

    def asked(self, signum: int, _: FrameType | None) -> None:
        """The handler: stop now, or at `release` while held."""
        name = signal.Signals(signum).name
        if self._held:
            self._asked = name
        else:
            raise StopAsked(name)

    def hold(self) -> None:
        """From now on a signal is kept rather than raised, until `release`."""
        self._held = True

    def release(self) -> None:
        """Signals raise again, and one kept meanwhile is raised now."""
        self._held = False
        if self._asked is not None:
            asked, self._asked = self._asked, None
            raise StopAsked(asked)


STOPPING = Stopping()
"""The one handler of this process (signals are a process's)."""
