"""Secrets the sandbox never sees: a header the egress proxy adds to the requests for one host.

A policy names them by host (`network.secrets: [{host, header, from}]`), the value coming from the server's
environment (`env:NAME`) or a file (`file:/path`), read when the proxy starts; the sandbox's requests carry no
such header of their own to that host (the proxy drops it first) and those to any other host never get it.
Plain HTTP has the header added as it passes. HTTPS to such a host is opened by the proxy (Squid's TLS
interception, `ssl_bump`), with a certificate for the host made from a CA the server makes for that proxy alone;
the policy's sandboxes trust that CA (and nothing else new), and the proxy checks the real host's certificate
against the system's CAs, or the policy's own for a private API (`network.upstream_ca`). Every other HTTPS host
stays a CONNECT tunnel the proxy never opens.

The value lives in the proxy's configuration, a file only the proxy's user can read, bound read-only into the
proxy's container; it is never in the sandbox's environment or files, the audit record, the logs or a result.
"""

from __future__ import annotations

import datetime
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from sandbox_server.errors import Refusal

__all__ = ["CA_PATH", "CERTIFICATES", "Secret", "make_ca", "parse_secrets", "secret_lines"]

HEADER = re.compile(r"^[A-Za-z0-9][A-Za-z0-9-]{0,63}$")
SOURCE = re.compile(r"^(env:[A-Za-z_][A-Za-z0-9_]{0,127}|file:/.+)$")
RESERVED = {"host", "content-length", "transfer-encoding", "connection", "proxy-authorization", "upgrade"}
CA_PATH = "/etc/sandbox-proxy/ca.pem"
"""Where a sandbox behind a proxy that opens HTTPS finds its CA (with the system's, in one bundle)."""
MAX_VALUE = 8192
CERTIFICATES = "/usr/lib/squid/security_file_certgen -s /tmp/ssl_db -M 4MB"
"""Squid's helper that makes and keeps the host certificates a proxy signs, with its store on the proxy's tmpfs."""


@dataclass(frozen=True, slots=True)
class Secret:
    """One header the proxy adds to every request for one host."""

    host: str
    header: str
    source: str
    """env:NAME or file:/path: where the server reads the value (the policy never holds it)."""

    def value(self, field: str) -> str:
        """The value, read now; a Refusal naming the field when it cannot be read or cannot be a header."""
        kind, _, where = self.source.partition(":")
        try:
            text = os.environ[where] if kind == "env" else Path(where).read_text(encoding="utf-8").strip()
        except KeyError:
            raise Refusal(f"refused: {field}.from: the server's environment has no {where}", field) from None
        except OSError as exc:
            raise Refusal(f"refused: {field}.from: {where} cannot be read ({exc.strerror})", field) from None
        if not text or len(text) > MAX_VALUE or not text.isprintable() or '"' in text:
            raise Refusal(
                f"refused: {field}.from: the value is empty, longer than {MAX_VALUE}, or holds a quote or a control "
                "character, and cannot be a header's",
                field,
            )
        return text


def parse_secrets(
    entries: object, field: str, allowed: Sequence[tuple[str, bool]], errors: list[str]
) -> tuple[Secret, ...]:
    """`network.secrets` as Secrets, each for a host the allow list opens (`allowed`: host, and whether every
    name under it); errors appended naming the field."""
    if entries is None:
        return ()
    if not isinstance(entries, Sequence) or isinstance(entries, str):
        errors.append(f"{field}: a list of {{host, header, from}}")
        return ()
    found = []
    for index, entry in enumerate(entries):
        where = f"{field}[{index}]"
        if not isinstance(entry, Mapping) or set(entry) != {"host", "header", "from"}:
            errors.append(f"{where}: an object with host, header and from (env:NAME or file:/path), nothing else")
            continue
        host, header, source = (str(entry[key]).strip() for key in ("host", "header", "from"))
        host = host.lower()
        if not any(host == name or (under and host.endswith("." + name)) for name, under in allowed):
            errors.append(f"{where}.host: {host!r} is not a host network.allow opens")
        elif not HEADER.match(header) or header.lower() in RESERVED:
            errors.append(f"{where}.header: {header!r} is not a header the proxy may set")
        elif not SOURCE.match(source):
            errors.append(f"{where}.from: {source!r}: give env:NAME (the server's environment) or file:/absolute/path")
        else:
            found.append(Secret(host, header, source))
    return tuple(found)


def _quoted(value: str) -> str:
    """A value as Squid's request_header_add reads it: in quotes, its % signs not taken for format codes."""
    return '"' + value.replace("%", "%%") + '"'


def secret_lines(secrets: Sequence[Secret], values: Sequence[str], bump: bool, upstream_ca: bool) -> list[str]:
    """Squid's lines that add each secret to its host's requests (and, with `bump`, open HTTPS to those hosts)."""
    lines = []
    for index, (secret, value) in enumerate(zip(secrets, values, strict=True)):
        lines.append(f"acl secret{index} dstdomain -n {secret.host}")
        lines.append(f"request_header_access {secret.header} deny secret{index}")  # the sandbox's own is dropped
        lines.append(f"request_header_add {secret.header} {_quoted(value)} secret{index}")
    if bump:
        hosts = " ".join(sorted({secret.host for secret in secrets}))
        lines += [
            f"sslcrtd_program {CERTIFICATES}",
            "sslcrtd_children 3 startup=1 idle=1",
            f"acl opened ssl::server_name {hosts}",
            "acl step1 at_step SslBump1",
            "ssl_bump peek step1",
            "ssl_bump bump opened",
            "ssl_bump splice all",
            "sslproxy_cert_error deny all",
        ]
        if upstream_ca:
            lines.append("tls_outgoing_options cafile=/etc/squid/sandbox/upstream-ca.pem")
    return lines


def make_ca(name: str) -> tuple[bytes, bytes]:
    """A CA of its own for one proxy (its certificate and key, PEM): good for a year, for nothing but signing the
    certificates the proxy makes for the hosts it opens."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, f"sandbox-server egress proxy {name}")])
    now = datetime.datetime.now(datetime.UTC)
    certificate = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=365))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                key_cert_sign=True,
                crl_sign=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )  # fmt: skip
        .sign(key, hashes.SHA256())
    )
    pem_key = key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    return certificate.public_bytes(serialization.Encoding.PEM), pem_key
