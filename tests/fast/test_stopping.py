"""A SIGTERM while a server starts: at once, or kept while its parts are opened and raised where they are in hand."""

from __future__ import annotations

import signal

import pytest

from sandbox_server.cli.stopping import StopAsked, Stopping


def test_a_signal_is_raised_at_once_unless_held_then_where_it_is_released() -> None:
    stopping = Stopping()
    with pytest.raises(StopAsked, match="SIGTERM"):
        stopping.asked(signal.SIGTERM, None)  # nothing opened yet: the start unwinds now
    stopping.hold()
    stopping.asked(signal.SIGTERM, None)  # the store is opening: kept
    with pytest.raises(StopAsked, match="SIGTERM"):
        stopping.release()  # every part in hand: raised here, where their closing is sure
    stopping.release()  # nothing kept since: nothing raised
