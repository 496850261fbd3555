"""`doctor --posture` for a policy that opens a network: its proxy, its allow list and the firewall, tried for real.

Nothing here reaches the policy's real hosts. The check makes a network of its own with an
upstream of its own on it (a small HTTP server in the shell image) and starts the policy's
proxy, from the policy's own allow list, with that network as its way out and two names
pinned to the upstream's address: the allow list's first host, and a host the list does not
name. A sandbox started as a call of the tool would be (its image, user, limits, the proxy's
network and settings) then asks for each through the proxy, and tries the upstream directly.
The listed host must answer with the upstream's page, the unlisted one must be refused by
the proxy (and the upstream must never see it, although its name leads there), and the
direct connection must fail. Where the server keeps sandboxes apart, the host's firewall
must hold the two rules that let them reach their proxy and nothing else.

What it changes from the policy, said in the checks' details: the proxy's way out is the
check's network; secrets (network.secrets) are not added, so the listed host is reached
without opening its HTTPS; a host the list does not name is refused at once rather than put
to a person (network.ask).
"""

from __future__ import annotations

import contextlib
import subprocess
from collections.abc import AsyncIterator
from dataclasses import dataclass, replace

import anyio.to_thread

from sandbox_server.errors import Refusal
from sandbox_server.network.egress import PROXY_PORT, Egress, ProxyEndpoint
from sandbox_server.network.firewall import FIREWALL_COMMENT
from sandbox_server.network.proxies import EgressProxies
from sandbox_server.network.upstream import PAGE, make_network, paths_seen, remove_trial, start_upstream
from sandbox_server.ops.doctor import Check
from sandbox_server.policy import ToolPolicy
from sandbox_server.sandbox.engine.runtime import DockerRuntime
from sandbox_server.sandbox.spec import SandboxSpec

__all__ = ["UNLISTED", "EgressTrial", "Probe", "behind", "firewall_check", "judge", "probe", "read_probe", "trial"]

UNLISTED = "not-listed.posture.sandbox-server.invalid"
"""The host the check asks for that no allow list names (`.invalid` is never a real name)."""
PROBE = r"""
proxy=${HTTP_PROXY#http://}; proxy=${proxy%/}; WAIT=30
ask() {  # what the proxy answered for host $1 port $2 (path $3): its status, and whether the upstream's page came
    exec 3<>"/dev/tcp/${proxy%:*}/${proxy##*:}" || { echo "$4 no-proxy"; return; }
    if [ "$2" = 443 ]; then
        printf 'CONNECT %s:%s HTTP/1.1\r\nHost: %s:%s\r\nConnection: close\r\n\r\n' "$1" "$2" "$1" "$2" >&3
        read -r -t "$WAIT" _ code _ <&3
        if [ "$code" = 200 ]; then
            while read -r -t "$WAIT" line <&3 && [ -n "${line%$'\r'}" ]; do :; done
            printf 'GET %s HTTP/1.0\r\nHost: %s\r\n\r\n' "$3" "$1" >&3
            read -r -t "$WAIT" _ code _ <&3
        fi
    else
        printf 'GET http://%s:%s%s HTTP/1.0\r\nHost: %s\r\n\r\n' "$1" "$2" "$3" "$1" >&3
        read -r -t "$WAIT" _ code _ <&3
    fi
    body=$(timeout "$WAIT" cat <&3)
    exec 3<&-
    case "$body" in *"$5"*) page=page ;; *"network.allow"*) page=refusal ;; *) page=other ;; esac
    echo "$4 ${code:-none} $page"
}
ask "$1" "$2" /posture-listed listed "$5"
ask "$3" "$2" /posture-unlisted unlisted "$5"
if timeout 5 bash -c 'exec 4<>"/dev/tcp/$0/$1"' "$4" "$2" 2>/dev/null; then echo "direct open"; else echo "direct closed"; fi
"""
"""Run by bash in a sandbox of the tool (every image has bash): $1 the listed host, $2 its port, $3 the unlisted
host, $4 the upstream's address, $5 the upstream's page. Each answer is awaited 30 s (a busy host's first request
through a proxy just started can take seconds; a working one answers at once). The CONNECT asks the proxy to close
the connection after its answer: a refused one was kept open for a next request, and reading the refusal to its end
waited the whole 30 s. One line per attempt: `listed 200 page`, `unlisted 403 refusal`, `direct closed`."""


@dataclass(frozen=True, slots=True)
class Probe:
    """What the sandbox saw: each attempt's status and body, and whether the direct connection opened."""

    listed: tuple[str, str]
    unlisted: tuple[str, str]
    direct: str


def read_probe(stdout: str) -> Probe:
    """The probe's lines as a Probe (an attempt with no line reads as `none`)."""
    seen: dict[str, list[str]] = {}
    for line in stdout.splitlines():
        words = line.split()
        if words:
            seen[words[0]] = words[1:]

    def pair(name: str) -> tuple[str, str]:
        words = seen.get(name, []) + ["none", "none"]
        return words[0], words[1]

    return Probe(pair("listed"), pair("unlisted"), (seen.get("direct") or ["none"])[0])


@dataclass(slots=True)
class EgressTrial:
    """One allow list under trial: its proxy's endpoint (None when it did not start) and what was found."""

    label: str
    endpoint: ProxyEndpoint | None
    checks: list[Check]
    listed: tuple[str, int]
    upstream: str
    upstream_container: str


def _changes(egress: Egress) -> str:
    said = ["the proxy's way out is the check's own network"]
    if egress.secrets:
        said.append("network.secrets not added")
    if egress.ask is not None:
        said.append("network.ask not asked: an unlisted host is refused at once")
    return "; ".join(said)


@contextlib.asynccontextmanager
async def trial(runtime: DockerRuntime, label: str, egress: Egress, policy_name: str) -> AsyncIterator[EgressTrial]:
    """The policy's proxy started on a network of the check's own with its upstream; removed on leaving."""
    api = runtime.api
    first = egress.allow[0]
    listed = (first.host, first.ports[0])
    network = await anyio.to_thread.run_sync(make_network, api, runtime.owner)
    proxies = EgressProxies(lambda: api, f"{runtime.owner}-posture")
    prefix = f"posture {policy_name}/{label}"
    container = ""
    endpoint: ProxyEndpoint | None = None
    try:
        container, address = await anyio.to_thread.run_sync(start_upstream, api, network, listed[1], runtime.owner)
        pinned = {**dict(egress.hosts), listed[0]: address, UNLISTED: address}
        tried = replace(egress, egress_network=network, hosts=tuple(sorted(pinned.items())), secrets=(), ask=None)
        try:
            endpoint = await anyio.to_thread.run_sync(proxies.endpoint, tried, policy_name)
        except Refusal as refusal:
            checks = [Check(f"{prefix}: network proxy", False, refusal.message,
                            "see the proxy's reason; `sandbox-server doctor`")]  # fmt: skip
        else:
            apart = await anyio.to_thread.run_sync(proxies.sandboxes_apart)
            bridge = proxies.bridge_name(endpoint.key)
            checks = [
                Check(
                    f"{prefix}: network proxy", True, f"answers at {endpoint.address}:{PROXY_PORT} ({_changes(egress)})"
                ),
                await anyio.to_thread.run_sync(firewall_check, apart, bridge, endpoint.address, prefix),
            ]
        yield EgressTrial(label, endpoint, checks, listed, address, container)
    finally:
        networks = [network] if endpoint is None else [endpoint.network, network]
        await anyio.to_thread.run_sync(remove_trial, api, proxies, container, networks)


def behind(spec: SandboxSpec, endpoint: ProxyEndpoint) -> SandboxSpec:
    """A sandbox's spec on the proxy's network, with its settings and what it mounts, as a call's gets them."""
    return replace(
        spec, network=endpoint.network, call_env=endpoint.environment(), mounts=spec.mounts + endpoint.mounts()
    )


async def probe(runtime: DockerRuntime, tool: ToolPolicy, found: EgressTrial, policy_name: str) -> list[Check]:
    """A sandbox of the tool behind the proxy asks for the listed host, an unlisted one, and the upstream directly."""
    endpoint = found.endpoint
    assert endpoint is not None
    host, port = found.listed
    spec = behind(tool.container_spec(), endpoint)
    spec = replace(
        spec, argv=("bash", "-c", PROBE, "probe", host, str(port), UNLISTED, found.upstream, PAGE),
        limits=replace(spec.limits, timeout_s=240.0),
    )  # fmt: skip
    result = await runtime.run(spec)
    seen = await anyio.to_thread.run_sync(paths_seen, runtime.api, found.upstream_container)
    checks = judge(read_probe(result.stdout.decode(errors="replace")), seen, f"posture {policy_name}/{found.label}",
                   found.listed, found.upstream)  # fmt: skip
    if result.exit_code != 0 and not all(check.ok for check in checks):
        checks[-1] = replace(checks[-1], detail=checks[-1].detail + f" (the probe: exit code {result.exit_code}, "
                             f"{result.stderr.decode(errors='replace').strip()[-300:]})")  # fmt: skip
    return checks


def judge(got: Probe, seen: set[str], name: str, listed: tuple[str, int], upstream: str) -> list[Check]:
    """The probe's attempts and the paths the upstream was asked for, held against what the allow list says."""
    (host, port), reached = listed, "/posture-unlisted" in seen
    fix = "the proxy did not do what the policy says: check its image (`sandbox-server images build`) and the engine"
    return [
        Check(f"{name}: network.allow (a listed host)", got.listed == ("200", "page") and "/posture-listed" in seen,
              f"{host}:{port} through the proxy: status {got.listed[0]}, {got.listed[1]}", fix),
        Check(f"{name}: network.allow (an unlisted host)", got.unlisted == ("403", "refusal") and not reached,
              f"{UNLISTED}:{port} through the proxy: status {got.unlisted[0]}, {got.unlisted[1]}; "
              f"{'the upstream was reached' if reached else 'the upstream never saw it'}", fix),
        Check(f"{name}: network (no way around the proxy)", got.direct == "closed",
              f"a direct connection to the upstream {upstream}:{port}: {got.direct}", fix),
    ]  # fmt: skip


def firewall_check(proxies_apart: bool, bridge: str, address: str, prefix: str) -> Check:
    """Whether the host's firewall holds the rules that let the bridge's sandboxes reach their proxy alone."""
    name = f"{prefix}: network (sandboxes apart)"
    if not proxies_apart:
        return Check(name, False, "sandboxes sharing an allow list can reach each other's open ports: the host's "
                     "firewall cannot be managed here", "run the server as root on the engine's host, with iptables",
                     required=False)  # fmt: skip
    done = subprocess.run(["iptables", "-w", "-S", "DOCKER-USER"], capture_output=True, text=True, check=False)
    rules = [line for line in done.stdout.splitlines() if FIREWALL_COMMENT in line and f"-i {bridge} " in line]
    ok = len(rules) == 2 and all(address in rule for rule in rules)
    detail = (f"bridge {bridge}: the engine keeps its sandboxes from each other, and DOCKER-USER lets them reach "
              f"the proxy {address}:{PROXY_PORT} alone ({len(rules)} rules)")  # fmt: skip
    return Check(name, ok, detail, "the proxy's firewall rules are missing: check iptables and the DOCKER-USER chain")
