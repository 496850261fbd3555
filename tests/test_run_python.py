"""run_python through the official MCP client on the real engine."""

from __future__ import annotations

import base64
import struct
from collections.abc import AsyncIterator
from pathlib import Path

import mcp_types as types
import pytest
from mcp import Client

from sandbox_server.sandbox.engine.runtime import DockerRuntime
from tests.mcp_harness import connect, stdio_parameters, text_of

pytestmark = pytest.mark.anyio


@pytest.fixture
async def client(runtime: DockerRuntime) -> AsyncIterator[Client]:
    """A stdio session on the default policy."""
    async with connect(stdio_parameters()) as session:
        yield session


def _png_size(data: bytes) -> tuple[int, int]:
    assert data.startswith(b"\x89PNG\r\n\x1a\n") and data[12:16] == b"IHDR"
    width, height = struct.unpack(">II", data[16:24])
    return width, height


async def test_two_figures_come_back_as_two_png_images(client: Client) -> None:
    code = (
        "import matplotlib.pyplot as plt\n"
        "plt.figure(); plt.plot([1, 2, 3])\n"
        "fig, ax = plt.subplots(); ax.bar(['a', 'b'], [3, 5])\n"
        "print('drawn')\n"
    )
    result = await client.call_tool("run_python", {"code": code})
    assert not result.is_error, text_of(result)
    images = [block for block in result.content if isinstance(block, types.ImageContent)]
    assert len(images) == 2
    for image in images:
        assert image.mime_type == "image/png"
        width, height = _png_size(base64.b64decode(image.data))
        assert width > 100 and height > 100
    assert "drawn" in text_of(result)


async def test_the_final_expression_is_shown_like_a_notebook_cell(client: Client) -> None:
    code = "import pandas as pd\ndf = pd.read_csv('d.csv')\nint(df['x'].sum()) * 2"
    result = await client.call_tool("run_python", {"code": code, "files": [{"path": "d.csv", "content": "x\n1\n2\n"}]})
    assert not result.is_error, text_of(result)
    assert result.structured_content is not None and result.structured_content["stdout"] == "6\n"


async def test_a_file_written_to_out_comes_back_as_a_resource(client: Client) -> None:
    code = "import numpy as np\nnp.savetxt('out/squares.txt', np.arange(4) ** 2, fmt='%d')"
    result = await client.call_tool("run_python", {"code": code})
    resources = [block for block in result.content if isinstance(block, types.EmbeddedResource)]
    assert len(resources) == 1
    assert str(resources[0].resource.uri).endswith("/out/squares.txt")
    assert getattr(resources[0].resource, "text", "").split() == ["0", "1", "4", "9"]


async def test_an_exception_is_an_error_with_the_tracebacks_last_lines(client: Client) -> None:
    code = "def divide(a, b):\n    return a / b\n\ndivide(1, 0)\n"
    result = await client.call_tool("run_python", {"code": code})
    assert result.is_error
    assert text_of(result).startswith("ZeroDivisionError: division by zero (exit code 1)")
    assert result.structured_content is not None
    stderr = result.structured_content["stderr"]
    assert "Traceback" in stderr and "in divide" in stderr and "run_cell.py" not in stderr


async def test_a_cold_cell_starts_without_what_only_some_cells_use(runtime: DockerRuntime, tmp_path: Path) -> None:
    """Under a harness's policy (nothing preloaded, no variables kept) the cell's interpreter starts with no module
    the launcher needs only for figures, tables, kept variables or a traceback: on a small machine they were half
    of a cell's CPU. A syntax error, a traceback and a figure still come back as ever."""
    policy = tmp_path / "harness.yaml"
    policy.write_text("extends: default\ntools:\n  run_python: {preload: []}\nworkspace: {persist: false}\n")
    probe = "import sys\nsorted(set(sys.modules) & {'ast', 'json', 'hashlib', 'traceback', 'cell_state', 'shutil', 'pickle'})"
    async with connect(stdio_parameters("--policy", str(policy))) as session:
        cold = await session.call_tool("run_python", {"code": probe})
        broken = await session.call_tool("run_python", {"code": "1 +"})
        raised = await session.call_tool("run_python", {"code": "def f():\n    raise KeyError('k')\nf()"})
        drawn = await session.call_tool("run_python", {"code": "import matplotlib.pyplot as plt\nplt.plot([1, 2])"})
    assert cold.structured_content is not None and cold.structured_content["stdout"] == "[]\n", text_of(cold)
    assert broken.is_error and "SyntaxError" in text_of(broken)
    assert raised.is_error and text_of(raised).startswith("KeyError: 'k' (exit code 1)"), text_of(raised)
    assert [type(block).__name__ for block in drawn.content].count("ImageContent") == 1, text_of(drawn)


MODERN = """
import numpy as np, pandas as pd, matplotlib, scipy, sklearn, statsmodels.api as sm, seaborn, pyarrow, polars as pl
import plotly, networkx, requests
from sklearn.linear_model import LinearRegression
days = pd.DataFrame({"v": np.arange(60, dtype=np.float64)}, index=pd.date_range("2024-01-01", periods=60, freq="D"))
monthly = days.resample("ME").sum()["v"].tolist()
doubled = days.head(2).map(lambda x: x * 2)["v"].tolist()
fit = LinearRegression().fit(days[["v"]], days["v"] * 3).coef_.round(6).tolist()
frame = pl.DataFrame({"a": [1, 2, 3]}).select(pl.col("a").sum()).item()
table = pyarrow.table({"a": [1, 2]}).num_rows
(np.__version__.split(".")[0], pd.__version__.split(".")[0], monthly, doubled, fit, frame, table)
"""


async def test_todays_scientific_python_runs_and_the_tool_names_its_versions(client: Client) -> None:
    result = await client.call_tool("run_python", {"code": MODERN})
    assert not result.is_error, text_of(result)
    assert result.structured_content is not None
    said = result.structured_content["stdout"].strip()
    assert said == "('2', '2', [465.0, 1305.0], [0.0, 2.0], [3.0], 6, 2)", said
    listed = {tool.name: tool for tool in (await client.list_tools()).tools}
    description = listed["run_python"].description or ""
    assert "numpy 2." in description and "pandas 2." in description and "scikit-learn 1." in description
