"""The services' watch, in process: a container's end it reads is the service's only while that container is still
the service's running one."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import anyio
import pytest

from sandbox_server.policy import ServiceSettings
from sandbox_server.sandbox.engine import services as service_containers
from sandbox_server.services.manager import Services
from sandbox_server.services.service import Service

pytestmark = pytest.mark.anyio


def _running(services: Services) -> Service:
    service = Service(
        id="svc", name="api", port=9000, ready_path=None, command="python3 api.py", tool="execute_command",
        policy_name="default", caller="alice", workspace_id="w", session="s", settings=ServiceSettings(),
        network="net", container_id="old", state="running",
    )  # fmt: skip
    services._services[service.id] = service
    return service


async def test_a_service_restarted_while_its_old_container_is_read_is_not_stopped_for_that_containers_end(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    services = Services(SimpleNamespace(api=None), SimpleNamespace(contents=SimpleNamespace(homed=None)))  # type: ignore[arg-type]
    service = _running(services)

    def read_while_restarted(api: Any, container_id: str) -> dict[str, Any]:
        assert container_id == "old"
        service.state, service.container_id = "starting", ""  # the restart removes it: killed, code 137
        return {"Running": False, "ExitCode": 137, "OOMKilled": False}

    monkeypatch.setattr(service_containers, "container_state", read_while_restarted)
    with anyio.fail_after(5):  # a stop asked here would wait for the service's task, which this test has not
        await services._look()
    assert not service.stop_asked, service.stop_reason


async def test_a_running_services_own_container_ending_stops_it_saying_how(monkeypatch: pytest.MonkeyPatch) -> None:
    services = Services(SimpleNamespace(api=None), SimpleNamespace(contents=SimpleNamespace(homed=None)))  # type: ignore[arg-type]
    service = _running(services)
    monkeypatch.setattr(
        service_containers, "container_state", lambda api, _: {"Running": False, "ExitCode": 3, "OOMKilled": False}
    )
    async with anyio.create_task_group() as group:
        group.start_soon(services._look)
        with anyio.fail_after(5):
            await service.wake.wait()  # what asking it to stop does
        service.stopped.set()  # what the service's task does once its container is gone
    assert service.stop_reason == "its program ended (with code 3)"
