"""The remover's close, without an engine: a network the engine will not remove does not hold a stopping server."""

from __future__ import annotations

import threading
import time

import docker

from sandbox_server.sandbox.removal import Remover


class Refusing:
    """An engine that will not remove a network (`has active endpoints`, with none left), however often asked."""

    def __init__(self) -> None:
        self.asked = threading.Event()

    def remove_network(self, network_id: str) -> None:
        self.asked.set()
        raise docker.errors.APIError("error while removing network: has active endpoints")


def test_a_network_the_engine_will_not_remove_does_not_hold_up_close() -> None:
    engine = Refusing()
    remover = Remover(lambda: engine)
    remover.remove_network("sandbox-egress-stuck")
    assert engine.asked.wait(5)  # it is being retried now
    started = time.monotonic()
    remover.close()
    assert time.monotonic() - started < 2  # not the 10 s of retries: the next server's reaper tries again
