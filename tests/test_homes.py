"""Replicas as one server (serve --state … --workspaces mounted): a workspace lives on its home replica, mounted
there, its services beside it; every other replica forwards its calls and its previews there over the replicas'
signed channel; a home that is killed loses no finished call, and its services are said to be gone.

Two real replicas share a real PostgreSQL; the calls go to each replica's own port, so that which one a request
reaches is chosen by the test, not by a load balancer (the HAProxy test sends them through the project's own
configuration)."""

from __future__ import annotations

import functools
import json
import signal
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio
import anyio.to_thread
import httpx2
import psutil
import pytest
from websockets.exceptions import ConnectionClosed, InvalidStatus
from websockets.sync.client import connect

from sandbox_server.protocol.forwarding import signature, signed_credentials
from sandbox_server.sandbox.engine.runtime import DockerRuntime
from sandbox_server.sandbox.mounts import mounted
from tests.conftest import run_cli
from tests.mcp_harness import text_of
from tests.replicas import Postgres, Replica, haproxy, one_caller, postgres, start_replica
from tests.test_replicas import a_workspace_kept_in_each_era, client_of, shell
from tests.test_tasks import request, until

pytestmark = pytest.mark.anyio

POLICY = """\
extends: default
defaults:
  limits: {timeout_s: 20, max_timeout_s: 20, max_task_s: 120}
rate: {calls_per_minute: 100000, concurrent_calls: 16}
workspace: {max_per_client: 64}
host: {max_load_per_cpu: 100}
services:
  tools: [execute_command]
  memory_mb: 96
  start_timeout_s: 10
  idle_s: 300
  max_lifetime_s: 600
"""
READ = "python3 -c \"import urllib.request as u; print(u.urlopen('http://web:8000/%s').read().decode())\""


@dataclass
class Homes:
    database: Postgres
    one: Replica
    two: Replica
    token: str
    folder: Path
    args: tuple[str, ...]


@pytest.fixture(scope="module")
def homes(tmp_path_factory: pytest.TempPathFactory, runtime: DockerRuntime) -> Iterator[Homes]:
    folder = tmp_path_factory.mktemp("homes")
    policy, tokens, token = one_caller(folder, POLICY)
    args = ("--policy", str(policy), "--tokens", str(tokens), "--no-pool")  # --workspaces auto: homes where it mounts
    with postgres() as database:
        one = start_replica(folder / "one", database.url, *args)
        one.wait_for_line("workspaces are mounted on their home replica")
        found = Homes(database, one, one, token, folder, args)
        try:
            found.two = start_replica(folder / "two", database.url, *args)
            yield found
        finally:
            for replica in {id(found.one): found.one, id(found.two): found.two}.values():  # as the tests left them
                replica.stop()


def _ran_on(replica: Replica, workspace: str, via: str | None = None) -> int:
    """The calls in `workspace` a replica's audit says it ran (`via`: those a peer of that name forwarded to it)."""
    return sum(
        1
        for r in replica.audit()
        if r.get("workspace") == workspace and r.get("tool")
        and (via is None or str(r.get("client", "")).endswith(f" via replica {via}"))
    )  # fmt: skip


async def _start_site(homes: Homes) -> tuple[str, dict[str, object]]:
    """A workspace made through replica one, with a page and the service `web` serving it: its id and the service."""
    async with client_of(homes.one.url, homes.token) as one:
        _, made = await shell(one, "mkdir site && echo made-on-one > site/index.html && echo ok")
        workspace = made["workspace"]
        result, started = await shell(
            one, "cd site && exec python3 -m http.server 8000", workspace=workspace,
            service={"name": "web", "port": 8000},
        )  # fmt: skip
        assert not result.is_error, text_of(result)
    return workspace, started["service"]


async def test_a_service_started_through_one_replica_is_reached_listed_and_previewed_through_the_other(
    homes: Homes,
) -> None:
    workspace, service = await _start_site(homes)
    ran_before = _ran_on(homes.one, workspace)
    async with client_of(homes.two.url, homes.token) as two:
        # A call through replica two writes a file and reads it back through the service: both ran on one, where
        # the workspace is mounted beside the service.
        result, reached = await shell(
            two, f"echo written-through-two > site/note.txt && {READ % 'note.txt'}", workspace=workspace
        )
        assert not result.is_error and "written-through-two" in reached["stdout"], text_of(result)
        listed = await two.call_tool("services", {"action": "list", "workspace": workspace})
        rows = (listed.structured_content or {}).get("services") or []
        assert [(r["name"], r["state"]) for r in rows] == [("web", "running")], text_of(listed)
    assert _ran_on(homes.one, workspace) == ran_before + 2  # the calls given to two ran on one, said forwarded
    assert _ran_on(homes.one, workspace, via=homes.two.owner()) == 2
    assert _ran_on(homes.two, workspace) == 0
    # The preview through replica two, with the caller's token, shows the page written through two.
    path = "/preview/" + str(service["id"]) + "/note.txt"
    headers = {"Authorization": f"Bearer {homes.token}"}
    page = await anyio.to_thread.run_sync(
        lambda: httpx2.get(f"http://{homes.two.address}{path}", headers=headers, timeout=30)
    )
    assert page.status_code == 200 and page.text.strip() == "written-through-two", (page.status_code, page.text)
    # Another caller's request, or none, gets through two what it gets through one.
    anonymous = await anyio.to_thread.run_sync(lambda: httpx2.get(f"http://{homes.two.address}{path}", timeout=30))
    assert anonymous.status_code == 401, anonymous.status_code
    # An operator sees where each replica is reached and what lives on it.
    shown = run_cli("replicas", "list", "--state", homes.database.url)
    rows = {row["replica"]: row for row in map(json.loads, shown.stdout.splitlines())}
    one = rows[homes.one.owner()]
    assert one["address"] == f"http://{homes.one.address}" and one["workspaces_homed"] >= 1, rows


async def test_a_forwarded_request_needs_the_replicas_signature(homes: Homes) -> None:
    """A request that says it was forwarded is run only with the shared key's signature over its time, nonce,
    method, path, body and the caller's credentials: a made-up one, an old one, one over another body, one with
    another caller's token swapped in, and one sent again (a captured request replayed) are refused before they
    run."""
    key = bytes.fromhex(homes.database.query("SELECT encode(secret, 'hex') FROM keys WHERE name = 'forwarding'")[0][0])
    envelope = {
        "io.modelcontextprotocol/protocolVersion": "2026-07-28",
        "io.modelcontextprotocol/clientCapabilities": {},
    }
    body = json.dumps({"jsonrpc": "2.0", "id": 1, "method": "tools/list", "params": {"_meta": envelope}}).encode()
    now = f"{time.time():.3f}"
    old = f"{time.time() - 120:.3f}"
    bearer = f"Bearer {homes.token}".encode()

    def signed(stamp: str, nonce: str, content: bytes = body, who: bytes = bearer, replica: str = "someone") -> str:
        credentials = signed_credentials({b"authorization": who})
        return (
            f"{replica};{stamp};{nonce};{signature(key, 'someone', stamp, nonce, 'POST', '/mcp', content, credentials)}"
        )

    def post(said: str, token: str = homes.token) -> httpx2.Response:
        headers = {
            "Authorization": f"Bearer {token}", "Sandbox-Forwarded": said, "Content-Type": "application/json",
            "Accept": "application/json, text/event-stream", "Mcp-Protocol-Version": "2026-07-28",
            "Mcp-Method": "tools/list",
        }  # fmt: skip
        return httpx2.post(homes.one.url, content=body, timeout=30, headers=headers)

    for said, token in (
        ("someone;0;n;00", homes.token),
        (f"someone;{now};n0;{'0' * 64}", homes.token),
        ("not a signature", homes.token),
        (signed(now, "n1", replica="another"), homes.token),
        (signed(old, "n2"), homes.token),
        (signed(now, "n3", content=body + b" "), homes.token),
        (signed(now, "n4"), "another-callers-token"),  # the signature covers the caller's credentials
        (f"someone;{now};{'ab' * 32}", homes.token),  # the earlier form, with no nonce
    ):
        refused = await anyio.to_thread.run_sync(post, said, token)
        assert refused.status_code == 403 and "signature" in refused.text, (said, refused.status_code, refused.text)
    captured = signed(now, "n5")
    taken = await anyio.to_thread.run_sync(post, captured)
    assert taken.status_code == 200 and "execute_command" in taken.text, (taken.status_code, taken.text[:300])
    replayed = await anyio.to_thread.run_sync(post, captured)
    assert replayed.status_code == 403 and "signature" in replayed.text, (replayed.status_code, replayed.text)
    # A workspace's hand-over is asked for by a replica alone: unsigned, or signed without the key, it is refused.
    async with client_of(homes.one.url, homes.token) as one:
        _, made = await shell(one, "echo mine > f.txt")
    asked = json.dumps({"workspace": made["workspace"]}).encode()
    hand_over = homes.one.url.removesuffix("/mcp") + "/replicas/hand-over"
    for headers in ({}, {"Sandbox-Forwarded": f"someone;{time.time():.3f};n6;{'0' * 64}"}):
        refused = await anyio.to_thread.run_sync(
            functools.partial(httpx2.post, hand_over, content=asked, headers=headers)
        )
        assert refused.status_code == 403, (headers, refused.status_code, refused.text)
    rows = homes.database.query(f"SELECT home FROM workspaces WHERE id = '{made['workspace']}'")
    assert rows == [(homes.one.owner(),)], rows  # still homed where it was made


async def test_a_killed_home_loses_no_finished_call_and_its_services_are_said_gone(homes: Homes) -> None:
    workspace, _ = await _start_site(homes)
    lost: dict[str, Any] = {}
    async with client_of(homes.two.url, homes.token) as two:
        result, _ = await shell(two, "echo kept-before-the-kill > site/kept.txt", workspace=workspace)
        assert not result.is_error, text_of(result)

        async def under_way() -> None:  # forwarded to one, whose sandbox runs it when one is killed
            lost["result"], lost["said"] = await shell(two, "sleep 61.25", workspace=workspace)

        reaper = next(p for p in psutil.Process(homes.one.process.pid).children() if "reap-after" in p.cmdline())
        async with anyio.create_task_group() as group:
            group.start_soon(under_way)
            with anyio.fail_after(60):
                while not _running(("sleep", "61.25")):
                    await anyio.sleep(0.05)
            homes.one.process.send_signal(signal.SIGKILL)
    # The call under way is a result its caller reads (checked against the tool's outputSchema), not an error raised
    # in the client: it may have run, and when to send it again.
    said, error = text_of(lost["result"]), lost["said"]["error"]
    assert lost["result"].is_error and "stopped answering while it had this request" in said, said
    assert (error["kind"], error["retry_after_s"]) == ("engine_error", 10.0), error
    # Until one's heartbeat is old enough for it to be taken for dead, two answers that the home does not answer,
    # and when to ask again: a call of this era is forwarded, and finds no one there ...
    async with client_of(homes.two.url, homes.token) as two:
        result, unreached = await shell(two, "true", workspace=workspace)
    assert result.is_error and unreached["error"]["kind"] == "engine_unavailable", text_of(result)
    assert "does not answer now; nothing of this request reached it" in text_of(result), text_of(result)
    # ... and a handshake-era session's, never forwarded (its session lives on two), is told how long one has been
    # silent and when it is taken for lost: sent again then, as told, it runs, continuing the workspace on two.
    deadline, told = time.monotonic() + 60, 0
    async with client_of(homes.two.url, homes.token, mode="legacy") as two:
        while True:
            result, continued = await shell(two, f"cat site/kept.txt && {READ % 'kept.txt'}", workspace=workspace)
            if not result.is_error:
                break
            error, said = continued["error"], text_of(result)
            if error["kind"] == "engine_unavailable":
                assert "lives on replica one (" in said and "has not said it is alive for" in said, said
                assert 1 <= error["retry_after_s"] <= 11, error
                told += 1
            else:
                assert error["kind"] == "busy" and "lives on replica one (" in said, said
            assert time.monotonic() < deadline, "replica two never took the workspace over"
            await anyio.sleep(error["retry_after_s"])
    assert told == 1, "the session was told when to send the call again, and it ran when sent then"
    homes.one.stop()
    # one's reaper lets go of the workspaces it had mounted, so that two may mount them; nothing stays mounted
    await anyio.to_thread.run_sync(lambda: reaper.wait(timeout=60))
    assert mounted(homes.folder / "one" / "state" / "workspaces" / "run") == [], "its workspaces stay mounted"
    said = text_of(result)
    assert not result.is_error, said
    assert f"workspace {workspace} lived on replica one (" in said and "stopped answering" in said, said  # its --name
    assert "its services there (web) are gone with that replica" in said, said
    assert continued["stdout"].count("kept-before-the-kill") == 2, said  # the file, and the service started again
    homes.one = start_replica(homes.folder / "one", homes.database.url, *homes.args)


async def test_haproxy_sends_a_workspaces_calls_to_its_home(homes: Homes, tmp_path: Path) -> None:
    """The tools ask clients to mirror `workspace` as the Mcp-Param-Workspace header; the home's answer names the
    workspace it made, and HAProxy (deploy/haproxy.cfg) sends the next calls there: none is forwarded."""
    with haproxy(tmp_path, homes.one, homes.two) as url:
        async with client_of(url, homes.token) as client:
            _, made = await shell(client, "echo first > f.txt")
            workspace = made["workspace"]
            for i in range(6):
                result, _ = await shell(client, f"echo {i} >> f.txt", workspace=workspace)
                assert not result.is_error, text_of(result)
    ran = {_ran_on(homes.one, workspace), _ran_on(homes.two, workspace)}
    assert ran == {0, 7}, ran
    forwarded = [
        _ran_on(r, workspace, via=peer.owner()) for r, peer in ((homes.one, homes.two), (homes.two, homes.one))
    ]
    assert forwarded == [0, 0], forwarded


async def test_a_home_stopped_for_an_upgrade_hands_its_workspace_and_services_to_the_next_replica(homes: Homes) -> None:
    """SIGTERM: the home drains, saves and lets go of its workspaces; the next call, through the other replica,
    continues the workspace there and starts its services again, as after a restart."""
    workspace, _ = await _start_site(homes)
    homes.one.process.send_signal(signal.SIGTERM)
    assert await anyio.to_thread.run_sync(homes.one.process.wait, 60) == 0
    homes.one.stop()
    rows = homes.database.query(f"SELECT home FROM workspaces WHERE id = '{workspace}'")
    assert rows == [(None,)], rows  # let go of: no replica has to be taken for dead first
    async with client_of(homes.two.url, homes.token) as two:
        result, continued = await shell(two, READ % "index.html", workspace=workspace)
    said = text_of(result)
    assert not result.is_error and "service web started again" in said, said
    assert "stopped answering" not in said, said
    assert continued["stdout"].strip() == "made-on-one", said
    assert _ran_on(homes.two, workspace) == 1
    homes.one = start_replica(homes.folder / "one", homes.database.url, *homes.args)


async def test_a_task_in_a_workspace_homed_on_one_replica_is_followed_and_read_through_the_other(homes: Homes) -> None:
    """A long call started through replica two in a workspace that lives on one runs on one (forwarded); its
    progress and result are read through two, and what it wrote is there for the next call, wherever it lands."""
    workspace, _ = await _start_site(homes)
    async with client_of(homes.two.url, homes.token) as two:
        arguments = {"command": "echo started; sleep 3; echo late > late.txt; echo done",
                     "timeout_s": 60, "workspace": workspace}  # fmt: skip
        answer = await two.session.call_tool("execute_command", arguments, allow_claimed=True)
        created = answer.model_dump(by_alias=True, exclude_none=True)
        assert created.get("resultType") == "task", created
        task_id = created["taskId"]
        seen = await until(
            two, task_id, lambda task: "started" in task.get("statusMessage", "") or task["status"] != "working"
        )
        assert "started" in seen.get("statusMessage", "") or seen["status"] == "completed", seen
        ended = await until(two, task_id, lambda task: task["status"] != "working")
        assert ended["status"] == "completed", ended
        result = await request(two, "tasks/result", taskId=task_id)
        assert result["structuredContent"]["stdout"] == "started\ndone\n", result
        output = await two.read_resource(f"sandbox://tasks/{task_id}/output")  # its output, kept where all read it
        assert "started" in str(output.contents[0]), output
        _, read = await shell(two, "cat late.txt", workspace=workspace)
        assert read["stdout"] == "late\n", read
    assert _ran_on(homes.one, workspace, via=homes.two.owner()) == 2


async def test_a_rolling_restart_of_homes_under_load_loses_no_call_and_no_line_of_any_workspace(
    homes: Homes, tmp_path: Path
) -> None:
    """Behind HAProxy, four callers each append to a file of their own workspace, call after call, while each replica
    in turn is sent SIGTERM and started again on its port. A workspace whose home drains is handed over: its calls
    wait for that, then go on where it is continued. No call fails, and each sees every line before it."""
    failures: list[str] = []
    done: dict[int, int] = {}
    stop = anyio.Event()
    with haproxy(tmp_path, homes.one, homes.two) as url:

        async def caller(number: int) -> None:
            async with client_of(url, homes.token, checked=False, extensions=[]) as client:
                _, made = await shell(client, "echo 0 > lines.txt")
                workspace, line = made["workspace"], 0
                while not stop.is_set():
                    line += 1
                    try:
                        result, seen = await shell(
                            client, f"echo {line} >> lines.txt; wc -l < lines.txt", workspace=workspace
                        )
                        if result.is_error or seen.get("stdout", "").strip() != str(line + 1):
                            failures.append(f"caller {number}, line {line}: {text_of(result)[:300]}")
                    except Exception as exc:  # a call lost on the way
                        failures.append(f"caller {number}, line {line}: {exc!r}"[:300])
                    done[number] = line

        async def until_each_made(more: int) -> None:
            wanted = {number: done.get(number, 0) + more for number in range(4)}
            with anyio.fail_after(120):
                while any(done.get(number, 0) < at for number, at in wanted.items()):
                    await anyio.sleep(0.1)

        async with anyio.create_task_group() as group:
            for number in range(4):
                group.start_soon(caller, number)
            await until_each_made(3)
            for name in ("one", "two"):
                old: Replica = getattr(homes, name)
                old.process.send_signal(signal.SIGTERM)
                assert await anyio.to_thread.run_sync(old.process.wait, 90) == 0
                old.stop()
                started = functools.partial(start_replica, homes.folder / name, homes.database.url, *homes.args)
                setattr(homes, name, await anyio.to_thread.run_sync(functools.partial(started, port=old.port)))
                await until_each_made(3)
            stop.set()
    assert not failures, failures
    assert min(done.values()) >= 9, done


async def test_a_previews_websocket_opened_through_the_other_replica_reaches_the_service_on_its_home(
    homes: Homes,
) -> None:
    """A dev server's hot reload through the preview: the WebSocket opened through replica two is carried to the
    service on one, for its caller alone."""
    echo = (Path(__file__).parent / "services" / "ws_echo.py").read_text()
    async with client_of(homes.one.url, homes.token) as one:
        _, made = await shell(one, "true", files=[{"path": "ws_echo.py", "content": echo}])
        result, started = await shell(
            one, "exec python3 ws_echo.py", workspace=made["workspace"], service={"name": "ws", "port": 8765}
        )
        assert not result.is_error, text_of(result)
    url = f"ws://{homes.two.address}/preview/{started['service']['id']}/"

    def talk(headers: dict[str, str]) -> str:
        with connect(url, additional_headers=headers, open_timeout=30) as ws:
            ws.send("hello through the other replica")
            return str(ws.recv(timeout=10))

    said = await anyio.to_thread.run_sync(talk, {"Authorization": f"Bearer {homes.token}"})
    assert said == "echo: hello through the other replica", said
    with pytest.raises(InvalidStatus):  # no token: refused at the home, as through it
        await anyio.to_thread.run_sync(talk, {})
    forged = {"Authorization": f"Bearer {homes.token}", "Sandbox-Forwarded": f"x;{time.time():.3f};{'0' * 64}"}
    with pytest.raises((InvalidStatus, ConnectionClosed)):  # a forged signature: closed before it is carried
        await anyio.to_thread.run_sync(talk, forged)


@pytest.mark.parametrize("mode", ["legacy", "2026-07-28"])
async def test_each_protocol_era_is_served_through_either_replica_and_through_haproxy(
    homes: Homes, mode: str, tmp_path: Path
) -> None:
    """A handshake-era session (2025-11-25) got HTTP 400 "Parse error" for every request after its `initialize`
    where replicas keep homes: each era keeps a workspace through each replica and through the load balancer."""
    with haproxy(tmp_path, homes.one, homes.two) as balanced:
        await a_workspace_kept_in_each_era((homes.one.url, homes.two.url, balanced), homes.token, mode)


def _running(argv: tuple[str, ...]) -> bool:
    """Whether a process of this host runs with exactly this command line."""
    return any(tuple(p.info["cmdline"] or ()) == argv for p in psutil.process_iter(["cmdline"]))


@pytest.mark.parametrize("mode", ["legacy", "2026-07-28"])
async def test_a_workspace_made_through_one_replica_is_continued_by_a_session_of_either_era_on_the_other(
    homes: Homes, mode: str
) -> None:
    """A handshake-era client's next session lands on another replica than the one its named workspace lives on
    (HAProxy keeps a session, not a workspace, on one replica): its calls there run, from the files it left."""
    workspace = f"carried-{mode}"
    async with client_of(homes.one.url, homes.token, mode=mode) as first:
        result, made = await shell(first, "echo 1 > note.txt && cat note.txt")
        assert not result.is_error, text_of(result)
        kept = await first.call_tool(
            "workspaces", {"action": "keep", "name": workspace, "workspace": made["workspace"]}
        )
        assert not kept.is_error, text_of(kept)
        result, _ = await shell(
            first, "exec python3 -m http.server 8000", workspace=workspace, service={"name": "web", "port": 8000}
        )
        assert not result.is_error, text_of(result)
    async with client_of(homes.two.url, homes.token, mode=mode) as second:
        for line in ("2", "3"):
            result, seen = await shell(second, f"echo {line} >> note.txt && cat note.txt", workspace=workspace)
            assert not result.is_error, text_of(result)
        assert seen["stdout"] == "1\n2\n3\n", text_of(result)
        result, served = await shell(second, READ % "note.txt", workspace=workspace)  # its service goes with it
        assert not result.is_error and served["stdout"] == "1\n2\n3\n\n", text_of(result)
    async with client_of(homes.one.url, homes.token, mode=mode) as back:  # and back again, a session later
        result, seen = await shell(back, "echo 4 >> note.txt && cat note.txt", workspace=workspace)
    assert not result.is_error and seen["stdout"] == "1\n2\n3\n4\n", text_of(result)
