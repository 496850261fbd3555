"""Plots are for people: rendered, opened, and checked for what they show (the statistic asked for, one point
per period, every label's glyphs), not only for being PNGs."""

from __future__ import annotations

import base64
import io
from typing import Any

import mcp_types as types
import numpy as np
import pytest
from mcp import Client
from PIL import Image

from tests.mcp_harness import text_of, upload

pytestmark = pytest.mark.anyio

LINE = (31, 119, 180)
"""matplotlib's first colour (C0): bars and lines."""
MARKER = (255, 127, 14)
"""Its second (C1): the points of a line through groups."""


def _pixels(result: types.CallToolResult) -> np.ndarray:
    [image] = [block for block in result.content if isinstance(block, types.ImageContent)]
    return np.asarray(Image.open(io.BytesIO(base64.b64decode(image.data))).convert("RGB")).astype(int)


def _mask(pixels: np.ndarray, colour: tuple[int, int, int]) -> np.ndarray:
    mask: np.ndarray = np.abs(pixels - np.array(colour)).sum(axis=2) < 40
    return mask


def _bar_heights(pixels: np.ndarray) -> list[int]:
    """The height in pixels of each bar, left to right."""
    columns = _mask(pixels, LINE).sum(axis=0)
    heights, current = [], 0
    for count in [*columns, 0]:
        if count:
            current = max(current, int(count))
        elif current:
            heights.append(current)
            current = 0
    return heights


def _blobs(mask: np.ndarray) -> int:
    """Connected groups of set pixels (4-neighbours)."""
    seen = np.zeros_like(mask, dtype=bool)
    count = 0
    for y, x in zip(*np.nonzero(mask), strict=True):
        if seen[y, x]:
            continue
        count += 1
        stack = [(y, x)]
        seen[y, x] = True
        while stack:
            cy, cx = stack.pop()
            for ny, nx in ((cy + 1, cx), (cy - 1, cx), (cy, cx + 1), (cy, cx - 1)):
                if 0 <= ny < mask.shape[0] and 0 <= nx < mask.shape[1] and mask[ny, nx] and not seen[ny, nx]:
                    seen[ny, nx] = True
                    stack.append((ny, nx))
    return count


def _sales(rows: int = 5_000) -> str:
    """Chinese categories with sums and counts in different proportions, two years of dates, gaps in amounts."""
    categories = [("图书", 10.0), ("服装", 90.0), ("电器", 40.0)]  # in 3, 1 and 2 rows of every 6
    lines = ["日期,类别,amount"]
    for index in range(rows):
        name, amount = categories[[0, 0, 0, 1, 2, 2][index % 6]]
        month = index % 24
        day = f"{2023 + month // 12}-{month % 12 + 1:02d}-{index % 28 + 1:02d}"
        lines.append(f"{day},{name},{'' if index % 50 == 7 else amount + index % 5}")
    return "\n".join(lines) + "\n"


async def _analyze(session: Client, rows: int = 5_000, **arguments: Any) -> types.CallToolResult:
    result = await session.call_tool(
        "analyze_csv", {"filepath": "sales.csv", "files": upload("sales.csv", _sales(rows)), **arguments}
    )
    assert not result.is_error, text_of(result)
    return result


async def test_a_bar_plot_draws_the_first_value_statistic_asked_for(module_session: Client) -> None:
    result = await _analyze(
        module_session, operations=["count", "sum", "average"], group_by=["类别"], plot={"kind": "bar", "y": "amount"}
    )
    assert result.structured_content is not None
    sums = [entry["columns"]["amount"]["sum"] for entry in result.structured_content["results"]]
    counts = [entry["columns"]["amount"]["count"] for entry in result.structured_content["results"]]
    heights = _bar_heights(_pixels(result))
    assert len(heights) == 3
    drawn = [h / max(heights) for h in heights]
    assert drawn == pytest.approx([s / max(sums) for s in sums], abs=0.02)  # the sums, not the counts
    assert drawn != pytest.approx([c / max(counts) for c in counts], abs=0.02)
    assert "missing" not in text_of(result)  # every Chinese label was drawn (no note of missing glyphs)


async def test_a_bar_plot_draws_the_statistic_plot_stat_names(module_session: Client) -> None:
    result = await _analyze(
        module_session,
        operations=["sum", "average"],
        group_by=["类别"],
        plot={"kind": "bar", "y": "amount", "stat": "average"},
    )
    assert result.structured_content is not None
    averages = [entry["columns"]["amount"]["average"] for entry in result.structured_content["results"]]
    heights = _bar_heights(_pixels(result))
    assert [h / max(heights) for h in heights] == pytest.approx([a / max(averages) for a in averages], abs=0.02)
    refused = await module_session.call_tool("analyze_csv", {
        "filepath": "sales.csv", "operations": ["sum"], "group_by": ["类别"],
        "plot": {"kind": "bar", "y": "amount", "stat": "median"}, "files": upload("sales.csv", _sales(60)),
    })  # fmt: skip
    assert refused.is_error and "plot.stat 'median' was not computed" in text_of(refused)


async def test_a_line_plot_by_period_draws_one_point_per_period(module_session: Client) -> None:
    result = await _analyze(
        module_session, operations=["sum"], group_by=["日期"], period="month", plot={"kind": "line", "y": "amount"}
    )
    assert result.structured_content is not None
    assert len(result.structured_content["results"]) == 24
    assert _blobs(_mask(_pixels(result), MARKER)) == 24


def _frame(pixels: np.ndarray) -> tuple[int, int, int, int]:
    """The axes' frame (top, bottom, left, right): the rows and columns its black spines run along."""
    dark = pixels.sum(axis=2) < 120
    rows = np.nonzero(dark.sum(axis=1) > 0.4 * pixels.shape[1])[0]
    columns = np.nonzero(dark.sum(axis=0) > 0.4 * pixels.shape[0])[0]
    return int(rows.min()), int(rows.max()), int(columns.min()), int(columns.max())


def _monthly(rows: int = 4_800) -> str:
    """Two years of orders worth about 13 million a month, each month within 7% of the others, some without a
    region."""
    lines = ["订单日期,地区,销售额"]
    for index in range(rows):
        month = index % 24
        amount = 65_000 + 2_000 * (month % 3)
        region = "" if index % 10 == 3 else ["华东", "华南"][index % 2]
        lines.append(f"{2023 + month // 12}-{month % 12 + 1:02d}-{index % 28 + 1:02d},{region},{amount}")
    return "\n".join(lines) + "\n"


async def test_a_line_of_large_sums_reads_as_people_write_it(module_session: Client) -> None:
    """From zero (a 7% wiggle stays a wiggle), no offset or power of ten above the axis, at most 12 dates."""
    result = await module_session.call_tool("analyze_csv", {
        "filepath": "orders.csv", "operations": ["sum"], "group_by": ["订单日期"], "period": "month",
        "plot": {"kind": "line", "y": "销售额"}, "files": upload("orders.csv", _monthly()),
    })  # fmt: skip
    assert not result.is_error, text_of(result)
    assert result.structured_content is not None
    sums = [entry["columns"]["销售额"]["sum"] for entry in result.structured_content["results"]]
    assert len(sums) == 24 and min(sums) > 0.93 * max(sums) and max(sums) > 10_000_000
    pixels = _pixels(result)
    top, bottom, left, right = _frame(pixels)
    line_rows = np.nonzero(_mask(pixels[top:bottom, left:right], LINE).any(axis=1))[0]
    height = bottom - top
    assert line_rows.max() < 0.25 * height, "the line spans the axes: its axis does not start at zero"
    offset = pixels[max(0, top - 22) : top - 2, left - 5 : left + 70]
    assert not (offset.sum(axis=2) < 300).any(), "something is written above the axis: an offset or 1e7"
    below = pixels[bottom + 2, left + 2 : right - 1].sum(axis=1) < 200
    ticks = int(np.count_nonzero(below[1:] & ~below[:-1]) + below[0])
    assert 6 <= ticks <= 12, ticks
    assert "sum(销售额) · 订单日期 (month)" not in text_of(result)  # the title is drawn, not said


async def test_a_missing_group_is_named_alike_in_the_table_and_the_plot(module_session: Client) -> None:
    result = await module_session.call_tool("analyze_csv", {
        "filepath": "orders.csv", "operations": ["sum"], "group_by": ["地区"],
        "plot": {"kind": "bar", "y": "销售额"}, "files": upload("orders.csv", _monthly(600)),
    })  # fmt: skip
    assert not result.is_error, text_of(result)
    assert result.structured_content is not None
    assert [entry["group"]["地区"] for entry in result.structured_content["results"]] == ["华东", "华南", None]
    assert "\n| (missing) | 销售额 | " in text_of(result)
    assert len(_bar_heights(_pixels(result))) == 3


async def test_a_plot_of_sampled_points_says_so(module_session: Client) -> None:
    result = await _analyze(
        module_session, 12_000, operations=["count"], plot={"kind": "scatter", "x": "日期", "y": "amount"}
    )
    assert "the scatter plot shows a random sample of 10000 of 11760 points" in text_of(result)


SCRIPTS = {
    "Chinese (simplified)": "地区 华东 金额 图书 服装",
    "Chinese (traditional)": "地區 臺北 金額 備註",
    "Japanese": "地域 東京 ひらがな カタカナ 備考",
    "Korean": "지역 서울 금액 비고",
    "Cyrillic": "Регион Москва Сумма",
    "Greek": "Περιοχή Αθήνα Ποσό",
    "Hebrew": "אזור ירושלים סכום",
    "Arabic": "المنطقة القاهرة المبلغ",
    "Vietnamese": "Khu vực Hà Nội Đà Nẵng Số tiền",
    "Latin": "Île-de-France Łódzkie İstanbul Šiauliai",
}
GLYPH_CHECK = """
import warnings, matplotlib.pyplot as plt
from matplotlib import font_manager
from matplotlib.ft2font import FT2Font
text = {text!r}
families = plt.rcParams['font.family']
fonts = [FT2Font(font_manager.findfont(font_manager.FontProperties(family=f), fallback_to_default=False))
         for f in families]
missing = sorted({{c for c in text if not c.isspace() and not any(f.get_char_index(ord(c)) for f in fonts)}})
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter('always')
    figure, axes = plt.subplots()
    axes.bar([0, 1], [1, 2])
    axes.set_xticks([0, 1], [text, text[::-1]])
    axes.set_title(text)
    figure.canvas.draw()
warned = [str(w.message) for w in caught if 'missing' in str(w.message)]
('missing', missing, 'warned', warned)
"""


@pytest.mark.parametrize("script", SCRIPTS)
async def test_run_python_draws_every_glyph_of_each_script(module_session: Client, script: str) -> None:
    result = await module_session.call_tool("run_python", {"code": GLYPH_CHECK.format(text=SCRIPTS[script])})
    assert not result.is_error, text_of(result)
    assert result.structured_content is not None
    assert "('missing', [], 'warned', [])" in result.structured_content["stdout"], result.structured_content
    assert "missing from" not in result.structured_content["stderr"]


DATE_PLOT = """
import pandas as pd, matplotlib.pyplot as plt
days = pd.date_range("2025-01-01", periods=120, freq="D")
series = pd.Series(range(120), index=days, name="orders")
axes = series.plot(figsize=(4, 3))
axes.set_xlabel("day of the order (UTC)", fontsize=14, color="#d62728")
plt.xticks(rotation=90)
figure = axes.figure
figure.set_dpi(100)
"""
LABEL = (214, 39, 40)
"""The x-axis label's colour in DATE_PLOT (C3)."""


async def test_a_figure_keeps_its_x_axis_label_below_rotated_dates(module_session: Client) -> None:
    """A pandas date plot whose rotated dates push the x label past the figure's bottom edge: saved with a tight
    bounding box, as a notebook shows it, the label is drawn inside the picture."""
    result = await module_session.call_tool("run_python", {"code": DATE_PLOT})
    assert not result.is_error, text_of(result)
    pixels = _pixels(result)
    label = _mask(pixels, LABEL)
    rows = np.flatnonzero(label.any(axis=1))
    assert label.sum() > 200 and len(rows) > 0, int(label.sum())  # the label's red letters are there
    assert rows.max() < pixels.shape[0] - 2, (rows.max(), pixels.shape)  # and whole: background below it
