"""Named workspaces: a caller keeps one under a name; it outlives its session and restarts of the server, any
later session opens it by that name, and it is listed and deleted by its caller (the `workspaces` tool)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NamedTuple

import pytest

from sandbox_server.sandbox.engine.runtime import DockerRuntime
from tests.mcp_harness import CheckedClient, audit_records, connect, http_server, stdio_parameters, text_of

pytestmark = pytest.mark.anyio

KEEPING = """\
extends: default
workspace: {persist: true, size_mb: 16, files: 2000, idle_ttl_s: 600, max_per_client: 2, named_per_caller: 2}
"""


class Keeping(NamedTuple):
    policy: Path
    state: Path
    kind: str

    def args(self) -> tuple[str, ...]:
        return ("--policy", str(self.policy), "--state-dir", str(self.state), "--workspaces", self.kind)


@pytest.fixture(params=["mounted", "archived"])
def keeping(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[Keeping]:
    policy = tmp_path / "keeping.yaml"
    policy.write_text(KEEPING)
    yield Keeping(policy, tmp_path / "state", request.param)


async def _call(session: CheckedClient, tool: str, **arguments: Any) -> dict[str, Any]:
    result = await session.call_tool(tool, arguments)
    assert result.structured_content is not None, text_of(result)
    return {**result.structured_content, "is_error": result.is_error, "text": text_of(result)}


async def test_a_named_workspace_outlives_its_session_and_a_restart_and_opens_by_name(
    keeping: Keeping, runtime: DockerRuntime
) -> None:
    async with connect(stdio_parameters(*keeping.args())) as session:
        await _call(session, "execute_command", command="echo rows > data.csv")
        await _call(session, "run_python", code="total = 41")
        kept = await _call(session, "workspaces", action="keep", name="sales-2024")
        scratch = await _call(session, "workspaces", action="list")
    assert not kept["is_error"] and "kept as 'sales-2024'" in kept["text"], kept["text"]
    assert "it lasts 30 days unused (workspace.keep_s)" in kept["text"], kept["text"]  # as people say it
    [row] = scratch["workspaces"]  # the session goes on in the workspace it named
    assert (row["name"], row["id"], row["current"]) == ("sales-2024", kept["workspace"], True)
    assert row["expires_in_s"] > 2_000_000  # workspace.keep_s (30 days), not idle_ttl_s
    # The stdio session ended with its server; a new server on the same state folder, a new session.
    async with connect(stdio_parameters(*keeping.args())) as session:
        fresh = await _call(session, "execute_command", command="ls")
        cell = await _call(session, "run_python", code="total + 1", workspace="sales-2024")
        files = await _call(session, "execute_command", command="cat data.csv", workspace="sales-2024")
        listed = await _call(session, "workspaces", action="list")
    assert "data.csv" not in fresh["stdout"] and fresh["workspace"] != kept["workspace"]  # its own session's, new
    assert (cell["stdout"], files["stdout"]) == ("42\n", "rows\n"), (cell["text"], files["text"])
    assert cell["workspace"] == kept["workspace"] and "pass either as `workspace`" in cell["text"]
    names = {(item["name"], item["id"]) for item in listed["workspaces"]}
    assert ("sales-2024", kept["workspace"]) in names and (None, fresh["workspace"]) in names


async def test_a_second_server_on_the_default_folder_says_where_a_name_given_through_the_first_is_kept(
    tmp_path: Path, runtime: DockerRuntime
) -> None:
    """Two desktop clients, or a client and `sandbox-server call` in a terminal, each start a server from one
    environment: the second keeps its workspaces in a subfolder of the default one, and a name given through the
    first is not the second's, which says where it lives and which process holds it."""
    policy = tmp_path / "keeping.yaml"
    policy.write_text(KEEPING)
    environment = {"SANDBOX_STATE_DIR": str(tmp_path / "state")}  # the default folder, as both clients' servers find it
    async with connect(stdio_parameters("--policy", str(policy), "--workspaces", "archived", env=environment)) as first:
        await _call(first, "execute_command", command="echo rows > ventes.csv")
        kept = await _call(first, "workspaces", action="keep", name="ventes-hgb")
        assert not kept["is_error"], kept["text"]
        second_server = stdio_parameters("--policy", str(policy), "--workspaces", "archived", env=environment)
        async with connect(second_server) as second:
            refused = await _call(second, "execute_command", command="ls", workspace="ventes-hgb")
            listed = await _call(second, "workspaces", action="export", workspace="ventes-hgb")
    assert refused["is_error"] and refused["error"]["field"] == "workspace", refused["text"]
    said = refused["text"]
    assert (
        f"unknown workspace 'ventes-hgb' here: it is kept in {tmp_path / 'state'}, which the server of process" in said
    )
    assert f"this server keeps its workspaces in {tmp_path / 'state' / 'servers' / '2'}" in said, said
    assert listed["is_error"] and "it is kept in" in listed["text"], listed["text"]  # by name through any tool


async def test_names_are_the_callers_own_bounded_by_the_policy_and_refused_in_words(
    keeping: Keeping, runtime: DockerRuntime
) -> None:
    with http_server(*keeping.args()) as url:
        async with connect(url, mode="2026-07-28") as alice:
            first = await _call(alice, "execute_command", command="echo a > f")
            named = await _call(alice, "workspaces", action="keep", name="one", workspace=first["workspace"])
            second = await _call(alice, "execute_command", command="true")
            taken = await _call(alice, "workspaces", action="keep", name="one", workspace=second["workspace"])
            renamed = await _call(alice, "workspaces", action="keep", name="uno", workspace="one")
            await _call(alice, "workspaces", action="keep", name="two", workspace=second["workspace"])
            third = await _call(alice, "execute_command", command="true")
            over = await _call(alice, "workspaces", action="keep", name="three", workspace=third["workspace"])
            for _ in range(3):  # unnamed ones past workspace.max_per_client (2): the named ones are not removed
                await _call(alice, "execute_command", command="true")
            old_name = await _call(alice, "execute_command", command="cat f", workspace="one")
            by_new = await _call(alice, "execute_command", command="cat f", workspace="uno")
            never = await _call(alice, "execute_command", command="true", workspace="never-given")
            bad = await alice.call_tool("workspaces", {"action": "keep", "name": "ws-mine"})
    assert not named["is_error"] and not renamed["is_error"], (named["text"], renamed["text"])
    assert (
        taken["is_error"]
        and taken["error"]["field"] == "name"
        and "already has a workspace named 'one'" in taken["text"]
    )
    assert over["is_error"] and over["error"]["field"] == "workspace.named_per_caller", over["text"]
    assert "named_per_caller: 2" in over["text"]
    assert old_name["is_error"] and old_name["error"]["field"] == "workspace"  # the old name no longer opens it
    assert by_new["stdout"] == "a\n" and by_new["workspace"] == first["workspace"]
    assert never["is_error"] and "unknown workspace 'never-given'" in never["text"], never["text"]
    assert bad.is_error and "not with 'ws-'" in text_of(bad), text_of(bad)


async def test_a_deleted_workspace_is_gone_with_its_files_and_its_name(
    keeping: Keeping, runtime: DockerRuntime
) -> None:
    with http_server(*keeping.args()) as url:
        async with connect(url, mode="2026-07-28") as session:
            made = await _call(session, "execute_command", command="echo x > f")
            await _call(session, "workspaces", action="keep", name="gone-soon", workspace=made["workspace"])
            deleted = await _call(session, "workspaces", action="delete", workspace="gone-soon")
            by_name = await _call(session, "execute_command", command="true", workspace="gone-soon")
            by_id = await _call(session, "execute_command", command="true", workspace=made["workspace"])
            listed = await _call(session, "workspaces", action="list")
    assert not deleted["is_error"] and "is deleted" in deleted["text"] and "workspace" not in deleted, deleted
    assert by_name["is_error"] and by_id["is_error"] and by_id["error"]["field"] == "workspace"
    assert made["workspace"] not in {item["id"] for item in listed["workspaces"]}


async def test_a_fork_holds_the_files_and_variables_as_they_were_and_the_two_change_apart(
    keeping: Keeping, runtime: DockerRuntime
) -> None:
    with http_server(*keeping.args()) as url:
        async with connect(url, mode="2026-07-28") as session:
            base = await _call(session, "execute_command", command="echo base > f")
            origin = base["workspace"]
            await _call(session, "run_python", code="x = [1]", workspace=origin)
            named = await _call(session, "workspaces", action="fork", name="branch-a", workspace=origin)
            plain = await _call(session, "workspaces", action="fork", workspace=origin)
            in_fork = await _call(session, "run_python", code="x.append(2)\nx", workspace="branch-a")
            await _call(session, "execute_command", command="echo fork >> f", workspace="branch-a")
            in_plain = await _call(session, "execute_command", command="cat f", workspace=plain["forked"])
            in_origin = await _call(session, "run_python", code="print(x, open('f').read().strip())", workspace=origin)
            fork_file = await _call(session, "execute_command", command="cat f", workspace="branch-a")
            listed = await _call(session, "workspaces", action="list", workspace=origin)
    assert not named["is_error"] and "forked as 'branch-a'" in named["text"], named["text"]
    assert named["forked"] not in (origin, plain["forked"])
    assert in_fork["stdout"] == "[1, 2]\n" and in_fork["workspace"] == named["forked"], in_fork["text"]
    assert (in_plain["stdout"], in_origin["stdout"]) == ("base\n", "[1] base\n"), (in_plain["text"], in_origin["text"])
    assert fork_file["stdout"] == "base\nfork\n"
    names = {item["id"]: item["name"] for item in listed["workspaces"]}
    assert names[named["forked"]] == "branch-a" and names[plain["forked"]] is None and origin in names


ROOMY = """\
extends: default
workspace: {persist: true, size_mb: 16, files: 2000, idle_ttl_s: 600, max_per_client: 6, named_per_caller: 6,
            snapshots_per_caller: 1}
"""


@pytest.fixture
def roomy(keeping: Keeping) -> Keeping:
    """Room for several branches, and one snapshot per caller."""
    keeping.policy.write_text(ROOMY)
    return keeping


async def test_a_snapshot_restores_files_and_variables_byte_equal_into_a_new_workspace_or_the_same(
    roomy: Keeping, runtime: DockerRuntime
) -> None:
    digest = "sha256sum blob | cut -c1-64"
    with http_server(*roomy.args()) as url:
        async with connect(url, mode="2026-07-28") as session:
            made = await _call(session, "execute_command", command=f"head -c 300000 /dev/urandom > blob; {digest}")
            base = made["workspace"]
            await _call(session, "run_python", code="kept = {'a': [1, 2], 'b': 'text'}", workspace=base)
            taken = await _call(session, "workspaces", action="snapshot", name="before", workspace=base)
            second = await _call(session, "workspaces", action="snapshot", workspace=base)
            await _call(session, "execute_command", command="rm blob", workspace=base)
            await _call(session, "run_python", code="kept = None", workspace=base)
            opened = await _call(session, "execute_command", command="true", workspace="before")
            restored = await _call(
                session, "workspaces", action="restore", snapshot="before", name="again", workspace=base
            )
            in_new = await _call(session, "execute_command", command=digest, workspace="again")
            new_cell = await _call(session, "run_python", code="print(kept)", workspace="again")
            replaced = await _call(
                session, "workspaces", action="restore", snapshot="before", replace=True, workspace=base
            )
            in_base = await _call(session, "execute_command", command=digest, workspace=base)
            base_cell = await _call(session, "run_python", code="print(kept)", workspace=base)
            listed = await _call(session, "workspaces", action="list", workspace=base)
            deleted = await _call(session, "workspaces", action="delete", snapshot="before", workspace=base)
            after = await _call(session, "workspaces", action="list", workspace=base)
    assert not taken["is_error"] and "snapshotted as 'before'" in taken["text"], taken["text"]
    assert second["is_error"] and second["error"]["field"] == "workspace.snapshots_per_caller", second["text"]
    assert opened["is_error"] and "is a snapshot" in opened["text"] and opened["error"]["field"] == "workspace"
    assert not restored["is_error"] and restored["forked"] != base, restored["text"]
    assert in_new["stdout"] == made["stdout"] and in_base["stdout"] == made["stdout"], (in_new, in_base)
    assert new_cell["stdout"] == base_cell["stdout"] == "{'a': [1, 2], 'b': 'text'}\n", (new_cell, base_cell)
    assert not replaced["is_error"] and "holds snapshot 'before' again" in replaced["text"], replaced["text"]
    [row] = [item for item in listed["workspaces"] if item["snapshot"]]
    assert (row["id"], row["name"], row["origin"]) == (taken["snapshot"], "before", base)
    assert not deleted["is_error"] and not any(item["snapshot"] for item in after["workspaces"]), deleted["text"]


async def test_three_branches_compared_say_the_files_and_variables_each_changed(
    roomy: Keeping, runtime: DockerRuntime
) -> None:
    with http_server(*roomy.args()) as url:
        async with connect(url, mode="2026-07-28") as session:
            base = (await _call(session, "execute_command", command="echo a > f.txt"))["workspace"]
            await _call(session, "run_python", code="n = 1\nitems = [1, 2, 3]", workspace=base)
            for branch in ("b1", "b2", "b3"):
                await _call(session, "workspaces", action="fork", name=branch, workspace=base)
            await _call(session, "execute_command", command="echo new > added.txt", workspace="b1")
            await _call(session, "run_python", code="total = sum(items)", workspace="b1")  # items read, not changed
            await _call(session, "run_python", code="n = 2", workspace="b2")
            await _call(session, "execute_command", command="rm f.txt", workspace="b3")
            await _call(
                session, "run_python", code="import numpy as np\narr = np.zeros((3, 4))\ndel items", workspace="b3"
            )
            result = await _call(session, "workspaces", action="compare", branches=["b1", "b2", "b3"], workspace=base)
            itself = await _call(session, "workspaces", action="compare", branches=[base], workspace=base)
    assert not result["is_error"], result["text"]
    b1, b2, b3 = result["branches"]
    assert (b1["name"], b1["files"]["created"], b1["files"]["deleted"]) == ("b1", ["added.txt"], [])
    assert b1["variables"] == {"added": [{"name": "total", "about": "int 6"}], "changed": [], "removed": [], "more": 0}
    assert b2["files"]["created"] == b2["files"]["deleted"] == b2["files"]["modified"] == []
    assert b2["variables"]["changed"] == [{"name": "n", "about": "int 2", "was": "int 1"}], b2["variables"]
    assert b3["files"]["deleted"] == ["f.txt"]
    assert b3["variables"]["added"] == [{"name": "arr", "about": "ndarray 3 x 4"}], b3["variables"]
    assert b3["variables"]["removed"] == [{"name": "items", "about": "list of 3"}], b3["variables"]
    assert "b2: no file changed; variables: ~n: int 1 -> int 2" in result["text"], result["text"]
    assert itself["is_error"] and itself["error"]["field"] == "branches"


async def test_a_callers_storage_share_holds_under_many_forks(keeping: Keeping, runtime: DockerRuntime) -> None:
    keeping.policy.write_text(
        "extends: default\nworkspace: {persist: true, size_mb: 16, files: 2000, named_per_caller: 20, "
        "storage_per_caller_mb: 60}\n"
    )
    share = 60 * 2**20
    with http_server(*keeping.args()) as url:
        async with connect(url, mode="2026-07-28") as session:
            base = await _call(session, "execute_command", command="head -c 12M /dev/urandom > data")
            forks = []
            for index in range(6):
                forks.append(
                    await _call(session, "workspaces", action="fork", name=f"f{index}", workspace=base["workspace"])
                )
                if forks[-1]["is_error"]:
                    break
            listed = await _call(session, "workspaces", action="list", workspace=base["workspace"])
    refused = forks[-1]
    assert refused["is_error"] and refused["error"]["field"] == "workspace.storage_per_caller_mb", refused["text"]
    assert 1 < len(forks) < 6 and not any(fork["is_error"] for fork in forks[:-1])  # some fit, then the share holds
    assert f"above its share of {share}" in refused["text"], refused["text"]
    assert sum(row["size_bytes"] for row in listed["workspaces"]) <= share


async def test_a_workspace_counts_at_what_its_files_take_and_whole_while_a_call_may_fill_it(
    keeping: Keeping, runtime: DockerRuntime
) -> None:
    """An empty workspace takes next to nothing of the caps, and forks count at what they hold, so a host's cap of
    40 MiB holds three workspaces of 12 MiB. A mounted workspace's calls write its filesystem in place, so a call
    that continues one counts it at its whole size (21.8 MiB) while it runs: refused, busy, when that does not fit.
    An archived workspace's save is checked instead, so that call runs."""
    keeping.policy.write_text(
        "extends: default\nworkspace: {persist: true, size_mb: 16, files: 2000, max_per_client: 8, "
        "named_per_caller: 8}\nhost: {workspace_storage_mb: 40}\n"
    )
    mib = 2**20
    with http_server(*keeping.args()) as url:
        async with connect(url, mode="2026-07-28") as session:
            empty = await _call(session, "execute_command", command="true")
            base = await _call(session, "execute_command", command="head -c 12M /dev/urandom > data")
            forks = [
                await _call(session, "workspaces", action="fork", name=f"f{index}", workspace=base["workspace"])
                for index in range(2)
            ]
            listed = await _call(session, "workspaces", action="list", workspace=base["workspace"])
            again = await _call(session, "execute_command", command="wc -c < data", workspace="f0")
    assert not any(fork["is_error"] for fork in forks), [fork["text"] for fork in forks]
    sizes = {row["name"] or row["id"]: row["size_bytes"] for row in listed["workspaces"]}
    assert sizes[empty["workspace"]] < 64 * 1024, sizes
    for held in (sizes[base["workspace"]], sizes["f0"], sizes["f1"]):
        assert 12 * mib <= held < 12 * mib + 256 * 1024, sizes
    if keeping.kind == "mounted":
        assert again["is_error"] and again["error"]["kind"] == "busy", again["text"]
        assert again["error"]["field"] == "host.workspace_storage_mb", again["text"]
        assert "are counted at" in again["text"] and "above the host's cap of 41943040" in again["text"]
    else:
        assert not again["is_error"] and again["stdout"] == f"{12 * mib}\n", again["text"]


async def test_each_workspace_event_is_audited_with_who_did_it(keeping: Keeping, runtime: DockerRuntime) -> None:
    audit = keeping.state.parent / "audit.jsonl"
    async with connect(stdio_parameters(*keeping.args(), "--audit-log", str(audit))) as session:
        made = await _call(session, "execute_command", command="echo a > f")
        await _call(session, "workspaces", action="keep", name="kept-one")
        fork = await _call(session, "workspaces", action="fork")
        taken = await _call(session, "workspaces", action="snapshot", name="snap")
        await _call(session, "workspaces", action="delete", snapshot="snap")
        await _call(session, "workspaces", action="delete", workspace=fork["forked"])
    records = [r for r in audit_records(audit) if r["tool"] == "workspaces"]
    events = [(r["outcome"], r["workspace_event"]["action"]) for r in records]
    assert events == [("ok", "keep"), ("ok", "fork"), ("ok", "snapshot"), ("ok", "delete"), ("ok", "delete")], records
    keep, forked, snapshot, dropped, deleted = (r["workspace_event"] for r in records)
    assert keep == {"action": "keep", "workspace": made["workspace"], "name": "kept-one"}
    assert (forked["workspace"], forked["forked"]) == (made["workspace"], fork["forked"])
    assert (snapshot["snapshot"], dropped["snapshot"], deleted["workspace"]) == (
        taken["snapshot"],
        "snap",
        fork["forked"],
    )
    assert all(r["client"] == records[0]["client"] and r["client"] for r in records)


async def test_a_named_workspace_and_a_snapshot_are_read_as_resources_by_name(
    keeping: Keeping, runtime: DockerRuntime
) -> None:
    async with connect(stdio_parameters(*keeping.args())) as session:
        await _call(session, "execute_command", command="echo before > notes.txt")
        await _call(session, "workspaces", action="keep", name="project")
        await _call(session, "workspaces", action="snapshot", name="project-v1")
        await _call(session, "execute_command", command="echo after > notes.txt", workspace="project")
        now = await session.read_resource("sandbox://workspace/project/notes.txt")
        then = await session.read_resource("sandbox://workspace/project-v1/notes.txt")
        listing = await session.read_resource("sandbox://workspace/project-v1/")
        templates = await session.list_resource_templates()
    assert [getattr(item, "text", None) for item in (*now.contents, *then.contents)] == ["after\n", "before\n"]
    files = json.loads(getattr(listing.contents[0], "text", ""))["files"]
    assert [entry["path"] for entry in files] == ["notes.txt"]
    assert any("snapshot" in (template.description or "") for template in templates.resource_templates)


async def test_a_branch_runs_one_call_per_fork_side_by_side_and_says_what_each_did_and_changed(
    roomy: Keeping, runtime: DockerRuntime
) -> None:
    audit = roomy.state.parent / "audit.jsonl"
    with http_server(*roomy.args(), "--audit-log", str(audit)) as url:
        async with connect(url, mode="2026-07-28") as session:
            base = (await _call(session, "execute_command", command="echo a > f.txt"))["workspace"]
            await _call(session, "run_python", code="n = 1", workspace=base)
            calls = [
                {"tool": "run_python", "arguments": {"code": "n = n * 10\nprint('ten times', n)"}},
                {"tool": "execute_command", "arguments": {"command": "echo b >> f.txt; cat f.txt"}},
                {"tool": "execute_command", "arguments": {"command": "rm f.txt; exit 3"}},
                {"tool": "workspaces", "arguments": {"action": "list"}},
            ]
            result = await _call(session, "workspaces", action="branch", calls=calls, workspace=base)
            untouched = await _call(session, "execute_command", command="cat f.txt", workspace=base)
            first = result["branches"][0]["workspace"]
            continued = await _call(session, "run_python", code="print(n)", workspace=first)
    assert not result["is_error"] and "4 branch(es) of workspace" in result["text"], result["text"]
    assert "(2 ended in an error)" in result["text"], result["text"]
    assert "\n  output: ten times 10\n" in result["text"] and "\n  output: a | b\n" in result["text"], result["text"]
    tens, appended, removed, refused = result["branches"]
    assert tens["call"]["stdout"] == "ten times 10\n" and not tens["call"]["is_error"], tens["call"]
    assert tens["variables"]["changed"] == [{"name": "n", "about": "int 10", "was": "int 1"}], tens["variables"]
    assert appended["call"]["stdout"] == "a\nb\n" and appended["files"]["modified"] == ["f.txt"]
    assert (removed["call"]["exit_code"], removed["call"]["is_error"]) == (3, True)
    assert removed["files"]["deleted"] == ["f.txt"]
    assert refused["call"]["is_error"] and "not 'workspaces'" in refused["call"]["headline"], refused["call"]
    assert untouched["stdout"] == "a\n" and continued["stdout"] == "10\n", (untouched, continued)
    ran = [r for r in audit_records(audit) if r.get("tool") in ("run_python", "execute_command")]
    assert len(ran) == 2 + 3 + 2  # each branch's call has an audit record of its own, beside the session's
