"""Egress proxies on the Docker engine: one per distinct allow list, started on demand.

For an allow list the server makes an `internal` Docker network whose bridge has no address
on the host (`inhibit_ipv4`: a sandbox there reaches neither the host nor any route out) and
a hardened Squid container joined to it and to the policy's egress network. Sandboxes join
only the internal network; the proxy is their one way out. The proxy's log (one line per
request) is followed, so that each call's requests, found by the sandbox's address, go into
its answer and its audit record.

A proxy that stopped is noticed by the next call needing it: that call is refused with the
reason and the proxy is restarted behind it; calls are refused until it answers again. A
sandbox never runs with a network its proxy does not guard.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import shutil
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import docker

from sandbox_server.errors import Refusal
from sandbox_server.network.asking import AskChannel, Gatekeeper
from sandbox_server.network.egress import (
    CONFIG_DIR,
    MARKER_DOMAIN,
    PROXY_FILES,
    PROXY_PORT,
    Egress,
    ProxyEndpoint,
)
from sandbox_server.network.firewall import close_to_proxy, firewall_managed, open_to_proxy
from sandbox_server.network.proxy_files import Trust, files_folder, write_proxy_files
from sandbox_server.network.proxy_log import ProxyRequest, RequestRecords, parse_log_line
from sandbox_server.network.secrets import CERTIFICATES
from sandbox_server.sandbox.engine.removal import owned_by
from sandbox_server.sandbox.runc.veth import create_network
from sandbox_server.sandbox.spec import Mount

__all__ = ["PROXY_IMAGE", "PROXY_LABEL", "EgressProxies"]

log = logging.getLogger(__name__)

PROXY_IMAGE = "sandbox-server/proxy:latest"
PROXY_LABEL = "org.sandbox-server.egress"
"""On the proxies and internal networks: the allow list's key."""
OPENING_COMMAND = ["sh", "-c", f"{CERTIFICATES} -c >/dev/null && exec /usr/sbin/squid -N -f {CONFIG_DIR}/squid.conf"]
"""A proxy that opens HTTPS first makes the store of the host certificates it signs, on its tmpfs."""
START_S = 20.0
"""The longest a proxy may take to answer after it starts."""
BARRIER_S = 5.0
"""The longest the proxy's log may lag behind a call's end."""


class _Proxy:
    """One allow list's network, proxy container and log."""

    def __init__(self, egress: Egress, policy_name: str, network: str) -> None:
        self.egress = egress
        self.key = egress.key()
        self.policy_name = policy_name
        self.network = network
        self.container_id: str | None = None
        self.address = ""
        """Its address on the internal network (sandboxes' proxy)."""
        self.health_address = ""
        """Its address on the egress network (the host reaches it there)."""
        self.config_dir: str | None = None
        self.records = RequestRecords()
        """The requests not yet filed, each sandbox's in its own bounded record."""
        self.markers: set[str] = set()
        self.changed = threading.Condition()
        """Guards the log's lines and markers."""
        self.lifecycle = threading.Lock()
        """Held while the proxy starts or stops."""
        self.restarting = False
        self.failure: str | None = None
        self.started_once = False
        self.trust: Trust | None = None
        """Its CA, when it opens HTTPS to add secrets (kept across its restarts)."""
        self.opened: tuple[str, str] | None = None
        """(bridge, address) the host's firewall lets reach the proxy (sandboxes reach nothing else there)."""
        self.channel: AskChannel | None = None
        """Where its helpers put the requests to hosts not on its list to the server (network.ask)."""

    def endpoint(self) -> ProxyEndpoint:
        return ProxyEndpoint(self.key, self.network, self.address, self.trust.bundle if self.trust else None)

    def file(self, request: ProxyRequest) -> None:
        """One request of the log: a marker among the markers, any other into its sandbox's record; under
        `changed`."""
        if request.host.endswith(MARKER_DOMAIN):
            self.markers.add(request.host)
        else:
            self.records.file(request)

    def open_firewall(self, bridge: str) -> None:
        """Let the sandboxes of its network's bridge reach its port (and its answers reach them); nothing else
        crosses that bridge."""
        self.close_firewall()
        open_to_proxy(bridge, self.address)
        self.opened = (bridge, self.address)

    def close_firewall(self) -> None:
        if self.opened is not None:
            close_to_proxy(*self.opened)
            self.opened = None


class EgressProxies:
    """The proxies of one server process; every method blocks (call them from a worker thread)."""

    def __init__(
        self,
        api: Callable[[], docker.APIClient],
        owner: str,
        on_this_host: Callable[[], bool] = lambda: True,
        folder: Path | None = None,
    ) -> None:
        self._api = api
        self._folder = folder
        """Where its proxies' files go (a CA's key, the secrets it adds): the server's own, the reaper removes it."""
        self._owner = owner
        self._suffix = hashlib.sha256(owner.encode()).hexdigest()[:8]
        self._proxies: dict[str, _Proxy] = {}
        self._lock = threading.Lock()
        self._on_this_host = on_this_host
        self._apart: bool | None = None
        """Whether sandboxes on one allow list are kept from reaching each other (decided at the first start)."""
        self.gatekeeper = Gatekeeper()
        """The calls its proxies may ask a person for (network.ask)."""

    def network_name(self, key: str) -> str:
        return f"sandbox-egress-{key}-{self._suffix}"

    def bridge_name(self, key: str) -> str:
        """The host's bridge of an allow list's network (at most 15 characters, as the kernel allows)."""
        return "sbx" + hashlib.sha256(f"{key}-{self._suffix}".encode()).hexdigest()[:12]

    def sandboxes_apart(self) -> bool:
        """Whether this host keeps sandboxes on one network from reaching each other: the engine's
        inter-container traffic off, and the host's firewall (root, the engine on this host) letting them
        reach the proxy alone."""
        if self._apart is None:
            self._apart = self._on_this_host() and firewall_managed()
            if not self._apart:
                log.warning(
                    "sandboxes sharing an allow list can reach each other's open ports: this host's firewall "
                    "cannot be managed here (the server is not root on the engine's host, or iptables or the "
                    "engine's DOCKER-USER chain is missing)"
                )
        return self._apart

    def _labels(self, proxy: _Proxy) -> dict[str, str]:
        return {**owned_by(self._owner), PROXY_LABEL: proxy.key}

    # -- the call path ---------------------------------------------------------------------

    def endpoint(self, egress: Egress, policy_name: str) -> ProxyEndpoint:
        """The running proxy for an allow list: started (and awaited) the first time; a Refusal naming the
        reason when it cannot start or has stopped (then it is restarted behind the refusal)."""
        key = egress.key()
        with self._lock:
            proxy = self._proxies.get(key)
            if proxy is None:
                proxy = self._proxies[key] = _Proxy(egress, policy_name, self.network_name(key))
        if proxy.restarting:
            raise self._refusal(proxy, proxy.failure or "it stopped", restarting=True)
        with proxy.lifecycle:
            if not proxy.started_once:
                self._start(proxy)
                if proxy.failure is not None:
                    self._remove(proxy)
                    raise self._refusal(proxy, proxy.failure, restarting=False)
                proxy.started_once = True
                return proxy.endpoint()
            if proxy.restarting:
                raise self._refusal(proxy, proxy.failure or "it stopped", restarting=True)
            problem = self._problem(proxy)
            if problem is None:
                return proxy.endpoint()
            proxy.failure, proxy.restarting = problem, True
        threading.Thread(target=self._restart, args=(proxy,), name="sandbox-proxy-restart", daemon=True).start()
        raise self._refusal(proxy, problem, restarting=True)

    def join(self, endpoint: ProxyEndpoint, network: str) -> ProxyEndpoint:
        """The proxy of `endpoint` on another network too (a workspace's services'), so that what runs there goes
        out through it without joining the allow list's network, which other callers' sandboxes share."""
        proxy = self._proxies.get(endpoint.key)
        if proxy is None or proxy.container_id is None:
            raise OSError("the allow list's proxy is not running")
        api = self._api()
        try:
            networks = api.inspect_container(proxy.container_id)["NetworkSettings"]["Networks"]
            if network not in networks:
                api.connect_container_to_network(proxy.container_id, network)
                networks = api.inspect_container(proxy.container_id)["NetworkSettings"]["Networks"]
        except docker.errors.APIError as exc:
            raise OSError(f"the proxy could not join the services' network: {exc}") from exc
        return replace(proxy.endpoint(), network=network, address=networks[network]["IPAddress"])

    def mounts_of(self, egress: Egress) -> tuple[Mount, ...]:
        """What the sandboxes behind an allow list's proxy have mounted (the CAs they trust, when it opens HTTPS),
        once it has started."""
        proxy = self._proxies.get(egress.key())
        return proxy.endpoint().mounts() if proxy is not None and proxy.started_once else ()

    def network_of(self, egress: Egress) -> str | None:
        """The internal network of an allow list once its proxy has started (it stays while the server runs,
        across restarts of the proxy); None before."""
        proxy = self._proxies.get(egress.key())
        return proxy.network if proxy is not None and proxy.started_once else None

    def requests_of(self, endpoint: ProxyEndpoint, client: str) -> tuple[list[ProxyRequest], int]:
        """The requests the sandbox at `client` made, once the proxy's log has caught up with now, and how many
        more it made than its record keeps (the latest are kept)."""
        proxy = self._proxies.get(endpoint.key)
        if proxy is None or not client:
            return [], 0
        marker = f"m{os.urandom(6).hex()}.{MARKER_DOMAIN}"
        with contextlib.suppress(OSError):
            with socket.create_connection((proxy.health_address, PROXY_PORT), timeout=2) as conn:
                conn.sendall(f"GET http://{marker}/ HTTP/1.0\r\n\r\n".encode())
                conn.recv(4096)
        deadline = time.monotonic() + BARRIER_S
        with proxy.changed:
            while marker not in proxy.markers and time.monotonic() < deadline:
                proxy.changed.wait(deadline - time.monotonic())
            proxy.markers.discard(marker)
            return proxy.records.take(client)

    def close(self) -> None:
        """Remove every proxy and network of this server; never raises."""
        with self._lock:
            proxies, self._proxies = list(self._proxies.values()), {}
        for proxy in proxies:
            with proxy.lifecycle:
                self._remove(proxy)
                if proxy.trust is not None:
                    proxy.trust.remove()
            with contextlib.suppress(docker.errors.APIError, docker.errors.NotFound):
                self._api().remove_network(proxy.network)
        if self._folder is not None:
            shutil.rmtree(self._folder, ignore_errors=True)

    # -- lifecycle -------------------------------------------------------------------------

    def _refusal(self, proxy: _Proxy, reason: str, restarting: bool) -> Refusal:
        then = "; it is being restarted, try again shortly" if restarting else ""
        return Refusal(
            f"refused: the network proxy of policy '{proxy.policy_name}' (field network) is not running: "
            f"{reason}{then}; nothing ran (a sandbox never runs without the proxy that guards its network)",
            "network",
            kind="network_unavailable",
        )

    def _problem(self, proxy: _Proxy) -> str | None:
        """Why the proxy cannot serve a call now (None: it answers)."""
        return self._container_problem(proxy) or self._port_problem(proxy)

    def _container_problem(self, proxy: _Proxy) -> str | None:
        """Why the proxy's container is not running (None: it runs)."""
        if proxy.container_id is None:
            return proxy.failure or "it was never started"
        try:
            state = self._api().inspect_container(proxy.container_id)["State"]
        except docker.errors.NotFound:
            return "its container was removed"
        except docker.errors.APIError as exc:
            return f"the engine cannot say how it is ({exc.explanation or exc})"
        if not state.get("Running"):
            return f"its container {state.get('Status', 'stopped')} with exit code {state.get('ExitCode')}"
        return None

    @staticmethod
    def _port_problem(proxy: _Proxy) -> str | None:
        """Why the proxy does not accept a connection on its port (None: it does)."""
        try:
            socket.create_connection((proxy.health_address, PROXY_PORT), timeout=1).close()
        except OSError as exc:
            return f"it does not answer on port {PROXY_PORT} ({exc.strerror or exc})"
        return None

    def _restart(self, proxy: _Proxy) -> None:
        with proxy.lifecycle:
            self._remove(proxy)
            self._start(proxy)
            if proxy.failure is not None:
                log.warning("egress proxy for policy %r did not restart: %s", proxy.policy_name, proxy.failure)
            proxy.restarting = False

    def _start(self, proxy: _Proxy) -> None:
        """Network, configuration and container, and wait until it answers; proxy.failure says why not."""
        proxy.failure = None
        api = self._api()
        egress = proxy.egress
        try:
            if not api.networks(names=[proxy.network]):
                options = {"com.docker.network.bridge.inhibit_ipv4": "true"}
                if self.sandboxes_apart():  # each sandbox reaches the proxy alone, never another sandbox
                    options["com.docker.network.bridge.enable_icc"] = "false"
                    options["com.docker.network.bridge.name"] = self.bridge_name(proxy.key)
                create_network(api, proxy.network, internal=True, options=options, labels=self._labels(proxy))
            proxy.config_dir = files_folder("sandbox-proxy-", self._folder)
            if egress.secrets and proxy.trust is None:
                proxy.trust = Trust(proxy.policy_name, self._folder)
            write_proxy_files(proxy.config_dir, egress, proxy.policy_name, proxy.trust)
            if egress.ask is not None:
                proxy.channel = AskChannel(proxy.config_dir, proxy.key, self.gatekeeper)
            host_config = api.create_host_config(
                read_only=True,
                cap_drop=["ALL"],
                security_opt=["no-new-privileges"],
                tmpfs={"/tmp": "size=16m,mode=1777,noexec,nosuid,nodev"},
                pids_limit=256,
                mem_limit=256 * 1024 * 1024,
                memswap_limit=256 * 1024 * 1024,
                nano_cpus=1_000_000_000,
                ulimits=[
                    {"name": "nofile", "soft": PROXY_FILES, "hard": PROXY_FILES},
                    {"name": "core", "soft": 0, "hard": 0},
                ],
                network_mode=egress.egress_network,
                binds={proxy.config_dir: {"bind": CONFIG_DIR, "mode": "ro"}},
                log_config={"type": "json-file", "config": {"max-size": "10m", "max-file": "2"}},
                init=True,
                privileged=False,
            )
            created = api.create_container(
                PROXY_IMAGE, labels=self._labels(proxy), hostname="sandbox-proxy", host_config=host_config,
                command=OPENING_COMMAND if proxy.trust is not None else None,
            )  # fmt: skip
            proxy.container_id = str(created["Id"])
            api.connect_container_to_network(proxy.container_id, proxy.network)
            api.start(proxy.container_id)
            networks = api.inspect_container(proxy.container_id)["NetworkSettings"]["Networks"]
            proxy.address = networks[proxy.network]["IPAddress"]
            proxy.health_address = networks[egress.egress_network]["IPAddress"]
            if self.sandboxes_apart():
                proxy.open_firewall(self.bridge_name(proxy.key))
        except docker.errors.ImageNotFound:
            proxy.failure = f"its image {PROXY_IMAGE} is not built (`sandbox-server images build`)"
            return
        except Refusal as refusal:  # a secret or the upstream CAs could not be read: the field is named
            proxy.failure = refusal.message.removeprefix("refused: ")
            return
        except (docker.errors.APIError, KeyError, OSError) as exc:
            said = exc.explanation if isinstance(exc, docker.errors.APIError) else None
            proxy.failure = f"it could not be started ({said or exc})"
            return
        threading.Thread(
            target=self._follow, args=(proxy, proxy.container_id), name="sandbox-proxy-log", daemon=True
        ).start()
        deadline = time.monotonic() + START_S
        while (problem := self._container_problem(proxy)) is None:
            waiting = self._port_problem(proxy)
            if waiting is None:
                log.info("egress proxy for policy %r up at %s", proxy.policy_name, proxy.address)
                return
            if time.monotonic() > deadline:
                problem = f"it did not answer within {START_S:g} s ({waiting})"
                break
            time.sleep(0.1)  # Squid says it listens only in its log: its port is polled until it answers
        tail = ""
        with contextlib.suppress(docker.errors.APIError):
            tail = api.logs(proxy.container_id, stdout=False, stderr=True, tail=3).decode(errors="replace").strip()
        proxy.failure = f"{problem}{': ' + tail if tail else ''}"

    def _follow(self, proxy: _Proxy, container_id: str) -> None:
        """Read the proxy's request log as it is written, until its container ends."""
        try:
            stream = self._api().logs(container_id, stdout=True, stderr=False, stream=True, follow=True)
            pending = b""
            for chunk in stream:
                pending += chunk
                *complete, pending = pending.split(b"\n")
                parsed = [parse_log_line(line.decode(errors="replace")) for line in complete]
                with proxy.changed:
                    for request in parsed:
                        if request is not None:
                            proxy.file(request)
                    proxy.changed.notify_all()
        except (docker.errors.APIError, OSError):
            return

    def _remove(self, proxy: _Proxy) -> None:
        proxy.close_firewall()
        if proxy.channel is not None:
            proxy.channel.close()
            proxy.channel = None
        if proxy.container_id is not None:
            with contextlib.suppress(docker.errors.APIError, docker.errors.NotFound):
                self._api().remove_container(proxy.container_id, force=True)
            proxy.container_id = None
        if proxy.config_dir is not None:
            shutil.rmtree(proxy.config_dir, ignore_errors=True)
            proxy.config_dir = None
