"""The files an egress proxy is started with, written into the folder bound read-only into its container, and
the CA of a proxy that opens HTTPS to add secrets (network.secrets), with the bundle its sandboxes trust."""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import tempfile
from pathlib import Path

from sandbox_server.errors import Refusal
from sandbox_server.network.egress import Egress, squid_config
from sandbox_server.network.secrets import make_ca

__all__ = ["PROXY_UID", "SYSTEM_BUNDLE", "Trust", "write_proxy_files"]

log = logging.getLogger("sandbox_server")

PROXY_UID = 13
"""Debian's `proxy` user and group, which the proxy image runs Squid as (base-passwd gives it this id on every
Debian system)."""
SYSTEM_BUNDLE = Path("/etc/ssl/certs/ca-certificates.crt")
"""The system's CAs (Debian's ca-certificates, as in the sandbox images), which the sandboxes keep trusting."""


def files_folder(prefix: str, under: Path | None) -> str:
    """A new folder for one proxy's files (mode 0755: bound read-only into its container), in the server's own
    folder `under` when it can make that one (the system's temporary folder otherwise: not root)."""
    if under is not None:
        try:
            under.mkdir(mode=0o700, parents=True, exist_ok=True)
        except OSError:
            under = None
    folder = tempfile.mkdtemp(prefix=prefix, dir=under)
    os.chmod(folder, 0o755)
    return folder


class Trust:
    """The CA of one proxy that opens HTTPS, made once and kept while the server runs (across the proxy's
    restarts, so that warm containers made earlier still trust it), and the bundle its sandboxes trust: the
    system's CAs and this one."""

    def __init__(self, name: str, under: Path | None = None) -> None:
        self.certificate, self.key = make_ca(name)
        self.folder = files_folder("sandbox-proxy-trust-", under)
        system = SYSTEM_BUNDLE.read_bytes() if SYSTEM_BUNDLE.exists() else b""
        self.bundle = os.path.join(self.folder, "ca-bundle.pem")
        with open(self.bundle, "wb") as out:
            out.write(system.rstrip(b"\n") + b"\n" + self.certificate)
        os.chmod(self.bundle, 0o644)

    def remove(self) -> None:
        shutil.rmtree(self.folder, ignore_errors=True)


def write_proxy_files(folder: str, egress: Egress, policy_name: str, trust: Trust | None) -> None:
    """Squid's configuration, hosts file and refusal pages, with the secrets' values read now and, for a proxy
    that opens HTTPS, its CA and the upstream CAs it checks hosts against. A Refusal naming the field when a
    secret or the upstream CAs cannot be read. Files holding a secret or the CA's key are the proxy user's
    alone."""
    values = [secret.value(f"network.secrets[{index}]") for index, secret in enumerate(egress.secrets)]
    files: dict[str, bytes] = {name: text.encode() for name, text in squid_config(egress, policy_name, values).items()}
    private = {"squid.conf"} if values else set()
    if trust is not None:
        files["ca.pem"], files["ca.key"] = trust.certificate, trust.key
        private.add("ca.key")
    if egress.upstream_ca is not None:
        try:
            files["upstream-ca.pem"] = Path(egress.upstream_ca).read_bytes()
        except OSError as exc:
            raise Refusal(
                f"refused: network.upstream_ca: {egress.upstream_ca} cannot be read ({exc.strerror})",
                "network.upstream_ca",
            ) from None
    if private:
        os.chmod(folder, 0o711)  # its files are opened by name, never listed
    for name, content in files.items():
        path = os.path.join(folder, name)
        os.makedirs(os.path.dirname(path), mode=0o755, exist_ok=True)
        with open(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "wb") as handle:
            handle.write(content)
        if name not in private:
            os.chmod(path, 0o644)
            continue
        try:
            os.chown(path, PROXY_UID, PROXY_UID)
            os.chmod(path, 0o400)
        except PermissionError:  # not root: the file stays the server user's, readable by the proxy through it
            with contextlib.suppress(OSError):
                os.chmod(path, 0o644)
            log.warning("egress proxy: %s could not be given to the proxy's user alone (the server is not root)", name)
