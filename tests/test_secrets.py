"""Secrets the sandbox never sees (network.secrets): the proxy adds a header to one host's requests, over plain
HTTP and over HTTPS it opens with its own CA, and to no other host's; the sandbox finds the value nowhere, and
neither do its results nor the audit trail. The upstreams are the test's own containers (tests/upstreams),
which log the headers each request reached them with."""

from __future__ import annotations

import json
import os
import secrets
import subprocess
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import docker
import pytest
from mcp import Client

from sandbox_server.sandbox.engine.removal import OWNER_LABEL
from tests.mcp_harness import answer, connect, stdio_parameters
from tests.upstreams import Upstreams, upstreams_fixture  # noqa: F401 (the upstreams fixture)

pytestmark = pytest.mark.anyio

API_KEY = "sk-test-" + secrets.token_hex(12)
BEARER = "Bearer tok-" + secrets.token_hex(12)


@pytest.fixture(scope="module")
async def secretive(
    upstreams: Upstreams,
    tmp_path_factory: pytest.TempPathFactory,
) -> AsyncIterator[tuple[Client, Path]]:
    folder = tmp_path_factory.mktemp("secrets")
    token, audit, policy = folder / "token", folder / "audit.jsonl", folder / "secrets.yaml"
    token.write_text(BEARER + "\n")
    token.chmod(0o600)
    network = {
        "allow": ["web.test:80", "elsewhere.test:80", "secure.test:443"],
        "egress_network": upstreams.network,
        "hosts": {"web.test": upstreams.web, "elsewhere.test": upstreams.web, "secure.test": upstreams.secure},
        "secrets": [
            {"host": "web.test", "header": "X-Api-Key", "from": "env:TEST_UPSTREAM_KEY"},
            {"host": "secure.test", "header": "Authorization", "from": f"file:{token}"},
        ],
        "upstream_ca": str(upstreams.certificate_path),  # the proxy checks secure.test's own certificate
    }
    policy.write_text(json.dumps({"name": "secretive", "extends": "default", "audit": {"path": str(audit)},
                                  "tools": {"execute_command": {"network": network}}}))  # fmt: skip
    parameters = stdio_parameters("--policy", str(policy), env={"TEST_UPSTREAM_KEY": API_KEY})
    async with connect(parameters) as client:
        yield client, audit


async def run(client: Client, command: str) -> dict[str, Any]:
    return await answer(client, "execute_command", {"command": command})


def _requests(their: Upstreams, name: str, path: str) -> list[dict[str, list[str]]]:
    return [headers for seen_path, headers in their.seen(name) if seen_path == path]


async def test_the_proxy_adds_a_hosts_secret_over_http_and_https_and_to_no_other_host(
    secretive: tuple[Client, Path],
    upstreams: Upstreams,
) -> None:
    client, _ = secretive
    tag = secrets.token_hex(4)
    answer = await run(
        client,
        f"curl -sS -m 10 http://web.test/{tag}-a && curl -sS -m 10 http://elsewhere.test/{tag}-b && "
        f"curl -sS -m 10 -H 'X-Api-Key: forged' http://web.test/{tag}-c && "
        f"curl -sS -m 10 https://secure.test/{tag}-d && "
        f"python3 -c \"import urllib.request as u; print(u.urlopen('https://secure.test/{tag}-e').read().decode())\"",
    )
    assert not answer["is_error"], answer["text"]
    assert answer["stdout"].count("hello from") == 5, answer["text"]
    assert _requests(upstreams, "web", f"/{tag}-a")[0]["x-api-key"] == [API_KEY]
    assert _requests(upstreams, "web", f"/{tag}-c")[0]["x-api-key"] == [API_KEY]  # the sandbox's own was dropped
    elsewhere = _requests(upstreams, "web", f"/{tag}-b")[0]
    assert "x-api-key" not in elsewhere and "authorization" not in elsewhere, elsewhere  # another host: nothing
    for path in (f"/{tag}-d", f"/{tag}-e"):  # HTTPS, opened by the proxy with its own CA, which the sandbox trusts
        assert _requests(upstreams, "secure", path)[0]["authorization"] == [BEARER]
    assert [r["status"] for r in answer["network"]["requests"]].count(200) >= 5


async def test_the_sandbox_finds_the_secret_nowhere_and_neither_do_results_or_the_audit(
    secretive: tuple[Client, Path],
) -> None:
    client, audit = secretive
    looked = await run(
        client,
        "env; cat /proc/*/environ 2>/dev/null | tr '\\0' '\\n'; cat /etc/sandbox-proxy/ca.pem; "
        "grep -rs sk-test / --exclude-dir=proc --exclude-dir=sys 2>/dev/null | head -5; "
        'proxy="${HTTP_PROXY#http://}"; '
        'curl -sS -m 10 "http://${proxy}/squid-internal-mgr/config"; '
        'curl -sS -m 10 --proxy "$HTTP_PROXY" http://sandbox-proxy:3128/squid-internal-mgr/config',
    )
    shown = json.dumps(looked)
    for value in (API_KEY, BEARER, BEARER.removeprefix("Bearer ")):
        assert value not in shown, looked["text"]
        assert value not in audit.read_text()
    assert "BEGIN CERTIFICATE" in looked["stdout"]  # the CA's certificate is the sandbox's to see; its key is not
    assert "PRIVATE KEY" not in looked["stdout"]
    # The proxy's cache manager, which could dump its configuration, is refused like any host not on the list.
    assert looked["stdout"].count("is not allowed by policy 'secretive' (field network.allow)") == 2, looked["text"]


async def test_a_secret_the_server_cannot_read_refuses_the_call_naming_the_field(
    upstreams: Upstreams,
    tmp_path: Path,
) -> None:
    policy = tmp_path / "missing.yaml"
    network = {
        "allow": ["web.test:80"], "egress_network": upstreams.network, "hosts": {"web.test": upstreams.web},
        "secrets": [{"host": "web.test", "header": "X-Api-Key", "from": "env:TEST_NOT_SET_ANYWHERE"}],
    }  # fmt: skip
    policy.write_text(json.dumps({"name": "missing", "extends": "default",
                                  "tools": {"execute_command": {"network": network}}}))  # fmt: skip
    async with connect(stdio_parameters("--policy", str(policy))) as client:
        refused = await run(client, "curl -sS http://web.test/")
    assert refused["is_error"] and refused["error"]["kind"] == "network_unavailable", refused["text"]
    assert "network.secrets[0].from" in refused["text"] and "TEST_NOT_SET_ANYWHERE" in refused["text"]


async def test_a_killed_servers_proxy_files_holding_the_secret_are_never_in_tmp_and_go_with_it(
    upstreams: Upstreams, tmp_path: Path
) -> None:
    """A killed server's proxy folders stayed under /tmp for hours, each with the proxy's CA key and a squid.conf
    holding the injected secret in clear: they live on the runc state (memory-backed, root's) and the reaper
    removes them once the server is gone."""
    import signal

    import anyio

    from sandbox_server.sandbox.runc.state import STATE, folders_left
    from tests.mcp_harness import http_server_process

    policy = tmp_path / "secrets.yaml"
    network = {
        "allow": ["web.test:80"], "egress_network": upstreams.network, "hosts": {"web.test": upstreams.web},
        "secrets": [{"host": "web.test", "header": "X-Api-Key", "from": "env:TEST_UPSTREAM_KEY"}],
    }  # fmt: skip
    policy.write_text(json.dumps({"extends": "default", "tools": {"execute_command": {"network": network}}}))
    with http_server_process("--policy", str(policy), env={"TEST_UPSTREAM_KEY": API_KEY}) as server:
        async with connect(server.url) as client:
            said = await run(client, "curl -sS -m 10 http://web.test/headers")
            assert not said["is_error"], said["text"]
        pid = server.process.pid
        [folder] = [
            path for owner, path in folders_left(STATE) if f":{pid}:" in owner and path.parent.name == "proxies"
        ]
        holding = [path for path in folder.rglob("*") if path.is_file() and API_KEY.encode() in path.read_bytes()]
        assert holding, "the proxy's configuration is there while it runs"
        in_tmp = [p for p in Path("/tmp").glob("sandbox-proxy-*") if p.is_dir()]
        assert not any(API_KEY.encode() in f.read_bytes() for p in in_tmp for f in p.rglob("*") if f.is_file())
        api = docker.from_env().api
        networks = [n for n in api.networks() if f":{pid}:" in (n.get("Labels") or {}).get(OWNER_LABEL, "")]
        ours = {str((n.get("Options") or {}).get("com.docker.network.bridge.name")) for n in networks} - {"None"}
        assert ours and ours <= _egress_bridges(), "the firewall lets the sandboxes reach their proxy while it runs"
        server.process.send_signal(signal.SIGKILL)
        with anyio.fail_after(30):  # the reaper, a process of its own, removes what the server left
            while folder.exists() or any(os.path.exists(f"/sys/class/net/{bridge}") for bridge in ours):
                await anyio.sleep(0.1)
            while ours & _egress_bridges():  # and the rules of its bridges, gone with them
                await anyio.sleep(0.1)
        api.close()


def _egress_bridges() -> set[str]:
    """The bridges the firewall lets sandboxes reach a proxy on (of any server's)."""
    from sandbox_server.network.firewall import FIREWALL_COMMENT

    listed = subprocess.run(["iptables", "-w", "-S", "DOCKER-USER"], capture_output=True, text=True, check=True)
    return {line.split(" -i ")[1].split()[0] for line in listed.stdout.splitlines() if FIREWALL_COMMENT in line}
