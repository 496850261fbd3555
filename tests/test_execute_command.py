"""execute_command through the official MCP client, over stdio and Streamable HTTP, on the real engine."""

from __future__ import annotations

import base64
import io
import json
import time
import wave
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import anyio
import mcp_types as types
import pytest
from mcp import Client
from mcp.shared.exceptions import MCPError

from sandbox_server.sandbox.engine.runtime import DockerRuntime
from tests.conftest import a_sleep_of_its_own, containers_running
from tests.mcp_harness import connect, http_server, stdio_parameters, text_of

pytestmark = pytest.mark.anyio

PNG_1x1 = base64.b64decode(
    "iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mNk+M9QDwADhgGAWjR9awAAAABJRU5ErkJggg=="
)


@pytest.fixture(scope="session")
def http_url(runtime: DockerRuntime) -> Iterator[str]:
    """One HTTP server for the session's HTTP tests."""
    with http_server() as url:
        yield url


@pytest.fixture(scope="module", params=["stdio", "http"])
async def client(request: pytest.FixtureRequest, http_url: str) -> AsyncIterator[Client]:
    """A client session with the real server over each transport, one per module: no test here changes the server
    or its session (each call is a sandbox of its own), and a stdio server costs seconds to start."""
    target = stdio_parameters() if request.param == "stdio" else http_url
    async with connect(target) as session:
        yield session


async def test_tools_list_describes_execute_command(client: Client) -> None:
    listed = await client.list_tools()
    tool = next(tool for tool in listed.tools if tool.name == "execute_command")
    assert tool.title and "Example:" in (tool.description or "")
    assert tool.input_schema["required"] == ["command"]
    assert {"command", "args", "stdin", "timeout_s", "files"} <= set(tool.input_schema["properties"])
    assert tool.output_schema is not None and "exit_code" in tool.output_schema["properties"]
    assert tool.annotations is not None and tool.annotations.open_world_hint is False
    assert listed.next_cursor is None


async def test_an_invalid_cursor_is_a_protocol_error(client: Client) -> None:
    with pytest.raises(MCPError) as raised:
        await client.list_tools(cursor="not-a-cursor")
    assert raised.value.code == -32602


async def test_echo_returns_text_and_structured_content(client: Client) -> None:
    result = await client.call_tool("execute_command", {"command": "echo hello; echo oops >&2"})
    assert not result.is_error
    assert text_of(result).startswith("exit code 0")
    assert "hello" in text_of(result) and "oops" in text_of(result)
    structured = result.structured_content
    assert structured is not None
    assert structured["exit_code"] == 0
    assert structured["stdout"] == "hello\n"
    assert structured["stderr"] == "oops\n"
    assert structured["timed_out"] is False and structured["oom_killed"] is False
    second = result.content[1]  # the JSON for clients without structuredContent, naming the output, not repeating it
    assert isinstance(second, types.TextContent)
    assert json.loads(second.text) == {
        **structured,
        "stdout": "<6 characters: the --- stdout --- section of the first text block>",
        "stderr": "<5 characters: the --- stderr --- section of the first text block>",
    }


@pytest.mark.parametrize("with_a_file", [False, True], ids=["after the request script", "in the request tar"])
async def test_stdin_reaches_the_program_byte_for_byte(client: Client, with_a_file: bool) -> None:
    """A call's stdin comes after its request script (no files: the launcher copies exactly its bytes) or in the
    request's tar (with files); either way the program reads it whole, and nothing of the request after it."""
    stdin = "first line\n  indented; 'quoted' $HOME `x`\n\u00e9t\u00e9 \u2603\nno newline at its end" * 200
    arguments: dict[str, object] = {"command": "cat", "stdin": stdin}
    if with_a_file:
        arguments["files"] = [{"path": "in.txt", "content": "a file"}]
    result = await client.call_tool("execute_command", arguments)
    assert not result.is_error and result.structured_content is not None, text_of(result)
    assert result.structured_content["stdout"] == stdin


async def test_a_program_reaching_for_a_network_the_policy_gives_none_fails_at_once_and_is_told_the_field(
    client: Client,
) -> None:
    pip = await client.call_tool("execute_command", {"command": "pip download no-such-package-here==1.0 2>&1"})
    fine = await client.call_tool("execute_command", {"command": "echo no network needed"})
    said = text_of(pip)
    assert "policy field network: none" in said and "allow list" in said, said
    assert "Retrying" not in (pip.structured_content or {})["stdout"], said  # no retries: it fails at once
    assert "field network" not in text_of(fine)  # only where a program reached for it
    cell = await client.call_tool("run_python", {
        "code": "import subprocess\nsubprocess.run(['pip', 'install', 'no-such-package-here'])",
    })  # fmt: skip
    said = text_of(cell)
    assert "policy field network: none" in said and "Retrying" not in said, said  # a cell's pip: the same


async def test_unknown_tool_is_a_protocol_error(client: Client) -> None:
    with pytest.raises(MCPError) as raised:
        await client.call_tool("no_such_tool", {})
    assert raised.value.code == -32602
    assert "no_such_tool" in raised.value.message


async def test_invalid_arguments_name_the_field(client: Client) -> None:
    missing = await client.call_tool("execute_command", {"args": ["x"]})
    assert missing.is_error and "missing required field: 'command'" in text_of(missing)
    wrong_type = await client.call_tool("execute_command", {"command": "true", "timeout_s": "soon"})
    assert wrong_type.is_error and "`timeout_s`" in text_of(wrong_type)
    nul = await client.call_tool("execute_command", {"command": "echo", "args": ["a\x00b"]})
    assert nul.is_error and "`args[0]` contains a NUL byte" in text_of(nul)


async def test_non_zero_exit_is_an_error_result_with_the_code_first(client: Client) -> None:
    result = await client.call_tool("execute_command", {"command": "echo partial; exit 3"})
    assert result.is_error
    assert text_of(result).startswith("exit code 3")
    assert result.structured_content is not None and result.structured_content["exit_code"] == 3
    assert "partial" in text_of(result)


async def test_args_are_literal_without_a_shell(client: Client) -> None:
    hostile = ["$(id)", "; id", "`id`", "--help", "a\nb"]
    result = await client.call_tool("execute_command", {"command": "printf", "args": ["%s|", *hostile]})
    assert not result.is_error
    assert result.structured_content is not None
    assert result.structured_content["stdout"] == "|".join(hostile) + "|"


async def test_timeout_is_answered_within_timeout_plus_two_seconds(client: Client) -> None:
    started = time.monotonic()
    result = await client.call_tool(
        "execute_command", {"command": "echo before; trap '' TERM; sleep 3600", "timeout_s": 1}
    )
    elapsed = time.monotonic() - started
    assert elapsed < 3.0
    assert result.is_error
    assert text_of(result).startswith("timed out after 1 s")
    assert result.structured_content is not None and result.structured_content["timed_out"] is True
    assert "before" in result.structured_content["stdout"]


async def test_timeout_above_the_policy_cap_is_refused(client: Client) -> None:
    result = await client.call_tool("execute_command", {"command": "true", "timeout_s": 100000})
    assert result.is_error
    assert "above the cap" in text_of(result) and "max_timeout_s" in text_of(result)


async def test_out_of_memory_is_reported(client: Client) -> None:
    result = await client.call_tool("execute_command", {"command": "head -c 2000m /dev/zero | tail > /dev/null"})
    assert result.is_error
    assert text_of(result).startswith("killed: out of memory (512 MiB); policy field limits.memory_mb")
    assert result.structured_content is not None and result.structured_content["oom_killed"] is True


async def test_output_is_capped_head_and_tail_with_a_marker(client: Client) -> None:
    result = await client.call_tool("execute_command", {"command": "seq 1 1000000"})
    structured = result.structured_content
    assert structured is not None and structured["truncated"] is True
    assert structured["stdout"].startswith("1\n2\n3\n")
    assert structured["stdout"].endswith("999999\n1000000\n")
    assert "bytes truncated" in structured["stdout"]
    assert len(structured["stdout"]) < 110_000
    dropped = len("".join(f"{n}\n" for n in range(1, 1_000_001))) - 100_000  # the default cap: 100,000 bytes
    first = text_of(result).splitlines()[0]
    assert f"output cut to the cap: {dropped} bytes of stdout dropped (policy field limits.output_bytes)" in first


@pytest.mark.parametrize("size", [49_000, 50_500, 77_000, 99_000, 101_000])
@pytest.mark.parametrize("stream", ["stdout", "stderr"])
async def test_output_comes_back_whole_up_to_the_cap_and_marked_past_it(client: Client, stream: str, size: int) -> None:
    """A 77 KB test log used to come back as its first 50,000 bytes, unmarked: every size up to the cap is whole."""
    redirect = " >&2" if stream == "stderr" else ""
    command = f"{{ head -c {size - 12} /dev/zero | tr '\\0' x; printf '\\nRan 901 OK\\n'; }}{redirect}"
    result = await client.call_tool("execute_command", {"command": command})
    structured = result.structured_content
    assert structured is not None and not result.is_error, text_of(result)
    output = structured[stream]
    assert output.endswith("\nRan 901 OK\n") and output.startswith("xxx")
    if size <= 100_000:  # the default policy's limits.output_bytes
        assert len(output) == size and structured["truncated"] is False
        assert "truncated" not in output and "output cut" not in text_of(result).splitlines()[0]
    else:
        assert structured["truncated"] is True
        assert f"[… {size - 100_000} bytes truncated …]" in output
        assert f"{size - 100_000} bytes of {stream} dropped" in text_of(result).splitlines()[0]


async def test_a_result_never_carries_the_same_output_twice(client: Client) -> None:
    result = await client.call_tool("execute_command", {"command": "head -c 50000000 /dev/zero | tr '\\0' x"})
    assert result.structured_content is not None and result.structured_content["truncated"] is True
    texts = [block.text for block in result.content if isinstance(block, types.TextContent)]
    assert sum(len(text) for text in texts) < 100_000 + 2_000  # the capped stdout once, and a little more
    assert texts[0].splitlines()[0].startswith("exit code 0; output cut to the cap: 49900000 bytes of stdout")


async def test_an_endless_flood_is_stopped(client: Client) -> None:
    started = time.monotonic()
    result = await client.call_tool("execute_command", {"command": "yes", "timeout_s": 60})
    assert time.monotonic() - started < 30
    assert result.is_error
    assert "output flood" in text_of(result)


async def test_invalid_utf8_and_escape_sequences_are_sanitised(client: Client) -> None:
    command = r"printf 'a\033[2Jb\033]52;c;ZXZpbA==\007c\377\000d\342\200\256e\rf'"
    result = await client.call_tool("execute_command", {"command": command})
    assert result.structured_content is not None
    stdout = result.structured_content["stdout"]
    assert "\x1b" not in stdout and "\x00" not in stdout and "\x07" not in stdout and "\r" not in stdout
    assert "\u202e" not in stdout and "<U+202E>" in stdout
    assert stdout.startswith("abc\ufffd\ufffdd")
    assert "\x1b" not in text_of(result)


async def test_files_go_in_and_out(client: Client) -> None:
    result = await client.call_tool(
        "execute_command",
        {
            "command": "wc -l < data/in.txt > out/count.txt && cp pixel.png out/pixel.png && ln -s /etc/shadow out/x",
            "files": [
                {"path": "data/in.txt", "content": "a\nb\nc\n"},
                {"path": "pixel.png", "content": base64.b64encode(PNG_1x1).decode(), "encoding": "base64"},
            ],
        },
    )
    assert not result.is_error, text_of(result)
    images = [block for block in result.content if isinstance(block, types.ImageContent)]
    assert len(images) == 1 and base64.b64decode(images[0].data) == PNG_1x1
    resources = [block for block in result.content if isinstance(block, types.EmbeddedResource)]
    assert len(resources) == 1 and str(resources[0].resource.uri).endswith("/out/count.txt")
    assert getattr(resources[0].resource, "text", "").strip() == "3"
    assert "x: skipped, links are never followed" in text_of(result)
    assert result.structured_content is not None
    listed = {item["path"]: item for item in result.structured_content["files"]}
    assert set(listed) == {"count.txt", "pixel.png"}
    for path, item in listed.items():  # every returned file names the URI it is read by
        read = await client.read_resource(item["uri"])
        content = read.contents[0]
        got = (
            content.text.encode() if isinstance(content, types.TextResourceContents) else base64.b64decode(content.blob)
        )
        assert got == (PNG_1x1 if path == "pixel.png" else b"3\n")


async def test_scripts_run_from_the_workspace_but_never_from_tmp(client: Client) -> None:
    script = '#!/bin/sh\necho "$0 ran"\n'
    result = await client.call_tool("execute_command", {
        "command": "./uploaded.sh && chmod +x made.sh && ./made.sh && cp made.sh /tmp/ && /tmp/made.sh",
        "files": [
            {"path": "uploaded.sh", "content": script, "executable": True},
            {"path": "made.sh", "content": script},
        ],
    })  # fmt: skip
    assert result.structured_content is not None, text_of(result)
    assert result.structured_content["stdout"] == "./uploaded.sh ran\n./made.sh ran\n", text_of(result)
    assert result.is_error and "/tmp/made.sh: Permission denied" in result.structured_content["stderr"]


async def test_input_paths_outside_the_workspace_are_refused(client: Client) -> None:
    result = await client.call_tool(
        "execute_command", {"command": "true", "files": [{"path": "../etc/x", "content": ""}]}
    )
    assert result.is_error and "relative path inside /workspace" in text_of(result)


async def test_workdir_runs_the_program_in_a_folder_under_the_workspace(client: Client) -> None:
    result = await client.call_tool(
        "execute_command",
        {
            "command": "pwd; cat ../in.txt",
            "workdir": "/workspace/a/b",
            "files": [{"path": "a/in.txt", "content": "hi"}],
        },
    )
    assert result.structured_content is not None and not result.is_error, text_of(result)
    assert result.structured_content["stdout"] == "/workspace/a/b\nhi"


async def test_progress_arrives_for_long_calls(client: Client) -> None:
    updates: list[tuple[float, str | None]] = []

    async def on_progress(progress: float, total: float | None, message: str | None) -> None:
        updates.append((progress, message))

    result = await client.call_tool(
        "execute_command",
        {"command": "echo first; sleep 1.6; echo second >&2; sleep 1.6"},
        progress_callback=on_progress,
    )
    assert not result.is_error
    assert updates, "no progress notification arrived"
    assert "elapsed" in (updates[0][1] or "")
    # Each says the latest line of either stream, so a model (or a person) sees where the work is.
    assert (updates[0][1] or "").endswith("last line: first"), updates
    assert (updates[-1][1] or "").endswith("last line: second"), updates


async def _cancel_mid_call(session: Client, runtime: DockerRuntime) -> None:
    running = anyio.Event()
    command = a_sleep_of_its_own(100)  # the other era's test may be cancelling its own at the same time

    async def on_progress(progress: float, total: float | None, message: str | None) -> None:
        running.set()

    async with anyio.create_task_group() as group:
        group.start_soon(
            lambda: session.call_tool("execute_command", {"command": command}, progress_callback=on_progress)
        )
        with anyio.fail_after(10):
            await running.wait()
        [container] = containers_running(command)
        group.cancel_scope.cancel()
    with anyio.fail_after(5):
        while container in runtime.sandbox_containers():
            await anyio.sleep(0.05)


async def test_cancellation_kills_the_container(client: Client, runtime: DockerRuntime) -> None:
    await _cancel_mid_call(client, runtime)


async def test_abandoning_a_2026_era_http_request_kills_the_container(http_url: str, runtime: DockerRuntime) -> None:
    async with connect(http_url, mode="2026-07-28") as session:
        await _cancel_mid_call(session, runtime)


async def test_the_stateless_2026_era_serves_tools_too(http_url: str) -> None:
    for target in (stdio_parameters(), http_url):
        async with connect(target, mode="2026-07-28") as session:
            listed = await session.list_tools()
            assert [tool.name for tool in listed.tools] == [
                "analyze_csv",
                "execute_command",
                "files",
                "run_python",
                "services",
                "workspaces",
            ]
            result = await session.call_tool("execute_command", {"command": "echo modern"})
            assert result.structured_content is not None and result.structured_content["stdout"] == "modern\n"


async def test_an_engine_that_is_down_is_an_error_result_not_a_crash(tmp_path: Path) -> None:
    target = stdio_parameters(env={"DOCKER_HOST": f"unix://{tmp_path}/no-engine.sock"})
    async with connect(target) as session:
        listed = await session.list_tools()
        assert listed.tools
        result = await session.call_tool("execute_command", {"command": "true"})
        assert result.is_error
        assert text_of(result).startswith("sandbox engine unavailable")
        assert "sandbox-server setup" in text_of(result)


async def test_files_keep_their_times_going_in_and_coming_out(client: Client) -> None:
    before = time.time()
    result = await client.call_tool(
        "execute_command",
        {
            "command": "stat -c '%n %Y' dated.txt undated.txt; mkdir -p out; touch -d @1600000000 out/old.txt",
            "files": [
                {"path": "dated.txt", "content": "a", "mtime": 1_700_000_000},
                {"path": "undated.txt", "content": "b"},
            ],
        },
    )
    assert not result.is_error and result.structured_content is not None, text_of(result)
    stated = dict(line.split() for line in result.structured_content["stdout"].splitlines())
    assert stated["dated.txt"] == "1700000000"  # the time the client gave
    assert before - 2 <= int(stated["undated.txt"]) <= time.time() + 2  # else the time of the call, never 1970
    (returned,) = result.structured_content["files"]
    assert returned["path"] == "old.txt" and returned["modified"] == "2020-09-13T12:26:40Z", returned


TONE = (
    "import math, struct, wave\n"
    "with wave.open('out/tone.wav', 'wb') as w:\n"
    "    w.setnchannels(1); w.setsampwidth(2); w.setframerate(8000)\n"
    "    w.writeframes(b''.join(struct.pack('<h', int(12000 * math.sin(2 * math.pi * 440 * i / 8000)))"
    " for i in range(4000)))\n"
)


async def test_a_sound_a_program_writes_comes_back_as_audio_content(client: Client) -> None:
    result = await client.call_tool(
        "execute_command", {"command": "python3 tone.py", "files": [{"path": "tone.py", "content": TONE}]}
    )
    audio = [block for block in result.content if isinstance(block, types.AudioContent)]
    assert not result.is_error and len(audio) == 1, result.content
    assert audio[0].mime_type == "audio/wav"
    with wave.open(io.BytesIO(base64.b64decode(audio[0].data))) as heard:
        assert (heard.getnchannels(), heard.getframerate(), heard.getnframes()) == (1, 8000, 4000)
        frames = heard.readframes(4000)
    peak = max(abs(int.from_bytes(frames[i : i + 2], "little", signed=True)) for i in range(0, len(frames), 2))
    assert 11_500 < peak <= 12_000  # the tone itself, not silence
