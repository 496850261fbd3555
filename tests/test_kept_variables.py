"""run_python's kept variables, through the real server and engine: a cell loads only the variables it names and
keeps again only what it loaded or set, one variable that cannot be kept costs no other, and a figure comes back
from the cell that drew or changed it, not from every later one that merely keeps it."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import mcp_types as types
import pytest

from sandbox_server.sandbox.engine.runtime import DockerRuntime
from tests.mcp_harness import CheckedClient, connect, stdio_parameters, text_of
from tests.test_workspaces import KEEPING, Keeping, _serve_args

pytestmark = pytest.mark.anyio


@pytest.fixture(params=["mounted", "archived"])
def keeping(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[Keeping]:
    """A policy that keeps workspaces of 16 MB, kept both ways (serve --workspaces)."""
    policy = tmp_path / "keeping.yaml"
    policy.write_text(KEEPING)
    yield Keeping(policy, tmp_path / "state", tmp_path / "audit.jsonl", request.param)


async def _cell(session: CheckedClient, code: str) -> tuple[dict[str, Any], int]:
    """A cell's structured answer (with its text) and how many images came back."""
    result = await session.call_tool("run_python", {"code": code})
    assert result.structured_content is not None, text_of(result)
    images = sum(isinstance(block, types.ImageContent) for block in result.content)
    return {**result.structured_content, "is_error": result.is_error, "text": text_of(result)}, images


STAT = "import os; s = os.stat('/workspace/.sandbox/cell-state/v1.pickle'); (s.st_ino, s.st_mtime_ns)"


async def test_a_cell_that_names_no_kept_variable_reads_and_writes_none_of_them(
    keeping: Keeping, runtime: DockerRuntime
) -> None:
    async with connect(stdio_parameters(*_serve_args(keeping))) as session:
        made, _ = await _cell(session, "big = bytes(4_000_000)\nsmall = 1")
        before = await session.call_tool(
            "execute_command", {"command": "stat -c '%i %Y' .sandbox/cell-state/v1.pickle"}
        )
        plain, _ = await _cell(session, "1 + 1")
        after = await session.call_tool("execute_command", {"command": "stat -c '%i %Y' .sandbox/cell-state/v1.pickle"})
        changed, _ = await _cell(session, "small += 1\nsmall")
        both, _ = await _cell(session, "(len(big), small)")
    assert "variables kept for the next cell: big, small" in made["text"], made["text"]
    assert plain["stdout"] == "2\n" and "variables kept for the next cell: big, small" in plain["text"], plain["text"]
    assert before.structured_content is not None and after.structured_content is not None
    assert before.structured_content["stdout"] == after.structured_content["stdout"]  # its file: not written again
    assert changed["stdout"] == "2\n" and both["stdout"] == "(4000000, 2)\n", (changed["text"], both["text"])


async def test_a_variable_that_cannot_be_kept_costs_no_other(keeping: Keeping, runtime: DockerRuntime) -> None:
    async with connect(stdio_parameters(*_serve_args(keeping))) as session:  # the workspace holds 16 MB
        made, _ = await _cell(session, "big = bytes(40_000_000)\nsmall = 1\nstream = open('/dev/null')")
        after, _ = await _cell(session, "small + 1")
    assert "variables kept for the next cell: small" in made["text"], made["text"]
    assert "big (the workspace is full: policy field workspace.size_mb)" in made["text"], made["text"]
    assert (
        "stream (TextIOWrapper: not picklable (cannot pickle '_io.TextIOWrapper' object); make it again" in made["text"]
    ), made["text"]
    assert not after["is_error"] and after["stdout"] == "2\n", after["text"]


FORMATTED = """
import matplotlib.pyplot as plt
from matplotlib.ticker import FuncFormatter
fig, ax = plt.subplots()
ax.plot([1000, 3000, 2000])
ax.yaxis.set_major_formatter(FuncFormatter(lambda value, _: f"{value / 1000:g}k"))
total = 6000
"""


async def test_a_figure_that_cannot_be_kept_says_which_part_stops_it_and_what_to_do(
    keeping: Keeping, runtime: DockerRuntime
) -> None:
    async with connect(stdio_parameters(*_serve_args(keeping))) as session:
        made, _ = await _cell(session, FORMATTED)
        after, _ = await _cell(session, "total")
    said = made["text"]
    assert "variables kept for the next cell: FuncFormatter, total; not kept: fig (Figure" in said, said
    assert (
        "fig (Figure: not picklable, a lambda in its y axis' tick formatter; give it a function made with def" in said
    )
    assert "ax (Axes: not picklable, a lambda in its y axis' tick formatter" in said, said
    assert after["stdout"] == "6000\n", after["text"]


PLOT = "import matplotlib.pyplot as plt\nfig, ax = plt.subplots()\nax.plot([1, 3, 2])\nax.set_title('first')"


async def test_a_figure_comes_back_from_the_cell_that_drew_or_changed_it_alone(
    keeping: Keeping, runtime: DockerRuntime
) -> None:
    async with connect(stdio_parameters(*_serve_args(keeping))) as session:
        _, drawn = await _cell(session, PLOT)
        plain = [(await _cell(session, f"n{i} = {i}"))[1] for i in range(5)]
        _, looked_at = await _cell(session, "fig.get_size_inches().tolist()")
        _, changed = await _cell(session, "ax.set_title('second')")
        title, again = await _cell(session, "ax.get_title()")
        _, new = await _cell(session, "plt.figure(); plt.plot([1, 2])")
    assert drawn == 1 and plain == [0] * 5 and looked_at == 0, (drawn, plain, looked_at)
    assert changed == 1 and again == 0 and title["stdout"] == "'second'\n", title["text"]
    assert new == 1  # a new figure beside the kept one: it alone comes back


async def test_a_cell_starts_with_no_current_figure_and_a_kept_one_is_drawn_when_asked(
    keeping: Keeping, runtime: DockerRuntime
) -> None:
    async with connect(stdio_parameters(*_serve_args(keeping))) as session:
        await _cell(session, PLOT)
        bars, drawn = await _cell(session, "bars = plt.bar(['a', 'b'], [3, 5])\nbars[0].figure is fig")
        kept, unchanged = await _cell(session, "(len(ax.lines), len(ax.patches), ax.get_title())")
        asked, shown = await _cell(session, "fig")
    assert bars["stdout"] == "False\n" and drawn == 1, bars["text"]  # a new figure, not the kept one drawn over
    assert kept["stdout"] == "(1, 0, 'first')\n" and unchanged == 0, kept["text"]
    assert shown == 1, asked["text"]  # the cell's value: drawn, though unchanged
