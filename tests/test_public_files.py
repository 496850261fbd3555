"""analyze_csv on real public files nobody here wrote, shipped in data packages on PyPI, against pandas on
the host reading the same files: missing values spelled NA, quoted commas, dates written `Jan 1 2000` and
`2012/01/01`, thousands of rows of mixed columns."""

from __future__ import annotations

import importlib.resources
from pathlib import Path
from typing import Any

import pandas as pd
import pytest
from mcp import Client

from tests.mcp_harness import text_of, upload

pytestmark = pytest.mark.anyio


def _public(package: str, *parts: str) -> Path:
    return Path(str(importlib.resources.files(package).joinpath(*parts)))


async def _grouped(
    module_session: Client, path: Path, group: str, column: str, operations: list[str], **more: Any
) -> dict[str, Any]:
    result = await module_session.call_tool("analyze_csv", {
        "filepath": path.name, "operations": operations, "columns": [column], "group_by": [group],
        "max_groups": 500, "files": upload(path.name, path.read_bytes()), **more,
    })  # fmt: skip
    assert not result.is_error, text_of(result)
    assert result.structured_content is not None
    return {str(entry["group"][group]): entry["columns"][column] for entry in result.structured_content["results"]}


async def test_penguin_measurements_with_na_and_quoted_commas(module_session: Client) -> None:
    path = _public("palmerpenguins", "data", "penguins-raw.csv")
    frame = pd.read_csv(path)
    for column in ("Body Mass (g)", "Culmen Length (mm)", "Delta 15 N (o/oo)"):
        ours = await _grouped(module_session, path, "Species", column, ["sum", "average", "count", "min", "max", "std"])
        theirs = frame.groupby("Species")[column]
        for species, stats in ours.items():
            assert stats["count"] == theirs.count()[species]
            for name, expected in (("sum", theirs.sum()), ("average", theirs.mean()), ("min", theirs.min()),
                                   ("max", theirs.max()), ("std", theirs.std())):  # fmt: skip
                assert stats[name] == pytest.approx(expected[species]), (column, species, name)


async def test_stock_prices_dated_jan_1_2000_grouped_by_year(module_session: Client) -> None:
    path = _public("vega_datasets", "_data", "stocks.csv")
    frame = pd.read_csv(path)
    frame["year"] = pd.to_datetime(frame["date"], format="%b %d %Y").dt.strftime("%Y-01-01")
    ours = await _grouped(module_session, path, "date", "price", ["sum", "average"], period="year")
    expected = frame.groupby("year")["price"].sum().to_dict()
    assert {key[:10]: stats["sum"] for key, stats in ours.items()} == pytest.approx(expected)
    dates = await _grouped(module_session, path, "symbol", "date", ["min", "max"])
    written = pd.to_datetime(frame["date"], format="%b %d %Y")
    for symbol, stats in dates.items():
        mine = written[frame["symbol"] == symbol]
        assert stats["min"][:10] == mine.min().date().isoformat() and stats["max"][:10] == mine.max().date().isoformat()


async def test_seattle_weather_by_month_and_airports_by_state(module_session: Client) -> None:
    weather = _public("vega_datasets", "_data", "seattle-weather.csv")
    frame = pd.read_csv(weather)
    frame["month"] = pd.to_datetime(frame["date"], format="%Y/%m/%d").dt.strftime("%Y-%m-01")
    ours = await _grouped(module_session, weather, "date", "temp_max", ["average", "max"], period="month")
    assert {key[:10]: stats["average"] for key, stats in ours.items()} == pytest.approx(
        frame.groupby("month")["temp_max"].mean().to_dict()
    )
    airports = _public("vega_datasets", "_data", "airports.csv")
    frame = pd.read_csv(airports)
    ours = await _grouped(module_session, airports, "state", "latitude", ["count", "average"])
    theirs = frame.groupby("state")["latitude"]
    assert {state: stats["count"] for state, stats in ours.items() if state != "None"} == theirs.count().to_dict()
    assert {state: stats["average"] for state, stats in ours.items() if state != "None"} == pytest.approx(
        theirs.mean().to_dict()
    )
