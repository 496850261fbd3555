"""The fast tier's own rule: no test in it reaches an engine."""

from __future__ import annotations

import docker
import pytest

from tests.fast.conftest import engine_addresses


def test_the_engine_addresses_are_the_usual_sockets_and_docker_host() -> None:
    assert "/var/run/docker.sock" in engine_addresses({})
    assert "/srv/engine.sock" in engine_addresses({"DOCKER_HOST": "unix:///srv/engine.sock"})
    assert ("10.1.2.3", 2376) in engine_addresses({"DOCKER_HOST": "tcp://10.1.2.3:2376"})


def test_a_fast_test_that_asks_the_engine_fails_at_once() -> None:
    with pytest.raises(pytest.fail.Exception, match="connected to an engine at '/var/run/docker.sock'"):
        docker.DockerClient(base_url="unix:///var/run/docker.sock", timeout=5)  # asks the engine its version
