"""Replicas taken out of service without losing work: a draining replica takes no new work (503 before any of it
runs, and its health says so), lets its running calls and tasks finish, then exits; behind HAProxy (the project's
own configuration) a rolling restart of both replicas under steady calls loses none of them and finishes a task
that was running; an operator drains a replica through the shared state alone."""

from __future__ import annotations

import json
import signal
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import anyio
import anyio.to_thread
import httpx2
import pytest

from sandbox_server.sandbox.engine.runtime import DockerRuntime
from tests.conftest import containers_running, run_cli
from tests.mcp_harness import text_of
from tests.replicas import Postgres, Replica, haproxy, one_caller, postgres, start_replica
from tests.test_replicas import client_of, shell
from tests.test_tasks import request, start, until

pytestmark = pytest.mark.anyio

POLICY = """\
extends: default
defaults:
  limits: {timeout_s: 20, max_timeout_s: 20, max_task_s: 120}
rate: {calls_per_minute: 100000, concurrent_calls: 16}
workspace: {max_per_client: 64}
tasks: {running: 4, running_per_caller: 4, per_caller: 20, ttl_s: 600, poll_interval_ms: 200}
"""
CALLERS = 8
"""Callers making calls back to back, each call in a new workspace: the policy lets one client keep more workspaces
than it makes at once (with 8 for 8 callers, a call finds every other one in use, and is refused as busy)."""


@dataclass
class Cluster:
    database: Postgres
    replicas: dict[str, Replica]
    token: str
    args: tuple[str, ...]
    folder: Path

    def restart(self, name: str) -> Replica:
        """The replica `name` started again where the load balancer knows it (its port), on the same folder."""
        old = self.replicas[name]
        self.replicas[name] = start_replica(self.folder / name, self.database.url, *self.args, port=old.port)
        return self.replicas[name]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory, runtime: DockerRuntime) -> Iterator[Cluster]:
    folder = tmp_path_factory.mktemp("draining")
    policy, tokens, token = one_caller(folder, POLICY)
    args = (
        "--policy",
        str(policy),
        "--tokens",
        str(tokens),
        "--no-pool",
        "--grace-s",
        "30",
        "--workspaces",
        "archived",
    )
    with postgres() as database:
        found = Cluster(database, {}, token, args, folder)
        try:
            for name in ("one", "two"):
                found.replicas[name] = start_replica(folder / name, database.url, *args)
            yield found
        finally:
            for replica in found.replicas.values():
                replica.stop()


def _stopped(replica: Replica) -> int:
    """Its exit code, once it has exited by itself and its log was read to the end."""
    code = replica.process.wait(timeout=60)
    replica.stop()  # nothing left to stop: its log read, its pipe closed
    return code


async def test_a_draining_replica_takes_no_new_work_and_finishes_what_runs(cluster: Cluster) -> None:
    one = cluster.replicas["one"]
    answers: list[dict[str, object]] = []
    async with client_of(one.url, cluster.token, checked=False) as client:
        async with anyio.create_task_group() as group:

            async def long_call() -> None:  # the session's own call: the client lists no tools after it, as the
                # replica may be gone by then (it exits once its last call is answered)
                result = await client.session.call_tool("execute_command", {"command": "sleep 3; echo finished"})
                answers.append({"error": result.is_error, **(result.structured_content or {})})

            group.start_soon(long_call)
            with anyio.fail_after(30):  # the call is under way on the replica (its container runs)
                while not await anyio.to_thread.run_sync(containers_running, "sleep 3"):
                    await anyio.sleep(0.1)
            one.process.send_signal(signal.SIGTERM)
            await anyio.to_thread.run_sync(one.wait_for_line, "draining: no new work taken")
            async with httpx2.AsyncClient(timeout=10) as http:
                health = await http.get(one.url.replace("/mcp", "/healthz"))
                assert health.status_code == 503 and "draining since" in health.json()["serving"], health.text
                refused = await http.post(
                    one.url, headers={"Authorization": f"Bearer {cluster.token}", "Accept": "application/json"},
                    json={"jsonrpc": "2.0", "id": 1, "method": "tools/call",
                          "params": {"name": "execute_command", "arguments": {"command": "echo never"}}},
                )  # fmt: skip
            assert refused.status_code == 503 and refused.headers["retry-after"] == "1", refused.text
            assert "takes no new work; nothing of this request ran" in refused.json()["error"]["message"]
    assert answers == [{"error": False, **{k: v for k, v in answers[0].items() if k != "error"}}]
    assert answers[0]["stdout"] == "finished\n", answers
    assert await anyio.to_thread.run_sync(_stopped, one) == 0
    log = "".join(one.lines)
    assert "drained: nothing under way" in log and "SIGTERM: shutting down" in log, log
    assert "never" not in json.dumps(one.audit()), "the refused request ran"
    cluster.restart("one")


async def test_a_rolling_restart_under_load_loses_no_call_and_finishes_the_running_task(
    cluster: Cluster, tmp_path: Path
) -> None:
    with haproxy(tmp_path, cluster.replicas["one"], cluster.replicas["two"]) as url:
        failures: list[str] = []
        answered = [0]
        stop = anyio.Event()

        async def caller(number: int) -> None:
            async with client_of(url, cluster.token) as client:
                while not stop.is_set():
                    try:
                        result, seen = await shell(client, f"echo caller-{number}")
                    except Exception as exc:  # a call lost on the way: the client's error, whichever it is
                        failures.append(repr(exc))
                        continue
                    if result.is_error or seen.get("stdout") != f"caller-{number}\n":
                        failures.append(text_of(result))
                    answered[0] += 1

        async with client_of(url, cluster.token) as tasks:
            created = await start(tasks, "sleep 8; echo the-task-ended", timeout_s=60)
            async with anyio.create_task_group() as group:
                for number in range(CALLERS):
                    group.start_soon(caller, number)
                for name in ("one", "two"):
                    replica = cluster.replicas[name]
                    replica.process.send_signal(signal.SIGTERM)
                    assert await anyio.to_thread.run_sync(_stopped, replica) == 0, "".join(replica.lines)
                    served = len(replica.audit())  # its audit trail goes on in the same file
                    again = await anyio.to_thread.run_sync(cluster.restart, name)
                    with anyio.fail_after(60):  # back in service: the balancer sends it calls again
                        while len(again.audit()) == served:
                            await anyio.sleep(0.2)
                stop.set()
            task_id = created["task"]["taskId"] if "task" in created else created["taskId"]
            ended = await until(tasks, task_id, lambda task: task["status"] != "working")
            assert ended["status"] == "completed", ended
            result = await request(tasks, "tasks/result", taskId=task_id)
            assert "the-task-ended" in json.dumps(result), result
    assert not failures, f"{len(failures)} of {answered[0] + len(failures)} calls lost: {failures[:5]}"
    assert answered[0] >= 2 * CALLERS


async def test_an_operator_drains_a_replica_through_the_shared_state_by_its_name_which_outlives_restarts(
    cluster: Cluster,
) -> None:
    listed = run_cli("replicas", "list", "--state", cluster.database.url)
    assert listed.returncode == 0, listed.stderr
    replicas = {r["name"]: r for r in map(json.loads, listed.stdout.splitlines())}
    two = cluster.replicas["two"]
    owner = two.owner()
    assert replicas["two"]["replica"] == owner and not any(r["draining"] for r in replicas.values()), replicas
    with pytest.raises(AssertionError, match="--name two: the replica .* has this name and is alive"):
        start_replica(cluster.folder / "impostor", cluster.database.url, *cluster.args, "--name", "two")
    asked = run_cli("replicas", "drain", "two", "--state", cluster.database.url)
    assert asked.returncode == 0 and "asked two to drain" in asked.stderr, asked.stderr
    assert await anyio.to_thread.run_sync(_stopped, two) == 0
    assert "draining: asked through the shared state" in "".join(two.lines)
    after = run_cli("replicas", "list", "--state", cluster.database.url)
    assert owner not in after.stdout, after.stdout  # it said it left
    unknown = run_cli("replicas", "drain", "no-such-replica", "--state", cluster.database.url)
    assert unknown.returncode == 1 and "no replica 'no-such-replica'" in unknown.stderr
    again = cluster.restart("two")
    relisted = {
        r["name"]: r
        for r in map(json.loads, run_cli("replicas", "list", "--state", cluster.database.url).stdout.splitlines())
    }
    assert relisted["two"]["replica"] == again.owner() != owner, relisted  # the same name, another process
