"""The fast tier: the real server and the SDK's in-memory client over a fake runtime.

Pagination, argument validation, every kind of refusal, rendering, names and hints,
and audit records, in both protocol eras and in seconds. What a sandbox does is
proved by the real-engine tests; here the runtime only answers what it is told to.
"""

from __future__ import annotations

import base64
import json
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import replace
from pathlib import Path
from typing import Any

import anyio
import mcp_types as types
import pytest
from mcp.shared.exceptions import MCPError

from sandbox_server.access.audit import AuditLog
from sandbox_server.calls.registry import ToolRegistry
from sandbox_server.errors import EngineError, EngineUnavailable
from sandbox_server.network.egress import Destination, Egress
from sandbox_server.policy import Policy, RateLimits, ToolPolicy
from sandbox_server.protocol.concise import HINT_DEFAULTS
from sandbox_server.protocol.meta import OWN_NAME_META, PATH_META
from sandbox_server.protocol.server import Parts, SandboxServer
from sandbox_server.sandbox import wire
from sandbox_server.sandbox.runtime import NO_HOOKS, RunHooks
from sandbox_server.sandbox.spec import ExecutionResult, Mount, OutputFile, SandboxSpec
from sandbox_server.tools import all_tools
from tests.mcp_harness import CHECKED, CheckedClient, connect, text_of

pytestmark = pytest.mark.anyio

ERAS = ["legacy", "2026-07-28"]
PNG = b"\x89PNG\r\n\x1a\n" + b"\0" * 32

Answer = Callable[[SandboxSpec], ExecutionResult]


def ran(stdout: bytes = b"", exit_code: int | None = 0, **fields: Any) -> Answer:
    """A runtime answer: the program ran and left this."""
    return lambda spec: ExecutionResult(exit_code=exit_code, stdout=stdout, stderr=b"", duration_ms=3, **fields)


class FakeRuntime:
    """A SandboxRuntime that records each spec and answers as told; `gate` holds calls until set."""

    def __init__(self, answer: Answer | None = None, error: Exception | None = None) -> None:
        self.answer = answer or ran()
        self.error = error
        self.specs: list[SandboxSpec] = []
        self.gate: anyio.Event | None = None
        self.entered = anyio.Event()

    async def run(self, spec: SandboxSpec, hooks: RunHooks = NO_HOOKS) -> ExecutionResult:
        self.specs.append(spec)
        self.entered.set()
        if self.gate is not None:
            await self.gate.wait()
        if self.error is not None:
            raise self.error
        return self.answer(spec)


def policy(tool: dict[str, Any] | None = None, **changes: Any) -> Policy:
    """A policy for the fast tier: the defaults, with `tool` settings for every tool and `changes` to the policy."""
    return replace(Policy(name="fast", default=ToolPolicy(**(tool or {}))), **changes)


@asynccontextmanager
async def serving(
    runtime: FakeRuntime, mode: str = "legacy", *, page_size: int = 50, audit: Path | None = None, **changes: Any
) -> AsyncIterator[tuple[SandboxServer, CheckedClient]]:
    registry = ToolRegistry(all_tools(), policy(**changes))
    app = SandboxServer(
        Parts(registry, runtime, AuditLog(audit) if audit else None, page_size=page_size, host_folders=HOST_FOLDERS)
    )
    async with connect(app.server, mode=mode) as client:
        yield app, client


@pytest.mark.parametrize("mode", ERAS)
async def test_tools_are_listed_a_page_at_a_time_and_a_bad_cursor_is_a_protocol_error(mode: str) -> None:
    async with serving(FakeRuntime(), mode, page_size=1) as (_, client):
        names, cursor = [], None
        while True:
            page = await client.list_tools(cursor=cursor)
            assert len(page.tools) == 1
            names += [tool.name for tool in page.tools]
            if (cursor := page.next_cursor) is None:
                break
        assert names == ["analyze_csv", "execute_command", "run_python"]
        with pytest.raises(MCPError) as bad:
            await client.list_tools(cursor="not-a-cursor")
        assert bad.value.error.code == -32602


@pytest.mark.parametrize("mode", ERAS)
async def test_invalid_arguments_are_an_error_result_naming_the_field(mode: str) -> None:
    runtime = FakeRuntime()
    async with serving(runtime, mode) as (_, client):
        result = await client.call_tool("execute_command", {"command": "ls", "timeout_s": -1})
    assert result.is_error and text_of(result).startswith("invalid arguments for execute_command: `timeout_s`")
    assert result.structured_content is not None
    usage = result.structured_content.pop("usage")
    assert result.structured_content == {
        "error": {
            "kind": "invalid_arguments",
            "message": text_of(result),
            "policy": "fast",
            "field": "timeout_s",
            "retry_after_s": None,
        }
    }
    # It ran nothing: its usage is its wall time alone.
    assert usage["cpu_s"] is None and usage["peak_memory_bytes"] is None and usage["network_in_bytes"] == 0
    assert runtime.specs == []


async def test_each_refusal_names_its_policy_field_and_runs_nothing() -> None:
    runtime = FakeRuntime()
    calls: list[tuple[str, dict[str, Any], str]] = [
        ("execute_command", {"command": "ls", "timeout_s": 500}, "limits.max_timeout_s"),
        ("execute_command", {"command": "ls", "workdir": "/proc/self/fd/7"}, "workdir"),
        ("execute_command", {"command": "ls", "files": [{"path": "../x", "content": ""}]}, "files[0].path"),
        (
            "run_python",
            {"code": "1", "files": [{"path": "a", "content": "!", "encoding": "base64"}]},
            "files[0].content",
        ),
        ("analyze_csv", {"filepath": "/etc/passwd", "operations": ["count"]}, "mounts"),
    ]
    async with serving(runtime) as (_, client):
        for tool, arguments, field in calls:
            result = await client.call_tool(tool, arguments)
            assert result.is_error and text_of(result).startswith("refused"), text_of(result)
            assert result.structured_content is not None
            error = result.structured_content["error"]
            assert (error["kind"], error["field"], error["policy"]) == ("refused", field, "fast")
    async with serving(runtime, tool={"allow_shell": False, "commands_allow": ("ls",)}) as (_, client):
        shell = await client.call_tool("execute_command", {"command": "ls"})
        program = await client.call_tool("execute_command", {"command": "cat", "args": ["x"]})
    assert shell.structured_content and shell.structured_content["error"]["field"] == "commands.shell"
    assert program.structured_content and program.structured_content["error"]["field"] == "commands.allow"
    assert runtime.specs == []


async def test_busy_is_answered_at_once_with_when_to_retry_when_no_call_may_wait() -> None:
    runtime = FakeRuntime()
    runtime.gate = anyio.Event()
    async with serving(runtime, rate=RateLimits(concurrent_calls=1, queue_wait_s=0)) as (_, client):
        async with anyio.create_task_group() as group:
            group.start_soon(client.call_tool, "execute_command", {"command": "sleep 1"})
            await runtime.entered.wait()
            with anyio.fail_after(2):
                busy = await client.call_tool("run_python", {"code": "1"})
            runtime.gate.set()
    assert busy.is_error and text_of(busy).startswith("busy: 1 calls already running")
    assert busy.structured_content is not None
    assert busy.structured_content["error"] | {"message": ""} == {
        "kind": "busy",
        "message": "",
        "policy": "fast",
        "field": "rate.concurrent_calls",
        "retry_after_s": 1,
    }


@pytest.mark.parametrize("mode", ERAS)
async def test_a_call_past_the_cap_waits_its_turn_and_hears_how_many_are_ahead(mode: str) -> None:
    runtime = FakeRuntime()
    gate = runtime.gate = anyio.Event()
    heard: list[str] = []

    async def on_progress(progress: float, total: float | None, message: str | None) -> None:
        heard.append(message or "")
        if "waiting for a slot" in (message or ""):
            gate.set()  # the running call ends once the waiting one has said it waits

    async with serving(runtime, mode, rate=RateLimits(concurrent_calls=1)) as (_, client):
        async with anyio.create_task_group() as group:
            group.start_soon(client.call_tool, "execute_command", {"command": "sleep 1"})
            await runtime.entered.wait()
            with anyio.fail_after(10):
                queued = await client.call_tool("run_python", {"code": "1"}, progress_callback=on_progress)
    assert not queued.is_error, text_of(queued)
    assert "waiting for a slot (0 ahead)" in heard


@pytest.mark.parametrize("mode", ERAS)
async def test_a_call_the_policy_refuses_is_answered_at_once_even_with_every_slot_taken(mode: str) -> None:
    """Refusals that need no engine come before admission: they never wait in the queue for a slot."""
    runtime = FakeRuntime()
    gate = runtime.gate = anyio.Event()
    tool = {"allow_shell": False, "max_timeout_s": 5.0, "max_input_files": 1}
    async with serving(runtime, mode, tool=tool, rate=RateLimits(concurrent_calls=1)) as (_, client):
        async with anyio.create_task_group() as group:
            group.start_soon(client.call_tool, "execute_command", {"command": "true", "args": []})
            await runtime.entered.wait()  # the one slot is taken until the gate opens
            refused = {}
            with anyio.fail_after(3):
                refused["commands.shell"] = await client.call_tool("execute_command", {"command": "ls"})
                refused["limits.max_timeout_s"] = await client.call_tool("run_python", {"code": "1", "timeout_s": 9})
                files = [{"path": name, "content": ""} for name in ("a", "b")]
                refused["limits.input_files"] = await client.call_tool("run_python", {"code": "1", "files": files})
                refused["mounts"] = await client.call_tool(
                    "analyze_csv", {"filepath": "/etc/passwd", "operations": ["count"]}
                )
            gate.set()
    for field, result in refused.items():
        assert result.is_error and result.structured_content is not None, text_of(result)
        assert result.structured_content["error"]["field"] == field, text_of(result)
    assert len(runtime.specs) == 1  # only the call that held the slot reached the engine


HOST_FOLDERS = ("/var/lib/sandbox-server", "/run/sandbox-server/runc")


@pytest.mark.parametrize("mode", ERAS)
async def test_no_answer_names_a_path_into_the_servers_own_folders(mode: str) -> None:
    """An engine's or the system's error carries a path into the server's state or runc's bundles: the answer
    says a folder of the server instead (the text, the structured error), and keeps every other path."""
    bundle = "/run/sandbox-server/runc/sbx-1a2b/bundle/views/rootfs"
    said = f"could not make sandbox sbx-1a2b's bundle: [Errno 28] No space left on device: '{bundle}'"
    runtime = FakeRuntime(error=EngineError(f"{said}; /var/lib/sandbox-server2/x and /workspace/a are not ours"))
    async with serving(runtime, mode) as (_, client):
        result = await client.call_tool("execute_command", {"command": "true"})
    text, error = text_of(result), (result.structured_content or {})["error"]
    for shown in (text, error["message"]):
        assert "/run/sandbox-server/runc" not in shown and "sbx-1a2b/bundle" not in shown, shown
        assert "No space left on device: '<a folder of the server>'" in shown, shown
        assert "/var/lib/sandbox-server2/x and /workspace/a are not ours" in shown, shown  # a neighbour, a sandbox path


async def test_an_engine_that_does_not_answer_is_a_refusal_of_that_kind() -> None:
    runtime = FakeRuntime(error=EngineUnavailable("sandbox engine unavailable: nothing at unix:///x"))
    async with serving(runtime) as (_, client):
        calls: list[tuple[str, dict[str, Any]]] = [
            ("execute_command", {"command": "true"}),
            ("run_python", {"code": "1"}),
            ("analyze_csv", {"filepath": "a.csv", "operations": ["count"]}),
        ]
        for tool, arguments in calls:
            result = await client.call_tool(tool, arguments)
            assert result.is_error and text_of(result).startswith("sandbox engine unavailable")
            assert result.structured_content and result.structured_content["error"]["kind"] == "engine_unavailable"


async def test_analyze_csv_failures_have_analyze_csvs_shape() -> None:
    runtime = FakeRuntime(ran(exit_code=None, oom_killed=True))
    async with serving(runtime) as (_, client):
        killed = await client.call_tool("analyze_csv", {"filepath": "a.csv", "operations": ["median"]})
        runtime.answer = lambda spec: ExecutionResult(
            exit_code=wire.ANALYSIS_REFUSED_EXIT,
            stdout=b"",
            stderr=b"",
            duration_ms=5,
            files=(OutputFile(wire.ANALYSIS_ANSWER, b'{"error": "no column \'x\'", "field": "columns"}', 45),),
        )
        refused = await client.call_tool("analyze_csv", {"filepath": "a.csv", "operations": ["sum"], "columns": ["x"]})
    assert killed.structured_content is not None and refused.structured_content is not None
    assert killed.structured_content["error"]["kind"] == "out_of_memory"
    assert "median and distinct keep every value" in text_of(killed)
    assert refused.structured_content["error"] | {"policy": None} == {
        "kind": "refused",
        "message": "no column 'x'",
        "policy": None,
        "field": "columns",
        "retry_after_s": None,
    }
    assert "exit_code" not in killed.structured_content  # not execute_command's shape


async def test_every_error_result_of_every_tool_was_checked_against_its_output_schema() -> None:
    before = len(CHECKED)
    runtime = FakeRuntime(ran(exit_code=3))
    async with serving(runtime) as (_, client):
        await client.call_tool("execute_command", {"command": "exit 3"})
        await client.call_tool("run_python", {"code": "raise SystemExit(3)"})
        await client.call_tool("analyze_csv", {"filepath": "a.csv", "operations": ["count"]})
        await client.call_tool("analyze_csv", {"filepath": "../a.csv", "operations": ["count"]})
    assert CHECKED[before:] == [
        ("execute_command", True),
        ("run_python", True),
        ("analyze_csv", True),
        ("analyze_csv", True),
    ]


@pytest.mark.parametrize("mode", ERAS)
async def test_output_is_sanitised_images_carry_their_path_and_large_files_are_links(mode: str) -> None:
    files = (OutputFile("plots/fig.png", PNG, len(PNG)), OutputFile("big.txt", b"y" * 300_000, 300_000))
    runtime = FakeRuntime(ran(b"\x1b[2Jclean\x1b]52;c;ZXZpbA==\x07", files=files))
    async with serving(runtime, mode) as (_, client):
        result = await client.call_tool("execute_command", {"command": "draw"})
        image = next(block for block in result.content if isinstance(block, types.ImageContent))
        link = next(block for block in result.content if isinstance(block, types.ResourceLink))
        read = await client.read_resource(str(link.uri))
        with pytest.raises(MCPError) as missing:
            await client.read_resource(str(link.uri).replace("big.txt", "gone.txt"))
    assert text_of(result).startswith("exit code 0") and "clean" in text_of(result) and "\x1b" not in text_of(result)
    assert base64.b64decode(image.data) == PNG and (image.meta or {})[PATH_META] == "plots/fig.png"
    assert isinstance(read.contents[0], types.TextResourceContents) and len(read.contents[0].text) == 300_000
    assert missing.value.error.code == (-32002 if mode == "legacy" else -32602)


async def test_a_prefix_renames_every_tool_and_keeps_its_own_name_beside_it(tmp_path: Path) -> None:
    audit = tmp_path / "audit.jsonl"
    runtime = FakeRuntime()
    async with serving(runtime, audit=audit, tool_prefix="sbx_") as (_, client):
        listed = (await client.list_tools()).tools
        result = await client.call_tool("sbx_execute_command", {"command": "true"})
        with pytest.raises(MCPError) as unknown:
            await client.call_tool("execute_command", {"command": "true"})
    assert [tool.name for tool in listed] == ["sbx_analyze_csv", "sbx_execute_command", "sbx_run_python"]
    assert [(tool.meta or {})[OWN_NAME_META] for tool in listed] == ["analyze_csv", "execute_command", "run_python"]
    assert not result.is_error and unknown.value.error.code == -32602
    records = [json.loads(line) for line in audit.read_text().splitlines()]
    assert [(r["tool"], r["exposed_as"], r["outcome"]) for r in records] == [
        ("execute_command", "sbx_execute_command", "ok"),
        ("execute_command", "execute_command", "refused"),
    ]


async def test_hints_follow_the_policy() -> None:
    """A hint a client would assume anyway is not listed: read here as the client reads it."""

    def hints(tools: list[types.Tool]) -> dict[str, dict[str, bool]]:
        said = {tool.name: (tool.annotations or types.ToolAnnotations()).model_dump(by_alias=True) for tool in tools}
        return {name: {k: v if v is not None else HINT_DEFAULTS[k] for k, v in each.items() if k in HINT_DEFAULTS}
                for name, each in said.items()}  # fmt: skip

    async with serving(FakeRuntime()) as (_, client):
        closed = hints((await client.list_tools()).tools)
    writable = (Mount("/srv", "/data", read_only=False),)
    async with serving(
        FakeRuntime(), tool={"mounts": writable, "egress": Egress((Destination("pypi.org", False, (443,)),))}
    ) as (_, client):
        opened = hints((await client.list_tools()).tools)
    for each in closed.values():
        assert each["destructiveHint"] is False and each["openWorldHint"] is False
    assert opened["execute_command"]["destructiveHint"] is True
    assert opened["run_python"]["openWorldHint"] is True
    assert opened["analyze_csv"]["readOnlyHint"] is True and opened["analyze_csv"]["destructiveHint"] is False


async def test_the_audit_record_says_who_what_and_why_never_the_arguments(tmp_path: Path) -> None:
    audit = tmp_path / "audit.jsonl"
    async with serving(FakeRuntime(ran(b"secret-output")), audit=audit) as (_, client):
        await client.call_tool("execute_command", {"command": "echo secret-argument"})
        await client.call_tool("execute_command", {"command": "ls", "timeout_s": 999})
    ok, refused = [json.loads(line) for line in audit.read_text().splitlines()]
    assert "secret" not in audit.read_text()
    assert ok["outcome"] == "ok" and ok["exit_code"] == 0 and ok["policy"] == "fast"
    assert len(ok["arguments_sha256"]) == 64 and ok["client"].startswith("mcp")
    assert refused["outcome"] == "refused" and refused["field"] == "limits.max_timeout_s"
    assert refused["kind"] == "refused" and refused["reason"].startswith("refused: timeout_s 999")
