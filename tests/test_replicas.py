"""Replicas on shared state: two (and a third, to kill) `serve --state postgresql://…` processes on this machine's
engine, each its own owner, sharing a real PostgreSQL; HAProxy in front with the project's own configuration.

Requests are sent to one replica and then the other on purpose (each replica's own URL), so that what is proven
does not depend on how a balancer happens to alternate; HAProxy is then shown to spread 2026-07-28 requests over
both replicas and to keep a handshake-era session on one.
"""

from __future__ import annotations

import json
import os
import signal
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio
import httpx2
import mcp_types as types
import pytest
from mcp import Client
from mcp.client.streamable_http import streamable_http_client
from mcp.shared.exceptions import MCPError

from sandbox_server.protocol.tasks_client import TasksExtension
from sandbox_server.sandbox.engine.runtime import DockerRuntime
from sandbox_server.workspaces.naming import resource_uri
from tests.conftest import containers_owned_by, run_cli
from tests.mcp_harness import CheckedClient, Person, text_of
from tests.replicas import Postgres, Replica, haproxy, postgres, start_replica
from tests.test_tasks import request, start, until

pytestmark = pytest.mark.anyio

POLICY = """\
extends: default
defaults:
  limits: {timeout_s: 20, max_timeout_s: 20, max_task_s: 120}
approval:
  commands: ["rm"]
tasks: {running: 4, running_per_caller: 3, per_caller: 20, ttl_s: 600, poll_interval_ms: 200}
audit: {include_arguments: true}
"""
METERED = """\
extends: default
rate: {calls_per_minute: 4, concurrent_calls: 2}
"""
HELD = """\
extends: default
rate: {calls_per_minute: 1000, concurrent_calls: 16}
tasks: {running: 8, running_per_caller: 8, per_caller: 3, ttl_s: 600, poll_interval_ms: 200}
"""
RUNNING = HELD.replace("running_per_caller: 8, per_caller: 3", "running_per_caller: 2, per_caller: 20")


@dataclass
class Deployment:
    database: Postgres
    one: Replica
    two: Replica
    tokens: dict[str, str]
    policy: Path
    tokens_file: Path
    folder: Path


@pytest.fixture(scope="module")
def deployment(tmp_path_factory: pytest.TempPathFactory, runtime: DockerRuntime) -> Iterator[Deployment]:
    folder = tmp_path_factory.mktemp("replicas")
    policy, metered, held = folder / "replicas.yaml", folder / "metered.yaml", folder / "held.yaml"
    running = folder / "running.yaml"
    policy.write_text(POLICY)
    metered.write_text(METERED)
    held.write_text(HELD)
    running.write_text(RUNNING)
    tokens_file = folder / "tokens.json"
    tokens = {}
    for name, its_policy in (("alice", policy), ("metered", metered), ("held", held), ("running", running)):
        added = run_cli("token", "add", name, "--policy", str(its_policy), "--tokens", str(tokens_file))
        assert added.returncode == 0, added.stderr
        tokens[name] = added.stdout.splitlines()[-1]
    args = ("--policy", str(policy), "--tokens", str(tokens_file), "--no-pool", "--workspaces", "archived")
    with postgres() as database:
        one = start_replica(folder / "one", database.url, *args)
        try:
            two = start_replica(folder / "two", database.url, *args)
            try:
                yield Deployment(database, one, two, tokens, policy, tokens_file, folder)
            finally:
                two.stop()
        finally:
            one.stop()


@asynccontextmanager
async def client_of(
    url: str, token: str, mode: str = "2026-07-28", checked: bool = True, **options: Any
) -> AsyncIterator[Client]:
    """The official client (`checked`: every result held against its tool's outputSchema, listed again after each
    call) with a caller's token."""
    headers = {"Authorization": f"Bearer {token}"}
    if mode != "legacy":
        options.setdefault("extensions", [TasksExtension()])
    kind = CheckedClient if checked else Client
    async with httpx2.AsyncClient(headers=headers, timeout=httpx2.Timeout(30, read=120)) as http:
        async with kind(streamable_http_client(url, http_client=http), mode=mode, **options) as client:
            yield client


async def shell(client: Client, command: str, **arguments: Any) -> tuple[types.CallToolResult, dict[str, Any]]:
    result = await client.call_tool("execute_command", {"command": command, **arguments})
    return result, result.structured_content or {}


async def a_workspace_kept_in_each_era(urls: tuple[str, ...], token: str, mode: str) -> None:
    """Through each URL, a session of the era `mode` makes a workspace and continues it, and lists the tools."""
    for url in urls:
        async with client_of(url, token, mode=mode) as session:
            result, made = await shell(session, "echo 1 > note.txt && cat note.txt")
            assert not result.is_error and made["stdout"] == "1\n", (url, text_of(result))
            result, seen = await shell(session, "echo 2 >> note.txt && cat note.txt", workspace=made["workspace"])
            assert not result.is_error and seen["stdout"] == "1\n2\n", (url, text_of(result))
            listed = await session.list_tools()
            assert "execute_command" in {tool.name for tool in listed.tools}


def calls_in(replica: Replica, marker: str) -> int:
    return sum(1 for line in replica.audit() if marker in json.dumps(line.get("arguments", line)))


async def test_2026_one_workspace_one_task_and_one_approval_wherever_each_request_lands(
    deployment: Deployment,
) -> None:
    alice = deployment.tokens["alice"]
    one, two = deployment.one, deployment.two
    person = Person()
    async with (
        client_of(one.url, alice, elicitation_callback=person) as first,
        client_of(two.url, alice, elicitation_callback=person) as second,
    ):
        # a workspace made on one replica, continued on each in turn: every call sees the one before
        result, made = await shell(first, "echo 1 >> /workspace/log.txt")
        assert not result.is_error, text_of(result)
        workspace = made["workspace"]
        for turn in range(2, 6):
            on = second if turn % 2 == 0 else first
            result, _ = await shell(on, f"echo {turn} >> /workspace/log.txt", workspace=workspace)
            assert not result.is_error, text_of(result)
        result, seen = await shell(second, "cat /workspace/log.txt", workspace=workspace)
        assert seen["stdout"].split() == ["1", "2", "3", "4", "5"], seen
        read = await first.read_resource(resource_uri(workspace, "log.txt"))  # the last save, read on the other
        assert isinstance(read.contents[0], types.TextResourceContents), read
        assert read.contents[0].text.split() == ["1", "2", "3", "4", "5"], read

        # a task started on one replica is read and its result fetched on the other
        async with client_of(one.url, alice) as starter:
            created = await start(starter, "sleep 1; echo finished > /workspace/task.txt; echo done")
        task_id = created["taskId"]
        ended = await until(second, task_id, lambda task: task["status"] != "working")
        assert ended["status"] == "completed", ended
        assert ended["result"]["structuredContent"]["stdout"] == "done\n", ended
        fetched = await request(first, "tasks/get", taskId=task_id)
        assert fetched["status"] == "completed"

        # an approval asked by one replica is answered to the other
        arguments = {"command": "rm -f /workspace/none && echo removed", "workspace": workspace}
        question = await first.session.call_tool("execute_command", arguments, allow_input_required=True)
        assert isinstance(question, types.InputRequiredResult) and question.request_state, question
        answer: types.InputResponses = {"approval": types.ElicitResult(action="accept", content={})}
        answered = await second.session.call_tool(
            "execute_command", arguments, input_responses=answer, request_state=question.request_state
        )
        assert isinstance(answered, types.CallToolResult) and not answered.is_error, answered
        assert answered.structured_content is not None and answered.structured_content["stdout"] == "removed\n"
        again = await first.session.call_tool(  # the answer was used up on the other replica
            "execute_command", arguments, input_responses=answer, request_state=question.request_state,
            allow_input_required=True,
        )  # fmt: skip
        assert isinstance(again, types.InputRequiredResult), again
    asked = [line for line in one.audit() if line.get("approval", {}).get("decision") == "asked"]
    accepted = [line for line in two.audit() if line.get("approval", {}).get("decision") == "accept"]
    assert asked and accepted and {line["replica"] for line in accepted} == {two.owner()}, (asked, accepted)
    assert one.owner() != two.owner()


async def test_a_task_running_on_one_replica_is_cancelled_through_the_other(
    deployment: Deployment, runtime: DockerRuntime
) -> None:
    alice = deployment.tokens["alice"]
    owner = deployment.one.owner()
    async with client_of(deployment.one.url, alice) as first, client_of(deployment.two.url, alice) as second:
        created = await start(first, "echo started; sleep 60")
        task_id = created["taskId"]
        await until(first, task_id, lambda task: "last line: started" in task.get("statusMessage", ""))
        await request(second, "tasks/cancel", taskId=task_id)  # answered once the running replica acted on it
        seen = await request(first, "tasks/get", taskId=task_id)
        assert seen["status"] == "cancelled" and "container was removed" in seen["statusMessage"], seen
    assert not containers_owned_by(owner, running=True), "the cancelled task's container still runs"


async def test_a_returned_file_too_large_to_embed_is_read_through_the_other_replica_by_its_caller_alone(
    deployment: Deployment,
) -> None:
    alice, metered = deployment.tokens["alice"], deployment.tokens["metered"]
    async with client_of(deployment.one.url, alice) as first, client_of(deployment.two.url, alice) as second:
        result, _ = await shell(
            first, "mkdir -p /workspace/out; head -c 100000 /dev/zero | tr '\\0' a > /workspace/out/big.txt"
        )
        links = [block for block in result.content if isinstance(block, types.ResourceLink)]
        assert len(links) == 1 and links[0].size == 100_000, result.content  # too large to embed: a link
        read = await second.read_resource(str(links[0].uri))
        assert isinstance(read.contents[0], types.TextResourceContents), read
        assert read.contents[0].text == "a" * 100_000
    async with client_of(deployment.two.url, metered) as stranger:
        with pytest.raises(MCPError):  # another caller's: not found, on either replica
            await stranger.read_resource(str(links[0].uri))


async def test_a_fork_made_on_one_replica_is_continued_on_the_other_and_a_snapshot_restored_across(
    deployment: Deployment,
) -> None:
    alice = deployment.tokens["alice"]
    async with client_of(deployment.one.url, alice) as first, client_of(deployment.two.url, alice) as second:
        result, made = await shell(first, "echo base > /workspace/f.txt")
        origin = made["workspace"]
        await first.call_tool("run_python", {"code": "x = [1]", "workspace": origin})
        forked = await first.call_tool("workspaces", {"action": "fork", "name": "on-two", "workspace": origin})
        assert not forked.is_error, text_of(forked)
        cell = await second.call_tool("run_python", {"code": "x.append(2)\nprint(x)", "workspace": "on-two"})
        _, changed = await shell(second, "echo branch >> f.txt; cat f.txt", workspace="on-two")
        _, kept = await shell(first, "cat f.txt", workspace=origin)
        taken = await second.call_tool("workspaces", {"action": "snapshot", "name": "at-two", "workspace": "on-two"})
        restored = await first.call_tool(
            "workspaces", {"action": "restore", "snapshot": "at-two", "name": "back-on-one", "workspace": origin}
        )
        back = await first.call_tool(
            "run_python", {"code": "print(x, open('f.txt').read().split())", "workspace": "back-on-one"}
        )
        replaced = await first.call_tool(
            "workspaces", {"action": "restore", "snapshot": "at-two", "replace": True, "workspace": origin}
        )
    assert (cell.structured_content or {}).get("stdout") == "[1, 2]\n", text_of(cell)
    assert changed["stdout"] == "base\nbranch\n" and kept["stdout"] == "base\n", (changed, kept)
    assert not taken.is_error and not restored.is_error, (text_of(taken), text_of(restored))
    assert (back.structured_content or {}).get("stdout") == "[1, 2] ['base', 'branch']\n", text_of(back)
    assert replaced.is_error and (replaced.structured_content or {})["error"]["field"] == "replace", text_of(replaced)


async def test_rate_limits_count_the_calls_of_both_replicas(deployment: Deployment) -> None:
    metered = deployment.tokens["metered"]
    one, two = deployment.one, deployment.two
    async with client_of(one.url, metered) as first, client_of(two.url, metered) as second:
        for turn in range(4):  # 4 calls a minute, two on each replica: each alone would allow 4
            result, _ = await shell(second if turn % 2 else first, "true")
            assert not result.is_error, text_of(result)
        result, refused = await shell(first, "true")
    assert result.is_error and refused["error"]["kind"] == "rate_limited", refused
    assert "4 calls/min" in text_of(result) and "counted across every replica" in text_of(result), text_of(result)


@pytest.mark.parametrize(
    ("caller", "cap", "field"), [("held", 3, "tasks.per_caller"), ("running", 2, "tasks.running_per_caller")]
)
async def test_a_burst_of_tasks_through_both_replicas_gets_exactly_the_callers_share(
    deployment: Deployment, runtime: DockerRuntime, caller: str, cap: int, field: str
) -> None:
    """Ten long calls at once, five through each replica, of a caller who may hold three tasks (tasks.per_caller),
    or run two (tasks.running_per_caller): each replica alone would let it have that many, and counting then
    writing would let both."""
    held = deployment.tokens[caller]
    created: list[tuple[Client, str]] = []
    refused: list[str] = []
    async with client_of(deployment.one.url, held) as first, client_of(deployment.two.url, held) as second:

        async def one(client: Client) -> None:
            arguments = {"command": "sleep 60", "timeout_s": 200}
            sent = await client.session.call_tool("execute_command", arguments, allow_claimed=True)
            if isinstance(sent, types.CallToolResult):
                assert sent.is_error and sent.structured_content is not None, sent
                refused.append(sent.structured_content["error"]["field"])
            else:
                created.append((client, sent.model_dump(by_alias=True)["taskId"]))

        async with anyio.create_task_group() as group:
            for number in range(10):
                group.start_soon(one, first if number % 2 else second)
        assert len(created) == cap and refused == [field] * (10 - cap), (created, refused)
        for client, task_id in created:
            await request(client, "tasks/cancel", taskId=task_id)


@pytest.mark.parametrize("mode", ["legacy", "2026-07-28"])
async def test_each_protocol_era_keeps_a_workspace_through_either_archived_replica_and_through_haproxy(
    deployment: Deployment, mode: str, tmp_path: Path
) -> None:
    with haproxy(tmp_path, deployment.one, deployment.two) as balanced:
        urls = (deployment.one.url, deployment.two.url, balanced)
        await a_workspace_kept_in_each_era(
            urls, deployment.tokens["held"], mode
        )  # alice's workspaces are counted below


async def test_haproxy_spreads_2026_requests_and_keeps_a_handshake_session_on_one_replica(
    deployment: Deployment,
) -> None:
    alice = deployment.tokens["alice"]
    one, two = deployment.one, deployment.two
    with haproxy(deployment.folder, one, two) as url:
        async with client_of(url, alice) as modern:
            result, made = await shell(modern, "echo spread-0 > /workspace/spread.txt")
            for turn in range(1, 6):
                result, _ = await shell(
                    modern, f"echo spread-{turn} >> /workspace/spread.txt", workspace=made["workspace"]
                )
                assert not result.is_error, text_of(result)
            result, seen = await shell(modern, "cat /workspace/spread.txt", workspace=made["workspace"])
        assert seen["stdout"].split() == [f"spread-{turn}" for turn in range(6)], seen
        assert calls_in(one, "spread-") > 0 and calls_in(two, "spread-") > 0, "2026 calls were not spread"

        async with client_of(url, alice, mode="legacy") as session:
            for turn in range(6):
                result, _ = await shell(session, f"echo sticky-{turn} >> /workspace/sticky.txt")
                assert not result.is_error, text_of(result)
            result, seen = await shell(session, "cat /workspace/sticky.txt")
        assert seen["stdout"].split() == [f"sticky-{turn}" for turn in range(6)], seen
        assert sorted([calls_in(one, "sticky-"), calls_in(two, "sticky-")]) == [0, 6], "a session left its replica"


async def test_a_killed_replica_loses_nothing_finished_and_its_task_fails_on_the_survivor(
    deployment: Deployment, runtime: DockerRuntime
) -> None:
    alice = deployment.tokens["alice"]
    args = (
        "--policy",
        str(deployment.policy),
        "--tokens",
        str(deployment.tokens_file),
        "--no-pool",
        "--workspaces",
        "archived",
    )
    doomed = start_replica(deployment.folder / "doomed", deployment.database.url, *args)
    owner = doomed.owner()
    try:
        async with client_of(doomed.url, alice) as there:
            result, made = await shell(there, "echo kept > /workspace/kept.txt")
            assert not result.is_error, text_of(result)
            created = await start(there, "echo started; sleep 60")
            await until(there, created["taskId"], lambda task: "last line: started" in task.get("statusMessage", ""))
        # a handshake session of the doomed replica, whose workspace another session continues by its id
        failures: list[BaseException] = []
        try:
            async with client_of(doomed.url, alice, mode="legacy") as session:
                _, legacy = await shell(session, "echo legacy > /workspace/legacy.txt")
                os.kill(doomed.process.pid, signal.SIGKILL)
                doomed.process.wait(timeout=10)
                await shell(session, "true")
        except Exception as exc:  # the client's transport error, whichever it raises
            failures.append(exc)
        assert failures, "a call to a killed replica did not fail on the client side"
    finally:
        doomed.stop()
    async with client_of(deployment.two.url, alice) as survivor:
        failed = await until(survivor, created["taskId"], lambda task: task["status"] != "working")
        assert failed["status"] == "failed" and "server running this task stopped" in failed["statusMessage"], failed
        result, seen = await shell(survivor, "cat /workspace/kept.txt", workspace=made["workspace"])
        assert not result.is_error and seen["stdout"] == "kept\n", text_of(result)
    async with client_of(deployment.two.url, alice, mode="legacy") as next_session:  # the client's next session
        result, seen = await shell(next_session, "cat /workspace/legacy.txt", workspace=legacy["workspace"])
        assert not result.is_error and seen["stdout"] == "legacy\n", text_of(result)
    # its own reaper removes its containers
    with anyio.fail_after(60):
        while containers_owned_by(owner):
            await anyio.sleep(0.5)


async def test_migrations_run_once_and_a_newer_schema_is_refused(deployment: Deployment) -> None:
    from sandbox_server.state.schema import MIGRATIONS

    versions = [row[0] for row in deployment.database.query("SELECT version FROM schema_version ORDER BY version")]
    assert versions == list(range(1, len(MIGRATIONS) + 1)), versions  # each once, however many replicas started
    newer = len(MIGRATIONS) + 1
    deployment.database.query(f"INSERT INTO schema_version (version) VALUES ({newer})")
    try:
        with pytest.raises(AssertionError) as refused:
            start_replica(deployment.folder / "older", deployment.database.url, "--no-pool", "--workspaces", "archived")
    finally:
        deployment.database.query(f"DELETE FROM schema_version WHERE version = {newer}")
    said = str(refused.value)
    assert f"schema version {newer}, newer than this server's {len(MIGRATIONS)}" in said, said


async def test_a_database_restart_fails_calls_clearly_and_leaves_nothing_half_written(
    deployment: Deployment, runtime: DockerRuntime
) -> None:
    alice = deployment.tokens["alice"]
    async with client_of(deployment.one.url, alice) as client:
        result, made = await shell(client, "echo before > /workspace/state.txt")
        workspace = made["workspace"]
        assert not result.is_error, text_of(result)
        async with anyio.create_task_group() as group:
            ended: dict[str, Any] = {}

            async def in_flight() -> None:  # a call that runs while the database goes away, and saves after
                answer, structured = await shell(
                    client, "echo during >> /workspace/state.txt; sleep 2", workspace=workspace
                )
                ended.update(structured, text=text_of(answer))

            group.start_soon(in_flight)
            with anyio.fail_after(30):  # the call is inside its sandbox (it began from the database's archive)
                owner = deployment.one.owner()
                while not containers_owned_by(owner, running=True):
                    await anyio.sleep(0.05)
            deployment.database.stop()
        try:
            refused, structured = await shell(client, "true", workspace=workspace)
            assert refused.is_error and structured["error"]["kind"] == "busy", structured
            assert "shared state (PostgreSQL at 127.0.0.1" in text_of(refused), text_of(refused)
        finally:
            deployment.database.start()
        assert "shared state (PostgreSQL at 127.0.0.1" in ended["text"], ended  # said, not lost in silence
        with anyio.fail_after(30):  # the pool makes new connections to the database that came back
            while True:
                result, seen = await shell(client, "cat /workspace/state.txt", workspace=workspace)
                if not result.is_error:
                    break
                await anyio.sleep(0.5)
    assert seen["stdout"] == "before\n", seen  # the save the database missed is not half there
    assert deployment.database.query("SELECT count(*) FROM workspaces")[0][0] >= 1


async def test_a_replica_its_peer_forgot_while_the_database_was_away_says_it_is_alive_and_serves(
    deployment: Deployment,
) -> None:
    """A database away longer than a replica may be silent: the peer whose heartbeat comes back first forgets the
    other (its row, and its running calls with it). A call the forgotten one takes before its own next heartbeat
    is served, the replica said alive again first (before: an internal error, its call counted against no
    replica)."""
    owner = deployment.one.owner()
    async with client_of(deployment.one.url, deployment.tokens["alice"]) as client:
        await shell(client, "true")  # (its connections made)
        deployment.database.query(f"DELETE FROM replicas WHERE owner = '{owner}'")  # as a peer's forget_lost does
        result, structured = await shell(client, "echo served")
    assert not result.is_error and structured["stdout"] == "served\n", structured
    assert deployment.database.query(f"SELECT count(*) FROM replicas WHERE owner = '{owner}'") == [(1,)]


async def test_callers_are_the_shared_states_seeded_from_the_file_and_revoked_everywhere(
    deployment: Deployment,
) -> None:
    url = deployment.database.url
    added = run_cli("token", "add", "bob", "--state", url)
    assert added.returncode == 0 and "to the shared state" in added.stderr, added.stderr
    bob = added.stdout.splitlines()[-1]
    listed = run_cli("token", "list", "--state", url)
    names = [line.split("\t")[0] for line in listed.stdout.splitlines()]
    assert names == ["alice", "bob", "held", "metered", "running"], listed  # the file's four, seeded once, and bob

    async def status(replica: Replica) -> int:
        async with httpx2.AsyncClient(headers={"Authorization": f"Bearer {bob}"}, timeout=30) as http:
            answer = await http.get(replica.url, headers={"Accept": "text/event-stream"})
        return answer.status_code

    for replica in (deployment.one, deployment.two):  # bob is in no file: both replicas know him from the state
        with anyio.fail_after(10):
            while await status(replica) == 401:
                await anyio.sleep(0.2)
        async with client_of(replica.url, bob) as client:
            result, _ = await shell(client, "true")
            assert not result.is_error, text_of(result)
    revoked = run_cli("token", "revoke", "bob", "--state", url)
    assert revoked.returncode == 0, revoked.stderr
    for replica in (deployment.one, deployment.two):
        with anyio.fail_after(10):  # each replica reads the callers again within a second
            while await status(replica) != 401:
                await anyio.sleep(0.2)


async def test_a_replica_whose_name_was_taken_while_it_was_forgotten_says_so_and_serves(
    deployment: Deployment,
) -> None:
    """A replica forgotten by a peer while the database was away, whose name another replica then took: its next
    heartbeat says so and goes on without the name (before: the name's unique index broke its heartbeat, and the
    error ended the server). Last in the module: the replica keeps no name after it."""
    owner = deployment.one.owner()
    seen = len(deployment.one.lines)
    deployment.database.query(f"DELETE FROM replicas WHERE owner = '{owner}'")  # as a peer's forget_lost does
    deployment.database.query("INSERT INTO replicas (owner, name) VALUES ('a-new-replica', 'one')")  # then took it
    try:
        said = await anyio.to_thread.run_sync(
            lambda: deployment.one.wait_for_line("another replica took this name", 30, seen)
        )
        assert "--name one" in said, said
        async with client_of(deployment.one.url, deployment.tokens["alice"]) as client:
            result, structured = await shell(client, "echo served")
        assert not result.is_error and structured["stdout"] == "served\n", structured
        assert deployment.one.process.poll() is None, "the replica ended"
        rows = deployment.database.query(f"SELECT name FROM replicas WHERE owner = '{owner}'")
        assert rows == [(None,)], rows
    finally:
        deployment.database.query("DELETE FROM replicas WHERE owner = 'a-new-replica'")
