"""The posture check's own upstream on the engine: a network nobody else uses, a small HTTP server on it that
says which paths it was asked for, and their removal with the trial's proxy and the sandboxes left on them."""

from __future__ import annotations

import contextlib
import secrets

import docker

from sandbox_server.errors import SandboxServerError
from sandbox_server.network.proxies import EgressProxies
from sandbox_server.sandbox.engine.removal import owned_by

__all__ = ["PAGE", "make_network", "paths_seen", "remove_trial", "start_upstream", "wait_listening"]

UPSTREAM_IMAGE = "sandbox-server/shell:latest"
PAGE = "sandbox-server posture upstream"
UPSTREAM = f"""
import http.server, sys
class Page(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        print("seen", self.path, flush=True)
        body = b"{PAGE}\\n"
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)
server = http.server.ThreadingHTTPServer(("0.0.0.0", int(sys.argv[1])), Page)
print("listening", flush=True)
server.serve_forever()
"""
"""The upstream: a page naming itself, and a line on stdout for every path it was asked for."""


def make_network(api: docker.APIClient, owner: str) -> str:
    """An internal network of the check's own (its reaper's label on it), by name."""
    network = f"sandbox-posture-{secrets.token_hex(4)}"
    api.create_network(network, internal=True, labels=owned_by(owner))
    return network


def start_upstream(api: docker.APIClient, network: str, port: int, owner: str) -> tuple[str, str]:
    """The upstream listening on `port` of `network`: its container and address."""
    created = api.create_container(
        UPSTREAM_IMAGE, ["python3", "-c", UPSTREAM, str(port)],
        labels=owned_by(owner),
        host_config=api.create_host_config(network_mode=network, read_only=True, cap_drop=["ALL"],
                                           security_opt=["no-new-privileges"]),
    )  # fmt: skip
    container = str(created["Id"])
    api.start(container)
    wait_listening(api, container)
    address = api.inspect_container(container)["NetworkSettings"]["Networks"][network]["IPAddress"]
    return container, str(address)


def wait_listening(api: docker.APIClient, container: str) -> None:
    """Until a started server's log says `listening`; SandboxServerError with its log when it ends first."""
    stream = api.logs(container, stream=True, follow=True, stdout=True, stderr=True)
    try:
        for line in stream:
            if b"listening" in line:
                return
    finally:  # the stream, and the engine's connection under it
        with contextlib.suppress(Exception):
            stream.close()
        with contextlib.suppress(Exception):
            stream._response.close()
    raise SandboxServerError(
        f"{container[:12]} ended before it listened: {api.logs(container).decode(errors='replace')}"
    )


def remove_trial(api: docker.APIClient, proxies: EgressProxies, container: str, networks: list[str]) -> None:
    """The sandboxes still on the check's networks (a call's container is removed in a pause, after this), the
    proxy, the upstream, then the networks."""
    for network in networks:
        with contextlib.suppress(docker.errors.APIError, docker.errors.NotFound):
            for attached in api.inspect_network(network).get("Containers") or {}:
                with contextlib.suppress(docker.errors.APIError, docker.errors.NotFound):
                    api.remove_container(attached, force=True, v=True)
    proxies.close()
    with contextlib.suppress(docker.errors.APIError, docker.errors.NotFound):
        if container:
            api.remove_container(container, force=True)
    for network in networks:
        with contextlib.suppress(docker.errors.APIError, docker.errors.NotFound):
            api.remove_network(network)


def paths_seen(api: docker.APIClient, container: str) -> set[str]:
    """The paths the upstream was asked for."""
    lines = api.logs(container, stdout=True, stderr=False).decode(errors="replace").splitlines()
    return {line.split()[1] for line in lines if line.startswith("seen ") and len(line.split()) > 1}
