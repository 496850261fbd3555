"""A service's container and its workspace's network on the engine; every function blocks (run it in a thread).

A service runs its program directly (no launcher: nothing waits for it to end), in the hardened container of
every call, with its own memory and CPU, a log the engine keeps bounded, and the workspace mounted as calls see
it. Its workspace's network is `internal` with no address on the host's bridge: the services and the calls of
that one workspace reach each other there, by name, and nothing else reaches them or leaves. Under an allow list
the list's proxy joins that network and is a service's one way out (a service never joins the allow list's own
network, which other callers' sandboxes share).
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import tempfile
from dataclasses import dataclass, replace
from typing import Any

import docker

from sandbox_server.sandbox import mounts
from sandbox_server.sandbox.engine.connection import Engine, engine_errors
from sandbox_server.sandbox.engine.host_config import host_config_kwargs, masked_paths
from sandbox_server.sandbox.engine.removal import owned_by, until_network_removed
from sandbox_server.sandbox.runc.veth import create_network
from sandbox_server.sandbox.spec import SandboxSpec

__all__ = ["SERVICE_LABEL", "Started", "container_state", "ensure_network", "listening_ports", "log_tail",
           "network_name", "remove", "remove_network", "start_container"]  # fmt: skip

SERVICE_LABEL = "org.sandbox-server.service"
"""On a service's container and its workspace's network: the service's id, or the workspace's network."""


def network_name(workspace_id: str, owner: str) -> str:
    """The private network of one workspace's services (the id itself never appears on the engine)."""
    return "sandbox-svc-" + hashlib.sha256(f"{owner}|{workspace_id}".encode()).hexdigest()[:16]


def ensure_network(api: docker.APIClient, name: str, owner: str) -> None:
    """Create the workspace's network unless it exists: internal, and no address of the host on its bridge."""
    with engine_errors("create the services' network"):
        if api.networks(names=[name]):
            return
        create_network(  # the second half of its addresses the server's, for the calls' sandboxes runc makes
            api,
            name,
            internal=True,
            options={"com.docker.network.bridge.inhibit_ipv4": "true"},
            labels={**owned_by(owner), SERVICE_LABEL: "network"},
        )


def remove_network(api: docker.APIClient, name: str) -> None:
    """Remove a workspace's network, what joined it let go of first (an egress proxy; a warm container the pool was
    making for it as its last service stopped, which may join between letting go and removing: then again);
    never raises."""

    def let_go_and_remove() -> None:
        for container in api.inspect_network(name).get("Containers") or {}:
            with contextlib.suppress(docker.errors.APIError, docker.errors.NotFound):
                api.disconnect_container_from_network(container, name, force=True)
        api.remove_network(name)

    until_network_removed(let_go_and_remove)


@dataclass(frozen=True, slots=True)
class Started:
    """A service's container, running."""

    container_id: str
    pid: int
    """Its init's host pid: its network namespace's sockets are read through it."""
    slot: str | None
    address: str = ""
    """Its address on its workspace's network (where its name leads)."""


def start_container(
    engine: Engine, spec: SandboxSpec, service_id: str, name: str, network: str, owner: str, log_kb: int
) -> Started:
    """Create and start a service's container on its workspace's network, reachable there as `name`."""
    api = engine.api
    ensure_network(api, network, owner)
    slot = tempfile.mkdtemp(prefix="slot-", dir=spec.workspace_slots) if spec.mounted_workspace else None
    try:
        if slot is not None and spec.mounted_workspace is not None:
            mounts.bind(spec.mounted_workspace, slot)
        # As a call on its services' network: no IPv6 (its link-local addresses would reach the host's bridge),
        # and no name server but the engine's own for the network's names.
        options: dict[str, Any] = host_config_kwargs(replace(spec, service_network=network), slot, engine.dialect)
        options["network_mode"] = network
        options["log_config"] = {"type": "json-file", "config": {"max-size": f"{log_kb}k", "max-file": "1"}}
        with engine_errors("create the service's container"):
            host_config = api.create_host_config(**options)
            masked = masked_paths(spec)
            if masked is not None:
                host_config["MaskedPaths"] = masked
            created = api.create_container(
                image=spec.image,
                entrypoint=list(spec.argv[:1]),  # the program alone: neither the image's ENTRYPOINT nor its CMD
                command=list(spec.argv[1:]) or None,
                user=spec.user,
                working_dir=spec.workdir,
                environment=dict(spec.env) | dict(spec.call_env),
                labels={**owned_by(owner), SERVICE_LABEL: service_id, **dict(spec.labels)},
                hostname=name,
                host_config=host_config,
                networking_config=api.create_networking_config({network: api.create_endpoint_config(aliases=[name])}),
            )
        container_id = str(created["Id"])
        try:
            with engine_errors("start the service's container"):
                api.start(container_id)
                state = api.inspect_container(container_id)
                pid = int(state["State"].get("Pid") or 0)
                networks = (state.get("NetworkSettings") or {}).get("Networks") or {}
                address = str((networks.get(network) or {}).get("IPAddress") or "")
        except BaseException:
            remove(api, container_id, None)
            raise
        return Started(container_id, pid, slot, address)
    except BaseException:
        _free_slot(slot)
        raise


def remove(api: docker.APIClient, container_id: str, slot: str | None) -> None:
    """Kill and remove a service's container (every process it left with it), then free its slot; never raises."""
    with contextlib.suppress(docker.errors.APIError, docker.errors.NotFound):
        api.remove_container(container_id, force=True, v=True)
    _free_slot(slot)


def _free_slot(slot: str | None) -> None:
    if slot is not None:
        mounts.detach(slot)
        with contextlib.suppress(OSError):
            os.rmdir(slot)


def container_state(api: docker.APIClient, container_id: str) -> dict[str, Any]:
    """The engine's State of a service's container ({} when it is gone)."""
    try:
        return dict(api.inspect_container(container_id)["State"])
    except (docker.errors.APIError, docker.errors.NotFound):
        return {}


def log_tail(api: docker.APIClient, container_id: str, max_bytes: int) -> str:
    """The end of a service's log (stdout and stderr as they came), at most `max_bytes`."""
    try:
        raw = api.logs(container_id, stdout=True, stderr=True, tail=2000)
    except (docker.errors.APIError, docker.errors.NotFound):
        return ""
    return bytes(raw)[-max_bytes:].decode("utf-8", "replace")


LISTEN = "0A"
"""A socket's state in /proc/net/tcp when it listens."""
ENGINE_RESOLVER = "0B00007F"
"""127.0.0.11, where the engine's name server listens in every container on a user-made network."""


def listening_ports(pid: int) -> set[int]:
    """The TCP ports listened on in a container's network namespace, read from the host through its init."""
    ports: set[int] = set()
    for table in ("tcp", "tcp6"):
        try:
            with open(f"/proc/{pid}/net/{table}", encoding="ascii") as handle:
                next(handle, None)
                for line in handle:
                    fields = line.split()
                    if len(fields) > 3 and fields[3] == LISTEN:
                        address, port = fields[1].rsplit(":", 1)
                        if address != ENGINE_RESOLVER:
                            ports.add(int(port, 16))
        except OSError:
            continue
    return ports
