"""A sandbox killed with no word from its launcher is out of memory only when the engine says so: its `oom` event,
waited for a moment when the engine recorded the container's end first (under load it may)."""

from __future__ import annotations

import docker
import pytest

from sandbox_server.sandbox.engine.connection import oom_reported
from sandbox_server.sandbox.engine.runtime import DockerRuntime

SHELL = "sandbox-server/shell:latest"


@pytest.mark.parametrize("how", ["outgrows its memory", "is killed from outside"])
def test_the_engines_out_of_memory_event_tells_the_two_apart(runtime: DockerRuntime, how: str) -> None:
    api = docker.from_env().api
    program = (
        ["python3", "-c", "chunks = []\nwhile True:\n    chunks.append(bytearray(2**22))"]
        if how == "outgrows its memory"
        else ["sleep", "60"]
    )
    made = api.create_container(
        SHELL, program, host_config=api.create_host_config(mem_limit=48 * 2**20, memswap_limit=48 * 2**20,
                                                           network_mode="none", cap_drop=["ALL"]),
    )  # fmt: skip
    try:
        api.start(made["Id"])
        if how == "is killed from outside":
            api.kill(made["Id"])
        assert api.wait(made["Id"], timeout=60)["StatusCode"] == 137
        assert oom_reported(api, made["Id"], within_s=1) is (how == "outgrows its memory")
    finally:
        api.remove_container(made["Id"], force=True)
        api.close()
