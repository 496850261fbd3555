"""Kept workspaces: files last across the calls of a session (or of a workspace id), containers never do."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NamedTuple

import anyio
import mcp_types as types
import pytest
from mcp.shared.exceptions import MCPError

from sandbox_server.sandbox.engine.runtime import DockerRuntime
from tests.conftest import a_sleep_of_its_own, containers_running, kill_from_outside
from tests.mcp_harness import CheckedClient, audit_records, connect, http_server, stdio_parameters, text_of

pytestmark = pytest.mark.anyio

KEEPING = """\
extends: default
workspace: {persist: true, size_mb: 16, files: 2000, idle_ttl_s: 600, max_per_client: 3}
"""


class Keeping(NamedTuple):
    """A policy that keeps workspaces, its state folder, an audit log, and how the server keeps them."""

    policy: Path
    state: Path
    audit: Path
    kind: str


@pytest.fixture(params=["mounted", "archived"])
def keeping(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[Keeping]:
    """Every test runs with both ways of keeping workspaces (serve --workspaces)."""
    policy = tmp_path / "keeping.yaml"
    policy.write_text(KEEPING)
    yield Keeping(policy, tmp_path / "state", tmp_path / "audit.jsonl", request.param)


@pytest.fixture(scope="module", params=["mounted", "archived"])
def url(tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest) -> Iterator[str]:
    """One HTTP server for each way of keeping workspaces, shared by the tests that only open sessions and call:
    their workspaces are apart by session or id, and a client may keep 16, so none counts another test's."""
    folder = tmp_path_factory.mktemp(f"shared-{request.param}")
    policy = folder / "keeping.yaml"
    policy.write_text(KEEPING.replace("max_per_client: 3", "max_per_client: 16"))
    with http_server(*_serve_args(Keeping(policy, folder / "state", folder / "audit.jsonl", request.param))) as url:
        yield url


def _serve_args(keeping: Keeping) -> tuple[str, ...]:
    return (
        "--policy", str(keeping.policy), "--state-dir", str(keeping.state), "--audit-log", str(keeping.audit),
        "--workspaces", keeping.kind,
    )  # fmt: skip


def _containers(audit: Path) -> list[str]:
    return [r["container_id"] for r in audit_records(audit) if "container_id" in r]


async def _call(session: CheckedClient, command: str, **extra: Any) -> dict[str, Any]:
    result = await session.call_tool("execute_command", {"command": command, **extra})
    assert result.structured_content is not None, text_of(result)
    return {**result.structured_content, "is_error": result.is_error, "text": text_of(result)}


async def test_a_stdio_session_finds_its_files_in_the_next_call_in_another_container(
    keeping: Keeping, runtime: DockerRuntime
) -> None:
    async with connect(stdio_parameters(*_serve_args(keeping))) as session:
        first = await _call(session, "echo kept > a.txt; mkdir -p d/e && echo deep > d/e/f; echo temp > /tmp/t")
        second = await _call(session, "cat a.txt d/e/f; cat /tmp/t 2>&1 || true")
    assert not first["is_error"] and first["workspace"] == second["workspace"]
    assert second["stdout"].startswith("kept\ndeep\n") and "No such file" in second["stdout"]
    first_container, second_container = _containers(keeping.audit)
    assert first_container != second_container
    # The session ended with the server: its workspace is gone from the host.
    assert not [*(keeping.state / "workspaces").glob("ws-*"), *(keeping.state / "workspaces").glob("img-*")]


async def test_http_sessions_each_have_their_own_and_cannot_open_anothers(url: str, runtime: DockerRuntime) -> None:
    async with connect(url) as alice, connect(url) as bob:
        written = await _call(alice, "echo secret > mine.txt")
        theirs = await _call(bob, "ls")
        forged = await _call(bob, "cat mine.txt", workspace=written["workspace"])
        made_up = await _call(bob, "true", workspace="ws-" + "A" * 22)
        again = await _call(alice, "cat mine.txt")
    assert theirs["workspace"] != written["workspace"] and "mine.txt" not in theirs["stdout"]
    assert forged["is_error"] and made_up["is_error"]
    assert forged["error"]["field"] == "workspace" and forged["text"].replace(written["workspace"], "X") == made_up[
        "text"
    ].replace("ws-" + "A" * 22, "X")
    assert again["stdout"] == "secret\n"


async def test_2026_era_calls_continue_by_id_and_each_call_without_one_starts_empty(
    url: str, runtime: DockerRuntime
) -> None:
    async with connect(url, mode="2026-07-28") as session:
        first = await _call(session, "echo one > n.txt")
        continued = await _call(session, "cat n.txt; echo two >> n.txt", workspace=first["workspace"])
        fresh = await _call(session, "ls")
        last = await _call(session, "cat n.txt", workspace=first["workspace"])
    assert continued["stdout"] == "one\n" and last["stdout"] == "one\ntwo\n"
    assert fresh["workspace"] != first["workspace"] and "n.txt" not in fresh["stdout"]


async def test_a_disk_bomb_stops_at_the_workspace_size_and_the_next_call_still_runs(
    keeping: Keeping, runtime: DockerRuntime
) -> None:
    async with connect(stdio_parameters(*_serve_args(keeping))) as session:
        bomb = await _call(session, "dd if=/dev/zero of=big bs=1M count=64 2>&1; wc -c < big")
        inodes = await _call(
            session, "i=0; while [ $i -lt 3000 ]; do touch f$i 2>/dev/null || break; i=$((i+1)); done; echo made=$i"
        )
        after = await _call(session, "ls -s big; echo still-running")
    written = int(bomb["stdout"].split()[-1])
    assert "No space left on device" in bomb["stdout"], bomb["stdout"]
    assert 15 * 2**20 <= written <= 17 * 2**20, bomb["stdout"]  # workspace.size_mb is 16
    made = int(inodes["stdout"].strip().rsplit("=", 1)[-1])
    assert 1000 < made < 2000, inodes["stdout"]
    assert "still-running" in after["stdout"], after


async def test_a_timed_out_call_leaves_the_workspace_as_its_program_left_it(
    keeping: Keeping, runtime: DockerRuntime
) -> None:
    async with connect(stdio_parameters(*_serve_args(keeping))) as session:
        slow = await _call(session, "echo before > progress; sleep 30", timeout_s=1)
        after = await _call(session, "cat progress")
    assert slow["is_error"] and slow["text"].startswith("timed out after 1 s") and slow["timed_out"]
    assert after["stdout"] == "before\n"


async def test_a_program_that_kills_the_launchers_timer_is_neither_stopped_nor_called_timed_out(
    tmp_path: Path, runtime: DockerRuntime
) -> None:
    # An archived workspace's launcher stops the program at its deadline itself (to save it as it was), with a
    # timer that the OOM killer also ends when the workspace fills memory: that was answered 'timed out'. (A
    # mounted workspace needs no such timer: the host's timeout leaves its filesystem as the kill found it.)
    policy = tmp_path / "keeping.yaml"
    policy.write_text(KEEPING)
    archived = Keeping(policy, tmp_path / "state", tmp_path / "audit.jsonl", "archived")
    async with connect(stdio_parameters(*_serve_args(archived))) as session:
        ended = await _call(
            session,
            # The timer may start a moment after the program: look for it until it is there (at most 5 s).
            'for turn in $(seq 50); do for p in /proc/[0-9]*; do [ "$(cat $p/comm 2>/dev/null)" = sleep ] && '
            'kill -9 "${p#/proc/}" && echo killed && break 2; done; sleep 0.1; done; sleep 0.3; echo still-here > kept; '
            "cat kept",
        )
        after = await _call(session, "cat kept")
    assert not ended["is_error"] and not ended["timed_out"] and ended["stdout"] == "killed\nstill-here\n", ended
    assert after["stdout"] == "still-here\n"


async def test_an_archived_workspace_that_fills_memory_is_answered_out_of_memory_not_timed_out(
    tmp_path: Path, runtime: DockerRuntime
) -> None:
    # An archived workspace is a tmpfs, whose pages count against the memory cap: the OOM killer ends what runs,
    # the launcher's timer among them (which was taken for the deadline, and answered 'timed out after 60 s').
    policy = tmp_path / "small.yaml"
    policy.write_text(
        "extends: default\nworkspace: {persist: true, size_mb: 256}\ndefaults: {limits: {memory_mb: 64}}\n"
    )
    archived = Keeping(policy, tmp_path / "state", tmp_path / "audit.jsonl", "archived")
    async with connect(stdio_parameters(*_serve_args(archived))) as session:
        filled = await _call(session, "head -c 200M /dev/zero > big; echo written")
    assert filled["is_error"] and filled["oom_killed"] and not filled["timed_out"], filled["text"]
    assert filled["text"].startswith("killed: out of memory (64 MiB); policy field limits.memory_mb"), filled["text"]


async def test_links_fifos_and_output_files_are_not_carried_into_the_next_call(
    keeping: Keeping, runtime: DockerRuntime
) -> None:
    async with connect(stdio_parameters(*_serve_args(keeping))) as session:
        await _call(session, "ln -s /etc/shadow shadow; mkfifo pipe; echo x > kept; ln kept hard; echo o > out/o.txt")
        after = await _call(session, "ls -l; ls out | wc -l; cat hard")
    listing = after["stdout"]
    assert "shadow -> /etc/shadow" in listing and listing.rstrip().endswith("0\nx")
    # An archive keeps no FIFO; a mounted filesystem keeps it where the host never opens it.
    assert ("pipe" in listing) == (keeping.kind == "mounted")


async def test_a_mounted_workspaces_output_folder_is_read_by_the_host_not_sent_by_the_launcher(
    keeping: Keeping, runtime: DockerRuntime
) -> None:
    async with connect(stdio_parameters(*_serve_args(keeping))) as session:
        done = await _call(
            session, "echo a > out/a.txt; echo b > out/locked.txt; chmod 000 out/locked.txt; ln -s a.txt out/x"
        )
    returned = {item["path"] for item in done["files"]}
    # The sandbox's user cannot read what it made unreadable, so the launcher's tar leaves it out; where the workspace
    # is mounted, the host reads the folder on its own mount, and returns it. A link is never followed either way.
    assert returned == ({"a.txt", "locked.txt"} if keeping.kind == "mounted" else {"a.txt"}), done["text"]
    assert "x: skipped, links are never followed" in done["text"]


async def test_a_2026_workspace_outlives_a_restart_until_its_idle_time_then_the_sweep_removes_it(
    keeping: Keeping, runtime: DockerRuntime
) -> None:
    policy, state = keeping.policy, keeping.state
    with http_server(*_serve_args(keeping)) as url:
        async with connect(url, mode="2026-07-28") as session:
            first = await _call(session, "echo across > r.txt")
    with http_server(*_serve_args(keeping)) as url:
        async with connect(url, mode="2026-07-28") as session:
            continued = await _call(session, "cat r.txt", workspace=first["workspace"])
    assert continued["stdout"] == "across\n"
    policy.write_text(KEEPING.replace("idle_ttl_s: 600", "idle_ttl_s: 0.01"))
    with http_server(*_serve_args(keeping)) as url:
        async with connect(url, mode="2026-07-28") as session:
            expired = await _call(session, "true", workspace=first["workspace"])
    assert expired["is_error"] and expired["error"]["field"] == "workspace"
    assert not list((state / "workspaces").glob(f"{first['workspace']}*"))


async def test_a_client_past_its_workspace_cap_loses_one_nobody_continued_and_the_loser_is_told(
    keeping: Keeping, runtime: DockerRuntime
) -> None:
    with http_server(*_serve_args(keeping)) as url:
        async with connect(url, mode="2026-07-28") as session:
            made = [await _call(session, "echo one > f")]
            await _call(session, "cat f", workspace=made[0]["workspace"])  # the first is continued
            made += [await _call(session, "true") for _ in range(3)]
            lost = await _call(session, "true", workspace=made[1]["workspace"])
            kept = await _call(session, "cat f", workspace=made[0]["workspace"])
    # The second, which no call continued, went first, though the first was made earlier.
    assert f"workspace {made[1]['workspace']} (no call continued it) was removed" in made[3]["text"]
    assert "workspace.max_per_client" in made[3]["text"] and kept["stdout"] == "one\n"
    assert lost["is_error"] and lost["error"]["field"] == "workspace.max_per_client"
    assert f"workspace {made[1]['workspace']} was removed to make room for a newer one" in lost["text"]


async def test_a_stateless_client_past_its_workspace_cap_is_never_refused(
    keeping: Keeping, runtime: DockerRuntime
) -> None:
    with http_server(*_serve_args(keeping)) as url:
        async with connect(url, mode="2026-07-28") as session:
            calls = [await _call(session, "true") for _ in range(5)]  # never passes an id back; the cap is 3
    assert not any(call["is_error"] for call in calls), [call["text"] for call in calls if call["is_error"]]


async def test_a_workspace_continued_in_the_last_minutes_is_never_removed_to_make_room(
    keeping: Keeping, runtime: DockerRuntime
) -> None:
    with http_server(*_serve_args(keeping)) as url:
        async with connect(url, mode="2026-07-28") as session:
            made = [await _call(session, f"echo {n} > f") for n in range(3)]
            for each in made:  # each is continued: someone works in it
                await _call(session, "true", workspace=each["workspace"])
            refused = await _call(session, "true")
            still = [await _call(session, "cat f", workspace=m["workspace"]) for m in made]
    assert refused["is_error"] and refused["error"]["field"] == "workspace.max_per_client"
    assert "workspace.protect_recent_s" in refused["text"] and "none is removed" in refused["text"]
    assert [entry["stdout"] for entry in still] == ["0\n", "1\n", "2\n"]


async def test_programs_run_from_the_workspace_with_either_way_of_keeping_it(
    keeping: Keeping, runtime: DockerRuntime
) -> None:
    async with connect(stdio_parameters(*_serve_args(keeping))) as session:
        ran = await _call(session, "printf '#!/bin/sh\\necho ran\\n' > t.sh && chmod +x t.sh && ./t.sh")
    assert not ran["is_error"] and ran["stdout"] == "ran\n", ran["text"]  # workspace.exec: true (the default)


async def test_in_the_2026_era_over_http_a_workspaces_files_are_listed_by_its_id(
    url: str, runtime: DockerRuntime
) -> None:
    async with connect(url, mode="2026-07-28") as session:
        made = await session.call_tool("run_python", {"code": "x = 1\nopen('notes.txt', 'w').write('hi')"})
        assert made.structured_content is not None, text_of(made)
        workspace = made.structured_content["workspace"]
        templates = await session.list_resource_templates()
        read = await session.read_resource(f"sandbox://workspace/{workspace}/")
        listed = json.loads(read.contents[0].text)  # type: ignore[union-attr]
        file = await session.read_resource(listed["files"][0]["uri"])
        with pytest.raises(MCPError):  # an id that is no workspace lists nothing
            await session.read_resource("sandbox://workspace/ws-AAAAAAAAAAAAAAAAAAAAAA/")
    assert "sandbox://workspace/{workspace}/" in [t.uri_template for t in templates.resource_templates]
    assert [entry["path"] for entry in listed["files"]] == ["notes.txt"]  # not run_python's own .sandbox/
    assert file.contents[0].text == "hi"  # type: ignore[union-attr]


async def test_over_stdio_calls_continue_the_connections_workspace_in_both_eras(
    keeping: Keeping, runtime: DockerRuntime
) -> None:
    for mode in ("legacy", "2026-07-28"):
        async with connect(stdio_parameters(*_serve_args(keeping)), mode=mode) as session:
            first = await session.call_tool("run_python", {"code": "x = 41"})
            second = await session.call_tool("run_python", {"code": "x + 1"})
            listed = await session.list_resources()
        assert second.structured_content is not None, text_of(second)
        assert second.structured_content["stdout"] == "42\n", (mode, text_of(second))
        assert first.structured_content is not None
        assert first.structured_content["workspace"] == second.structured_content["workspace"]
        assert not any(".sandbox" in str(resource.uri) for resource in listed.resources)  # internal files stay so
        # The connection's workspace goes with the process.
        assert not list((keeping.state / "workspaces").glob(f"{first.structured_content['workspace']}*"))


async def test_a_workspace_past_the_hosts_storage_cap_is_not_kept_and_the_answer_names_the_field(
    keeping: Keeping, runtime: DockerRuntime
) -> None:
    policy = keeping.policy
    if keeping.kind == "mounted":  # a new filesystem counts at its whole size (21.8 MiB) while its first call runs
        policy.write_text(KEEPING + "host: {workspace_storage_mb: 30}\n")
        with http_server(*_serve_args(keeping)) as url:
            async with connect(url, mode="2026-07-28") as session:
                first = await _call(session, "head -c 12M /dev/zero > big; echo wrote")  # then 12 MiB
                second = await _call(session, "true")
        assert not first["is_error"] and second["is_error"], second["text"]
        assert second["error"]["field"] == "host.workspace_storage_mb" and "no new workspace" in second["text"]
        return
    policy.write_text(KEEPING + "host: {workspace_storage_mb: 1}\n")
    async with connect(stdio_parameters(*_serve_args(keeping))) as session:
        small = await _call(session, "echo small > s.txt")
        big = await _call(session, "head -c 2000000 /dev/zero > big; echo wrote")
        after = await _call(session, "ls")
    assert not small["is_error"] and big["is_error"] and big["stdout"] == "wrote\n"
    assert "the workspace was not saved" in big["text"] and "host.workspace_storage_mb" in big["text"]
    assert after["stdout"] == "out\ns.txt\n"


async def test_a_policy_that_keeps_nothing_refuses_a_workspace_id(tmp_path: Path, runtime: DockerRuntime) -> None:
    forgetting = tmp_path / "forgetting.yaml"
    forgetting.write_text("extends: default\nworkspace: {persist: false}\n")
    async with connect(stdio_parameters("--policy", str(forgetting))) as session:
        first = await _call(session, "echo x > a")
        refused = await _call(session, "true", workspace="ws-" + "B" * 22)
        second = await _call(session, "ls")
    assert "workspace" not in first and refused["is_error"] and refused["error"]["field"] == "workspace"
    assert second["stdout"] == "out\n"


async def test_workspace_files_are_resources_of_their_session_only(url: str, runtime: DockerRuntime) -> None:
    async with connect(url) as alice, connect(url) as bob:
        written = await _call(alice, "mkdir -p data && printf 'a,b\\n1,2\\n' > data/t.csv")
        listed = (await alice.list_resources()).resources
        uri = next(str(r.uri) for r in listed if r.name == "data/t.csv")
        read = await alice.read_resource(uri)
        with pytest.raises(MCPError) as foreign:
            await bob.read_resource(uri)
        bobs = [r.name for r in (await bob.list_resources()).resources]
        templates = (await alice.list_resource_templates()).resource_templates
    async with connect(url, mode="2026-07-28") as modern:
        with pytest.raises(MCPError) as by_id:
            await modern.read_resource(uri)
    assert uri == f"sandbox://workspace/{written['workspace']}/data/t.csv"
    assert isinstance(read.contents[0], types.TextResourceContents) and read.contents[0].text == "a,b\n1,2\n"
    assert [r.mime_type for r in listed if r.name == "data/t.csv"] == ["text/csv"]
    assert foreign.value.error.code == -32002 and "data/t.csv" not in bobs
    assert by_id.value.error.code == -32602  # a session's workspace is not anyone's capability
    assert [t.uri_template for t in templates] == [
        "sandbox://workspace/{workspace}/{+path}",
        "sandbox://workspace/{workspace}/",
        "sandbox://tasks/{task_id}/output",
        "sandbox://services/{id}",
    ]


async def test_a_2026_workspace_file_is_read_by_its_id(url: str, runtime: DockerRuntime) -> None:
    async with connect(url, mode="2026-07-28") as session:
        written = await _call(session, "echo hello > greeting.txt")
        read = await session.read_resource(f"sandbox://workspace/{written['workspace']}/greeting.txt")
    assert isinstance(read.contents[0], types.TextResourceContents) and read.contents[0].text == "hello\n"


async def test_run_python_keeps_a_dataframe_for_the_next_cell_and_names_what_it_cannot_keep(
    keeping: Keeping, runtime: DockerRuntime
) -> None:
    async with connect(stdio_parameters(*_serve_args(keeping))) as session:
        first = await session.call_tool(
            "run_python",
            {"code": "import pandas as pd, matplotlib.pyplot as plt\ndf = pd.DataFrame({'x': [1, 2, 3]})\n"
             "total = int(df.x.sum())\nfig = plt.figure()\nstream = open('/dev/null')"},
        )  # fmt: skip
        second = await session.call_tool(
            "run_python", {"code": "df['y'] = df.x * 2\n(total, int(df.y.sum()), pd.__name__)"}
        )
    assert not first.is_error and not second.is_error, text_of(second)
    assert "variables kept for the next cell: df, total, fig" in text_of(first)
    assert "not kept: stream (TextIOWrapper: not picklable" in text_of(first)
    assert second.structured_content is not None
    assert second.structured_content["stdout"].strip() == "(6, 12, 'pandas')"
    assert not any(f["path"] == "cell-state.json" for f in second.structured_content["files"])


async def test_a_poisoned_state_runs_only_inside_the_next_sandbox(
    keeping: Keeping, runtime: DockerRuntime, tmp_path: Path
) -> None:
    marker = tmp_path / "poisoned-on-the-host"
    poison = (
        "import os, pickle\n"
        "class Evil:\n"
        "    def __reduce__(self):\n"
        f"        return (os.system, ('id -u > /workspace/ran-inside; touch {marker}',))\n"
        "os.makedirs('.sandbox', exist_ok=True)\n"
        "pickle.dump({'values': {'x': Evil()}}, open('.sandbox/cell-state.pickle', 'wb'))\n"
        "os._exit(0)  # before the launcher keeps this cell's own variables over the planted ones"
    )
    async with connect(stdio_parameters(*_serve_args(keeping))) as session:
        planted = await session.call_tool("run_python", {"code": poison})
        loaded = await session.call_tool("run_python", {"code": "open('ran-inside').read().strip()"})
    assert not planted.is_error, text_of(planted)
    assert loaded.structured_content is not None and loaded.structured_content["stdout"].strip() == "'1000'"
    assert not marker.exists()


async def test_calls_in_a_mounted_workspace_run_side_by_side_and_in_an_archived_one_wait_or_are_answered_busy(
    keeping: Keeping, runtime: DockerRuntime
) -> None:
    results: dict[str, dict[str, Any]] = {}

    async def call(name: str, command: str, timeout_s: float = 10) -> None:
        results[name] = await _call(session, command, timeout_s=timeout_s)

    async with connect(stdio_parameters(*_serve_args(keeping))) as session:
        await _call(session, "true")
        async with anyio.create_task_group() as group:
            group.start_soon(call, "first", "sleep 2; echo a >> log")
            await _running("sleep 2")
            group.start_soon(call, "second", "echo b >> log; cat log")
        async with anyio.create_task_group() as group:
            group.start_soon(call, "long", "sleep 6")
            await _running("sleep 6")
            group.start_soon(call, "impatient", "cat log", 1)
    impatient = results["impatient"]
    if keeping.kind == "archived":
        # Each call starts from the archive the one before saved: without one call at a time the second
        # would have started from the workspace before "a" (and one of the two saves would be lost).
        assert results["second"]["stdout"] == "a\nb\n"
        assert impatient["is_error"] and impatient["error"]["kind"] == "busy"
        assert impatient["error"]["field"] == "workspace"
    else:
        # One filesystem, as on a laptop: the second ran while the first slept, and both appends are kept.
        assert results["second"]["stdout"] == "b\n"
        assert not impatient["is_error"] and impatient["stdout"] == "b\na\n", impatient


async def _running(command: str) -> None:
    with anyio.fail_after(10):
        while not containers_running(command):
            await anyio.sleep(0.05)


async def test_a_call_that_changes_the_workspace_tells_the_session_its_resources_changed(
    keeping: Keeping, runtime: DockerRuntime
) -> None:
    send, told = anyio.create_memory_object_stream[object](16)

    async def on_message(message: object) -> None:
        if isinstance(message, types.ResourceListChangedNotification):
            await send.send(message)

    async with send, told, connect(stdio_parameters(*_serve_args(keeping)), message_handler=on_message) as session:
        await _call(session, "true")  # kept, changing nothing: nothing to list again
        await _call(session, "echo new > file.txt")
        with anyio.fail_after(5):
            await told.receive()
        await _call(session, "cat file.txt")  # read, not changed
        await _call(session, "echo newer > file.txt")  # changed again
        with anyio.fail_after(5):
            await told.receive()
        capabilities = session.server_capabilities
        # A notification is handled before the answer after it on the one stream: none came for the other calls.
        assert told.statistics().current_buffer_used == 0
    assert capabilities.resources is not None and capabilities.resources.list_changed


async def test_an_http_session_its_client_ends_takes_its_workspace_with_it(
    keeping: Keeping, runtime: DockerRuntime
) -> None:
    state = keeping.state / "workspaces"
    with http_server(*_serve_args(keeping)) as url:
        async with connect(url) as session:
            written = await _call(session, "echo bye > gone.txt")
            assert list(state.glob(f"{written['workspace']}.*"))
        # Leaving the session sends DELETE: the server ends it, and its workspace with it.
        with anyio.fail_after(5):
            while list(state.glob(f"{written['workspace']}.*")):
                await anyio.sleep(0.05)


async def test_resources_never_follow_a_link_or_open_a_fifo_the_sandbox_left(
    keeping: Keeping, runtime: DockerRuntime
) -> None:
    with http_server(*_serve_args(keeping)) as url:
        async with connect(url, mode="2026-07-28") as session:
            made = await _call(
                session,
                "echo mine > real.txt; ln -s /etc/hostname host.txt; ln -s /etc up; mkfifo pipe.txt; "
                "mkdir d; ln -s ../real.txt d/again.txt",
            )
            base = f"sandbox://workspace/{made['workspace']}/"
            read = await session.read_resource(base + "real.txt")
            refused = {}
            for path in ("host.txt", "up/hostname", "pipe.txt", "d/again.txt", "out"):
                with anyio.fail_after(5), pytest.raises(MCPError) as missing:
                    await session.read_resource(base + path)
                refused[path] = missing.value.error.code
    assert isinstance(read.contents[0], types.TextResourceContents) and read.contents[0].text == "mine\n"
    assert set(refused.values()) == {-32602}, refused


async def test_a_sessions_resource_list_names_its_regular_files_only(keeping: Keeping, runtime: DockerRuntime) -> None:
    async with connect(stdio_parameters(*_serve_args(keeping))) as session:
        await _call(session, "echo a > a.txt; ln -s /etc/passwd p.txt; mkfifo f; mkdir -p s/t && echo b > s/t/b.txt")
        names = sorted(r.name for r in (await session.list_resources()).resources if "workspace" in str(r.uri))
    assert names == ["a.txt", "s/t/b.txt"]


async def test_a_result_says_what_the_call_changed_in_its_workspace(keeping: Keeping, runtime: DockerRuntime) -> None:
    async with connect(stdio_parameters(*_serve_args(keeping))) as session:
        made = await _call(session, "echo a > a.txt; echo b > b.txt; echo c > c.txt; echo o > out/o.txt")
        changed = await _call(
            session, "echo more >> a.txt; rm b.txt; mv c.txt d.txt; echo t > tmp; rm tmp; echo n > new.txt"
        )
        nothing = await _call(session, "cat a.txt > /dev/null")
    assert not any(answer["is_error"] for answer in (made, changed, nothing)), (made, changed, nothing)
    assert made["changes"]["created"] == ["a.txt", "b.txt", "c.txt"]  # not out/: returned, never kept
    changes = changed["changes"]
    assert changes["modified"] == ["a.txt"] and changes["more"] == 0
    if keeping.kind == "mounted":  # the file's inode under another name
        assert changes["renamed"] == [{"from": "c.txt", "to": "d.txt"}]
        assert changes["created"] == ["new.txt"] and changes["deleted"] == ["b.txt"]
    else:  # an archive keeps no inode: a rename is a deletion and a creation
        assert changes["created"] == ["d.txt", "new.txt"] and changes["deleted"] == ["b.txt", "c.txt"]
    assert "workspace changes: " in changed["text"] and "a.txt" in changed["text"]
    assert nothing["changes"] == {"created": [], "modified": [], "deleted": [], "renamed": [], "more": 0}
    assert "workspace changes" not in nothing["text"]


async def test_large_workspaces_in_use_count_what_they_hold_plus_a_bounded_reserve(
    tmp_path: Path, runtime: DockerRuntime
) -> None:
    """A 2 GiB workspace in use holding a few kilobytes counts 256 MiB (an eighth of its size), not 2 GiB: a host's
    cap of 900 MiB holds three in use at once. A fourth is refused busy, naming what holds the room; a call that
    only lists workspaces is never refused for storage."""
    policy = tmp_path / "large.yaml"
    policy.write_text(
        "extends: default\nworkspace: {persist: true, size_mb: 2048, files: 2000, max_per_client: 8}\n"
        "host: {workspace_storage_mb: 900}\n"
    )
    sleep = a_sleep_of_its_own(30)
    with http_server(*_serve_args(Keeping(policy, tmp_path / "state", tmp_path / "audit.jsonl", "mounted"))) as url:
        async with connect(url, mode="2026-07-28") as session:
            held: list[dict[str, Any]] = []

            async def hold() -> None:
                held.append(await _call(session, f"{sleep} & wait"))

            async with anyio.create_task_group() as group:
                for _ in range(3):
                    group.start_soon(hold)
                while len(containers_running(sleep)) < 3:
                    await anyio.sleep(0.05)
                fourth = await _call(session, "true")
                bookkeeping = await session.call_tool("workspaces", {"action": "list"})
                for container in containers_running(sleep):
                    kill_from_outside(container)
    assert len(held) == 3 and all(not result["timed_out"] for result in held), held
    assert fourth["is_error"] and fourth["error"]["kind"] == "busy", fourth["text"]
    assert fourth["error"]["field"] == "host.workspace_storage_mb"
    assert "no new workspace" in fourth["text"] and "in use (a call works in it) counts" in fourth["text"]
    assert not bookkeeping.is_error, text_of(bookkeeping)
