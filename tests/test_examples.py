"""The examples each tool's description shows a model are valid calls that the default policy runs."""

from __future__ import annotations

import json
import re
from collections.abc import AsyncIterator

import pytest
from mcp import Client

from sandbox_server.sandbox.engine.runtime import DockerRuntime
from sandbox_server.tools import all_tools
from tests.mcp_harness import connect, stdio_parameters, text_of

pytestmark = pytest.mark.anyio

EXAMPLES = [
    (tool.name, example)
    for tool in all_tools()
    for example in re.findall(r"^Example: (\{.*\})$", tool.description, flags=re.MULTILINE)
]


def test_every_tool_shows_examples() -> None:
    assert {name for name, _ in EXAMPLES} == {tool.name for tool in all_tools()}


@pytest.fixture(scope="module")
async def examples_session(runtime: DockerRuntime, tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Client]:
    """The default policy, on a state folder of its own: what an example keeps is not left to the next run."""
    state = tmp_path_factory.mktemp("examples-state")
    async with connect(stdio_parameters("--state-dir", str(state))) as session:
        yield session


@pytest.mark.parametrize(("tool", "example"), EXAMPLES)
async def test_each_example_runs_under_the_default_policy(examples_session: Client, tool: str, example: str) -> None:
    result = await examples_session.call_tool(tool, json.loads(example))
    error = (result.structured_content or {}).get("error")
    assert error is None, text_of(result)  # a program may fail (no such file); the call is never refused
