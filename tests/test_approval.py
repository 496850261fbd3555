"""Calls a person must approve: the policy's `approval` section, asked through the official client in both eras.

The real server and engine; the client's elicitation callback stands for the person.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mcp_types as types
import pytest
from mcp.shared.exceptions import MCPError

from sandbox_server.sandbox.engine.runtime import DockerRuntime
from tests.mcp_harness import (
    CheckedClient,
    Person,
    answer,
    audit_records,
    connect,
    http_server,
    stdio_parameters,
)

pytestmark = pytest.mark.anyio

POLICY = """\
extends: default
approval:
  commands: ["rm", "*sudo*"]
  tools: [analyze_csv]
"""
SAFE_RM = "rm -f /workspace/nothing-here"


@dataclass
class Setup:
    policy: Path
    audit: Path

    def serve_args(self) -> list[str]:
        return ["--policy", str(self.policy), "--audit-log", str(self.audit), "--no-pool"]

    def records(self) -> list[dict[str, Any]]:
        return audit_records(self.audit)


@pytest.fixture
def setup(tmp_path: Path) -> Setup:
    policy = tmp_path / "asking.yaml"
    policy.write_text(POLICY)
    return Setup(policy, tmp_path / "audit.jsonl")


async def run(client: CheckedClient, tool: str, **arguments: Any) -> dict[str, Any]:
    return await answer(client, tool, arguments)


async def test_handshake_era_accept_runs_decline_refuses_and_the_audit_keeps_the_decision(
    setup: Setup, runtime: DockerRuntime
) -> None:
    person = Person()
    async with connect(stdio_parameters(*setup.serve_args()), elicitation_callback=person) as client:
        plain = await run(client, "execute_command", command="echo no question")
        accepted = await run(client, "execute_command", command=SAFE_RM + " && echo removed")
        person.answer = "decline"
        declined = await run(client, "execute_command", command="echo x | sudo -n true")
        person.answer = "cancel"
        cancelled = await run(client, "execute_command", command="/bin/rm", args=["-f", "nothing"])
    assert plain["stdout"] == "no question\n" and len(person.shown) == 3  # echo alone was not asked about
    assert accepted["stdout"] == "removed\n", accepted["text"]
    assert f"$ {SAFE_RM} && echo removed" in person.shown[0] and "approval.commands" in person.shown[0]
    assert "the command matches 'rm'" in person.shown[0] and "'*sudo*'" in person.shown[1]
    assert "$ /bin/rm -f nothing" in person.shown[2]
    for refused in (declined, cancelled):
        assert refused["is_error"] and refused["text"] == "declined by the user (policy field approval.commands)"
        assert refused["error"]["kind"] == "declined" and refused["error"]["field"] == "approval.commands"
    decisions = [r.get("approval", {}).get("decision") for r in setup.records()]
    assert decisions == [None, "accept", "decline", "cancel"]
    assert [r["outcome"] for r in setup.records()] == ["ok", "ok", "refused", "refused"]


async def test_a_client_that_cannot_ask_is_told_why_and_which_field_to_change(
    setup: Setup, runtime: DockerRuntime
) -> None:
    async with connect(stdio_parameters(*setup.serve_args())) as client:
        refused = await run(client, "analyze_csv", filepath="data.csv", operations=["describe"])
        plain = await run(client, "execute_command", command="echo fine")
    assert refused["is_error"] and refused["error"]["field"] == "approval.tools", refused["text"]
    assert "cannot ask one (it declares no form elicitation)" in refused["text"]
    assert "change the policy field approval.tools" in refused["text"]
    assert plain["stdout"] == "fine\n"
    assert setup.records()[0]["approval"] == {
        "field": "approval.tools",
        "reason": "every call of analyze_csv",
        "decision": "unavailable",
    }


async def test_a_client_that_fails_to_ask_gets_the_call_refused_not_run(setup: Setup, runtime: DockerRuntime) -> None:
    async def unable(context: Any, params: types.ElicitRequestParams) -> types.ErrorData:
        return types.ErrorData(code=-32603, message="no user at this terminal")

    async with connect(stdio_parameters(*setup.serve_args()), elicitation_callback=unable) as client:
        refused = await run(client, "execute_command", command="rm -f x && echo ran")
    assert refused["is_error"] and "ran" not in refused["text"]
    assert refused["text"] == (
        "not approved: the client could not ask the user (no user at this terminal) (policy field approval.commands)"
    )
    assert setup.records()[0]["approval"]["decision"] == "client error"


@pytest.fixture
def modern_url(setup: Setup, runtime: DockerRuntime) -> Iterator[str]:
    with http_server(*setup.serve_args()) as url:
        yield url


async def test_2026_era_accept_runs_and_decline_refuses_through_the_input_required_round_trip(
    setup: Setup, modern_url: str
) -> None:
    person = Person()
    async with connect(modern_url, mode="2026-07-28", elicitation_callback=person) as client:
        accepted = await run(client, "execute_command", command=SAFE_RM + " && echo removed")
        person.answer = "decline"
        declined = await run(client, "execute_command", command="sudo -n true")
    assert accepted["stdout"] == "removed\n", accepted["text"]
    assert declined["is_error"] and declined["text"] == "declined by the user (policy field approval.commands)"
    assert len(person.shown) == 2 and f"$ {SAFE_RM} && echo removed" in person.shown[0]
    assert [(r["outcome"], r["approval"]["decision"]) for r in setup.records()] == [
        ("awaiting_approval", "asked"),
        ("ok", "accept"),
        ("awaiting_approval", "asked"),
        ("refused", "decline"),
    ]


async def test_2026_era_an_answer_is_good_for_its_own_call_once(setup: Setup, modern_url: str) -> None:
    yes: types.InputResponses = {"approval": types.ElicitResult(action="accept", content={})}
    async with connect(modern_url, mode="2026-07-28", elicitation_callback=Person()) as client:
        session = client.session
        arguments = {"command": SAFE_RM + " && echo removed"}
        question = await session.call_tool("execute_command", arguments, allow_input_required=True)
        assert isinstance(question, types.InputRequiredResult) and question.request_state
        assert question.input_requests is not None and set(question.input_requests) == {"approval"}
        state = question.request_state
        with pytest.raises(MCPError) as elsewhere:  # the same answer for another command
            await session.call_tool(
                "execute_command",
                {"command": "rm -rf /workspace"},
                input_responses=yes,
                request_state=state,
                allow_input_required=True,
            )
        ran = await session.call_tool(
            "execute_command", arguments, input_responses=yes, request_state=state, allow_input_required=True
        )
        again = await session.call_tool(
            "execute_command", arguments, input_responses=yes, request_state=state, allow_input_required=True
        )
    assert elsewhere.value.error.code == -32602 and "requestState" in elsewhere.value.error.message
    assert isinstance(ran, types.CallToolResult) and not ran.is_error
    assert ran.structured_content is not None and ran.structured_content["stdout"] == "removed\n"
    assert isinstance(again, types.InputRequiredResult)  # replayed: asked afresh, not run
    assert [r["outcome"] for r in setup.records()] == ["awaiting_approval", "ok", "awaiting_approval"]


async def test_tools_list_says_what_needs_approval(setup: Setup, runtime: DockerRuntime) -> None:
    async with connect(stdio_parameters(*setup.serve_args())) as client:
        tools = {tool.name: tool for tool in (await client.list_tools()).tools}
    shell, csv, python = tools["execute_command"], tools["analyze_csv"], tools["run_python"]
    assert "commands matching rm, *sudo* (approval.commands)" in (shell.description or "")
    assert shell.meta is not None and "approval.commands" in shell.meta["org.sandbox-server/approval"]
    assert "every call (approval.tools)" in (csv.description or "")
    assert "approve" not in (python.description or "") and "org.sandbox-server/approval" not in (python.meta or {})


async def test_a_tool_that_writes_to_the_host_asks_first_and_a_decline_writes_nothing(
    tmp_path: Path, runtime: DockerRuntime
) -> None:
    shared = tmp_path / "shared"
    shared.mkdir(mode=0o777)
    shared.chmod(0o777)  # the sandbox's user may write there
    policy = tmp_path / "writing.yaml"
    policy.write_text(
        "extends: default\napproval: {writable_mounts: true}\n"
        f"tools:\n  execute_command:\n    mounts: [{{host: {shared}, sandbox: /mnt/shared, mode: rw}}]\n"
    )
    person = Person(answer="decline")
    async with connect(stdio_parameters("--policy", str(policy), "--no-pool"), elicitation_callback=person) as client:
        tool = next(t for t in (await client.list_tools()).tools if t.name == "execute_command")
        declined = await run(client, "execute_command", command="echo no > /mnt/shared/declined.txt")
        person.answer = "accept"
        accepted = await run(client, "execute_command", command="echo yes > /mnt/shared/accepted.txt")
        python = await run(client, "run_python", code="1 + 1")  # no writable mount: not asked
    assert declined["text"] == "declined by the user (policy field approval.writable_mounts)"
    assert not (shared / "declined.txt").exists()
    assert not accepted["is_error"] and (shared / "accepted.txt").read_text() == "yes\n"
    assert python["stdout"] == "2\n" and len(person.shown) == 2
    assert f"it can write to the host's {shared} as /mnt/shared" in person.shown[0]
    assert tool.annotations is not None and tool.annotations.destructive_hint is not False  # unsaid: destructive
    assert f"it can write to host folders: {shared} (as /mnt/shared)" in (tool.description or "")
    assert "approval.writable_mounts" in (tool.description or "")
