"""A policy with an allow list, through the real server, the real proxy and the real engine.

Every packet stays on this machine: the upstream servers are the test's own containers on a
network the test creates (internal, so nothing on it routes out), named to the proxy through
the policy's `hosts`, and every name the policy allows is pinned there, so the proxy asks no
name server. Refusals are proven against those upstreams and the proxy's own configuration.
"""

from __future__ import annotations

import difflib
import functools
import ipaddress
import json
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import anyio
import anyio.to_thread
import docker
import pytest
from mcp import Client

from sandbox_server.network.egress import parse_egress
from sandbox_server.network.proxies import PROXY_LABEL
from sandbox_server.sandbox.engine.removal import OWNER_LABEL
from sandbox_server.sandbox.engine.services import SERVICE_LABEL
from sandbox_server.sandbox.runc.state import is_runc
from sandbox_server.sandbox.runc.veth import layout_of
from sandbox_server.sandbox.spec import SANDBOX_LABEL
from tests.conftest import assert_engine_routes_and_mac, runc_sandboxes_on
from tests.mcp_harness import (
    answer,
    audit_records,
    close_stream,
    connect,
    first_runc_sandboxes,
    first_sandboxes,
    stdio_parameters,
    text_of,
)
from tests.upstreams import SHELL, Upstreams, shell_network, upstreams_fixture  # noqa: F401 (the upstreams fixture)

pytestmark = pytest.mark.anyio


@pytest.fixture(scope="module")
def audit_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("audit") / "audit.jsonl"


@pytest.fixture(scope="module")
async def session(
    upstreams: Upstreams, audit_path: Path, tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[Client]:
    policy = tmp_path_factory.mktemp("policy") / "egress.yaml"
    tools = {
        "execute_command": {"network": _shell(upstreams)},
        # run_python may reach the package index alone, and the policy's environment points pip at it.
        "run_python": {
            "network": {
                "allow": ["index.test:80"],
                "egress_network": upstreams.network,
                "hosts": {"index.test": upstreams.index},
            },
            "env": {"set": {"PIP_INDEX_URL": "http://index.test/simple/", "PIP_TRUSTED_HOST": "index.test"}},
        },
    }
    # JSON is YAML.
    policy.write_text(
        json.dumps({"name": "egress-test", "extends": "default", "audit": {"path": str(audit_path)}, "tools": tools})
    )
    async with connect(stdio_parameters("--policy", str(policy))) as client:
        yield client


def _shell(upstreams: Upstreams) -> dict[str, Any]:
    """execute_command's network here: the web and HTTPS upstreams, and quiet.test:81, allowed: the web upstream,
    where nothing listens on port 81."""
    shell = shell_network(upstreams)
    return {
        **shell,
        "allow": [*shell["allow"], "quiet.test:81"],
        "hosts": {**shell["hosts"], "quiet.test": upstreams.web},
    }


async def run(session: Client, command: str, **arguments: Any) -> dict[str, Any]:
    return await answer(session, "execute_command", {"command": command, **arguments})


async def test_an_allowed_host_answers_over_http_and_every_request_is_in_the_answer_and_the_audit(
    session: Client, audit_path: Path
) -> None:
    answer = await run(session, "curl -sS -m 10 http://web.test/first && curl -sS -m 10 http://web.test/second")
    assert answer["stdout"] == "hello from web /first\nhello from web /second\n", answer["text"]
    requests = answer["network"]["requests"]
    assert [(r["method"], r["host"], r["port"], r["allowed"], r["status"]) for r in requests] == [
        ("GET", "web.test", 80, True, 200), ("GET", "web.test", 80, True, 200),
    ], requests  # fmt: skip
    assert all(r["bytes_in"] > 0 and r["bytes_out"] > 0 for r in requests)
    assert answer["network"]["denied"] == []
    # What went through the proxy is metered: received and sent, as the proxy's log counts them.
    assert answer["usage"]["network_in_bytes"] == sum(r["bytes_in"] for r in requests) > 0
    assert answer["usage"]["network_out_bytes"] == sum(r["bytes_out"] for r in requests) > 0
    record = audit_records(audit_path)[-1]
    assert record["network"]["requests"] == requests and record["usage"] == answer["usage"]


async def test_https_goes_through_connect_to_an_allowed_host_without_interception(
    session: Client, upstreams: Upstreams
) -> None:
    answer = await run(
        session, "curl -sS -m 10 --cacert ca.pem https://secure.test/page",
        files=[{"path": "ca.pem", "content": upstreams.certificate}],
    )  # fmt: skip
    assert answer["stdout"] == "hello from secure /page\n", answer["text"]  # the test's own certificate verified
    assert [(r["method"], r["host"], r["port"], r["allowed"]) for r in answer["network"]["requests"]] == [
        ("CONNECT", "secure.test", 443, True)
    ]


def pip(*arguments: str) -> str:
    """A cell that runs pip with the arguments, prints what it said and exits with its code."""
    return (
        "import subprocess, sys\n"
        f"done = subprocess.run([sys.executable, '-m', 'pip', *{arguments!r}], capture_output=True, text=True)\n"
        "print(done.stdout, done.stderr, sep='')\n"
        "sys.exit(done.returncode)"
    )


async def test_pip_installs_from_the_allowed_index_into_the_workspace_and_the_sessions_next_calls_import_it(
    session: Client, audit_path: Path
) -> None:
    installed = await session.call_tool("run_python", {"code": pip("install", "--user", "tabulate"), "timeout_s": 60})
    data = installed.structured_content
    assert data is not None and not installed.is_error, text_of(installed)
    assert "Successfully installed tabulate-0.9.0" in data["stdout"] and "WARNING" not in data["stdout"], data["stdout"]
    # Through the proxy: the project's page, then the wheel; no version check of pip's own.
    requests = data["network"]["requests"]
    assert [(r["method"], r["host"], r["port"], r["allowed"], r["status"]) for r in requests] == [
        ("GET", "index.test", 80, True, 200), ("GET", "index.test", 80, True, 200),
    ], requests  # fmt: skip
    assert audit_records(audit_path)[-1]["network"]["requests"] == requests
    # The session's next call is a fresh container: the package is in the workspace's user site.
    imported = await session.call_tool(
        "run_python", {"code": "import tabulate\n(tabulate.__version__, tabulate.__file__)"}
    )
    assert imported.structured_content is not None and not imported.is_error, text_of(imported)
    assert imported.structured_content["stdout"].strip() == (
        "('0.9.0', '/workspace/.local/lib/python3.11/site-packages/tabulate/__init__.py')"
    )
    # The shell image's pip and python3 see it too, and its console script is on PATH.
    shell = await run(
        session, "pip list --user --format freeze; command -v tabulate; printf '1 2\\n' | tabulate -f plain; "
        "python3 -c 'import tabulate'",
    )  # fmt: skip
    assert shell["stdout"].splitlines() == ["tabulate==0.9.0", "/workspace/.local/bin/tabulate", "1  2"], shell["text"]
    # pip's cache is in the workspace too: asked again, it fetches the project's page and takes the wheel from there.
    again = await session.call_tool(
        "run_python", {"code": pip("download", "--no-deps", "-d", "/tmp/again", "tabulate")}
    )
    assert again.structured_content is not None and not again.is_error, text_of(again)
    assert "Saved /tmp/again/tabulate-0.9.0-py3-none-any.whl" in again.structured_content["stdout"], text_of(again)
    assert [(r["method"], r["status"]) for r in again.structured_content["network"]["requests"]] == [("GET", 200)]


async def test_a_host_the_list_does_not_name_gets_a_403_naming_the_field_and_is_listed_as_denied(
    session: Client, upstreams: Upstreams
) -> None:
    answer = await run(
        session,
        f"curl -sS -m 10 http://other.test/; echo; curl -sS -m 10 http://{upstreams.web}/; echo; "
        "curl -sS -m 10 http://web.test:8080/ -o /dev/null -w '%{http_code}\\n'; "
        "curl -sS -m 10 https://other.test/ 2>&1 | tail -1",
    )
    lines = answer["stdout"].splitlines()
    assert lines[0] == (
        "sandbox-server: other.test:80 is not allowed by policy 'egress-test' (field network.allow); "
        "ask for a host the policy allows, or add it to network.allow"
    ), answer["text"]
    assert lines[2].startswith(f"sandbox-server: {upstreams.web}:80 is not allowed"), answer["text"]  # an address
    assert lines[4] == "403", answer["text"]  # an allowed host on a port it does not list
    assert "403" in lines[5], answer["text"]  # CONNECT to a name not listed
    assert answer["network"]["denied"] == sorted(
        {"other.test:80", f"{upstreams.web}:80", "web.test:8080", "other.test:443"}
    )
    assert "the proxy refused" in answer["text"] and "(policy field network.allow)" in answer["text"]


async def test_an_allowed_host_with_nothing_listening_is_said_to_be_the_proxys_answer_not_the_hosts(
    session: Client,
) -> None:
    answer = await run(session, "curl -sS -m 10 -o /dev/null -w '%{http_code}\\n' http://quiet.test:81/")
    assert answer["stdout"] == "503\n", answer["text"]
    [request] = answer["network"]["requests"]
    assert (request["allowed"], request["status"], request["proxy_error"]) == (True, 503, "ERR_CONNECT_FAIL"), request
    said = "quiet.test:81 is allowed, but the proxy could not connect to it: nothing listens there, or it refused"
    assert said in answer["text"] and "its 503 page is the proxy's, not the host's" in answer["text"], answer["text"]
    assert answer["network"]["denied"] == []
    plain = await run(session, "curl -sS -m 10 http://web.test/ok")
    assert "proxy_error" not in plain["network"]["requests"][0] and "proxy could not" not in plain["text"]


async def test_no_way_around_the_proxy_direct_connections_udp_and_name_lookups_fail(
    session: Client, upstreams: Upstreams
) -> None:
    probe = (
        "import socket\n"
        "def attempt(what, action):\n"
        "    try:\n"
        "        action()\n"
        "        print(what, 'REACHED')\n"
        "    except OSError as exc:\n"
        "        print(what, 'failed', type(exc).__name__)\n"
        f"attempt('tcp', lambda: socket.create_connection(('{upstreams.web}', 80), timeout=3))\n"
        "def udp():\n"
        "    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)\n"
        "    s.settimeout(3)\n"
        f"    s.sendto(b'ping', ('{upstreams.web}', 5353))\n"
        "    s.recvfrom(64)\n"
        "attempt('udp', udp)\n"
        "attempt('dns', lambda: socket.getaddrinfo('web.test', 80))\n"
        "attempt('raw', lambda: socket.socket(socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_ICMP))\n"
        "print(open('/proc/sys/net/ipv6/conf/all/disable_ipv6').read().strip())\n"
    )
    answer = await run(session, "python3 probe.py", files=[{"path": "probe.py", "content": probe}])
    lines = answer["stdout"].splitlines()
    assert lines[0].startswith("tcp failed"), answer["text"]
    assert lines[1].startswith("udp failed"), answer["text"]
    assert lines[2].startswith("dns failed"), answer["text"]
    assert lines[3].startswith("raw failed"), answer["text"]
    assert lines[4] == "1", answer["text"]  # no IPv6, so no link-local path to the host's bridge
    # The same echo answers a container on the upstreams' own network: the probe could have succeeded.
    api = docker.from_env().api
    container = api.create_container(
        SHELL, ["python3", "-c", probe.replace("('web.test', 80)", "('localhost', 80)")],
        host_config=api.create_host_config(network_mode=upstreams.network, read_only=True, cap_drop=["ALL"]),
    )  # fmt: skip
    try:
        api.start(container["Id"])
        api.wait(container["Id"], timeout=30)
        control = api.logs(container["Id"], stdout=True, stderr=False).decode().splitlines()
    finally:
        api.remove_container(container["Id"], force=True)
        api.close()
    assert control[:2] == ["tcp REACHED", "udp REACHED"], control


def _proxy_container(api: docker.APIClient, upstreams: Upstreams) -> dict[str, Any]:
    """execute_command's proxy (run_python's allow list has one of its own)."""
    egress = parse_egress(_shell(upstreams), "network", [])
    assert egress is not None
    found = api.containers(filters={"label": f"{PROXY_LABEL}={egress.key()}"})
    assert len(found) == 1, found
    return dict(found[0])


async def test_the_running_proxy_denies_special_destinations_before_any_allow_rule(
    session: Client, upstreams: Upstreams
) -> None:
    await run(session, "true")  # the proxy is up
    api = docker.from_env().api
    try:
        proxy = _proxy_container(api, upstreams)
        exec_id = api.exec_create(proxy["Id"], ["cat", "/etc/squid/sandbox/squid.conf"])
        conf = api.exec_start(exec_id).decode().splitlines()
        inspected = api.inspect_container(proxy["Id"])
    finally:
        api.close()
    rules = [line for line in conf if line.startswith("http_access")]
    assert rules[:2] == ["http_access deny !allowed", "http_access deny !named special"], rules
    assert rules[-1] == "http_access deny all"
    special = next(line for line in conf if line.startswith("acl special dst")).split()
    assert {"127.0.0.0/8", "169.254.0.0/16", "10.0.0.0/8", "172.16.0.0/12", "192.168.0.0/16"} <= set(special)
    assert "dns_nameservers 127.0.0.1" in conf  # every allowed name is pinned: no name server is asked
    host = inspected["HostConfig"]
    assert host["ReadonlyRootfs"] and host["CapDrop"] == ["ALL"] and "no-new-privileges" in host["SecurityOpt"]
    assert inspected["Config"]["User"] in ("", "proxy:proxy") and not host["Privileged"]


async def test_once_its_proxy_runs_a_tool_with_an_allow_list_is_served_by_warm_containers_on_its_network(
    session: Client, upstreams: Upstreams, audit_path: Path
) -> None:
    await run(session, "true")  # the proxy is up, so its network is, and the pool fills on it
    by_runc = is_runc(audit_records(audit_path)[-1]["container_id"])  # who makes this host's sandboxes on it
    api = docker.from_env().api
    try:
        proxy = _proxy_container(api, upstreams)
        network = next(name for name in proxy["NetworkSettings"]["Networks"] if name.startswith("sandbox-egress-"))

        def made(running_only: bool) -> set[str]:  # the sandboxes on the network no call has used yet: the pool's
            used = {record.get("container_id") for record in audit_records(audit_path)}  # `true`'s may linger
            listed = api.containers(all=not running_only, filters={"network": network, "label": SANDBOX_LABEL})
            ids = {c["Id"][:12] for c in listed if PROXY_LABEL not in c["Labels"]}
            return (ids | {name[:12] for name in runc_sandboxes_on(network, running_only)}) - used

        waiting = functools.partial(made, True)
        with anyio.fail_after(60):  # one of them running: the pool fills on this network
            if by_runc:
                await anyio.to_thread.run_sync(first_runc_sandboxes, waiting)
            else:
                await anyio.to_thread.run_sync(first_sandboxes, api, waiting)
        before = made(False)  # and every one it has begun (a call finding none ready waits for one being made)
    finally:
        api.close()
    answer = await run(session, "curl -sS -m 10 http://web.test/warm")
    assert answer["stdout"] == "hello from web /warm\n", answer["text"]
    assert [r["host"] for r in answer["network"]["requests"]] == ["web.test"]  # filed by the warm one's address
    used = audit_records(audit_path)[-1]["container_id"]
    assert used in before, (used, before)  # made before the call: a cold one is made after it begins


async def test_a_killed_proxy_refuses_calls_with_the_reason_until_it_is_back(
    session: Client, upstreams: Upstreams
) -> None:
    await run(session, "true")
    api = docker.from_env().api
    try:
        killed = _proxy_container(api, upstreams)
        owner = killed["Labels"][OWNER_LABEL]
        since = int(time.time()) - 1
        await anyio.to_thread.run_sync(api.kill, killed["Id"])
        result = await session.call_tool("execute_command", {"command": "curl -sS http://web.test/"})
        assert result.is_error and result.structured_content is not None
        error = result.structured_content["error"]
        assert error["kind"] == "network_unavailable" and error["field"] == "network", error
        assert "is not running" in error["message"] and "nothing ran" in error["message"], error
        assert "exit code 137" in error["message"] or "does not answer" in error["message"], error

        def started() -> str:  # the restarted proxy, once it says it accepts connections
            events = api.events(
                since=since,
                until=since + 60,
                filters={"label": f"{OWNER_LABEL}={owner}", "event": "start"},
                decode=True,
            )
            try:
                for event in events:  # (the killed one's own start may fall in the window: a proxy started just before)
                    if event.get("Actor", {}).get("Attributes", {}).get(PROXY_LABEL) and event["id"] != killed["Id"]:
                        log = api.logs(event["id"], stream=True, follow=True, stderr=True, stdout=False)
                        try:
                            if any(b"Accepting HTTP Socket connections" in line for line in log):
                                return str(event["id"])
                        finally:
                            close_stream(log)
            finally:
                close_stream(events)
            raise AssertionError("the event stream ended")

        with anyio.fail_after(60):
            restarted = await anyio.to_thread.run_sync(started)
            assert restarted != killed["Id"]
            while True:  # the server sees it answer within its next check
                answer = await run(session, "curl -sS -m 10 http://web.test/again")
                if not answer["is_error"]:
                    break
                assert answer["error"]["kind"] == "network_unavailable", answer["text"]
    finally:
        api.close()
    assert answer["stdout"] == "hello from web /again\n", answer["text"]


async def test_a_service_goes_out_through_the_proxy_and_the_sessions_calls_reach_it_and_the_proxy_both(
    session: Client,
) -> None:
    """Under an allow list a service goes out as a call does, through the proxy; a call of its session then
    joins both networks: it reaches the service by name and the allowed host through the proxy."""
    started = await session.call_tool(
        "execute_command",
        {
            "command": "curl -sS -m 10 http://web.test/from-the-service > fetched.txt && exec python3 -m http.server 8000",
            "service": {"name": "svc", "port": 8000},
        },
    )
    assert not started.is_error and started.structured_content is not None, text_of(started)
    # It is on its workspace's network alone, never on the allow list's (which other callers' sandboxes share).
    api = docker.from_env().api
    label = f"{SERVICE_LABEL}={started.structured_content['service']['id']}"
    [container] = api.containers(filters={"label": label})
    [network] = container["NetworkSettings"]["Networks"]
    assert network.startswith("sandbox-svc-"), network
    both = await run(
        session,
        "curl -sS -m 10 http://svc:8000/fetched.txt; curl -sS -m 10 http://web.test/from-a-call; "
        'echo $(ls /sys/class/net) $(awk \'NR > 1 && $2 == "00000000" {print "default via", $1}\' /proc/net/route)',
    )
    assert both["stdout"] == (  # the allow list's network first (the way out), the services' beside it
        "hello from web /from-the-service\nhello from web /from-a-call\neth0 eth1 lo default via eth0\n"
    ), both["text"]
    assert [r["host"] for r in both["network"]["requests"]] == ["web.test"]  # the service is reached directly
    stopped = await session.call_tool("services", {"action": "stop", "name": "svc"})
    assert not stopped.is_error, text_of(stopped)
    assert api.networks(names=[network]) == []  # the proxy let go of it, and it is gone


FLOOD = """\
import http.client, os
host, port = os.environ["HTTP_PROXY"].split("//")[1].rstrip("/").split(":")
def ask(connection, name):
    connection.request("GET", f"http://{name}/", headers={"Host": name})
    answer = connection.getresponse()
    answer.read()
    return answer.status, answer.will_close
connection = http.client.HTTPConnection(host, int(port), timeout=10)
print(ask(connection, "web.test")[0])
refused = 0
for number in range(10_050):
    status, closing = ask(connection, f"flood{number}.test")
    refused += status == 403
    if closing:
        connection.close()
        connection = http.client.HTTPConnection(host, int(port), timeout=10)
print(refused)
"""


async def test_a_sandboxs_own_flood_of_denied_requests_does_not_push_its_allowed_request_out_of_its_answer(
    session: Client,
) -> None:
    """The attack: one allowed request, then more denied ones than a sandbox's record keeps (10,000)."""
    answer = await run(session, "python3 flood.py", files=[{"path": "flood.py", "content": FLOOD}], timeout_s=110)
    assert answer["stdout"].split() == ["200", "10050"], answer["text"]
    requests = answer["network"]["requests"]
    allowed = [(r["host"], r["status"]) for r in requests if r["allowed"]]
    assert allowed == [("web.test", 200)], allowed[:5]
    assert requests[0]["host"] == "web.test"  # first, as it came
    # The answer lists 200 (the allowed one, then the latest refused) and counts the rest: 10,000 would make an
    # answer larger than the 1 MiB message the official client takes.
    assert answer["network"]["requests_not_kept"] == 50 + 10_001 - 200 and len(requests) == 200
    assert len(answer["network"]["denied"]) == 200 and answer["network"]["denied_not_listed"] == 9_800
    assert len(json.dumps(answer)) < 256 * 1024, len(json.dumps(answer))
    assert "and 9980 more (policy field network.allow)" in answer["text"]  # the note names 20 of them


NETWORK_PROBE = r"""
echo "links=$(ls /sys/class/net | tr '\n' ' ') mtu=$(cat /sys/class/net/eth0/mtu)"
echo "ipv6=$(cat /proc/sys/net/ipv6/conf/all/disable_ipv6 /proc/sys/net/ipv6/conf/eth0/disable_ipv6 | tr '\n' ' ')"
echo "ipv6 addresses=$(wc -l < /proc/net/if_inet6)"
awk 'NR > 1 {print "route", $1, $2, $3, $8}' /proc/net/route
echo "mac $(cat /sys/class/net/eth0/address)"
curl -sS -m 10 http://web.test/probe
python3 -c "import socket; socket.create_connection(('$1', 80), timeout=3)" 2>/dev/null && echo direct || echo "no direct"
"""


async def test_runc_makes_an_allow_lists_sandboxes_as_the_engine_does_at_an_address_of_the_servers_half(
    upstreams: Upstreams, tmp_path: Path
) -> None:
    policy = tmp_path / "egress.yaml"
    tools = {"execute_command": {"network": shell_network(upstreams)}}
    policy.write_text(json.dumps({"extends": "default", "workspace": {"persist": False}, "tools": tools}))
    said: dict[str, dict[str, Any]] = {}
    for path in ("engine", "runc"):
        audit = tmp_path / f"{path}.jsonl"
        serve = ("--policy", str(policy), "--sandboxes", path, "--audit-log", str(audit))
        async with connect(stdio_parameters(*serve)) as client:
            said[path] = await answer(
                client, "execute_command", {"command": f"sh probe.sh {upstreams.web}", "files": [
                    {"path": "probe.sh", "content": NETWORK_PROBE}]},
            )  # fmt: skip
            record = audit_records(audit)[-1]
            api = docker.from_env().api
            try:  # the network the sandbox was on, while its server runs
                (inspected,) = [
                    api.inspect_network(n["Id"]) for n in api.networks(filters={"label": OWNER_LABEL})
                    if n["Name"].startswith("sandbox-egress-")
                    and ipaddress.IPv4Address(record["address"]) in ipaddress.IPv4Network(n["IPAM"]["Config"][0]["Subnet"])
                ]  # fmt: skip
            finally:
                api.close()
        said[path] |= {"record": record, "layout": layout_of(inspected)}
    engine, runc = said["engine"], said["runc"]
    assert not runc["is_error"] and not engine["is_error"], (engine["text"], runc["text"])
    assert is_runc(runc["record"]["container_id"]) and not is_runc(engine["record"]["container_id"])

    def apart(stdout: str) -> list[str]:  # the lines of the network's own addresses apart: each server has its own
        return [line for line in stdout.splitlines() if not line.startswith(("route ", "mac "))]

    differ = list(difflib.unified_diff(apart(engine["stdout"]), apart(runc["stdout"]), lineterm=""))
    assert not differ, "\n".join(differ)
    for each in (engine, runc):  # the engine's routes and MAC, which it derives from the address, on both paths
        assert_engine_routes_and_mac(each, each["layout"], ipaddress.IPv4Address(each["record"]["address"]))
    assert "hello from web /probe\nno direct\n" in runc["stdout"] and "links=eth0 lo " in runc["stdout"], runc["text"]
    assert "ipv6=1 1 " in runc["stdout"] and "ipv6 addresses=0" in runc["stdout"], runc["text"]
    assert [r["host"] for r in runc["network"]["requests"]] == ["web.test"]  # the proxy named it by its address
    layout = runc["layout"]
    assert layout is not None, "the allow list's network leaves the server no addresses"
    assert ipaddress.IPv4Address(runc["record"]["address"]) in layout.ours
    assert ipaddress.IPv4Address(engine["record"]["address"]) not in layout.ours
