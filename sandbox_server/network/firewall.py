"""The host's firewall between a proxy and the sandboxes of its network: with the engine's inter-container traffic
off, two rules in the engine's DOCKER-USER chain let a bridge's sandboxes reach the proxy's port (and its answers
come back), and nothing else crosses that bridge. Each rule carries FIREWALL_COMMENT, so the rules of a server
killed before it could remove them are found and removed at the next start."""

from __future__ import annotations

import os
import shlex
import subprocess

from sandbox_server.network.egress import PROXY_PORT

__all__ = ["FIREWALL_COMMENT", "close_to_proxy", "firewall_managed", "open_to_proxy", "sweep_firewall"]

FIREWALL_COMMENT = "sandbox-server egress"
"""Marks the host firewall's rules that let sandboxes reach their proxy."""


def firewall_managed() -> bool:
    """Whether this process can manage the engine's DOCKER-USER chain (root, iptables, the chain there)."""
    return _iptables("-S", "DOCKER-USER")[0] is None


def open_to_proxy(bridge: str, address: str) -> None:
    """Let the sandboxes of a bridge reach the proxy at `address` (and its answers reach them); OSError when the
    firewall would not."""
    for rule in _rules(bridge, address):
        problem, _ = _iptables("-I", "DOCKER-USER", *rule)
        if problem is not None:
            raise OSError(f"the host's firewall would not let sandboxes reach the proxy: {problem}")


def close_to_proxy(bridge: str, address: str) -> None:
    """Remove the rules `open_to_proxy` made (those missing are no matter)."""
    for rule in _rules(bridge, address):
        _iptables("-D", "DOCKER-USER", *rule)


def sweep_firewall() -> None:
    """Remove the proxy rules of bridges that are gone (a server killed before it could); as root only, never
    raises."""
    if os.geteuid() != 0:
        return
    problem, listed = _iptables("-S", "DOCKER-USER")
    for line in listed.splitlines() if problem is None else ():
        if FIREWALL_COMMENT not in line or not line.startswith("-A DOCKER-USER "):
            continue
        words = shlex.split(line)  # the comment is quoted
        bridge = words[words.index("-i") + 1] if "-i" in words else ""
        if bridge and not os.path.exists(f"/sys/class/net/{bridge}"):
            _iptables("-D", *words[1:])


def _rules(bridge: str, address: str) -> list[list[str]]:
    """The firewall rules between a proxy and the sandboxes of its bridge: to its port, and its answers back."""
    across = ["-i", bridge, "-o", bridge, "-p", "tcp"]
    mark = ["-m", "comment", "--comment", FIREWALL_COMMENT, "-j", "ACCEPT"]
    return [
        [*across, "-d", f"{address}/32", "--dport", str(PROXY_PORT), *mark],
        [*across, "-s", f"{address}/32", "--sport", str(PROXY_PORT), "-m", "conntrack", "--ctstate", "ESTABLISHED",
         *mark],
    ]  # fmt: skip


def _iptables(*arguments: str) -> tuple[str | None, str]:
    """Run iptables (waiting for its lock): what went wrong (None when nothing did), and what it printed."""
    try:
        done = subprocess.run(["iptables", "-w", *arguments], capture_output=True, text=True, check=False, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return str(exc), ""
    problem = None if done.returncode == 0 else (done.stderr.strip() or f"exit code {done.returncode}")
    return problem, done.stdout
