"""The fast tier runs in-process without an engine: a test here that opens a socket to one fails, and the suite's
end-of-run check for leftover containers (which asks the engine) is not made for this tier alone."""

from __future__ import annotations

import os
import socket
from collections.abc import Iterator
from urllib.parse import urlsplit

import pytest

ENGINE_SOCKETS = frozenset(
    {
        "/var/run/docker.sock",
        "/run/docker.sock",
        "/run/podman/podman.sock",
        "/run/containerd/containerd.sock",
        "/var/run/containerd/containerd.sock",
    }
)
"""Where engines listen on a host; the environment's DOCKER_HOST is added to these."""


def engine_addresses(environment: dict[str, str]) -> set[object]:
    """The addresses a connect to would reach an engine: the usual sockets and the one DOCKER_HOST names."""
    said: set[object] = set(ENGINE_SOCKETS)
    named = urlsplit(environment.get("DOCKER_HOST", ""))
    if named.scheme == "unix":
        said.add(named.path)
    elif named.scheme in ("tcp", "http", "https") and named.hostname:
        said.add((named.hostname, named.port or 2375))
    return said


ENGINE_ADDRESSES = engine_addresses(dict(os.environ))
"""Fixed when the tier starts, so that a test pointing DOCKER_HOST at a socket of its own may still use it."""


@pytest.fixture(autouse=True)
def no_engine_socket(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Fail a fast test the moment it connects to an engine (on a laptop without one, it would leave a socket
    open; with one, it would pass here and fail there)."""
    real_connect = socket.socket.connect

    def connect(self: socket.socket, address: object) -> None:
        where = address.decode() if isinstance(address, bytes) else address
        if isinstance(where, tuple):
            where = where[:2]
        if where in ENGINE_ADDRESSES:
            self.close()
            pytest.fail(f"a fast test connected to an engine at {where!r}: move it out of tests/fast", pytrace=False)
        real_connect(self, address)  # type: ignore[arg-type]

    monkeypatch.setattr(socket.socket, "connect", connect)
    yield


@pytest.fixture(scope="session", autouse=True)
def no_container_left_behind() -> None:
    """The fast tier makes no container, so it does not ask an engine for leftovers (the engine tiers do)."""
