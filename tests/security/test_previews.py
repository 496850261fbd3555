"""Previews attacked from the browser's side: another origin on the same site (another port of 127.0.0.1), a
service's cookies, a service that answers no upgrade or no HTTP at all, and a Host that is not the server's.

Through the real server, the official client and the engine; the browser's requests are sent as a browser sends
them (its cookie, its `Origin` and `Sec-Fetch-*` headers), to loopback only.
"""

from __future__ import annotations

import re
from pathlib import Path
from urllib.parse import urlsplit

import anyio
import httpx2
import pytest
from websockets.exceptions import InvalidStatus
from websockets.sync.client import connect as ws_connect

from sandbox_server.sandbox.engine.runtime import DockerRuntime
from tests.mcp_harness import free_port, http_server_process
from tests.test_services import as_caller, call, short_policy

pytestmark = pytest.mark.anyio

APP = """\
import http.server as h
class A(h.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200)
        if self.path == "/cookies":
            self.send_header("Set-Cookie", "x=1; Path=/")
            self.send_header("Set-Cookie", "y=2; Path=/mcp; Domain=127.0.0.1")
            self.send_header("Set-Cookie", "sbx-preview-0123456789ab=stolen; Path=/")
        self.end_headers()
        self.wfile.write(("seen " + self.path).encode())
    def do_POST(self):
        body = self.rfile.read(int(self.headers.get("content-length") or 0))
        open("posted.txt", "ab").write(body + b"\\n")
        self.send_response(200); self.end_headers(); self.wfile.write(b"posted")
h.HTTPServer(("", 8000), A).serve_forever()
"""
NOT_HTTP = """\
import socket
server = socket.create_server(("", 9000))
while True:
    connection, _ = server.accept()
    connection.recv(65536)
    connection.sendall(b"this is not HTTP at all\\r\\n\\r\\n")
    connection.close()
"""


async def test_previews_refuse_other_origins_and_hosts_keep_a_services_cookies_to_it_and_answer_failures_cleanly(
    tmp_path: Path, runtime: DockerRuntime
) -> None:
    serve = ("--policy", str(short_policy(tmp_path)), "--no-pool", "--state-dir", str(tmp_path / "s"))
    with http_server_process(*serve) as server:
        own = urlsplit(server.url).netloc
        other_origin = f"http://127.0.0.1:{free_port()}"  # same site, another origin: the attacker's page
        async with as_caller(server.url) as session:
            files = [{"path": "app.py", "content": APP}, {"path": "not_http.py", "content": NOT_HTTP}]
            await call(session, command="true", files=files)
            app = await call(session, command="exec python3 app.py", service={"name": "app", "port": 8000})
            assert not app["is_error"], app["text"]
            raw = await call(session, command="exec python3 not_http.py", service={"name": "raw", "port": 9000})
            assert not raw["is_error"], raw["text"]
            prefix = app["service"]["preview"].split("?", 1)[0]
            path = urlsplit(prefix).path
            async with httpx2.AsyncClient(timeout=30, follow_redirects=True) as browser:
                opened = await browser.get(app["service"]["preview"])  # the link: this browser's cookie
                assert opened.status_code == 200 and opened.text == "seen /", opened.text
                # 4. Another origin: refused for every method, before anything reaches the service.
                for method in ("GET", "POST", "PUT", "DELETE"):
                    foreign = await browser.request(
                        method, prefix + "x", headers={"Origin": other_origin}, content=b"evil"
                    )
                    assert foreign.status_code == 403 and "another origin" in foreign.text, (method, foreign.text)
                fetched = await browser.get(
                    prefix + "x", headers={"Sec-Fetch-Site": "same-site", "Sec-Fetch-Mode": "cors"}
                )
                assert fetched.status_code == 403, fetched.text
                # Another site's page, or another port of this one, navigating to it: the browser's cookie would
                # carry a side effect of the caller's (it did: a GET that deletes, served). Only a link opens it so.
                for site in ("cross-site", "same-site"):
                    navigated = await browser.get(
                        prefix + "delete", headers={"Sec-Fetch-Site": site, "Sec-Fetch-Mode": "navigate"}
                    )
                    assert navigated.status_code == 403, navigated.text
                    assert f"opened this preview (Sec-Fetch-Site: {site})" in navigated.text, navigated.text
                for mode, method, status in (("navigate", "GET", 200), ("cors", "GET", 403), ("navigate", "POST", 403)):
                    # A link from elsewhere, a frame in a sandboxed page (an MCP Apps view: Origin null) among them,
                    # opens the page, and does nothing more.
                    listed = await session.call_tool("services", {"action": "list", "workspace": app["workspace"]})
                    [fresh] = [
                        r["preview"] for r in (listed.structured_content or {})["services"] if r["name"] == "app"
                    ]
                    sandboxed = await browser.request(
                        method,
                        fresh,
                        headers={"Origin": "null", "Sec-Fetch-Site": "cross-site", "Sec-Fetch-Mode": mode},
                    )
                    assert sandboxed.status_code == status, (mode, method, sandboxed.text)
                    assert status == 403 or sandboxed.text == "seen /", sandboxed.text
                same = await browser.post(prefix + "form", headers={"Origin": f"http://{own}"}, content=b"mine")
                assert same.status_code == 200 and same.text == "posted"
                posted = await call(session, command="cat posted.txt")
                assert posted["stdout"] == "mine\n", posted["stdout"]  # the foreign POSTs never arrived
                # 5. A service's cookies stay below its own prefix; none takes a preview cookie's name.
                cookies = (await browser.get(prefix + "cookies")).headers.get_list("set-cookie")
                assert sorted(cookies) == [f"x=1; Path={path}", f"y=2; Path={path}mcp"], cookies
                # 7. A Host that is not the server's (DNS rebinding) is refused as /mcp refuses it.
                rebound = await browser.get(prefix, headers={"Host": "evil.example"})
                assert rebound.status_code == 403 and "Host header" in rebound.text, rebound.text
                # 6. A service that answers no HTTP: a clean 502.
                raw_prefix = raw["service"]["preview"]
                assert (await browser.get(raw_prefix)).status_code == 502  # the link is redeemed, then 502
                cookie_header = "; ".join(f"{name}={value}" for name, value in browser.cookies.items())

            socket_url = prefix.replace("http://", "ws://")

            def upgrade(origin: str | None) -> str:
                with ws_connect(socket_url, origin=origin, additional_headers={"Cookie": cookie_header}) as ws:  # type: ignore[arg-type]
                    return str(ws.recv(timeout=10))

            with pytest.raises(InvalidStatus) as hijacked:  # cross-site WebSocket hijacking
                await anyio.to_thread.run_sync(upgrade, other_origin)
            assert hijacked.value.response.status_code == 403
            with pytest.raises(InvalidStatus):  # its own origin, but the service answers no upgrade
                await anyio.to_thread.run_sync(upgrade, f"http://{own}")
            still = await call(session, command="curl -s http://app:8000/still")
            assert still["stdout"] == "seen /still", still["stdout"]
        log = "".join(server.lines)
        assert "Traceback" not in log and "InvalidMessage" not in log, log[-3000:]
        assert re.search(r"refused a preview request: a page of another origin", log), log[-3000:]
