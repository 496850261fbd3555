"""The network a policy may open: its allow list and static names, checked, and the filtering
proxy's configuration made from them.

A sandbox with an allow list joins an `internal` Docker network whose only way out is a
Squid proxy: plain HTTP to an allowed host and port, HTTPS through CONNECT to an allowed
host and port (never intercepted, but for the hosts a policy adds secrets for: network.secrets),
nothing else. The proxy refuses loopback, link-local,
private and other special addresses even when an allowed name resolves to them, unless the
policy's `hosts` names them itself.
"""

from __future__ import annotations

import hashlib
import ipaddress
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from sandbox_server.network.asking import HELPER, HELPER_NAME, AskSettings, ask_lines, parse_ask
from sandbox_server.network.secrets import CA_PATH, Secret, parse_secrets, secret_lines
from sandbox_server.sandbox.spec import Mount

__all__ = [
    "CONNECTIONS_PER_SANDBOX",
    "DEFAULT_PORTS",
    "MARKER_DOMAIN",
    "PROXY_FILES",
    "PROXY_PORT",
    "SPECIAL_NETWORKS",
    "Destination",
    "Egress",
    "ProxyEndpoint",
    "parse_egress",
    "squid_config",
]

DEFAULT_PORTS = (443, 80)
"""The ports an entry without one opens: HTTPS and HTTP."""
SPECIAL_NETWORKS = (
    "0.0.0.0/8", "10.0.0.0/8", "100.64.0.0/10", "127.0.0.0/8", "169.254.0.0/16", "172.16.0.0/12",
    "192.0.0.0/24", "192.0.2.0/24", "192.168.0.0/16", "198.18.0.0/15", "198.51.100.0/24", "203.0.113.0/24",
    "224.0.0.0/4", "240.0.0.0/4", "::/128", "::1/128", "::ffff:0:0/96", "64:ff9b::/96", "fc00::/7", "fe80::/10",
    "ff00::/8",
)  # fmt: skip
"""Destinations the proxy never connects to unless the policy's `hosts` names them: this host, cloud
metadata (link-local), private networks and the other addresses that are not the internet."""
LABEL = re.compile(r"^(?!-)[a-z0-9-]{1,63}(?<!-)$")
PROXY_PORT = 3128
CONFIG_DIR = "/etc/squid/sandbox"
"""Where the proxy's container has the folder of its configuration, bound read-only."""
MARKER_DOMAIN = "marker.sandbox-server.invalid"
"""Requests the server itself sends the proxy, to know its log has caught up; never a sandbox's."""


@dataclass(frozen=True, slots=True)
class Destination:
    """One allow-list entry: a host (or, with `subdomains`, every name under a domain) and its ports."""

    host: str
    subdomains: bool
    ports: tuple[int, ...]

    def squid_domain(self) -> str:
        return f".{self.host}" if self.subdomains else self.host


@dataclass(frozen=True, slots=True)
class Egress:
    """A policy's network when it is not `none`."""

    allow: tuple[Destination, ...]
    egress_network: str = "bridge"
    hosts: tuple[tuple[str, str], ...] = ()
    """Static name -> address entries the proxy resolves before DNS (private mirrors, tests)."""
    secrets: tuple[Secret, ...] = ()
    """Headers the proxy adds for one host each (network.secrets; their values are read at the proxy's start)."""
    upstream_ca: str | None = None
    """CA certificates (PEM, a path on the server's host) the proxy trusts for the HTTPS hosts it opens."""
    ask: AskSettings | None = None
    """A host the allow list does not name is put to a person (network.ask); None: refused at once."""

    def admits(self, host: str, port: int) -> bool:
        """Whether the allow list opens host:port, as the proxy's `dstdomain` and port rules match it (a
        `subdomains` entry: the domain and every name under it)."""
        host = host.lower().rstrip(".")
        for destination in self.allow:
            named = host == destination.host or (destination.subdomains and host.endswith("." + destination.host))
            if named and port in destination.ports:
                return True
        return False

    def key(self) -> str:
        """What proxies are shared by: equal allow lists, egress networks, hosts, secrets and asking share one."""
        text = repr((self.allow, self.egress_network, self.hosts, self.secrets, self.upstream_ca, self.ask))
        return hashlib.sha256(text.encode()).hexdigest()[:12]


def _host_problem(name: str) -> str | None:
    """Why `name` is not a host name (None when it is one)."""
    if "://" in name:
        return "is a URL; give the host name alone (e.g. pypi.org)"
    if "/" in name:
        return "holds a path or an address range; give a host name"
    try:
        ipaddress.ip_address(name.strip("[]"))
    except ValueError:
        pass
    else:
        return "is an IP address; allow a host name (name a private address in network.hosts)"
    labels = name.split(".")
    if not all(LABEL.match(label) for label in labels) or labels[-1].isdigit():
        return "is not a host name (letters, digits and '-' in dot-separated labels)"
    return None


def _destination(entry: object, field: str, errors: list[str]) -> Destination | None:
    if not isinstance(entry, str) or not entry.strip():
        errors.append(f"{field}: an entry is a host name, host:port, *.domain or *.domain:port, not {entry!r}")
        return None
    text = entry.strip().lower()
    ports: tuple[int, ...] = DEFAULT_PORTS
    host = text
    if text.count(":") == 1 and "://" not in text:
        host, _, port_text = text.partition(":")
        if not port_text.isdigit() or not 1 <= int(port_text) <= 65535:
            errors.append(f"{field}: {entry!r}: the port must be a number from 1 to 65535")
            return None
        ports = (int(port_text),)
    subdomains = host.startswith("*.")
    if subdomains:
        host = host[2:]
        if "." not in host:
            errors.append(f"{field}: {entry!r} opens a whole top-level domain; name a domain under it")
            return None
    if "*" in host:
        errors.append(f"{field}: {entry!r}: '*' may only begin an entry, as *.domain")
        return None
    problem = _host_problem(host)
    if problem:
        errors.append(f"{field}: {entry!r} {problem}")
        return None
    return Destination(host, subdomains, ports)


def parse_egress(network: object, field: str, errors: list[str]) -> Egress | None:
    """The policy's `network` object as an Egress (None, with errors appended naming the field, when it is
    not valid). `none` is not handled here."""
    if not isinstance(network, Mapping):
        errors.append(f"{field}: either none or an object with allow, egress_network and hosts")
        return None
    allow: list[Destination] = []
    entries = network.get("allow", [])
    if not isinstance(entries, Sequence) or isinstance(entries, str) or not entries:
        errors.append(f"{field}.allow: a non-empty list of host names and patterns")
        return None
    for index, entry in enumerate(entries):
        destination = _destination(entry, f"{field}.allow[{index}]", errors)
        if destination is not None:
            allow.append(destination)
    hosts: list[tuple[str, str]] = []
    for name, address in dict(network.get("hosts", {})).items():
        where = f"{field}.hosts.{name}"
        problem = _host_problem(str(name).lower())
        if problem:
            errors.append(f"{where}: {name!r} {problem}")
            continue
        try:
            hosts.append((str(name).lower(), str(ipaddress.ip_address(str(address)))))
        except ValueError:
            errors.append(f"{where}: {address!r} is not an IP address")
    egress_network = str(network.get("egress_network", "bridge"))
    if not re.match(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$", egress_network):
        errors.append(f"{field}.egress_network: {egress_network!r} is not a Docker network name")
    secrets = parse_secrets(network.get("secrets"), f"{field}.secrets", [(d.host, d.subdomains) for d in allow], errors)
    upstream_ca = network.get("upstream_ca")
    if upstream_ca is not None and not (isinstance(upstream_ca, str) and upstream_ca.startswith("/")):
        errors.append(f"{field}.upstream_ca: {upstream_ca!r}: an absolute path to CA certificates (PEM)")
    ask = parse_ask(network.get("ask"), f"{field}.ask", errors)
    if len(allow) != len(entries):
        return None
    return Egress(tuple(allow), egress_network, tuple(sorted(hosts)), secrets, upstream_ca, ask)


def squid_config(egress: Egress, policy_name: str, secret_values: Sequence[str] = ()) -> dict[str, str]:
    """The proxy's files: squid.conf, its hosts file, the refusal pages and (asking) its helper (name -> text).

    Rules, first match wins: a host the allow list does not name is denied by its name alone
    (nothing is resolved for it); a special destination (by the addresses an allowed name
    resolves to) is denied unless the policy's `hosts` names the host; an allowed host on one
    of its ports is let through (CONNECT for HTTPS, never decrypted); everything else is
    denied. Each refusal is an HTTP 403 whose text names the policy and the field to change.
    Every request is logged on stdout, one line each, for the calls' audit records. When
    every allowed name is pinned in `hosts`, the proxy asks no DNS server at all (a host
    approved live is then reached only if `hosts` names it too). With secrets, their headers
    are added for their hosts, whose HTTPS the proxy then opens (network.secrets;
    `secret_values` in their order). With `ask`, a host the list does not name is put to the
    server's helper before it is refused (network.ask).
    """
    opens = bool(egress.secrets)
    pinned = {name for name, _ in egress.hosts}
    lines = [
        f"# sandbox-server egress proxy for policy {policy_name!r}; generated, do not edit",
        f"http_port {PROXY_PORT}" + (OPENING if opens else ""),
        "visible_hostname sandbox-proxy",
        "pid_filename none",
        "cache deny all",
        "cache_mem 8 MB",
        "coredump_dir /tmp",
        "pinger_enable off",
        "shutdown_lifetime 1 seconds",
        # One sandbox cannot take the proxy from the others: a cap on its connections (counted by Squid's
        # client table), and connections that send no request, or idle between requests, are closed.
        "client_db on",
        f"client_ip_max_connections {CONNECTIONS_PER_SANDBOX}",
        f"max_filedescriptors {PROXY_FILES}",
        "request_start_timeout 30 seconds",
        "client_idle_pconn_timeout 30 seconds",
        "forwarded_for delete",
        "via off",
        "httpd_suppress_version_string on",
        f"hosts_file {CONFIG_DIR}/hosts",
        f"error_directory {CONFIG_DIR}/errors",
        "logformat sandbox %ts.%03tu %>a %rm %>rd %>rP %Ss %>Hs %<st %>st %err_code",
        "access_log stdio:/dev/stdout logformat=sandbox",
        "cache_log stdio:/dev/stderr",
    ]
    if all(not destination.subdomains and destination.host in pinned for destination in egress.allow):
        lines.append("dns_nameservers 127.0.0.1")
    asking, put = ask_lines(CONFIG_DIR) if egress.ask is not None else ([], ["http_access deny !allowed"])
    domains = sorted({destination.squid_domain() for destination in egress.allow})
    lines += [
        *asking,
        "acl allowed dstdomain -n " + " ".join(domains),
        *put,
        "acl special dst " + " ".join(SPECIAL_NETWORKS),
    ]
    if pinned:
        lines.append("acl named dstdomain -n " + " ".join(sorted(pinned)))
        lines.append("http_access deny !named special")
    else:
        lines.append("http_access deny special")
    for index, destination in enumerate(egress.allow):
        lines.append(f"acl allow{index} dstdomain -n {destination.squid_domain()}")
        lines.append(f"acl allow{index}_ports port {' '.join(map(str, destination.ports))}")
        lines.append(f"http_access allow allow{index} allow{index}_ports")
    if egress.ask is not None:  # past `deny !allowed !asked`, a host not on the list was approved when asked
        lines.append("http_access allow !allowed")
    lines += secret_lines(egress.secrets, secret_values, opens, egress.upstream_ca is not None)
    lines += [
        "http_access deny all",
        "deny_info ERR_SANDBOX_DENIED allowed",
        "deny_info ERR_SANDBOX_SPECIAL special",
        "deny_info ERR_SANDBOX_DENIED all",
        *(["deny_info ERR_SANDBOX_ASKED asked"] if egress.ask is not None else []),
    ]
    denied = (
        f"sandbox-server: %H:%p is not allowed by policy '{policy_name}' (field network.allow); "
        "ask for a host the policy allows, or add it to network.allow\n"
    )
    special = (
        f"sandbox-server: %H resolves to a private, loopback or link-local address, which policy "
        f"'{policy_name}' does not allow (field network.hosts names the ones it may reach)\n"
    )
    asked = (
        f"sandbox-server: %H:%p is not allowed by policy '{policy_name}' (field network.allow), and was not approved "
        "when asked (field network.ask): %o\n"
    )
    hosts = "".join(f"{address} {name}\n" for name, address in egress.hosts)
    return {
        "squid.conf": "\n".join(lines) + "\n",
        "hosts": hosts,
        "errors/ERR_SANDBOX_DENIED": denied,
        "errors/ERR_SANDBOX_SPECIAL": special,
        "errors/ERR_SANDBOX_ASKED": asked,
        **({HELPER_NAME: HELPER} if egress.ask is not None else {}),
    }


OPENING = (
    " ssl-bump tls-cert=/etc/squid/sandbox/ca.pem tls-key=/etc/squid/sandbox/ca.key generate-host-certificates=on"
    " dynamic_cert_mem_cache_size=4MB"
)
"""The proxy's port, when it opens the HTTPS of the hosts it adds secrets for: with the CA it signs their
certificates with."""
CONNECTIONS_PER_SANDBOX = 64
"""Connections one sandbox may hold to its proxy at once; Squid drops more as they come."""
PROXY_FILES = 16384
"""Descriptors the proxy may hold (its container's limit too)."""


@dataclass(frozen=True, slots=True)
class ProxyEndpoint:
    """Where a call's sandbox goes: the internal network, and the proxy's address on it."""

    key: str
    network: str
    address: str
    ca_bundle: str | None = None
    """A proxy that opens HTTPS (network.secrets): the host's file of the CAs its sandboxes trust."""

    def environment(self, direct: tuple[str, ...] = ()) -> tuple[tuple[str, str], ...]:
        """The sandbox's proxy settings: every HTTP client that reads them goes through the proxy, but to the
        `direct` names (its workspace's services, on a network of their own); and the CAs to trust, when the
        proxy opens HTTPS."""
        url = f"http://{self.address}:{PROXY_PORT}"
        names = ("HTTP_PROXY", "HTTPS_PROXY", "http_proxy", "https_proxy")
        bypass = ",".join(("localhost", "127.0.0.1", *direct))
        trust = CA_VARIABLES if self.ca_bundle is not None else ()
        return (
            *((name, url) for name in names),
            ("NO_PROXY", bypass),
            ("no_proxy", bypass),
            *((name, CA_PATH) for name in trust),
        )

    def mounts(self) -> tuple[Mount, ...]:
        """What a sandbox behind this proxy has mounted: the CAs it trusts, when the proxy opens HTTPS."""
        return () if self.ca_bundle is None else (Mount(self.ca_bundle, CA_PATH),)


CA_VARIABLES = (
    "SSL_CERT_FILE",
    "REQUESTS_CA_BUNDLE",
    "CURL_CA_BUNDLE",
    "PIP_CERT",
    "NODE_EXTRA_CA_CERTS",
    "GIT_SSL_CAINFO",
)
"""What OpenSSL, Python's requests, curl, pip, Node.js and git read the CAs to trust from."""
