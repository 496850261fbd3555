"""tools/list says what a model needs in few characters; the server still checks every bound it leaves out."""

from __future__ import annotations

import json

import pytest

from sandbox_server.calls.registry import ToolRegistry
from sandbox_server.policy.loader import load_policy
from sandbox_server.protocol.concise import concise_arguments, concise_results, first_sentence
from sandbox_server.protocol.server import Parts, SandboxServer
from sandbox_server.tools import all_tools
from tests.fast.test_protocol import FakeRuntime
from tests.mcp_harness import connect

pytestmark = pytest.mark.anyio

LISTING_CHARS = 12_000
"""The default policy's six tools as tools/list gives them, each with its icon: under 12,000 characters (54,700 when
each schema was listed whole; 11,860 for five tools, about 11,850 with `files` and no icons)."""


async def test_the_default_listing_of_six_tools_is_small_and_carries_no_bound() -> None:
    policy = load_policy("default", [tool.name for tool in all_tools()])
    app = SandboxServer(Parts(ToolRegistry(all_tools(), policy), FakeRuntime(), None))
    async with connect(app.server) as client:
        page = await client.list_tools()
    listed = json.dumps(page.model_dump(by_alias=True, exclude_none=True), separators=(",", ":"))
    assert sorted(tool.name for tool in page.tools) == [
        "analyze_csv",
        "execute_command",
        "files",
        "run_python",
        "services",
        "workspaces",
    ]
    assert len(listed) < LISTING_CHARS, len(listed)
    for word in ('"pattern":"', '"maxLength"', '"minimum"', '"x-in-words"', '"additionalProperties"', ": arguments"):
        assert word not in listed, word  # (the arguments' own title, "execute_command: arguments", said it again)
    execute = next(tool for tool in page.tools if tool.name == "execute_command")
    assert execute.input_schema["required"] == ["command"] and "workspace" in execute.input_schema["properties"]
    assert set(execute.output_schema or {}) == {"type", "properties"}
    results = (execute.output_schema or {})["properties"]
    assert results["stdout"] == {} and results["files"] == {}  # named; their shapes are the full schema's
    assert all(tool.icons for tool in page.tools)
    hints = {
        tool.name: tool.annotations.model_dump(by_alias=True, exclude_none=True)
        for tool in page.tools
        if tool.annotations
    }
    assert hints["execute_command"] == {"destructiveHint": False, "openWorldHint": False}  # the defaults unsaid
    assert hints["workspaces"] == {"openWorldHint": False}  # it deletes: destructive, as a client assumes


@pytest.mark.parametrize("tool", all_tools(), ids=lambda tool: tool.name)
def test_a_listed_schema_keeps_every_argument_and_field_of_the_full_one(tool: object) -> None:
    full_arguments, full_results = tool.input_schema, tool.output_schema  # type: ignore[attr-defined]
    arguments, results = concise_arguments(full_arguments), concise_results(full_results)
    assert set(arguments["properties"]) == set(full_arguments["properties"])
    assert arguments.get("required") == full_arguments.get("required")
    assert set(results["properties"]) == set(full_results["properties"])
    for name, field in results["properties"].items():  # only what the full schema says too: a result valid under
        assert all(full_results["properties"][name][key] == value for key, value in field.items())  # it still is


def test_a_description_keeps_its_first_sentence() -> None:
    assert first_sentence("Columns to analyze (e.g. a, b). The rest is detail.") == "Columns to analyze (e.g. a, b)."
    assert first_sentence("Wall-clock limit in seconds; The policy caps it.") == "Wall-clock limit in seconds."
    assert first_sentence("no full stop") == "no full stop"


async def test_descriptions_follow_the_policy_serving_them() -> None:
    async def described(name: str) -> dict[str, str]:
        policy = load_policy(name, [tool.name for tool in all_tools()])
        app = SandboxServer(Parts(ToolRegistry(all_tools(), policy), FakeRuntime(), None))
        async with connect(app.server) as client:
            return {tool.name: tool.description or "" for tool in (await client.list_tools()).tools}

    toolchain, default = await described("toolchain"), await described("default")
    assert "C, C++, Go, Rust" in toolchain["execute_command"]
    assert toolchain["execute_command"].endswith("300 s a call, `timeout_s` up to 900.")
    assert default["execute_command"].endswith("Policy 'default': 30 s a call, `timeout_s` up to 120.")
    assert "the shell (bash) as this one left them" in default["execute_command"]
    assert "s a call" not in default["files"]  # no timeout of its own to ask for


async def test_the_server_and_each_tool_show_an_icon_shipped_with_the_package() -> None:
    import base64
    from xml.etree import ElementTree

    policy = load_policy("default", [tool.name for tool in all_tools()])
    app = SandboxServer(Parts(ToolRegistry(all_tools(), policy), FakeRuntime(), None))
    async with connect(app.server) as client:
        assert client.server_info is not None
        (icon,) = client.server_info.icons or []
        tools = (await client.list_tools()).tools
    drawings = {"server": icon.src} | {tool.name: (tool.icons or [])[0].src for tool in tools}
    for name, src in drawings.items():
        assert src.startswith("data:image/svg+xml;base64,"), name  # the URI says its type: nothing to fetch
        drawn = ElementTree.fromstring(base64.b64decode(src.split(",", 1)[1]))
        assert drawn.tag.endswith("svg") and drawn.get("viewBox") in ("0 0 64 64", "0 0 8 8") and len(list(drawn))
        assert not any(element.tag.endswith("script") or "href" in str(element.attrib) for element in drawn.iter())
    assert len(set(drawings.values())) == 7 and max(len(src) for src in drawings.values()) < 800
