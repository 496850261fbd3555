"""A policy's limits are enforced by the engine, refusals name the field, and every call is audited."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import anyio
import mcp_types as types
import pytest
from mcp.shared.exceptions import MCPError

from sandbox_server.sandbox.engine.runtime import DockerRuntime
from tests.mcp_harness import CheckedClient, audit_records, connect, http_server_process, stdio_parameters, text_of

pytestmark = pytest.mark.anyio

TIGHT = """
name: tight
defaults:
  limits: {timeout_s: 5, max_timeout_s: 8, memory_mb: 64, pids: 16, output_bytes: 2048}
  env: {set: {GREETING: hello-from-policy}}
rate: {calls_per_minute: 1000, concurrent_calls: 4}
"""


@pytest.fixture
async def tight(tmp_path: Path, runtime: DockerRuntime) -> AsyncIterator[tuple[CheckedClient, Path]]:
    """A stdio session on a policy with small limits, and its audit log."""
    policy = tmp_path / "tight.yaml"
    policy.write_text(TIGHT)
    audit = tmp_path / "audit.jsonl"
    async with connect(stdio_parameters("--policy", str(policy), "--audit-log", str(audit))) as session:
        yield session, audit


async def test_memory_pids_timeout_output_and_network_limits_are_enforced(tight: tuple[CheckedClient, Path]) -> None:
    session, _ = tight
    memory = await session.call_tool("execute_command", {"command": "cat /sys/fs/cgroup/memory/memory.limit_in_bytes"})
    assert memory.structured_content is not None and memory.structured_content["stdout"].strip() == str(64 * 2**20)
    oom = await session.call_tool("execute_command", {"command": "head -c 300m /dev/zero | tail > /dev/null"})
    assert text_of(oom).startswith("killed: out of memory (64 MiB)")
    forks = await session.call_tool(
        "execute_command", {"command": "for i in $(seq 40); do sleep 5 & done; wait", "timeout_s": 2}
    )
    assert forks.is_error and ("fork" in text_of(forks).lower() or "timed out" in text_of(forks))
    capped = await session.call_tool("execute_command", {"command": "seq 1 100000"})
    assert capped.structured_content is not None and capped.structured_content["truncated"] is True
    assert len(capped.structured_content["stdout"]) < 2200
    refused = await session.call_tool("execute_command", {"command": "true", "timeout_s": 9})
    assert refused.is_error
    assert text_of(refused) == (
        "refused: timeout_s 9 is above the cap of 8 s set by policy 'tight' (field limits.max_timeout_s); "
        "ask for 8 or less, or up to 3600 s as a task (an MCP task: a 2025-11-25 client asks with `task`, a "
        "2026-07-28 one names the io.modelcontextprotocol/tasks extension)"
    )
    network = await session.call_tool("execute_command", {"command": "ls /sys/class/net; getent hosts example.com"})
    assert network.structured_content is not None and network.structured_content["stdout"] == "lo\n"
    env = await session.call_tool("execute_command", {"command": "echo $GREETING; echo ${HOSTNAME:-none}"})
    assert env.structured_content is not None and env.structured_content["stdout"].startswith("hello-from-policy\n")


async def test_every_call_leaves_exactly_one_audit_line(tight: tuple[CheckedClient, Path]) -> None:
    session, audit = tight
    await session.call_tool("execute_command", {"command": "echo audited"})
    await session.call_tool("execute_command", {"command": "exit 2"})
    await session.call_tool("execute_command", {"nonsense": True})
    await session.call_tool("execute_command", {"command": "true", "timeout_s": 100})
    with pytest.raises(MCPError):
        await session.call_tool("no_such_tool", {})
    lines = audit_records(audit)
    assert [line["outcome"] for line in lines] == ["ok", "error", "refused", "refused", "refused"]
    first = lines[0]
    assert first["tool"] == "execute_command" and first["policy"] == "tight" and len(first["policy_sha256"]) == 64
    assert first["exit_code"] == 0 and first["runtime"] == "runc" and first["limits"]["memory_mb"] == 64
    assert first["container_id"] and first["stdout_bytes"] == len("audited\n")
    assert len(first["arguments_sha256"]) == 64 and "arguments" not in first
    assert lines[1]["exit_code"] == 2
    assert "unknown field" in lines[2]["reason"]
    assert "limits.max_timeout_s" in lines[3]["reason"] and lines[4]["tool"] == "no_such_tool"


async def test_strict_runs_under_gvisor_without_a_shell(tmp_path: Path, runtime: DockerRuntime) -> None:
    policy = tmp_path / "strict-dmesg.yaml"
    policy.write_text("extends: strict\ndefaults:\n  commands: {shell: false, allow: [dmesg, echo]}\n")
    async with connect(stdio_parameters("--policy", str(policy))) as session:
        kernel = await session.call_tool("execute_command", {"command": "dmesg", "args": []})
        assert not kernel.is_error, text_of(kernel)
        assert "gVisor" in text_of(kernel)
        shell = await session.call_tool("execute_command", {"command": "echo hi"})
        assert text_of(shell).startswith("refused: policy 'strict-dmesg' does not allow a shell (field commands.shell)")
        other = await session.call_tool("execute_command", {"command": "/bin/ls", "args": ["/"]})
        assert text_of(other).startswith("refused: program 'ls' is not allowed by policy 'strict-dmesg'")


async def test_a_disabled_tool_disappears(tmp_path: Path, runtime: DockerRuntime) -> None:
    policy = tmp_path / "off.yaml"
    policy.write_text("tools:\n  execute_command: {enabled: false}\n")
    async with connect(stdio_parameters("--policy", str(policy))) as session:
        assert [tool.name for tool in (await session.list_tools()).tools] == ["analyze_csv", "run_python"]
        with pytest.raises(MCPError) as raised:
            await session.call_tool("execute_command", {"command": "true"})
        assert raised.value.code == -32602


async def test_a_busy_host_refuses_sandboxes_and_never_the_bookkeeping_of_workspaces(
    tmp_path: Path, runtime: DockerRuntime
) -> None:
    policy = tmp_path / "busy.yaml"
    policy.write_text("extends: default\nhost: {min_available_memory_mb: 100000000}\n")  # never this much: always busy
    async with connect(stdio_parameters("--policy", str(policy), "--no-pool")) as session:
        sandbox = await session.call_tool("execute_command", {"command": "true"})
        listed = await session.call_tool("workspaces", {"action": "list"})
        services = await session.call_tool("services", {"action": "list"})
    assert sandbox.is_error and "field host.min_available_memory_mb" in text_of(sandbox), text_of(sandbox)
    assert not listed.is_error and not services.is_error, (text_of(listed), text_of(services))


async def test_concurrency_cap_answers_busy_at_once_when_no_call_may_wait(
    tmp_path: Path, runtime: DockerRuntime
) -> None:
    policy = tmp_path / "one.yaml"
    policy.write_text("rate: {concurrent_calls: 1, queue_wait_s: 0}\n")
    running = anyio.Event()

    async def on_progress(progress: float, total: float | None, message: str | None) -> None:
        running.set()

    async with connect(stdio_parameters("--policy", str(policy))) as session, anyio.create_task_group() as group:
        group.start_soon(
            lambda: session.call_tool("execute_command", {"command": "sleep 30"}, progress_callback=on_progress)
        )
        with anyio.fail_after(10):
            await running.wait()
        with anyio.fail_after(2):
            busy = await session.call_tool("execute_command", {"command": "true"})
        assert text_of(busy).startswith("busy: 1 calls already running (policy 'one', field rate.concurrent_calls)")
        group.cancel_scope.cancel()


async def test_a_policy_edit_changes_the_next_call_and_a_broken_edit_changes_nothing(
    tmp_path: Path, runtime: DockerRuntime
) -> None:
    policy = tmp_path / "live.yaml"
    policy.write_text("defaults:\n  limits: {memory_mb: 64}\n")
    changed = anyio.Event()

    async def on_message(message: object) -> None:
        if isinstance(message, types.ToolListChangedNotification):
            changed.set()

    read_limit = {"command": "cat /sys/fs/cgroup/memory/memory.limit_in_bytes"}
    with http_server_process("--policy", str(policy)) as server:
        async with connect(server.url, message_handler=on_message) as session:
            first = await session.call_tool("execute_command", read_limit)
            assert first.structured_content is not None and first.structured_content["stdout"].strip() == str(
                64 * 2**20
            )
            policy.write_text("defaults:\n  limits: {memory_mb: 96}\n")
            with anyio.fail_after(10):
                await changed.wait()
            second = await session.call_tool("execute_command", read_limit)
            assert second.structured_content is not None and second.structured_content["stdout"].strip() == str(
                96 * 2**20
            )
            policy.write_text("defaults:\n  limits: {memory_mb: -5}\n")
            await anyio.to_thread.run_sync(server.wait_for_line, "policy change ignored")
            await anyio.to_thread.run_sync(
                server.wait_for_line, "defaults.limits.memory_mb: -5 is less than the minimum"
            )
            third = await session.call_tool("execute_command", read_limit)
            assert third.structured_content is not None and third.structured_content["stdout"].strip() == str(
                96 * 2**20
            )


async def test_2026_era_clients_hear_of_a_policy_change_through_subscriptions_listen(
    tmp_path: Path, runtime: DockerRuntime
) -> None:
    policy = tmp_path / "live.yaml"
    policy.write_text("defaults:\n  limits: {memory_mb: 64}\n")
    with http_server_process("--policy", str(policy)) as server:
        async with connect(server.url, mode="2026-07-28") as session:
            async with session.listen(tools_list_changed=True) as subscription:
                policy.write_text("tools:\n  execute_command: {enabled: false}\n")
                with anyio.fail_after(10):
                    async for _ in subscription:
                        break
            assert [tool.name for tool in (await session.list_tools()).tools] == ["analyze_csv", "run_python"]


async def test_a_mount_is_visible_read_only_and_nothing_else_is(tmp_path: Path, runtime: DockerRuntime) -> None:
    data = tmp_path / "data"
    data.mkdir()
    (data / "sales.csv").write_text("region,amount\nnorth,3\n")
    policy = tmp_path / "mounted.yaml"
    policy.write_text(f"defaults:\n  mounts: [{{host: {data}, sandbox: /data/shared, mode: ro}}]\n")
    async with connect(stdio_parameters("--policy", str(policy))) as session:
        read = await session.call_tool("execute_command", {"command": "cat /data/shared/sales.csv"})
        assert read.structured_content is not None and read.structured_content["stdout"] == "region,amount\nnorth,3\n"
        write = await session.call_tool("execute_command", {"command": "touch /data/shared/x"})
        assert write.is_error and "Read-only file system" in text_of(write)
    assert sorted(p.name for p in data.iterdir()) == ["sales.csv"]
