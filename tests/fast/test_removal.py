"""Removal without an engine: a network the engine will not remove does not hold a stopping server; a container
that joins a services' network as it is removed does not keep it; what labels say whose a container is."""

from __future__ import annotations

import re
import threading
import time

import docker
import pytest

from sandbox_server.errors import UsageError
from sandbox_server.sandbox.engine.removal import (
    LABELS_VARIABLE,
    OWNER_LABEL,
    Remover,
    current_owner,
    operator_labels,
    owned_by,
    owner_alive,
)
from sandbox_server.sandbox.engine.services import remove_network
from sandbox_server.sandbox.spec import SANDBOX_LABEL


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


class Joined:
    """An engine on which a warm container (made for the network before its last service stopped) joins the network
    after what was on it was let go of, and before it is removed: as the engine does, removal then fails."""

    def __init__(self) -> None:
        self.attached = {"service-container"}
        self.late = ["warm-container"]
        self.removed = False

    def inspect_network(self, name: str) -> dict[str, object]:
        return {"Containers": {container: {} for container in self.attached}}

    def disconnect_container_from_network(self, container: str, name: str, force: bool) -> None:
        self.attached.discard(container)

    def remove_network(self, name: str) -> None:
        self.attached.update(self.late)
        self.late = []
        if self.attached:
            raise docker.errors.APIError(f"error while removing network: network {name} has active endpoints")
        self.removed = True


def test_a_container_joining_a_services_network_as_it_is_removed_is_let_go_of_and_the_network_goes() -> None:
    engine = Joined()
    remove_network(engine, "sandbox-svc-0123456789abcdef")
    assert engine.removed and not engine.attached


def test_what_a_part_of_a_live_process_labels_with_its_role_is_not_taken_for_a_dead_servers() -> None:
    """`doctor --posture` labels its proxies `<owner>-posture`: another server's start, reaping what dead servers
    left, had removed such a proxy while the check ran (its container "removing with exit code 137")."""
    mine = current_owner()
    assert owner_alive(mine) and owner_alive(f"{mine}-posture")
    host, pid, _ = mine.split(":")
    assert not owner_alive(f"{host}:{pid}:1-posture")  # the same pid with another start time: another process


def test_a_live_server_is_alive_when_the_clock_moved_its_start_by_a_second() -> None:
    """A process's start as a time of day moves by a whole second when the boot's time does (the clock set, or its
    drift past a second's edge): another server's sweep would take every live server for gone, and remove their
    sandboxes and networks mid-call."""
    host, pid, created = current_owner().split(":")
    assert owner_alive(f"{host}:{pid}:{int(created) - 1}") and owner_alive(f"{host}:{pid}:{int(created) + 1}")
    assert not owner_alive(f"{host}:{pid}:{int(created) - 3}") and not owner_alive(f"{host}:{pid}:{int(created) + 3}")


def test_the_operators_labels_go_on_everything_a_server_makes_and_never_over_its_own(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv(LABELS_VARIABLE, " team=data , cost-centre=42,,empty=")
    assert operator_labels() == {"team": "data", "cost-centre": "42", "empty": ""}
    labels = owned_by("host:1:2")
    assert labels == {"team": "data", "cost-centre": "42", "empty": "", SANDBOX_LABEL: "1", OWNER_LABEL: "host:1:2"}
    monkeypatch.delenv(LABELS_VARIABLE, raising=False)
    assert owned_by("host:1:2") == {SANDBOX_LABEL: "1", OWNER_LABEL: "host:1:2"}


@pytest.mark.parametrize("said", ["team", "=data", f"{OWNER_LABEL}=someone-else", "org.sandbox-server.any=1"])
def test_a_label_that_is_no_pair_or_names_the_servers_own_is_refused_naming_it(
    monkeypatch: pytest.MonkeyPatch, said: str
) -> None:
    monkeypatch.setenv(LABELS_VARIABLE, f"team=data,{said}")
    with pytest.raises(UsageError, match=rf"SANDBOX_CONTAINER_LABELS: {re.escape(repr(said))} is not"):
        operator_labels()
