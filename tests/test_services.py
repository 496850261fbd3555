"""Services: programs a call starts that outlive it, through the real server, client and engine.

A policy with short caps proves what the shipped ones do with long ones (a start timeout of 3 s, a lifetime of a
few seconds). Reachability is proven from inside sandboxes: the session's own calls reach its services by name;
another session's and another caller's calls reach them neither by name nor by address.
"""

from __future__ import annotations

import difflib
import ipaddress
import json
import os
import re
import subprocess
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import anyio
import docker
import httpx2
import numpy
import pytest
from mcp.client.streamable_http import streamable_http_client
from mcp.shared.exceptions import MCPError
from PIL import Image
from websockets.exceptions import InvalidStatus
from websockets.sync.client import connect

from sandbox_server.sandbox.engine.removal import OWNER_LABEL
from sandbox_server.sandbox.engine.runtime import DockerRuntime
from sandbox_server.sandbox.engine.services import SERVICE_LABEL
from sandbox_server.sandbox.runc.state import STATE, is_runc
from sandbox_server.sandbox.runc.veth import layout_of
from sandbox_server.sandbox.spec import SANDBOX_LABEL
from tests.conftest import assert_engine_routes_and_mac, run_cli, runc_sandboxes_on
from tests.mcp_harness import (
    CheckedClient,
    answer,
    audit_records,
    free_port,
    http_server_process,
    stdio_parameters,
    text_of,
)
from tests.mcp_harness import connect as mcp_connect

pytestmark = pytest.mark.anyio

SHORT = """name: short-services
extends: default
services:
  tools: [execute_command, run_python]
  per_session: 3
  per_caller: 3
  running: 4
  memory_mb: 96
  start_timeout_s: 3
  idle_s: %(idle)d
  max_lifetime_s: %(lifetime)d
  log_kb: 64
"""
API_CODE = (
    "import http.server as h, json\n"
    "class A(h.BaseHTTPRequestHandler):\n"
    "    def do_GET(self):\n"
    "        body = json.dumps({'api': self.path}).encode()\n"
    "        self.send_response(200); self.end_headers(); self.wfile.write(body)\n"
    "h.HTTPServer(('', 9000), A).serve_forever()"
)
API = f'exec python3 -c "{API_CODE}"'
READY_AFTER = (
    "import http.server as h, time\n"
    "ready = time.monotonic() + %g\n"
    "class A(h.BaseHTTPRequestHandler):\n"
    "    def do_GET(self):\n"
    "        code = 200 if time.monotonic() > ready else 503\n"
    "        self.send_response(code); self.end_headers(); self.wfile.write(str(code).encode())\n"
    "h.HTTPServer(('', 8000), A).serve_forever()"
)
NODE = "exec node -e \"require('http').createServer((q, r) => r.end(JSON.stringify({node: q.url}))).listen(3000)\""


def short_policy(tmp_path: Path, lifetime: int = 600, idle: int = 600) -> Path:
    policy = tmp_path / f"short-{lifetime}-{idle}.yaml"
    policy.write_text(SHORT % {"lifetime": lifetime, "idle": idle})
    return policy


def add_token(tokens: Path, name: str, policy: Path) -> str:
    done = run_cli("token", "add", name, "--policy", str(policy), "--tokens", str(tokens))
    assert done.returncode == 0, done.stderr
    return done.stdout.splitlines()[-1]


@asynccontextmanager
async def as_caller(url: str, token: str | None = None, end: bool = True) -> AsyncIterator[CheckedClient]:
    """A handshake-era session (its own workspace) of the caller holding `token`; ended on leaving unless not `end`."""
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    async with httpx2.AsyncClient(headers=headers, timeout=httpx2.Timeout(30, read=120)) as http:
        async with mcp_connect(streamable_http_client(url, http_client=http, terminate_on_close=end)) as client:
            yield client


async def call(client: CheckedClient, **arguments: Any) -> dict[str, Any]:
    return await answer(client, "execute_command", arguments)


async def start_web(session: CheckedClient) -> dict[str, Any]:
    """`python3 -m http.server 8000` started as the service `web`, which must start."""
    started = await call(session, command="exec python3 -m http.server 8000", service={"name": "web", "port": 8000})
    assert not started["is_error"], started["text"]
    return started


def services_of(pid: int) -> list[dict[str, Any]]:
    """The service containers the server process `pid` made."""
    api = docker.from_env().api
    try:
        found = api.containers(all=True, filters={"label": SERVICE_LABEL})
    finally:
        api.close()
    return [c for c in found if f":{pid}:" in (c.get("Labels") or {}).get(OWNER_LABEL, "")]


def service_networks() -> set[str]:
    api = docker.from_env().api
    try:
        return {n["Name"] for n in api.networks(filters={"label": SERVICE_LABEL})}
    finally:
        api.close()


async def until_gone(pid: int, within_s: float = 30) -> None:
    """Wait until the server `pid` has no service container left (the engine has no event for a label's last)."""
    deadline = time.monotonic() + within_s
    while services_of(pid):
        assert time.monotonic() < deadline, services_of(pid)
        await anyio.sleep(0.1)


async def until_networks_gone(before: set[str], within_s: float = 30) -> None:
    """Wait until no services' network is left beyond `before`: a network goes after its containers (its removal
    tried again while something still leaves it)."""
    deadline = time.monotonic() + within_s
    while service_networks() - before:
        assert time.monotonic() < deadline, service_networks() - before
        await anyio.sleep(0.1)


async def test_a_sessions_services_are_reached_by_name_from_it_and_from_nowhere_else(
    tmp_path: Path, runtime: DockerRuntime
) -> None:
    tokens, policy = tmp_path / "tokens.json", short_policy(tmp_path)
    alice, bob = add_token(tokens, "alice", policy), add_token(tokens, "bob", policy)
    serve = ("--policy", str(policy), "--tokens", str(tokens), "--no-pool", "--state-dir", str(tmp_path / "s"))
    networks_before = service_networks()
    with http_server_process(*serve, "--audit-log", str(tmp_path / "audit.jsonl")) as server:
        async with as_caller(server.url, alice) as session:
            page = "echo '<h1>hello from web</h1>' > index.html && exec python3 -m http.server 8000"
            web = await call(session, command=page, service={"name": "web", "port": 8000})
            assert not web["is_error"], web["text"]
            assert web["service"]["url"] == "http://web:8000/" and web["service"]["state"] == "running"
            assert "the workspace's next calls reach it at http://web:8000/" in web["text"]
            # run_python serves too (an app in the python-data image: Dash, Streamlit, a small API).
            api = await session.call_tool("run_python", {"code": API_CODE, "service": {"name": "api", "port": 9000}})
            assert api.structured_content is not None and not api.is_error, text_of(api)
            node = await call(session, command=NODE, service={"name": "node", "port": 3000})
            assert not node["is_error"], node["text"]
            seen = await call(
                session,
                command="curl -s http://web:8000/index.html; curl -s http://api:9000/hi; echo; "
                "curl -s http://node:3000/there; echo; getent hosts web",
            )
            lines = seen["stdout"].splitlines()
            assert lines[0] == "<h1>hello from web</h1>" and json.loads(lines[1]) == {"api": "/hi"}, seen["stdout"]
            assert json.loads(lines[2]) == {"node": "/there"}, seen["stdout"]
            address = lines[3].split()[0]
            assert {s["name"] for s in seen["services"]} == {"web", "api", "node"}
            assert len(services_of(server.process.pid)) == 3
            for container in services_of(server.process.pid):  # hardened as every call, and nothing published
                host = docker.from_env().api.inspect_container(container["Id"])["HostConfig"]
                assert host["ReadonlyRootfs"] and host["CapDrop"] == ["ALL"] and not host["PortBindings"], host
                assert host["Sysctls"] == {"net.ipv6.conf.all.disable_ipv6": "1"} and host["Dns"] == ["127.0.0.1"]
                assert host["Memory"] == 96 * 2**20 and host["PidsLimit"] == 128
            # Another session of the same caller, and another caller: neither the name nor the address answers.
            probe = f"curl -sS --max-time 3 http://web:8000/; curl -sS --max-time 3 http://{address}:8000/; true"
            for token in (alice, bob):
                async with as_caller(server.url, token) as other:
                    tried = await call(other, command=probe)
                    assert "hello" not in tried["stdout"] and "services" not in tried, tried
                    assert "Could not resolve host: web" in tried["stderr"], tried["stderr"]
                    assert tried["stderr"].count("curl: (") == 2, tried["stderr"]
            # Each service is a resource of its caller's, with the end of its log; no one else's.
            listed = (await session.list_resources()).resources
            uri = f"sandbox://services/{web['service']['id']}"
            assert {str(r.uri) for r in listed if str(r.uri).startswith("sandbox://services/")} == {
                f"sandbox://services/{s['id']}" for s in seen["services"]
            }
            read = await session.read_resource(uri)
            described = json.loads(read.contents[0].text)  # type: ignore[union-attr]
            assert described["name"] == "web" and "GET /index.html" in described["log_tail"], described
            async with as_caller(server.url, bob) as other:
                with pytest.raises(MCPError):
                    await other.read_resource(uri)
                assert not [r for r in (await other.list_resources()).resources if "services" in str(r.uri)]
            taken = await call(session, command="sleep 60", service={"name": "web", "port": 8001})
            assert taken["is_error"] and "already runs a service named 'web'" in taken["text"], taken["text"]
            capped = await call(session, command="sleep 60", service={"name": "third", "port": 8002})
            assert capped["is_error"] and "(field services.per_session: 3)" in capped["text"], capped["text"]
        # The session ended (the client closed it): its services and their network are gone.
        await until_gone(server.process.pid)
        await until_networks_gone(networks_before)
    audit = audit_records(tmp_path / "audit.jsonl")
    events = [(r["event"], r["name"], r.get("reason")) for r in audit if str(r.get("event", "")).startswith("service")]
    assert sorted(events) == [
        ("service_started", "api", None),
        ("service_started", "node", None),
        ("service_started", "web", None),
        ("service_stopped", "api", "its session ended"),
        ("service_stopped", "node", "its session ended"),
        ("service_stopped", "web", "its session ended"),
    ], events
    assert all(r["client"] == "alice" for r in audit if "service" in r)


async def test_services_that_never_listen_listen_elsewhere_exit_or_hog_memory_are_refused_saying_why(
    tmp_path: Path, runtime: DockerRuntime
) -> None:
    serve = ("--policy", str(short_policy(tmp_path)), "--no-pool", "--state-dir", str(tmp_path / "s"))
    with http_server_process(*serve) as server:
        async with as_caller(server.url) as session:
            timeout = "services.start_timeout_s"
            cases = [
                ("echo waiting; sleep 60", "did not listen on port 8000 within 3 s (field services.start_timeout_s)", timeout),
                ("exec python3 -m http.server 8001", "it listens on 8001, not on port 8000 it was started for "
                 "(field service.port): start it on port 8000, or ask for port 8001", "service.port"),
                ("echo bye; exit 3", "it exited with code 3 before listening on port 8000", timeout),
                ("exec python3 -c 'b = bytearray(400 << 20)'", "out of memory (field services.memory_mb: 96)", "services.memory_mb"),
            ]  # fmt: skip
            for command, said, field in cases:
                refused = await call(session, command=command, service={"name": "web", "port": 8000})
                assert refused["is_error"] and said in refused["text"], refused["text"]
                assert refused["error"]["field"] == field
                if command.startswith("echo"):  # its last output is in the answer
                    assert command.split(";")[0].removeprefix("echo ") in refused["text"], refused["text"]
            assert services_of(server.process.pid) == []
            # With ready_path the answer waits for the path to answer below 500, not only for the port.
            slow = 'exec python3 -c "' + READY_AFTER % 1.5 + '"'
            ready = await call(session, command=slow, service={"name": "slow", "port": 8000, "ready_path": "/health"})
            assert not ready["is_error"], ready["text"]
            assert (await call(session, command="curl -s http://slow:8000/health"))["stdout"] == "200"
            never = 'exec python3 -c "' + READY_AFTER % 600 + '"'
            refused = await call(session, command=never, service={"name": "never", "port": 8000, "ready_path": "/h"})
            said = "it listens on port 8000, but GET /h answered 503 within 3 s (field services.start_timeout_s)"
            assert refused["is_error"] and said in refused["text"], refused["text"]
            await session.call_tool("services", {"action": "stop", "name": "slow"})
            # One that forks away and floods its log: it runs, the engine keeps its log bounded, and it stops
            # with its container, children and all.
            flood = "(yes flood-line-of-the-service > /dev/stderr &) ; exec python3 -m http.server 8000"
            started = await call(session, command=flood, service={"name": "web", "port": 8000})
            assert not started["is_error"], started["text"]
            (container,) = services_of(server.process.pid)
            log_path = Path(docker.from_env().api.inspect_container(container["Id"])["LogPath"])

            def log_size() -> int:  # the engine replaces the file when it reaches its cap: absent for a moment
                try:
                    return log_path.stat().st_size
                except FileNotFoundError:
                    return 0

            seen, deadline = [log_size()], time.monotonic() + 10
            while max(seen) < 60 * 1024:  # until the log has filled up to its cap at least once
                assert time.monotonic() < deadline, seen[-5:]
                await anyio.sleep(0.05)
                seen.append(log_size())
            seen += [log_size() for _ in range(20)]
            assert max(seen) <= 64 * 1024 + 4096, max(seen)  # and never past it
        await until_gone(server.process.pid)


async def test_a_service_stops_at_its_maximum_lifetime_and_the_strict_policy_starts_none(
    tmp_path: Path, runtime: DockerRuntime
) -> None:
    audit_log = tmp_path / "audit.jsonl"
    serve = ("--policy", str(short_policy(tmp_path, lifetime=3)), "--no-pool", "--state-dir", str(tmp_path / "s"))
    with http_server_process(*serve, "--audit-log", str(audit_log)) as server:
        async with as_caller(server.url) as session:
            await start_web(session)
            await until_gone(server.process.pid, within_s=15)
            after = await call(session, command="curl -sS --max-time 3 http://web:8000/; true")
            assert "services" not in after and "Could not resolve host: web" in after["stderr"], after
    serve = ("--policy", str(short_policy(tmp_path, idle=2)), "--no-pool", "--state-dir", str(tmp_path / "s"))
    with http_server_process(*serve, "--audit-log", str(audit_log)) as server:
        async with as_caller(server.url) as session:
            await start_web(session)
            await until_gone(server.process.pid, within_s=15)  # nothing called it, nothing ran in its workspace
    stopped = [json.loads(line) for line in audit_log.read_text().splitlines() if "service_stopped" in line]
    assert [r["reason"] for r in stopped] == [
        "it reached its maximum lifetime (services.max_lifetime_s: 3 s)",
        "it was idle (services.idle_s: 2 s)",
    ], stopped
    serve = ("--policy", "strict", "--no-pool", "--state-dir", str(tmp_path / "s2"))
    with http_server_process(*serve) as server:
        async with as_caller(server.url) as session:
            refused = await call(session, command="true", args=[], service={"name": "web", "port": 8000})
            assert refused["is_error"] and refused["error"]["field"] == "services.tools", refused["text"]
            assert "may not start services under policy 'strict' (field services.tools: none)" in refused["text"]


PAGE = (
    "<html><body style='margin:0;background:#ffffff'><h1 style='font:bold 48px sans-serif;margin:20px'>"
    "Preview works</h1><div style='width:400px;height:200px;background:rgb(255,0,0)'></div></body></html>"
)


def screenshot(url: str, where: Path) -> Path:
    """Debian's Chromium, headless, opens `url` as a person's browser would and saves what it shows."""
    shot = where / "preview.png"
    done = subprocess.run(
        ["chromium", "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars", "--window-size=800,600",
         f"--user-data-dir={where / 'profile'}", f"--screenshot={shot}", url],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0 and shot.is_file(), done.stderr
    return shot


async def test_the_preview_opens_a_service_for_its_caller_alone_in_a_real_browser_and_carries_websockets(
    tmp_path: Path, runtime: DockerRuntime
) -> None:
    tokens, policy = tmp_path / "tokens.json", short_policy(tmp_path)
    alice, bob = add_token(tokens, "alice", policy), add_token(tokens, "bob", policy)
    serve = ("--policy", str(policy), "--tokens", str(tokens), "--no-pool", "--state-dir", str(tmp_path / "s"))
    echo = (Path(__file__).parent / "services" / "ws_echo.py").read_text()
    with http_server_process(*serve, "--audit-log", str(tmp_path / "audit.jsonl")) as server:
        async with as_caller(server.url, alice) as session:
            await call(session, command="true", files=[{"path": "index.html", "content": PAGE}])
            answer = await session.call_tool(
                "execute_command",
                {"command": "exec python3 -m http.server 8000", "service": {"name": "web", "port": 8000}},
            )
            assert answer.structured_content is not None and not answer.is_error, text_of(answer)
            link = answer.structured_content["service"]["preview"]
            assert [b.uri for b in answer.content if b.type == "resource_link"] == [link]
            prefix = link.split("?", 1)[0]
            other_id = prefix.replace(answer.structured_content["service"]["id"], "svc-AAAAAAAAAAAAAAAA")
            async with httpx2.AsyncClient(timeout=30) as http:
                as_alice, as_bob = {"Authorization": f"Bearer {alice}"}, {"Authorization": f"Bearer {bob}"}
                assert (await http.get(prefix)).status_code == 401
                assert (await http.get(prefix, headers=as_bob)).status_code == 404
                assert (await http.get(other_id, headers=as_alice)).status_code == 404
                # What follows the prefix goes to the service as its path, and nowhere else: its own 404 page.
                for escape in ("..%2F..%2Fmcp", "%2e%2e/%2e%2e/mcp", "http://127.0.0.1:1/", "/example.invalid/"):
                    tried = await http.get(prefix + escape, headers=as_alice)
                    assert tried.status_code == 404 and "Error response" in tried.text, (escape, tried.text)
                page = await http.get(prefix + "index.html", headers=as_alice)
                assert page.status_code == 200 and "Preview works" in page.text
            # A person's browser, with the link: the page as it is drawn.
            shot = Image.open(screenshot(link, tmp_path)).convert("RGB")
            pixels = numpy.asarray(shot)

            def at(x: int, y: int) -> tuple[int, int, int]:
                red, green, blue = (int(v) for v in pixels[y, x])
                return red, green, blue

            red = sum(1 for x in range(0, 400, 10) for y in range(120, 300, 10) if at(x, y) == (255, 0, 0))
            dark = sum(1 for x in range(20, 400, 2) for y in range(25, 75, 2) if sum(at(x, y)) < 200)
            assert red > 200 and dark > 100, (red, dark)  # the red box, and the heading's letters above it
            async with httpx2.AsyncClient(timeout=30) as later:  # the link was used: another browser cannot
                assert (await later.get(link)).status_code == 401
            # A WebSocket through the preview, as a dev server's hot reload uses one.
            await call(session, command="true", files=[{"path": "ws_echo.py", "content": echo}])
            started = await call(session, command="exec python3 ws_echo.py", service={"name": "ws", "port": 8765})
            assert not started["is_error"], started["text"]
            socket_url = started["service"]["preview"].split("?", 1)[0].replace("http://", "ws://")

            def talk(token: str) -> str:
                with connect(socket_url, additional_headers={"Authorization": f"Bearer {token}"}) as ws:
                    ws.send("hello through the preview")
                    return str(ws.recv(timeout=10))

            assert await anyio.to_thread.run_sync(talk, alice) == "echo: hello through the preview"
            with pytest.raises(InvalidStatus):
                await anyio.to_thread.run_sync(talk, bob)
    audit = audit_records(tmp_path / "audit.jsonl")
    previewed = {(r["name"], r["by"], r["by_means_of"]) for r in audit if r.get("event") == "service_previewed"}
    assert previewed == {("web", "alice", "token"), ("ws", "alice", "token")}, previewed


async def test_the_services_tool_lists_reads_the_log_of_restarts_and_stops_a_workspaces_services(
    tmp_path: Path, runtime: DockerRuntime
) -> None:
    serve = ("--policy", str(short_policy(tmp_path)), "--no-pool", "--state-dir", str(tmp_path / "s"))
    with http_server_process(*serve) as server:
        async with as_caller(server.url) as session:

            async def services(**arguments: Any) -> dict[str, Any]:
                return await answer(session, "services", arguments)

            assert (await services(action="list"))["services"] == []
            await start_web(session)
            await call(session, command=API, service={"name": "api", "port": 9000})
            listed = await services(action="list")
            assert [(s["name"], s["state"], s["port"]) for s in listed["services"]] == [
                ("web", "running", 8000),
                ("api", "running", 9000),
            ]
            await call(session, command="curl -s -o /dev/null http://web:8000/asked-for-by-the-test")
            log = await services(action="log", name="web")
            assert '"GET /asked-for-by-the-test HTTP/1.1" 404' in log["log"], log["log"]
            first = {c["Id"] for c in services_of(server.process.pid)}
            restarted = await services(action="restart", name="api")
            assert not restarted["is_error"] and "listens on port 9000 again" in restarted["text"], restarted["text"]
            assert [s.get("restarts", 0) for s in restarted["services"]] == [0, 1]
            assert len(first - {c["Id"] for c in services_of(server.process.pid)}) == 1  # a new container
            answered = await call(session, command="curl -s http://api:9000/again")
            assert json.loads(answered["stdout"]) == {"api": "/again"}
            stopped = await services(action="stop", name="web")
            assert [s["name"] for s in stopped["services"]] == ["api"]
            gone = await call(session, command="curl -sS --max-time 3 http://web:8000/; true")
            # The name is no more: not in the server's hosts file of runc's sandboxes, and the engine's name server,
            # asked for it, finds no one (it has no way out: "Resolving timed out").
            assert gone["stdout"] == "" and "resol" in gone["stderr"].lower(), gone["stderr"]
            unknown = await services(action="log", name="web")
            assert (
                unknown["is_error"]
                and "no service named 'web' runs in this workspace (running: api)" in unknown["text"]
            )
        await until_gone(server.process.pid)


async def test_a_killed_servers_services_and_their_network_are_removed_by_its_reaper(
    tmp_path: Path, runtime: DockerRuntime
) -> None:
    serve = ("--policy", str(short_policy(tmp_path)), "--no-pool", "--state-dir", str(tmp_path / "s"))
    networks_before = service_networks()
    with http_server_process(*serve) as server:
        async with as_caller(server.url) as session:
            await start_web(session)
            assert len(services_of(server.process.pid)) == 1 and service_networks() - networks_before
            beside = await call(session, command="getent hosts web")  # a sandbox beside it, which runc makes
            assert not beside["is_error"] and beside["stdout"].endswith(" web\n"), beside
            names = list((STATE / "hosts").glob(f"{server.process.pid}-*"))  # its services' names, for runc's
            assert names or os.environ.get("SANDBOX_SANDBOXES") == "engine", "no hosts file for runc's sandboxes"
            server.process.kill()  # no goodbye: what it started is the reaper's to remove
            server.process.wait(timeout=30)
            await until_gone(server.process.pid)
    await until_networks_gone(networks_before)  # the reaper removes the network after the containers
    assert not [folder for folder in names if folder.exists()], names  # and the names, before them
    with http_server_process(*serve) as again:  # the next server on the same state lets go of what was left mounted
        async with as_caller(again.url) as session:
            assert not (await call(session, command="true"))["is_error"]
    assert str(tmp_path) not in Path("/proc/self/mounts").read_text()


async def test_over_stdio_the_server_opens_previews_on_a_loopback_port_by_link_alone(
    tmp_path: Path, runtime: DockerRuntime
) -> None:
    port = free_port()
    serve = ("--policy", str(short_policy(tmp_path)), "--no-pool", "--state-dir", str(tmp_path / "s"))
    async with mcp_connect(stdio_parameters(*serve, "--preview-port", str(port))) as session:
        await call(session, command="true", files=[{"path": "index.html", "content": PAGE}])
        started = await start_web(session)
        link = started["service"]["preview"]
        assert link.startswith(f"http://127.0.0.1:{port}/preview/svc-"), link
        async with httpx2.AsyncClient(timeout=30, follow_redirects=True) as browser:
            assert (await browser.get(link.split("?", 1)[0])).status_code == 401  # no token comes over stdio
            page = await browser.get(link)
            assert page.status_code == 200 and "Preview works" in page.text
        async with httpx2.AsyncClient(timeout=30) as other:
            again = await other.get(link)
            assert again.status_code == 401 and '{"action": "list"}' in again.text, again.text  # it says how
        listed = await session.call_tool("services", {"action": "list"})
        fresh = (listed.structured_content or {})["services"][0]["preview"]
        said = text_of(listed).split("for a person to open (once, in one browser): ", 1)[1].split()[0]
        assert fresh != link and said != link, (fresh, said, link)
        async with httpx2.AsyncClient(timeout=30, follow_redirects=True) as browser:
            assert "Preview works" in (await browser.get(fresh)).text
        async with httpx2.AsyncClient(timeout=30, follow_redirects=True) as browser:
            assert "Preview works" in (await browser.get(said)).text


async def test_calls_beside_a_service_take_warm_containers_waiting_on_its_network(
    tmp_path: Path, runtime: DockerRuntime
) -> None:
    audit = tmp_path / "audit.jsonl"
    with http_server_process("--policy", str(short_policy(tmp_path)), "--audit-log", str(audit)) as server:
        server.wait_for_line("warm pool ready")
        async with as_caller(server.url) as session:
            await start_web(session)
            [service] = services_of(server.process.pid)
            [network] = service["NetworkSettings"]["Networks"]
            api = docker.from_env().api

            def waiting_on_it() -> set[str]:  # the server's warm containers on the services' network, either path's
                found = api.containers(filters={"label": SANDBOX_LABEL, "network": network})
                made = {c["Id"][:12] for c in found if SERVICE_LABEL not in (c.get("Labels") or {})}
                return made | {name[:12] for name in runc_sandboxes_on(network, True)}

            deadline = time.monotonic() + 30
            while len(waiting_on_it()) < 2:  # execute_command's and the python tools' (no event says "warm")
                assert time.monotonic() < deadline, waiting_on_it()
                await anyio.sleep(0.1)
            warm = waiting_on_it()
            # A service started after they were made is found by its name all the same, as is the first.
            assert not (await call(session, command=API, service={"name": "api", "port": 9000}))["is_error"]
            reached = await call(
                session, command="curl -s -o /dev/null -w '%{http_code} ' http://web:8000/; curl -s http://api:9000/hi"
            )
            assert reached["stdout"] == '200 {"api": "/hi"}', reached
            used = audit_records(audit)[-1]["container_id"]
            assert used in warm, (used, warm)  # the call took one of them
            await session.call_tool("services", {"action": "stop", "name": "api"})
            gone = await call(
                session, command="getent hosts web >/dev/null && echo web; getent hosts api || echo no api"
            )
            assert gone["stdout"] == "web\nno api\n", gone  # a stopped service's name is not found any more
            await session.call_tool("services", {"action": "stop", "name": "web"})
            deadline = time.monotonic() + 30
            while waiting_on_it() or api.networks(names=[network]):  # they go with the network
                assert time.monotonic() < deadline, waiting_on_it()
                await anyio.sleep(0.1)


NEIGHBOUR_PROBE = r"""
echo "links=$(ls /sys/class/net | tr '\n' ' ') mtu=$(cat /sys/class/net/eth0/mtu)"
echo "ipv6=$(cat /proc/sys/net/ipv6/conf/all/disable_ipv6 /proc/sys/net/ipv6/conf/eth0/disable_ipv6 | tr '\n' ' ')"
echo "ipv6 addresses=$(wc -l < /proc/net/if_inet6)"
awk 'NR > 1 {print "route", $1, $2, $3, $8}' /proc/net/route
echo "mac $(cat /sys/class/net/eth0/address)"
curl -sS -m 10 http://web:8000/hello.txt
python3 -c "import socket; s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); s.connect(('web', 8000)); print('me', s.getsockname()[0])"
getent hosts nowhere.test || echo "nowhere.test: not found"
getent hosts localhost
"""


async def test_runc_makes_the_sandboxes_beside_services_as_the_engine_does_at_an_address_of_the_servers_half(
    tmp_path: Path,
) -> None:
    said: dict[str, dict[str, Any]] = {}
    for path in ("engine", "runc"):
        audit = tmp_path / f"{path}.jsonl"
        serve = ("--policy", str(short_policy(tmp_path)), "--sandboxes", path, "--audit-log", str(audit))
        with http_server_process(*serve, "--state-dir", str(tmp_path / path)) as server:
            async with as_caller(server.url) as session:
                page = "echo hello from web > hello.txt && exec python3 -m http.server 8000"
                assert not (await call(session, command=page, service={"name": "web", "port": 8000}))["is_error"]
                probe = await call(
                    session, command="sh probe.sh", files=[{"path": "probe.sh", "content": NEIGHBOUR_PROBE}]
                )
                record = audit_records(audit)[-1]
                [service] = services_of(server.process.pid)
                [network] = service["NetworkSettings"]["Networks"]
                api = docker.from_env().api
                try:
                    layout = layout_of(api.inspect_network(network))
                finally:
                    api.close()
        said[path] = probe | {"record": record, "layout": layout}
    engine, runc = said["engine"], said["runc"]
    assert not engine["is_error"] and not runc["is_error"], (engine["text"], runc["text"])
    assert is_runc(runc["record"]["container_id"]) and not is_runc(engine["record"]["container_id"])

    def apart(stdout: str) -> list[str]:  # each server's network has its own addresses
        return [line for line in stdout.splitlines() if not line.startswith(("route ", "mac ", "me "))]

    differ = list(difflib.unified_diff(apart(engine["stdout"]), apart(runc["stdout"]), lineterm=""))
    assert not differ, "\n".join(differ)
    assert "links=eth0 lo " in runc["stdout"] and "hello from web\nme " in runc["stdout"], runc["text"]
    assert "ipv6=1 1 " in runc["stdout"] and "nowhere.test: not found" in runc["stdout"], runc["text"]
    for each in (engine, runc):  # the engine's routes and MAC, derived from the network and the address
        [me] = [line.split()[1] for line in each["stdout"].splitlines() if line.startswith("me ")]
        address, layout = ipaddress.IPv4Address(me), each["layout"]
        assert_engine_routes_and_mac(each, layout, address)
        assert (address in layout.ours) is (each is runc), (address, layout)  # runc's from the server's half


def test_a_server_on_every_address_gives_no_preview_link_until_told_its_public_url(tmp_path: Path) -> None:
    tokens = tmp_path / "tokens.json"
    assert run_cli("token", "add", "ada", "--policy", "default", "--tokens", str(tokens)).returncode == 0
    serve = ("--host", "0.0.0.0", "--tokens", str(tokens), "--no-pool", "--state-dir", str(tmp_path / "s"))
    with http_server_process(*serve) as server:  # clients reach it on loopback; 0.0.0.0 is no address to open
        server.wait_for_line("services' answers give no preview link: this server listens on every address", 60)
        assert not any("previews at http://0.0.0.0" in line for line in server.lines), server.lines
    with http_server_process(*serve, "--public-url", "https://sandbox.example/mcp") as server:
        server.wait_for_line("services' previews at https://sandbox.example/preview/", 60)


@pytest.mark.parametrize(("policy", "said"), [("default", True), ("strict", False)])
def test_the_log_mentions_previews_only_where_the_policy_starts_services(policy: str, said: bool) -> None:
    with http_server_process("--policy", policy, "--no-pool") as server:
        server.wait_for_line("serving MCP over Streamable HTTP")
        mentioned = [line for line in server.lines if "preview" in line]
    assert bool(mentioned) == said, server.lines  # strict starts none: nothing to preview


async def test_over_stdio_previews_open_on_a_free_loopback_port_by_default_and_say_why_when_they_do_not(
    tmp_path: Path, runtime: DockerRuntime
) -> None:
    serve = ("--policy", str(short_policy(tmp_path)), "--no-pool", "--state-dir", str(tmp_path / "s"))
    async with mcp_connect(stdio_parameters(*serve)) as session:  # the Claude Desktop way: no option at all
        await call(session, command="true", files=[{"path": "index.html", "content": PAGE}])
        started = await start_web(session)
        link = started["service"]["preview"]
        assert re.match(r"http://127\.0\.0\.1:\d+/preview/svc-", link), link
        async with httpx2.AsyncClient(timeout=30, follow_redirects=True) as browser:
            assert "Preview works" in (await browser.get(link)).text
    async with mcp_connect(stdio_parameters(*serve, "--no-preview")) as session:
        started = await start_web(session)
    assert "preview" not in started["service"], started["service"]
    assert "no preview link: this server was started with --no-preview" in started["text"], started["text"]


async def test_a_service_started_with_files_finds_them_in_its_workspace(tmp_path: Path, runtime: DockerRuntime) -> None:
    serve = ("--policy", str(short_policy(tmp_path)), "--no-pool", "--state-dir", str(tmp_path / "s"))
    app = "import http.server as h\nclass A(h.BaseHTTPRequestHandler):\n    def do_GET(self):\n" \
          "        self.send_response(200); self.end_headers(); self.wfile.write(b'from files')\n" \
          "h.HTTPServer(('', 8000), A).serve_forever()\n"  # fmt: skip
    with http_server_process(*serve) as server:
        async with as_caller(server.url) as session:
            started = await call(
                session, command="exec python3 app.py", files=[{"path": "app.py", "content": app}],
                service={"name": "app", "port": 8000},
            )  # fmt: skip
            reached = await call(session, command="curl -s http://app:8000/; echo; ls")
            stdin = await call(session, command="cat", stdin="x", service={"name": "other", "port": 8001})
        await until_gone(server.process.pid)
    assert not started["is_error"], started["text"]
    assert reached["stdout"].startswith("from files\n") and "app.py" in reached["stdout"], reached["stdout"]
    assert stdin["is_error"] and stdin["error"]["field"] == "stdin", stdin["text"]


async def test_a_storage_refusal_names_the_service_that_holds_the_room(tmp_path: Path, runtime: DockerRuntime) -> None:
    """A 2 GiB workspace whose service runs counts its bounded reserve (256 MiB); on a host's cap of 400 MiB a second
    session's new workspace does not fit, and the refusal says which service holds the room."""
    policy = tmp_path / "room.yaml"
    policy.write_text(
        SHORT % {"idle": 600, "lifetime": 600}
        + "workspace: {persist: true, size_mb: 2048, files: 2000}\nhost: {workspace_storage_mb: 400}\n"
    )
    serve = ("--policy", str(policy), "--no-pool", "--state-dir", str(tmp_path / "s"))
    with http_server_process(*serve) as server:
        async with as_caller(server.url) as first:
            await start_web(first)
            async with as_caller(server.url) as second:
                refused = await call(second, command="true")
        await until_gone(server.process.pid)
    assert refused["is_error"] and refused["error"]["field"] == "host.workspace_storage_mb", refused["text"]
    assert "in use by its service web counts" in refused["text"], refused["text"]
