"""A sandbox runc runs on an engine network (an allow list's, its workspace's services', or both): its own network
namespace, plugged into each network's bridge.

The proxy, the host's firewall and the egress audit tell a network's sandboxes apart by their addresses, so every
sandbox needs one of its own that nothing else on the network holds. The engine hands out addresses from the
network's `ip range`, which the server sets at the network's creation to the first half of its subnet
(`engine_range`); the second half is the server's, and it hands those out itself (`Addresses`), one per sandbox,
in turn. A sandbox's namespace gets one end of a veth pair per network, named `eth0` (then `eth1`, as the engine
names them in the order they are joined), with its address and the MAC address the engine itself derives from an
address (so a neighbour's cache can never hold a stale one for it); the other end joins the network's bridge.
Everything the engine's bridge does for its own containers (the firewall's rules, which match the bridge; traffic
between sandboxes off on an allow list's; no way out of an internal network) does the same for these, and nothing
in the sandbox can change its address (it holds no capability). The pair goes when the sandbox's namespace does:
nothing is left on the host.
"""

from __future__ import annotations

import hashlib
import ipaddress
import subprocess
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import docker
from docker.types import IPAMConfig, IPAMPool

from sandbox_server.errors import EngineError

__all__ = [
    "NETWORK_ANNOTATION", "Addresses", "Layout", "create_network", "engine_range", "host_end", "layout_of", "mac_of",
    "on_network", "plug",
]  # fmt: skip

BRIDGE_NAME_OPTION = "com.docker.network.bridge.name"
NETWORK_ANNOTATION = "org.sandbox-server.network"
"""Names, in the bundle of a sandbox runc runs, the engine network it is plugged into."""
PLUG_S = 10.0
"""The longest plugging a sandbox in may take before its call is told the runtime failed."""


def create_network(api: docker.APIClient, name: str, **settings: Any) -> None:
    """Create an engine bridge network whose subnet's second half is the server's to hand out: the engine chooses a free
    subnet for it (as for any network), which it is then made again with, its ip range set to the first half. Should
    another network take that subnet in between, the network is made as any other, and runc makes none of its
    sandboxes (`layout_of` says None)."""
    settings["driver"] = "bridge"
    made = api.create_network(name, **settings)
    try:
        config = api.inspect_network(made["Id"])["IPAM"]["Config"][0]
        subnet, gateway = config["Subnet"], config.get("Gateway") or None
        ipaddress.IPv4Network(subnet)
    except (KeyError, IndexError, TypeError, ValueError):
        return  # no IPv4 subnet said: the network stays the engine's alone
    api.remove_network(made["Id"])
    ipam = IPAMConfig(pool_configs=[IPAMPool(subnet=subnet, iprange=engine_range(subnet), gateway=gateway)])
    try:
        api.create_network(name, ipam=ipam, **settings)
    except docker.errors.APIError:  # another network took the subnet meanwhile: this one is the engine's alone
        api.create_network(name, **settings)


def engine_range(subnet: str) -> str:
    """The part of a network's subnet the engine hands out (its first half); the rest is the server's."""
    network = ipaddress.IPv4Network(subnet)
    return str(next(network.subnets(prefixlen_diff=1)))


@dataclass(frozen=True, slots=True)
class Layout:
    """An engine network as the server plugs sandboxes into it: its bridge, its subnet and the server's half."""

    network: str
    bridge: str
    subnet: ipaddress.IPv4Network
    ours: ipaddress.IPv4Network
    gateway: ipaddress.IPv4Address | None
    """The address the engine routes its containers' other traffic to (none holds it on an internal network whose
    bridge has no address: such traffic goes nowhere, for these sandboxes as for the engine's)."""


def layout_of(inspected: Mapping[str, Any]) -> Layout | None:
    """The layout of an engine network (its inspection), or None when it leaves the server no addresses (made
    without the ip range `engine_range` says, as by an earlier version, or not a bridge)."""
    if inspected.get("Driver") != "bridge":
        return None
    for config in (inspected.get("IPAM") or {}).get("Config") or ():
        subnet, ip_range = config.get("Subnet") or "", config.get("IPRange") or ""
        try:
            network = ipaddress.IPv4Network(subnet)
        except ValueError:
            continue  # IPv6, or nothing said
        if network.prefixlen > 29 or ip_range != engine_range(subnet):
            continue
        options = inspected.get("Options") or {}
        bridge = options.get(BRIDGE_NAME_OPTION) or f"br-{str(inspected.get('Id', ''))[:12]}"
        ours = list(network.subnets(prefixlen_diff=1))[1]
        gateway = ipaddress.IPv4Address(config["Gateway"]) if config.get("Gateway") else None
        return Layout(str(inspected.get("Name", "")), bridge, network, ours, gateway)
    return None


class Addresses:
    """The server's addresses on its networks, each held by one sandbox, handed out in turn (an address comes back
    round only after every other one of the half has been handed out); thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._held: dict[str, list[tuple[str, ipaddress.IPv4Address]]] = {}
        """Sandbox name: its networks and its address on each, in the order they were taken."""
        self._taken: dict[str, set[ipaddress.IPv4Address]] = {}
        self._next: dict[str, int] = {}

    def take(self, layout: Layout, sandbox: str) -> ipaddress.IPv4Address:
        """A free address of the server's half of `layout` for `sandbox`; EngineError when every one is held."""
        ours = layout.ours
        size = ours.num_addresses
        with self._lock:
            taken = self._taken.setdefault(layout.network, set())
            start = self._next.get(layout.network, 0)
            for step in range(size):
                address = ours.network_address + (start + step) % size
                if address in taken or address == layout.subnet.broadcast_address:
                    continue
                taken.add(address)
                self._held.setdefault(sandbox, []).append((layout.network, address))
                self._next[layout.network] = (start + step + 1) % size
                return address
        raise EngineError(f"network {layout.network}: all {size - 1} of the server's addresses are in use")

    def give_back(self, sandbox: str) -> None:
        """Free the addresses `sandbox` held (none held: nothing)."""
        with self._lock:
            for network, address in self._held.pop(sandbox, ()):
                self._taken.get(network, set()).discard(address)

    def held(self, sandbox: str) -> ipaddress.IPv4Address | None:
        """The first address `sandbox` took (its first network's), if any."""
        with self._lock:
            found = self._held.get(sandbox)
        return found[0][1] if found else None


def on_network(layouts: Sequence[Layout]) -> dict[str, str]:
    """The annotation of a sandbox's bundle that names its networks, comma-separated (none without one)."""
    return {NETWORK_ANNOTATION: ",".join(layout.network for layout in layouts)} if layouts else {}


def mac_of(address: ipaddress.IPv4Address) -> str:
    """The MAC address the engine's bridge gives the container at `address` (02:42 and the address's bytes)."""
    return ":".join(f"{part:02x}" for part in (0x02, 0x42, *address.packed))


def host_end(sandbox: str, index: int = 0) -> str:
    """The name of the host's end of a sandbox's `index`th veth (`eth<index>` inside), at most 15 characters, as
    the kernel allows."""
    return "sbv" + hashlib.sha256(sandbox.encode()).hexdigest()[:11] + str(index)


def plug(pid: int, sandbox: str, layout: Layout, address: ipaddress.IPv4Address, index: int = 0) -> None:
    """Give the network namespace of the host process `pid` (a sandbox's init) an `eth<index>` at `address` on
    the network's bridge; EngineError when the host would not. As the engine does, only a sandbox's first
    network routes what is for no network of its (through its gateway)."""
    host, inside = host_end(sandbox, index), f"eth{index}"
    _ip(
        ["ip", "-batch", "-"],
        f"link add {host} type veth peer name {inside} address {mac_of(address)} netns {pid}\n"
        f"link set {host} master {layout.bridge} up\n",
        sandbox,
    )
    routed = index == 0 and layout.gateway is not None
    _ip(
        ["nsenter", f"--net=/proc/{pid}/ns/net", "ip", "-batch", "-"],
        f"address add {address}/{layout.subnet.prefixlen} dev {inside}\nlink set {inside} up\n"
        + (f"route add default via {layout.gateway} dev {inside}\n" if routed else ""),
        sandbox,
    )


def _ip(command: list[str], batch: str, sandbox: str) -> None:
    try:
        done = subprocess.run(command, input=batch.encode(), capture_output=True, timeout=PLUG_S, check=False)
    except (OSError, subprocess.SubprocessError) as exc:
        raise EngineError(f"sandbox {sandbox} could not be put on its network: {exc}") from exc
    if done.returncode != 0:
        said = done.stderr.decode(errors="replace").strip()[:400]
        raise EngineError(f"sandbox {sandbox} could not be put on its network: {said or 'ip said nothing'}")
