"""Holes found by attacking the newer features, each through the real server and the real engine.

Every case ends with the server still serving a plain call. Network cases talk only to
loopback (127.0.0.1, and 127.0.0.2 standing for a second client machine).
"""

from __future__ import annotations

import base64
import json
import os
import resource
import socket
import sys
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import anyio
import anyio.to_thread
import httpx2
import mcp_types as types
import psutil
import pytest
from mcp.client.stdio import StdioServerParameters
from mcp.client.streamable_http import streamable_http_client
from mcp.shared.exceptions import MCPError

from sandbox_server.network.egress import CONNECTIONS_PER_SANDBOX
from sandbox_server.sandbox.engine.runtime import DockerRuntime
from sandbox_server.sandbox.engine.services import remove_network
from sandbox_server.sandbox.runc.runtime import RuncRuntime
from tests.conftest import images_of
from tests.mcp_harness import CheckedClient, connect, http_server_process, stdio_parameters, text_of

pytestmark = pytest.mark.anyio

KEEPING = """\
extends: default
workspace: {persist: true, size_mb: 64, files: 20000, idle_ttl_s: 600, max_per_client: 8}
"""


@pytest.fixture
def keeping(tmp_path: Path) -> Path:
    policy = tmp_path / "keeping.yaml"
    policy.write_text(KEEPING)
    return policy


def _serve(policy: Path, state: Path, *more: str) -> tuple[str, ...]:
    return ("--policy", str(policy), "--state-dir", str(state), "--workspaces", "mounted", *more)


async def _call(session: CheckedClient, tool: str = "execute_command", **arguments: Any) -> dict[str, Any]:
    result = await session.call_tool(tool, arguments)
    assert result.structured_content is not None, text_of(result)
    return {**result.structured_content, "is_error": result.is_error, "text": text_of(result)}


async def _still_serving(session: CheckedClient) -> None:
    with anyio.fail_after(10):
        plain = await _call(session, command="echo ok")
    assert not plain["is_error"] and plain["stdout"] == "ok\n", plain["text"]


def _more_files() -> None:
    """Let this test process hold the many sockets an attack needs."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


# -- 1. ids and host paths through /sys and /proc ------------------------------------------------------

SEARCH = r"""
import os, signal, stat, sys
wanted = [word[::-1].encode() for word in open("wanted.txt").read().split()]  # reversed: never in our memory as is
signal.signal(signal.SIGALRM, lambda *_: None)
found, read = set(), 0
def look(path):
    global read
    try:
        info = os.lstat(path)
        if not stat.S_ISREG(info.st_mode):
            return
        signal.setitimer(signal.ITIMER_REAL, 0.5)
        try:
            handle = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
            try:
                data = os.read(handle, 1 << 20)
            finally:
                os.close(handle)
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
    except OSError:
        return
    read += 1
    for word in wanted:
        if word in data:
            found.add(path + " has " + word.decode()[:12])
for top in ("/sys", "/proc"):
    for folder, folders, files in os.walk(top):
        if folder == "/proc":  # our own processes know only our own call
            folders[:] = [name for name in folders if not name.isdigit() and name not in ("self", "thread-self")]
        for name in files:
            look(os.path.join(folder, name))
        for name in folders:  # links to folders are not walked, but what they name is read as a file if it is one
            if os.path.islink(os.path.join(folder, name)):
                look(os.path.join(folder, name))
print("read", read, "files")
print("\n".join(sorted(found)) or "nothing found")
"""


async def test_a_sandbox_reads_no_other_workspaces_id_nor_a_host_path_in_sys_or_proc(
    keeping: Path, tmp_path: Path, runtime: DockerRuntime
) -> None:
    state = tmp_path / "state"
    with http_server_process(*_serve(keeping, state)) as server:
        async with connect(server.url, mode="2026-07-28") as alice, connect(server.url, mode="2026-07-28") as bob:
            hers = await _call(alice, command="echo mine > secret.txt")  # her workspace stays mounted on the host
            image = next(images_of(state / "workspaces").glob("img-*.img"))
            wanted = " ".join(word[::-1] for word in (hers["workspace"], image.stem, str(state)))
            search = await _call(
                bob,
                command="python3 search.py",
                files=[{"path": "search.py", "content": SEARCH}, {"path": "wanted.txt", "content": wanted}],
                timeout_s=110,
            )
            assert not search["is_error"], search["text"]
            read = int(search["stdout"].split()[1])
            assert read > 1000, search["stdout"]  # it did look: thousands of files of /sys and /proc
            assert search["stdout"].endswith("nothing found\n"), search["stdout"]
            blocks = await _call(
                bob,
                command="find /sys/block /sys/class/block /sys/dev/block /sys/devices/virtual/block -mindepth 1 | wc -l",
            )
            assert blocks["stdout"].strip() == "0", blocks["text"]  # the host's block devices are not shown
            await _still_serving(bob)


# -- 2 and 9. a listing of thousands of folders, a bad name, and large files ------------------------------

MANY_FOLDERS = (
    "for i in $(seq 3000); do mkdir -p d$i/e && : > d$i/e/f; done; "
    "python3 -c \"open(b'bad-\\xff-name.txt', 'w').write('x')\"; ls -d d* bad* | wc -l"
)


async def test_a_listing_of_thousands_of_folders_holds_few_descriptors_and_the_server_lives(
    keeping: Path, tmp_path: Path, runtime: DockerRuntime
) -> None:
    # The server may hold 512 descriptors: a walk that opened every folder before reading any would run out.
    serve = stdio_parameters(*_serve(keeping, tmp_path / "state"))
    limited = StdioServerParameters(
        command="sh", args=["-c", 'ulimit -n 512 && exec "$0" "$@"', serve.command, *serve.args], env=serve.env
    )
    async with connect(limited) as session:
        made = await _call(session, command=MANY_FOLDERS, timeout_s=100)
        assert made["stdout"].strip() == "3001", made["text"]
        listed: list[types.Resource] = []
        cursor: str | None = None
        pages = 0
        with anyio.fail_after(60):
            while True:
                page = await session.list_resources(cursor=cursor)
                listed += page.resources
                pages += 1
                cursor = page.next_cursor
                if cursor is None:
                    break
        names = {resource.name for resource in listed}
        assert len(listed) == 3001 and pages >= 6, (len(listed), pages)
        assert "d2999/e/f" in names and "bad-\\xff-name.txt" in names  # the name's byte shown escaped
        bad = next(resource for resource in listed if resource.name == "bad-\\xff-name.txt")
        assert str(bad.uri).endswith("/bad-%FF-name.txt")
        read = await session.read_resource(str(bad.uri))
        assert read.contents[0].text == "x"  # type: ignore[union-attr]
        await _still_serving(session)


async def test_a_kept_file_larger_than_a_message_is_read_in_parts_with_the_official_client(
    keeping: Path, tmp_path: Path, runtime: DockerRuntime
) -> None:
    with http_server_process(*_serve(keeping, tmp_path / "state")) as server:
        async with connect(server.url) as session:
            made = await _call(session, command="head -c 3000000 /dev/urandom > big.bin && sha256sum big.bin")
            digest = made["stdout"].split()[0]
            (listed,) = [r for r in (await session.list_resources()).resources if r.name == "big.bin"]
            with pytest.raises(MCPError) as whole:
                await session.read_resource(str(listed.uri))
            assert "read it in parts" in whole.value.error.message and "?offset=0" in whole.value.error.message
            content, uri = b"", f"{listed.uri}?offset=0"
            while uri:
                (part,) = (await session.read_resource(uri)).contents
                assert isinstance(part, types.BlobResourceContents) and part.meta is not None
                content += base64.b64decode(part.blob)
                uri = part.meta["org.sandbox-server/part"]["next"]
            import hashlib

            assert len(content) == 3_000_000 and hashlib.sha256(content).hexdigest() == digest
            await _still_serving(session)


# -- 5. a program that forges the end of its call ---------------------------------------------------------

FORGE = r"""
import os, re, sys, time
pid = os.getppid()
while "sandbox-launch" not in open(f"/proc/{pid}/cmdline", "rb").read().decode(errors="replace"):
    pid = int(open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[1])
boundary = None
with open(f"/proc/{pid}/mem", "rb", 0) as memory:  # the launcher's memory: same user, no Yama here
    for line in open(f"/proc/{pid}/maps"):
        span, perms = line.split()[:2]
        if not perms.startswith("rw"):
            continue
        start, end = (int(edge, 16) for edge in span.split("-"))
        try:
            memory.seek(start)
            found = re.search(rb"boundary=([0-9a-f]{32})", memory.read(end - start))
        except (OSError, ValueError, OverflowError):
            continue
        if found:
            boundary = found.group(1)
            break
assert boundary, "no boundary found"
sys.stderr.buffer.write(boundary + b"\n")
sys.stderr.flush()
empty_tar = bytes(10240)
sys.stdout.buffer.write(boundary + empty_tar + boundary + b" exit=0 oom_kill=0 pids_max=0 timed_out=0\n")
sys.stdout.flush()
with open("/workspace/after.log", "a") as log:  # the host thinks the call is over; keep writing
    for number in range(150):
        log.write(f"{number}\n")
        log.flush()
        time.sleep(0.02)
"""


async def test_a_forged_end_of_call_writes_nothing_after_the_answer(
    keeping: Path, tmp_path: Path, runtime: DockerRuntime
) -> None:
    async with connect(stdio_parameters(*_serve(keeping, tmp_path / "state"))) as session:
        forged = await _call(
            session, command="python3 forge.py", files=[{"path": "forge.py", "content": FORGE}], timeout_s=20
        )
        assert "they were stopped with the sandbox before this answer" in forged["text"], forged["text"]
        # Two looks a second apart in the next call: nothing of the forger writes any more.
        looked = await _call(session, command="a=$(wc -l < after.log); sleep 1; b=$(wc -l < after.log); echo $a $b")
        before, after = looked["stdout"].split()
        assert before == after and int(after) < 150, looked["text"]
        await _still_serving(session)


# -- 3. connections before authentication ------------------------------------------------------------------


def _idle_sockets(port: int, count: int) -> list[socket.socket]:
    """`count` connections from 127.0.0.2 that send nothing (those the server closes at once included)."""
    opened = []
    for _ in range(count):
        idle = socket.socket()
        idle.bind(("127.0.0.2", 0))
        idle.settimeout(5)
        try:
            idle.connect(("127.0.0.1", port))
        except OSError:
            idle.close()
            continue
        opened.append(idle)
    return opened


def _answer_of(connection: socket.socket) -> bytes:
    """What the server says before it closes the connection (b"" when it says nothing)."""
    said = b""
    try:
        while chunk := connection.recv(4096):
            said += chunk
    except OSError:
        pass
    return said


def tokens_file(folder: Path, *names: str, policy: str = "default") -> tuple[Path, list[str]]:
    tokens = folder / "tokens.json"
    made = []
    for name in names:
        done = subprocess_run("token", "add", name, "--policy", policy, "--tokens", str(tokens))
        made.append(done.stdout.splitlines()[-1])
    return tokens, made


def subprocess_run(*args: str) -> Any:
    import subprocess

    done = subprocess.run([sys.executable, "-m", "sandbox_server", *args], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return done


@asynccontextmanager
async def as_caller(url: str, token: str, mode: str = "legacy") -> AsyncIterator[CheckedClient]:
    headers = {"Authorization": f"Bearer {token}"}
    async with httpx2.AsyncClient(headers=headers, timeout=httpx2.Timeout(30, read=300)) as http:
        async with connect(streamable_http_client(url, http_client=http), mode=mode) as client:
            yield client


async def test_idle_and_slow_connections_are_bounded_and_a_caller_is_still_served(
    tmp_path: Path, runtime: DockerRuntime
) -> None:
    _more_files()
    tokens, (alice,) = tokens_file(tmp_path, "alice")
    limits = ("--max-connections-per-address", "50", "--header-timeout-s", "2", "--no-pool")
    with http_server_process("--tokens", str(tokens), *limits) as server:
        port = int(server.url.rsplit(":", 1)[1].split("/")[0])
        idle = await anyio.to_thread.run_sync(_idle_sockets, port, 1500)
        try:
            answers = [await anyio.to_thread.run_sync(_answer_of, connection) for connection in idle[50:60]]
            assert all(b"503" in said and b"--max-connections-per-address 50" in said for said in answers), answers
            started = time.monotonic()
            async with as_caller(server.url, alice) as session:
                await _still_serving(session)
                assert time.monotonic() - started < 10
            # The first 50 were let in; none sent a request, so each is closed at the header timeout.
            kept = await anyio.to_thread.run_sync(_answer_of, idle[0])
            assert b"408" in kept and b"--header-timeout-s" in kept, kept
        finally:
            for connection in idle:
                connection.close()
        slow = socket.create_connection(("127.0.0.1", port))
        started, sent = time.monotonic(), 0
        request = b"POST /mcp HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        try:
            for byte in request:  # a header a byte at a time, slower than any client
                slow.sendall(bytes([byte]))
                sent += 1
                await anyio.sleep(0.1)
        except OSError:
            pass  # closed by the server
        finally:
            slow.close()
        assert sent < len(request) and time.monotonic() - started < 6, (sent, time.monotonic() - started)
        server.wait_for_line("no complete request headers within 2 s")
        assert server.process.poll() is None
        async with as_caller(server.url, alice) as session:
            await _still_serving(session)


# -- 7 and 8. anonymous callers, sessions per caller, and whose large outputs are whose ----------------------

RATED = """\
extends: default
rate: {calls_per_minute: 3, concurrent_calls: 4}
"""


async def test_anonymous_limits_hold_however_the_client_names_itself(tmp_path: Path, runtime: DockerRuntime) -> None:
    policy = tmp_path / "rated.yaml"
    policy.write_text(RATED)
    with http_server_process("--policy", str(policy), "--no-pool") as server:
        for number in range(3):
            info = types.Implementation(name=f"client-{number}", version="1")
            async with connect(server.url, mode="2026-07-28", client_info=info) as session:
                assert not (await _call(session, command="true"))["is_error"]
        renamed = types.Implementation(name="someone-else", version="9")
        async with connect(server.url, mode="2026-07-28", client_info=renamed) as session:
            limited = await _call(session, command="true")
        assert limited["is_error"] and limited["error"]["field"] == "rate.calls_per_minute", limited["text"]


async def test_one_caller_cannot_fill_the_session_table_and_others_still_open_theirs(
    tmp_path: Path, runtime: DockerRuntime
) -> None:
    tokens, (alice, bob) = tokens_file(tmp_path, "alice", "bob")
    with http_server_process("--tokens", str(tokens), "--max-sessions-per-caller", "5", "--no-pool") as server:
        initialize = {
            "jsonrpc": "2.0", "id": 1, "method": "initialize",
            "params": {"protocolVersion": "2025-06-18", "capabilities": {}, "clientInfo": {"name": "x", "version": "1"}},
        }  # fmt: skip
        accept = {"Accept": "application/json, text/event-stream", "Content-Type": "application/json"}
        async with httpx2.AsyncClient(headers={**accept, "Authorization": f"Bearer {alice}"}, timeout=30) as http:
            opened = [await http.post(server.url, json=initialize) for _ in range(5)]
            assert all(answer.status_code == 200 for answer in opened)
            refused = await http.post(server.url, json=initialize)
            assert refused.status_code == 503 and "--max-sessions-per-caller 5" in refused.text, refused.text
            ended = await http.delete(server.url, headers={"mcp-session-id": opened[0].headers["mcp-session-id"]})
            assert ended.status_code == 200
            assert (await http.post(server.url, json=initialize)).status_code == 200  # room again
        async with as_caller(server.url, bob) as session:
            await _still_serving(session)


async def test_an_anonymous_sessions_large_output_is_its_own(tmp_path: Path, runtime: DockerRuntime) -> None:
    with http_server_process("--no-pool") as server:
        async with connect(server.url) as first, connect(server.url) as second:
            made = await first.call_tool(
                "execute_command", {"command": "head -c 300000 /dev/zero | tr '\\0' x > out/big.txt"}
            )
            (link,) = [block for block in made.content if isinstance(block, types.ResourceLink)]
            assert str(link.uri) in {str(r.uri) for r in (await first.list_resources()).resources}
            assert str(link.uri) not in {str(r.uri) for r in (await second.list_resources()).resources}
            with pytest.raises(MCPError):
                await second.read_resource(str(link.uri))
            assert (await first.read_resource(str(link.uri))).contents[0].text == "x" * 300_000  # type: ignore[union-attr]
            await _still_serving(second)


# -- 4 and 10. calls waiting for a person, and what approval patterns see ----------------------------------

ASKING = """\
extends: default
rate: {calls_per_minute: 1000, concurrent_calls: 4}
approval: {commands: ["rm *"]}
"""


class Person:
    """Never answers until told to; counts the questions."""

    def __init__(self) -> None:
        self.asked = 0
        self.may_answer = anyio.Event()
        self.shown: list[str] = []

    async def __call__(self, context: Any, params: types.ElicitRequestParams) -> types.ElicitResult:
        self.asked += 1
        self.shown.append(params.message)
        await self.may_answer.wait()
        return types.ElicitResult(action="decline")


async def test_calls_waiting_for_a_person_are_bounded_per_caller(tmp_path: Path, runtime: DockerRuntime) -> None:
    policy = tmp_path / "asking.yaml"
    policy.write_text(ASKING)
    person = Person()
    stdin = "x" * 2_000_000
    with http_server_process("--policy", str(policy), "--no-pool") as server:
        memory = psutil.Process(server.process.pid)
        before = memory.memory_info().rss
        results: list[dict[str, Any]] = []
        async with connect(server.url, elicitation_callback=person) as session:

            async def waiting_call() -> None:
                results.append(await _call(session, command="rm -f x", stdin=stdin))

            async with anyio.create_task_group() as group:
                for started in range(1, 121):  # one after another, each asked about or answered before the next
                    group.start_soon(waiting_call)
                    with anyio.fail_after(30):
                        while len(results) + person.asked < started:
                            await anyio.sleep(0.01)
                grown = memory.memory_info().rss - before
                person.may_answer.set()
            assert person.asked == 4, person.asked
            busy = [r for r in results if r.get("error", {}).get("field") == "rate.concurrent_calls"]
            assert len(busy) == 116 and "wait for a person's approval" in busy[0]["text"]
            assert grown < 120 * 2**20, grown  # not 120 arguments of 2 MB held
            for line in ("true; rm x", "sh -c 'rm x'", "/bin/rm x", "echo x | xargs rm -f"):
                asked = person.asked
                declined = await _call(session, command=line)
                assert declined["is_error"] and person.asked == asked + 1, (line, declined["text"])
            await _still_serving(session)


# -- 11. a request larger than the SDK's own body cap ----------------------------------------------------


async def test_http_requests_reach_the_policys_argument_cap_and_past_it_the_refusal_names_it(
    runtime: DockerRuntime,
) -> None:
    with http_server_process("--no-pool") as server:
        async with connect(server.url) as session:
            counted = await _call(session, command="wc -c", stdin="y" * 6_000_000)  # above the SDK's 4 MiB
            assert counted["stdout"].strip() == "6000000", counted["text"]
        port = int(server.url.rsplit(":", 1)[1].split("/")[0])
        head = (  # a body of 17 MB announced: refused by its length before a byte of it is read
            f"POST /mcp HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Type: application/json\r\n"
            "Accept: application/json, text/event-stream\r\nContent-Length: 17000000\r\n\r\n"
        )
        with socket.create_connection(("127.0.0.1", port), timeout=10) as raw:
            raw.sendall(head.encode())
            refused = _answer_of(raw).decode()
        assert refused.startswith("HTTP/1.1 413"), refused
        assert "serve --max-request-bytes" in refused and "limits.argument_bytes (16777216 bytes)" in refused
        async with connect(server.url) as session:
            await _still_serving(session)


# -- 6. callers sharing an allow list ---------------------------------------------------------------------

HOLD = r"""
import os, socket, time
host, port = os.environ["HTTP_PROXY"].removeprefix("http://").rstrip("/").rsplit(":", 1)
held = []
for _ in range(200):  # far more than a sandbox may hold at the proxy
    connection = socket.create_connection((host, int(port)), timeout=5)
    connection.setblocking(False)
    held.append(connection)
time.sleep(1)
kept = 0
for connection in held:
    try:
        kept += connection.recv(1) != b""
    except BlockingIOError:
        kept += 1  # still open, nothing said: the proxy keeps it
    except OSError:
        pass
print("kept", kept, flush=True)
time.sleep(float(os.environ.get("HOLD_S", "0")))
"""
REACH = r"""
import socket, sys
try:
    socket.create_connection((sys.argv[1], 8080), timeout=3).close()
    print("reached")
except OSError as exc:
    print("no route:", exc)
"""


def _proxy_connections(api: Any, proxy: str) -> int:
    """Established connections to the proxy's port, read from its network namespace on the host."""
    pid = api.inspect_container(proxy)["State"]["Pid"]
    with open(f"/proc/{pid}/net/tcp") as table:
        rows = [line.split() for line in table.readlines()[1:]]
    return sum(1 for row in rows if row[1].endswith(":0C38") and row[3] == "01")


@pytest.fixture
def egress_network(runtime: DockerRuntime) -> Iterator[tuple[str, str]]:
    """An internal network of the test's own (the allow list's egress network) and an unused address on it."""
    import docker

    api = docker.from_env().api
    name = f"sandbox-test-holes-{os.getpid()}"
    network = api.create_network(name, internal=True)["Id"]
    subnet = api.inspect_network(network)["IPAM"]["Config"][0]["Subnet"]
    try:
        yield name, subnet.rsplit(".", 2)[0] + ".250.250"
    finally:
        remove_network(api, network)  # what is still attached (a proxy on its way out) let go of first
        assert not api.networks(ids=[network]), f"the test's network {name} was left behind"
        api.close()


async def test_callers_on_one_allow_list_cannot_reach_each_other_nor_take_the_proxy(
    tmp_path: Path, egress_network: tuple[str, str], runtime: RuncRuntime
) -> None:
    import docker

    from sandbox_server.network.proxies import PROXY_LABEL
    from tests.conftest import containers_of, containers_running, egress_address_of
    from tests.mcp_harness import first_runc_sandboxes, first_sandboxes

    network, unused = egress_network
    policy = tmp_path / "egress.yaml"
    shell = {"network": {"allow": ["web.test"], "egress_network": network, "hosts": {"web.test": unused}}}
    policy.write_text(json.dumps({"extends": "default", "tools": {"execute_command": shell}}))
    tokens = tmp_path / "tokens.json"
    alice, dave = (
        subprocess_run("token", "add", name, "--policy", str(policy), "--tokens", str(tokens)).stdout.splitlines()[-1]
        for name in ("alice", "dave")
    )
    api = docker.from_env().api
    with http_server_process("--tokens", str(tokens), "--policy", str(policy), "--no-pool") as server:
        async with as_caller(server.url, alice) as hers, as_caller(server.url, dave) as his:
            await _call(hers, command="true")  # the proxy is up
            ours = set(containers_of(server.process.pid))  # (other tests' servers may run beside this one)
            (proxy,) = [c["Id"] for c in api.containers(filters={"label": PROXY_LABEL}) if c["Id"] in ours]
            listening: dict[str, Any] = {}

            async def serve_for_a_while() -> None:
                listening["result"] = await _call(hers, command="python3 -m http.server 8080", timeout_s=60)

            async with anyio.create_task_group() as group:
                group.start_soon(serve_for_a_while)

                def listeners() -> set[str]:
                    return set(containers_running("http.server")) & set(containers_of(server.process.pid))

                if runtime.runc_refused() is None:  # runc makes this host's sandboxes on an allow list
                    found = await anyio.to_thread.run_sync(first_runc_sandboxes, listeners)
                else:
                    found = await anyio.to_thread.run_sync(first_sandboxes, api, listeners)
                (listener,) = found
                address = await anyio.to_thread.run_sync(egress_address_of, listener)
                reached = await _call(his, command=f"python3 reach.py {address}", files=[
                    {"path": "reach.py", "content": REACH}])  # fmt: skip
                group.cancel_scope.cancel()
            assert reached["stdout"].startswith("no route"), reached["text"]
            seen: dict[str, Any] = {}

            async def hold() -> None:
                seen["hold"] = await _call(
                    his, command="HOLD_S=6 python3 hold.py", files=[{"path": "hold.py", "content": HOLD}], timeout_s=30
                )

            async with anyio.create_task_group() as group:
                group.start_soon(hold)
                with anyio.fail_after(20):
                    while _proxy_connections(api, proxy) < CONNECTIONS_PER_SANDBOX:
                        await anyio.sleep(0.05)
                started = time.monotonic()
                seen["other"] = await _call(
                    hers, command="curl -s -m 5 -o /dev/null -w '%{http_code}' http://other.test/"
                )
                seen["other_s"] = time.monotonic() - started
            # Squid drops a sandbox's connections past its cap (it lets the one that reaches the cap in).
            assert int(seen["hold"]["stdout"].split()[1]) <= CONNECTIONS_PER_SANDBOX + 1, seen["hold"]["text"]
            assert seen["other"]["stdout"] == "403" and seen["other_s"] < 5, seen["other"]["text"]
            await _still_serving(his)
    api.close()


def test_the_firewall_rules_of_a_proxy_whose_bridge_is_gone_are_swept() -> None:
    import subprocess

    from sandbox_server.network.firewall import FIREWALL_COMMENT, sweep_firewall

    rule = ["-i", "sbxgone0000001", "-o", "sbxgone0000001", "-p", "tcp", "-d", "10.255.255.1/32", "--dport", "3128",
            "-m", "comment", "--comment", FIREWALL_COMMENT, "-j", "ACCEPT"]  # fmt: skip
    subprocess.run(["iptables", "-w", "-I", "DOCKER-USER", *rule], check=True)  # as a server killed would leave it
    try:
        sweep_firewall()
        listed = subprocess.run(["iptables", "-w", "-S", "DOCKER-USER"], capture_output=True, text=True, check=True)
        assert "sbxgone0000001" not in listed.stdout, listed.stdout
    finally:
        subprocess.run(["iptables", "-w", "-D", "DOCKER-USER", *rule], capture_output=True, check=False)
