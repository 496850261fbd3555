"""Pause and resume: a paused workspace holds no container and no mount; any call in it, or `resume`, starts its
services again with the commands their calls gave, and run_python's variables come back with its files. The same
after the server stops, and after it is killed. Through the real server, client and engine."""

from __future__ import annotations

import hashlib
import hmac
import json
from pathlib import Path
from typing import Any

import pytest

from sandbox_server.sandbox.engine.runtime import DockerRuntime
from sandbox_server.workspaces.image_files import image_key
from sandbox_server.workspaces.mounted import IMAGE_KEY
from tests.mcp_harness import CheckedClient, answer, audit_records, http_server_process
from tests.test_services import API, add_token, as_caller, call, services_of, short_policy, start_web, until_gone

pytestmark = pytest.mark.anyio


def image_of(state: Path, workspace_id: str) -> Path:
    """A mounted workspace's image: named by a keyed hash of its id, with the state folder's own key."""
    root = state / "workspaces"
    name = hmac.new(image_key(root / IMAGE_KEY), workspace_id.encode(), hashlib.sha256).hexdigest()[:32]
    [image] = root.rglob(f"img-{name}.img")
    return image


def mounted(image: Path) -> bool:
    """Whether a loop device backed by the image is mounted anywhere on the host."""
    loops = {
        f"/dev/{backing.parents[1].name}"
        for backing in Path("/sys/block").glob("loop*/loop/backing_file")
        if backing.read_text().strip() == str(image)
    }
    return any(line.split()[0] in loops for line in Path("/proc/self/mounts").read_text().splitlines())


async def workspaces(session: CheckedClient, **arguments: Any) -> dict[str, Any]:
    return await answer(session, "workspaces", arguments)


async def test_a_paused_workspace_holds_nothing_and_its_next_call_restarts_its_services_and_variables(
    tmp_path: Path, runtime: DockerRuntime
) -> None:
    state = tmp_path / "s"
    audit = tmp_path / "audit.jsonl"
    serve = ("--policy", str(short_policy(tmp_path)), "--no-pool", "--state-dir", str(state), "--audit-log", str(audit))
    with http_server_process(*serve) as server:
        async with as_caller(server.url) as session:
            await call(session, command="echo 'kept page' > index.html")
            await answer(session, "run_python", {"code": "total = 41"})
            await start_web(session)
            await call(session, command=API, service={"name": "api", "port": 9000})
            stopped = await answer(session, "services", {"action": "stop", "name": "api"})  # not to start again
            assert not stopped["is_error"], stopped["text"]
            image = image_of(state, stopped["workspace"])
            assert mounted(image) and len(services_of(server.process.pid)) == 1

            paused = await workspaces(session, action="pause")
            assert not paused["is_error"] and "is paused: its 1 service(s) stopped (web)" in paused["text"]
            assert "filesystem is unmounted" in paused["text"], paused["text"]
            [row] = paused["workspaces"]
            assert row["paused"] and [(s["name"], s["port"], s["running"]) for s in row["services"]] == [
                ("web", 8000, False)
            ]
            assert row["services"][0]["command"] == "exec python3 -m http.server 8000"
            await until_gone(server.process.pid)
            assert not mounted(image)  # no container, no mount

            page = await call(session, command="curl -s http://web:8000/index.html")  # resumes it first
            assert page["stdout"] == "kept page\n", page["text"]
            assert "service web started again as its call asked (execute_command)" in page["text"], page["text"]
            cell = await answer(session, "run_python", {"code": "total + 1"})
            assert cell["stdout"] == "42\n", cell["text"]
            assert [s["name"] for s in cell["services"]] == ["web"]  # api was stopped by its caller: not again
            listed = await workspaces(session, action="list")
            [row] = listed["workspaces"]
            assert not row["paused"] and [(s["name"], s["running"]) for s in row["services"]] == [("web", True)]

            await workspaces(session, action="pause")
            resumed = await workspaces(session, action="resume")
            assert "in use again, 1 service(s) running (web)" in resumed["text"], resumed["text"]
            assert "service web started again" in resumed["text"]
    events = [r["workspace_event"]["action"] for r in audit_records(audit) if "workspace_event" in r]
    assert events == ["pause", "list", "pause", "resume"]
    starts = [r for r in audit_records(audit) if r.get("event") == "service_started" and r.get("name") == "web"]
    assert len(starts) == 3  # started, then started again after each pause


async def test_a_named_workspaces_services_start_again_after_the_server_stops_and_after_it_is_killed(
    tmp_path: Path, runtime: DockerRuntime
) -> None:
    policy, tokens = short_policy(tmp_path), tmp_path / "tokens.json"
    alice = add_token(tokens, "alice", policy)  # a caller who is the same one after a restart
    serve = ("--policy", str(policy), "--tokens", str(tokens), "--no-pool", "--state-dir", str(tmp_path / "s"))
    with http_server_process(*serve) as server:
        async with as_caller(server.url, alice) as session:
            await call(session, command="echo first > index.html")
            await start_web(session)
            kept = await workspaces(session, action="keep", name="site")
            assert not kept["is_error"], kept["text"]
    await until_gone(server.process.pid)  # the server stopped, and its services with it

    with http_server_process(*serve) as server:
        async with as_caller(server.url, alice) as session:
            page = await call(session, command="curl -s http://web:8000/index.html", workspace="site")
            assert page.get("stdout") == "first\n" and "service web started again" in page["text"], page["text"]
            await call(session, command="echo second > index.html", workspace="site")
            server.process.kill()  # no goodbye: its record still says what runs there
            server.process.wait(timeout=30)
    await until_gone(server.process.pid)

    with http_server_process(*serve) as server:
        async with as_caller(server.url, alice) as session:
            page = await call(session, command="curl -s http://web:8000/index.html", workspace="site")
            assert page["stdout"] == "second\n" and "service web started again" in page["text"], page["text"]


async def test_snapshots_and_forks_carry_the_services_which_start_in_the_copy_on_its_first_call(
    tmp_path: Path, runtime: DockerRuntime
) -> None:
    serve = ("--policy", str(short_policy(tmp_path)), "--no-pool", "--state-dir", str(tmp_path / "s"))
    with http_server_process(*serve) as server:
        async with as_caller(server.url) as session:
            await call(session, command="echo v1 > index.html")
            await start_web(session)
            taken = await workspaces(session, action="snapshot", name="v1")
            await call(session, command="echo v2 > index.html")
            restored = await workspaces(session, action="restore", snapshot="v1", name="back")
            [snapshot] = [w for w in restored["workspaces"] if w["id"] == taken["snapshot"]]
            assert [s["name"] for s in snapshot["services"]] == ["web"]
            both = len(services_of(server.process.pid))
            page = await call(session, command="curl -s http://web:8000/index.html", workspace="back")
            assert page["stdout"] == "v1\n" and "service web started again" in page["text"], page["text"]
            assert len(services_of(server.process.pid)) == both + 1  # its own, beside the first workspace's
            mine = await call(session, command="curl -s http://web:8000/index.html")
            assert mine["stdout"] == "v2\n", mine["text"]
            states = {s["name"]: s["state"] for s in mine["services"]}
            assert states == {"web": "running"}, json.dumps(mine["services"])


async def test_a_resumed_service_is_checked_again_under_the_callers_policy_as_it_is_now(
    tmp_path: Path, runtime: DockerRuntime
) -> None:
    policy, tokens = short_policy(tmp_path), tmp_path / "tokens.json"
    alice = add_token(tokens, "alice", policy)
    serve = ("--policy", str(policy), "--tokens", str(tokens), "--no-pool", "--state-dir", str(tmp_path / "s"))
    with http_server_process(*serve) as server:
        async with as_caller(server.url, alice) as session:
            await start_web(session)
            await workspaces(session, action="keep", name="site")
            await workspaces(session, action="pause")
    # The policy alice's token names no longer lets her calls start services.
    policy.write_text(policy.read_text().replace("tools: [execute_command, run_python]", "tools: []"))
    with http_server_process(*serve) as server:
        async with as_caller(server.url, alice) as session:
            page = await call(session, command="curl -sS --max-time 3 http://web:8000/; true", workspace="site")
            listed = await workspaces(session, action="list", workspace="site")
            started = services_of(server.process.pid)
    assert not page["is_error"] and "service web was not started again: refused" in page["text"], page["text"]
    assert "services.tools" in page["text"] and started == [], page["text"]
    [row] = [w for w in listed["workspaces"] if w["name"] == "site"]
    assert [(s["name"], s["running"]) for s in row["services"]] == [
        ("web", False)
    ]  # kept: the policy may allow it again
