"""How the server shares an engine network with the engine (an allow list's, a workspace's services'): its half of
the addresses, handed out in turn, and the services' names in a hosts file it keeps."""

from __future__ import annotations

import ipaddress
import socket
from pathlib import Path
from typing import Any

import pytest

from sandbox_server.errors import EngineError
from sandbox_server.sandbox.runc.hosts import LOCAL_NAMES, ensure_hosts, forget_hosts, write_hosts
from sandbox_server.sandbox.runc.state import delete_left_by, folders_left, hosts_folder, proxies_folder
from sandbox_server.sandbox.runc.veth import Addresses, engine_range, host_end, layout_of, mac_of


def _inspected(ip_range: str | None = "172.30.0.0/25", **overrides: Any) -> dict[str, Any]:
    config = {"Subnet": "172.30.0.0/24", "Gateway": "172.30.0.1"} | ({"IPRange": ip_range} if ip_range else {})
    return {
        "Name": "sandbox-egress-k-s", "Id": "0123456789abcdef", "Driver": "bridge", "IPAM": {"Config": [config]},
        "Options": {"com.docker.network.bridge.name": "sbxbridge"},
    } | overrides  # fmt: skip


def test_the_engine_hands_out_the_first_half_of_a_subnet_and_the_server_the_second() -> None:
    assert engine_range("172.30.0.0/16") == "172.30.0.0/17"
    layout = layout_of(_inspected())
    assert layout is not None
    assert (layout.network, layout.bridge) == ("sandbox-egress-k-s", "sbxbridge")
    assert layout.ours == ipaddress.IPv4Network("172.30.0.128/25")
    assert layout.gateway == ipaddress.IPv4Address("172.30.0.1")
    assert layout.gateway not in layout.ours  # the engine's own, in its half


@pytest.mark.parametrize(
    "inspected",
    [
        _inspected(ip_range=None),  # made as any network (an earlier version's): every address is the engine's
        _inspected(ip_range="172.30.0.0/26"),  # a range the server did not set
        _inspected(Driver="overlay"),
        _inspected(IPAM={"Config": [{"Subnet": "fd00::/64", "IPRange": "fd00::/65"}]}),
        _inspected(IPAM={"Config": [{"Subnet": "172.30.0.0/30", "IPRange": "172.30.0.0/31"}]}),  # too small
        _inspected(IPAM={}),
    ],
)
def test_a_network_that_leaves_the_server_no_addresses_has_no_layout(inspected: dict[str, Any]) -> None:
    assert layout_of(inspected) is None


def test_a_network_without_a_bridge_of_its_own_name_is_on_the_engines_bridge_of_its_id() -> None:
    layout = layout_of(_inspected(Options={}))
    assert layout is not None and layout.bridge == "br-0123456789ab"


def test_addresses_are_handed_out_in_turn_each_to_one_sandbox_and_never_the_broadcast() -> None:
    layout = layout_of(_inspected())
    assert layout is not None
    addresses = Addresses()
    first, second = addresses.take(layout, "a"), addresses.take(layout, "b")
    assert (str(first), str(second)) == ("172.30.0.128", "172.30.0.129")
    assert addresses.held("a") == first
    addresses.give_back("a")
    assert addresses.held("a") is None
    third = addresses.take(layout, "c")
    assert str(third) == "172.30.0.130"  # a freed address comes round again only after the others
    taken = {addresses.take(layout, f"s{n}") for n in range(125)}  # the rest of the half but its broadcast
    assert str(first) in {str(a) for a in taken} and ipaddress.IPv4Address("172.30.0.255") not in taken
    with pytest.raises(EngineError, match="all 127 of the server's addresses are in use"):
        addresses.take(layout, "one too many")
    addresses.give_back("b")
    assert addresses.take(layout, "d") == second


def test_a_sandbox_has_the_mac_the_engine_derives_from_its_address_and_a_short_host_port_name() -> None:
    assert mac_of(ipaddress.IPv4Address("172.17.0.2")) == "02:42:ac:11:00:02"  # as the engine gives its containers
    name = host_end("sbx-0123abcd-12345-1795995553")
    assert len(name) <= 15 and name.startswith("sbv") and name == host_end("sbx-0123abcd-12345-1795995553")
    second = host_end("sbx-0123abcd-12345-1795995553", 1)  # its end on a second network
    assert len(second) <= 15 and second != name and second[:-1] == name[:-1]


def test_a_sandbox_on_two_networks_holds_an_address_on_each_and_gives_both_back() -> None:
    egress, services = layout_of(_inspected()), layout_of(_inspected(Name="sandbox-svc-x"))
    assert egress is not None and services is not None
    addresses = Addresses()
    first = addresses.take(egress, "a")
    addresses.take(services, "a")
    assert addresses.held("a") == first  # its first network's: the one the proxy knows it by
    addresses.give_back("a")
    assert addresses.held("a") is None
    assert str(addresses.take(services, "b")) == "172.30.0.129"  # each network hands out its own in turn


def test_the_hosts_file_of_a_services_network_is_rewritten_in_place_and_goes_with_its_server(tmp_path: Path) -> None:
    owner = f"{socket.gethostname()}:4242:1795848710"
    folder = hosts_folder(tmp_path, owner)
    path = write_hosts(folder, "net", {"web": "172.30.0.2", "api": "172.30.0.3", "starting": ""})
    inode = path.stat().st_ino
    assert path.read_text() == LOCAL_NAMES + "172.30.0.3\tapi\n172.30.0.2\tweb\n"  # one not yet up: unnamed
    write_hosts(folder, "net", {"web": "172.30.0.2"})
    assert path.stat().st_ino == inode  # the file sandboxes have bound: the same one, shorter
    assert path.read_text() == LOCAL_NAMES + "172.30.0.2\tweb\n"
    assert ensure_hosts(folder, "net").read_text() == LOCAL_NAMES + "172.30.0.2\tweb\n"  # never emptied
    assert ensure_hosts(folder, "other").read_text() == LOCAL_NAMES  # made as it is first needed
    assert folders_left(tmp_path) == [(owner, folder)]
    forget_hosts(folder, ["other"])
    assert not path.exists() and (folder / "other").exists()
    forget_hosts(folder, [])
    assert not folder.exists()  # the last network's gone: the folder too


def test_what_a_server_keeps_here_goes_with_it_its_proxies_keys_among_it(tmp_path: Path) -> None:
    owner = f"{socket.gethostname()}:4242:1795848710"
    hosts, proxies = hosts_folder(tmp_path, owner), proxies_folder(tmp_path, owner)
    for folder in (hosts, proxies):
        folder.mkdir(parents=True)
    (proxies / "ca-key.pem").write_text("secret")
    assert sorted(folders_left(tmp_path)) == sorted([(owner, hosts), (owner, proxies)])
    delete_left_by(owner, tmp_path)
    assert folders_left(tmp_path) == [] and not proxies.exists()
