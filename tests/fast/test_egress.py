"""The egress allow list and the proxy configuration made from it: pure logic, no engine."""

from __future__ import annotations

from pathlib import Path

import pytest

from sandbox_server.errors import ConfigError
from sandbox_server.network.asking import AskSettings
from sandbox_server.network.egress import (
    DEFAULT_PORTS,
    SPECIAL_NETWORKS,
    Destination,
    Egress,
    ProxyEndpoint,
    parse_egress,
    squid_config,
)
from sandbox_server.network.proxy_log import ProxyRequest, RequestRecords, parse_log_line
from sandbox_server.policy.loader import HostFacts, load_policy
from sandbox_server.sandbox.engine.host_config import host_config_kwargs
from sandbox_server.sandbox.spec import SandboxSpec

TOOLS = ("execute_command", "files", "run_python", "analyze_csv")


def _parse(network: object) -> tuple[Egress | None, list[str]]:
    errors: list[str] = []
    return parse_egress(network, "defaults.network", errors), errors


def test_entries_become_hosts_domains_and_ports() -> None:
    egress, errors = _parse({
        "allow": ["PyPI.org", "files.pythonhosted.org:443", "*.example.com", "*.internal.test:8080", "upstream"],
        "egress_network": "test-upstreams",
        "hosts": {"upstream": "172.30.0.5", "mirror.internal.test": "10.1.2.3"},
    })  # fmt: skip
    assert errors == []
    assert egress is not None
    assert egress.allow == (
        Destination("pypi.org", False, DEFAULT_PORTS),
        Destination("files.pythonhosted.org", False, (443,)),
        Destination("example.com", True, DEFAULT_PORTS),
        Destination("internal.test", True, (8080,)),
        Destination("upstream", False, DEFAULT_PORTS),
    )
    assert egress.egress_network == "test-upstreams"
    assert egress.hosts == (("mirror.internal.test", "10.1.2.3"), ("upstream", "172.30.0.5"))


BAD_ENTRIES = {
    "https://pypi.org/simple": "is a URL",
    "pypi.org/simple": "holds a path",
    "10.0.0.0/8": "holds a path or an address range",
    "*": "'*' may only begin an entry",
    "*.com": "opens a whole top-level domain",
    "pypi.*.org": "'*' may only begin an entry",
    "169.254.169.254": "is an IP address",
    "[::1]": "is an IP address",
    "pypi.org:0": "the port must be a number from 1 to 65535",
    "pypi.org:https": "the port must be a number from 1 to 65535",
    "bad_name.org": "is not a host name",
    "": "an entry is a host name",
}


@pytest.mark.parametrize("entry", list(BAD_ENTRIES))
def test_an_entry_that_is_not_a_host_or_pattern_is_an_error_naming_its_field(entry: str) -> None:
    egress, errors = _parse({"allow": ["pypi.org", entry]})
    assert egress is None
    assert len(errors) == 1 and errors[0].startswith("defaults.network.allow[1]: "), errors
    assert BAD_ENTRIES[entry] in errors[0], errors


def test_hosts_and_the_egress_network_are_checked() -> None:
    egress, errors = _parse({"allow": ["a.test"], "hosts": {"a.test": "not-an-ip"}, "egress_network": "bad name"})
    assert egress is None or errors
    assert any(e.startswith("defaults.network.hosts.a.test: 'not-an-ip' is not an IP address") for e in errors)
    assert any(e.startswith("defaults.network.egress_network: 'bad name'") for e in errors)
    assert _parse({"allow": []})[1] == ["defaults.network.allow: a non-empty list of host names and patterns"]
    assert _parse("bridge")[1] == ["defaults.network: either none or an object with allow, egress_network and hosts"]


def test_the_proxy_denies_unlisted_names_unresolved_then_special_addresses_before_any_allow_rule() -> None:
    egress, _ = _parse({"allow": ["pypi.org", "*.example.com:8443"]})
    assert egress is not None
    conf = squid_config(egress, "team")["squid.conf"].splitlines()
    rules = [line for line in conf if line.startswith("http_access")]
    assert "acl allowed dstdomain -n .example.com pypi.org" in conf
    assert rules == [
        "http_access deny !allowed",
        "http_access deny special",
        "http_access allow allow0 allow0_ports",
        "http_access allow allow1 allow1_ports",
        "http_access deny all",
    ]
    special = next(line for line in conf if line.startswith("acl special dst "))
    for network in ("127.0.0.0/8", "169.254.0.0/16", "10.0.0.0/8", "172.16.0.0/12", "192.168.0.0/16", "::1/128",
                    "fe80::/10", "fc00::/7"):  # fmt: skip
        assert network in special.split()
    assert set(special.split()[3:]) == set(SPECIAL_NETWORKS)
    assert "acl allow0 dstdomain -n pypi.org" in conf and "acl allow0_ports port 443 80" in conf
    assert "acl allow1 dstdomain -n .example.com" in conf and "acl allow1_ports port 8443" in conf


def test_names_the_policy_gives_may_reach_their_private_addresses_and_refusals_name_the_field() -> None:
    egress, _ = _parse({"allow": ["upstream", "pypi.org"], "hosts": {"upstream": "172.30.0.5"}})
    assert egress is not None
    files = squid_config(egress, "team")
    conf = files["squid.conf"].splitlines()
    assert conf.index("acl named dstdomain -n upstream") < conf.index("http_access deny !named special")
    assert files["hosts"] == "172.30.0.5 upstream\n"
    assert "policy 'team' (field network.allow)" in files["errors/ERR_SANDBOX_DENIED"]
    assert "(field network.hosts" in files["errors/ERR_SANDBOX_SPECIAL"]
    assert not any(line.startswith("dns_nameservers") for line in conf)  # pypi.org is resolved by DNS


def test_a_proxy_whose_allowed_names_are_all_pinned_asks_no_dns_server() -> None:
    egress, _ = _parse(
        {"allow": ["upstream", "mirror.test:8080"], "hosts": {"upstream": "172.30.0.5", "mirror.test": "172.30.0.6"}}
    )
    assert egress is not None
    assert "dns_nameservers 127.0.0.1" in squid_config(egress, "team")["squid.conf"].splitlines()
    wildcard, _ = _parse({"allow": ["*.mirror.test"], "hosts": {"a.mirror.test": "172.30.0.6"}})
    assert wildcard is not None
    assert "dns_nameservers 127.0.0.1" not in squid_config(wildcard, "team")["squid.conf"].splitlines()


def test_equal_allow_lists_share_a_proxy() -> None:
    first, _ = _parse({"allow": ["pypi.org", "*.example.com"]})
    again, _ = _parse({"allow": ["PYPI.org", "*.example.com"]})
    other, _ = _parse({"allow": ["pypi.org"]})
    assert first is not None and again is not None and other is not None
    assert first.key() == again.key() != other.key()


def test_a_proxy_log_line_becomes_a_request_and_other_lines_are_skipped() -> None:
    line = "1795324648.244 172.19.0.3 CONNECT secure.test 443 TCP_TUNNEL 200 4120 980"
    request = parse_log_line(line)
    assert request == ProxyRequest("172.19.0.3", "CONNECT", "secure.test", 443, "TCP_TUNNEL", 200, 4120, 980)
    assert request.allowed and request.record()["bytes_in"] == 4120
    denied = parse_log_line("1795324653.275 172.19.0.3 GET nope.test 80 TCP_DENIED 403 443 119")
    assert denied is not None and not denied.allowed
    assert parse_log_line("2026/11/22 05:17:18| storeLateRelease: released 0 objects") is None
    quiet = parse_log_line("1795324653.300 172.19.0.3 GET quiet.test 81 TCP_MISS 503 3900 90 ERR_CONNECT_FAIL")
    assert quiet is not None and quiet.allowed and quiet.record()["proxy_error"] == "ERR_CONNECT_FAIL"
    plain = parse_log_line("1795324653.301 172.19.0.3 GET web.test 80 TCP_MISS 200 300 90 -")
    assert plain is not None and plain.error is None and "proxy_error" not in plain.record()


def test_a_sandbox_on_a_proxied_network_asks_no_name_server_and_has_no_ipv6() -> None:
    spec = SandboxSpec(image="x", argv=("true",), network="sandbox-egress-abc")
    settings = host_config_kwargs(spec)
    assert settings["network_mode"] == "sandbox-egress-abc"
    assert settings["dns"] == ["127.0.0.1"]
    assert settings["sysctls"] == {"net.ipv6.conf.all.disable_ipv6": "1"}
    assert "dns" not in host_config_kwargs(SandboxSpec(image="x", argv=("true",)))
    endpoint = ProxyEndpoint("abc", "sandbox-egress-abc", "172.19.0.2")
    assert ("HTTPS_PROXY", "http://172.19.0.2:3128") in endpoint.environment()
    assert ("NO_PROXY", "localhost,127.0.0.1") in endpoint.environment()


def test_a_policy_file_opens_an_allow_list_and_errors_name_the_field(tmp_path: Path) -> None:
    good = tmp_path / "good.yaml"
    good.write_text("name: good\nextends: default\ntools:\n  execute_command:\n    network:\n      allow: [pypi.org]\n")
    policy = load_policy(str(good), TOOLS, HostFacts(frozenset({"runc", "runsc"})))
    egress = policy.for_tool("execute_command").egress
    assert egress is not None and egress.allow == (Destination("pypi.org", False, DEFAULT_PORTS),)
    assert policy.for_tool("run_python").egress is None
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: bad\nextends: strict\ndefaults:\n  network:\n    allow: ['https://pypi.org/simple']\n")
    with pytest.raises(ConfigError) as raised:
        load_policy(str(bad), TOOLS, HostFacts(frozenset({"runc", "runsc"})))
    text = str(raised.value)
    assert "defaults.network.allow[0]: 'https://pypi.org/simple' is a URL" in text, text
    assert "defaults.network: runsc is registered here with --network=none" in text, text


def test_each_sandboxs_requests_are_kept_apart_so_a_flood_pushes_out_none_of_anothers() -> None:
    records = RequestRecords(per_sandbox=100, sandboxes=3)
    honest = ProxyRequest("10.0.0.2", "GET", "web.test", 80, "TCP_MISS", 200, 10, 5)
    records.file(honest)
    for number in range(10_100):  # cheap denied requests of one sandbox
        records.file(ProxyRequest("10.0.0.3", "GET", f"x{number}.test", 80, "TCP_DENIED", 403, 0, 0))
    assert records.take("10.0.0.2") == ([honest], 0)
    flood, dropped = records.take("10.0.0.3")
    assert len(flood) == 100 and dropped == 10_000 and flood[-1].host == "x10099.test"
    # A sandbox's own flood of denied requests pushes out none of its allowed ones, which keep their place.
    records.file(ProxyRequest("10.0.0.3", "GET", "first.test", 80, "TCP_DENIED", 403, 0, 0))
    records.file(ProxyRequest("10.0.0.3", "GET", "web.test", 80, "TCP_MISS", 200, 10, 5))
    for number in range(500):
        records.file(ProxyRequest("10.0.0.3", "GET", f"y{number}.test", 80, "TCP_DENIED", 403, 0, 0))
    kept, dropped = records.take("10.0.0.3")
    assert [r.host for r in kept if r.allowed] == ["web.test"] and dropped == 401, dropped
    assert kept[0].host == "web.test" and kept[1].host == "y400.test" and len(kept) == 101
    assert records.take("10.0.0.3") == ([], 0)
    for address in ("10.0.0.4", "10.0.0.5", "10.0.0.6", "10.0.0.7"):  # never taken: the longest unfiled go
        records.file(ProxyRequest(address, "GET", "web.test", 80, "TCP_MISS", 200, 1, 1))
    assert records.take("10.0.0.4") == ([], 0) and len(records.take("10.0.0.7")[0]) == 1


def test_secrets_name_an_allowed_host_a_header_and_where_the_value_comes_from() -> None:
    egress, errors = _parse({
        "allow": ["api.test", "*.corp.test:8443"],
        "secrets": [
            {"host": "api.test", "header": "Authorization", "from": "env:API_TOKEN"},
            {"host": "db.corp.test", "header": "X-Key", "from": "file:/run/secrets/key"},
            {"host": "other.test", "header": "X-Key", "from": "env:A"},
            {"host": "api.test", "header": "Host", "from": "env:A"},
            {"host": "api.test", "header": "X-Key", "from": "A_VALUE_INLINE"},
            {"host": "api.test", "header": "X-Key"},
        ],
    })  # fmt: skip
    assert errors == [
        "defaults.network.secrets[2].host: 'other.test' is not a host network.allow opens",
        "defaults.network.secrets[3].header: 'Host' is not a header the proxy may set",
        "defaults.network.secrets[4].from: 'A_VALUE_INLINE': give env:NAME (the server's environment) or "
        "file:/absolute/path",
        "defaults.network.secrets[5]: an object with host, header and from (env:NAME or file:/path), nothing else",
    ]
    assert egress is not None and [s.host for s in egress.secrets] == ["api.test", "db.corp.test"]
    assert egress.key() != _parse({"allow": ["api.test", "*.corp.test:8443"]})[0].key()  # type: ignore[union-attr]


def test_a_proxy_with_secrets_adds_each_for_its_host_alone_and_opens_only_those_hosts_https() -> None:
    egress, _ = _parse({
        "allow": ["api.test", "plain.test"], "upstream_ca": "/etc/corp-ca.pem",
        "secrets": [{"host": "api.test", "header": "X-Key", "from": "env:K"}],
    })  # fmt: skip
    assert egress is not None
    conf = squid_config(egress, "team", ["s3cr%t"])["squid.conf"].splitlines()
    assert conf[1].startswith("http_port 3128 ssl-bump tls-cert=/etc/squid/sandbox/ca.pem")
    assert "request_header_access X-Key deny secret0" in conf
    assert 'request_header_add X-Key "s3cr%%t" secret0' in conf  # a % is not a format code
    assert "acl secret0 dstdomain -n api.test" in conf
    assert conf.index("ssl_bump peek step1") < conf.index("ssl_bump bump opened") < conf.index("ssl_bump splice all")
    assert "acl opened ssl::server_name api.test" in conf
    assert "tls_outgoing_options cafile=/etc/squid/sandbox/upstream-ca.pem" in conf
    plain = squid_config(_parse({"allow": ["plain.test"]})[0], "team")["squid.conf"]  # type: ignore[arg-type]
    assert "ssl_bump" not in plain and "request_header_add" not in plain and "http_port 3128\n" in plain
    endpoint = ProxyEndpoint("k", "net", "10.0.0.2", "/tmp/bundle.pem")
    assert ("SSL_CERT_FILE", "/etc/sandbox-proxy/ca.pem") in endpoint.environment()
    assert [m.sandbox_path for m in endpoint.mounts()] == ["/etc/sandbox-proxy/ca.pem"]


def test_a_proxy_that_asks_puts_unlisted_hosts_to_its_helper_before_the_special_check_and_keeps_no_answer() -> None:
    egress, errors = _parse({"allow": ["pypi.org"], "ask": {"remember": "caller", "questions": 2, "wait_s": 30}})
    assert egress is not None and not errors and egress.ask == AskSettings("caller", 2, 30.0)
    conf = squid_config(egress, "team")["squid.conf"].splitlines()
    helper = next(line for line in conf if line.startswith("external_acl_type sandbox_ask "))
    assert " cache=0 " in helper and " ttl=0 " in helper and "%>a %>rd %>rP" in helper  # addresses are reused
    assert [line for line in conf if line.startswith("http_access")] == [
        "http_access deny !allowed !asked",
        "http_access deny special",
        "http_access allow allow0 allow0_ports",
        "http_access allow !allowed",
        "http_access deny all",
    ]
    assert "deny_info ERR_SANDBOX_ASKED asked" in conf
    assert "network.ask" in squid_config(egress, "team")["errors/ERR_SANDBOX_ASKED"]
    assert _parse({"allow": ["pypi.org"], "ask": True})[0].ask == AskSettings()  # type: ignore[union-attr]
    assert _parse({"allow": ["pypi.org"]})[0].ask is None  # type: ignore[union-attr]
    assert egress.key() != _parse({"allow": ["pypi.org"]})[0].key()  # type: ignore[union-attr]


@pytest.mark.parametrize(
    ("ask", "field"),
    [("yes", "defaults.network.ask"), ({"remember": "host"}, "defaults.network.ask.remember"),
     ({"questions": 0}, "defaults.network.ask.questions"), ({"wait_s": 9999}, "defaults.network.ask.wait_s"),
     ({"often": 1}, "defaults.network.ask")],
)  # fmt: skip
def test_a_bad_ask_is_an_error_naming_its_field(ask: object, field: str) -> None:
    _, errors = _parse({"allow": ["pypi.org"], "ask": ask})
    assert len(errors) == 1 and errors[0].startswith(f"{field}:"), errors


def test_the_posture_probe_is_judged_by_what_the_sandbox_saw_and_what_reached_the_upstream() -> None:
    from sandbox_server.ops.egress_posture import UNLISTED, judge, read_probe

    held = read_probe("listed 200 page\nunlisted 403 refusal\ndirect closed\n")
    checks = judge(held, {"/posture-listed"}, "posture p/t", ("pypi.org", 443), "172.30.0.2")
    assert [check.ok for check in checks] == [True, True, True]
    assert checks[1].detail == f"{UNLISTED}:443 through the proxy: status 403, refusal; the upstream never saw it"
    # A proxy that let the unlisted host through, a listed host that never reached the upstream, a way around.
    leaky = read_probe("listed 200 page\nunlisted 200 page\ndirect open\n")
    checks = judge(leaky, {"/posture-unlisted"}, "posture p/t", ("pypi.org", 443), "172.30.0.2")
    assert [check.ok for check in checks] == [False, False, False]
    assert checks[1].detail.endswith("status 200, page; the upstream was reached")
    # A probe that said nothing (no bash, no proxy) fails every check rather than passing any.
    silent = read_probe("")
    assert [check.ok for check in judge(silent, set(), "p", ("h", 80), "a")] == [False, False, False]
    assert read_probe("listed no-proxy\n").listed == ("no-proxy", "none")
