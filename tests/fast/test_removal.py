"""The remover's close, without an engine: a network the engine will not remove does not hold a stopping server."""

from __future__ import annotations

import threading
import time

import docker

from sandbox_server.sandbox.removal import Remover, current_owner, owner_alive


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


def test_what_a_part_of_a_live_process_labels_with_its_role_is_not_taken_for_a_dead_servers() -> None:
    """`doctor --posture` labels its proxies `<owner>-posture`: another server's start, reaping what dead servers
    left, had removed such a proxy while the check ran (its container "removing with exit code 137")."""
    mine = current_owner()
    assert owner_alive(mine) and owner_alive(f"{mine}-posture")
    host, pid, _ = mine.split(":")
    assert not owner_alive(f"{host}:{pid}:1-posture")  # the same pid with another start time: another process
