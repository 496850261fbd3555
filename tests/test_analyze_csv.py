"""analyze_csv through the official MCP client on the real engine, checked against pandas on the host."""

from __future__ import annotations

import base64
import csv
import io
import math
import random
import struct
import zlib
from pathlib import Path
from typing import Any

import mcp_types as types
import pandas as pd
import pytest
from mcp import Client

from sandbox_server.sandbox.engine.runtime import DockerRuntime
from sandbox_server.tools.analyze_csv import sandbox_path
from sandbox_server.tools.csv_answer import markdown_table
from tests.mcp_harness import connect, stdio_parameters, text_of, upload

pytestmark = pytest.mark.anyio

ALL = ["sum", "average", "count", "min", "max", "median", "std", "distinct", "nulls"]
PANDAS = {
    "sum": lambda s: s.sum(),
    "average": lambda s: s.mean(),
    "count": lambda s: s.count(),
    "min": lambda s: s.min(),
    "max": lambda s: s.max(),
    "median": lambda s: s.median(),
    "std": lambda s: s.std(),
    "distinct": lambda s: s.nunique(),
    "nulls": lambda s: s.isna().sum(),
}


def _generated_csv(rows: int, seed: int) -> str:
    """Numbers with gaps and negatives, quoted commas, unicode, a column mixing numbers and words."""
    rng = random.Random(seed)
    regions = ["Zürich", "São Paulo", "北京", "Nord, Süd", ""]
    buffer = io.StringIO()
    writer = csv.writer(buffer, lineterminator="\n")
    writer.writerow(["id", "region", "amount", "qty", "label", "mixed"])
    for index in range(rows):
        amount = "" if index % 7 == 3 else f"{rng.uniform(-500, 5000):.2f}"
        qty = "" if index % 11 == 5 else str(rng.randint(-3, 40))
        label = rng.choice(['say "hi", then go', "naïve café", "plain", "", "émoji 🎉"])
        mixed = str(rng.randint(1, 9)) if index % 13 else "n/a-ish"
        writer.writerow([index, rng.choice(regions), amount, qty, label, mixed])
    return buffer.getvalue()


def _same(ours: Any, theirs: Any) -> bool:
    if theirs is None or (isinstance(theirs, float) and math.isnan(theirs)):
        return ours is None
    return bool(ours == pytest.approx(float(theirs), rel=1e-9, abs=1e-9))


async def _analyze(module_session: Client, arguments: dict[str, Any]) -> dict[str, Any]:
    result = await module_session.call_tool("analyze_csv", arguments)
    assert not result.is_error, text_of(result)
    assert result.structured_content is not None
    return dict(result.structured_content)


async def test_statistics_equal_what_pandas_computes(module_session: Client, tmp_path: Path) -> None:
    content = _generated_csv(400, seed=1)
    answer = await _analyze(
        module_session, {"filepath": "data.csv", "operations": ALL, "files": upload("data.csv", content)}
    )
    (tmp_path / "data.csv").write_text(content)
    frame = pd.read_csv(tmp_path / "data.csv")
    assert answer["file"]["rows"] == len(frame) == 400
    assert answer["file"]["header"] is True and answer["file"]["delimiter"] == ","
    [result] = answer["results"]
    assert result["group"] is None and result["rows"] == 400
    for column in ("id", "amount", "qty"):
        for operation in ALL:
            ours, theirs = result["columns"][column][operation], PANDAS[operation](frame[column])
            assert _same(ours, theirs), (column, operation, ours, theirs)
    for column in ("region", "label", "mixed"):
        assert result["columns"][column]["count"] == frame[column].count()
        assert result["columns"][column]["nulls"] == frame[column].isna().sum()
        assert result["columns"][column]["distinct"] == frame[column].nunique()
        assert "sum" not in result["columns"][column]
    skipped = {item["column"]: item for item in answer["skipped"]}
    assert set(skipped) == {"region", "label", "mixed"}
    assert skipped["mixed"]["operations"] == ["sum", "average", "min", "max", "median", "std"]
    assert "not numeric" in skipped["mixed"]["reason"]
    assert any("'mixed' skipped for sum" in note for note in answer["notes"])


async def test_grouped_statistics_and_describe_equal_pandas(module_session: Client, tmp_path: Path) -> None:
    content = _generated_csv(300, seed=2)
    arguments = {
        "filepath": "/workspace/in/data.csv",
        "operations": ["sum", "count", "describe"],
        "columns": ["amount", "qty"],
        "group_by": ["region"],
        "files": upload("in/data.csv", content),
    }
    result = await module_session.call_tool("analyze_csv", arguments)
    assert not result.is_error, text_of(result)
    answer = result.structured_content
    assert answer is not None
    (tmp_path / "data.csv").write_text(content)
    frame = pd.read_csv(tmp_path / "data.csv")
    groups = frame.groupby("region", dropna=False)
    assert answer["groups"] == len(groups) == 5
    assert [r["group"]["region"] for r in answer["results"]] == sorted(frame["region"].dropna().unique()) + [None]
    for entry in answer["results"]:
        key = entry["group"]["region"]
        part = frame[frame["region"].isna()] if key is None else frame[frame["region"] == key]
        assert entry["rows"] == len(part)
        for column in ("amount", "qty"):
            described = part[column].describe()
            stats = entry["columns"][column]
            expected = {
                "sum": part[column].sum(),
                "count": described["count"],
                "average": described["mean"],
                "std": described["std"],
                "min": described["min"],
                "25%": described["25%"],
                "median": described["50%"],
                "75%": described["75%"],
                "max": described["max"],
            }
            for stat, theirs in expected.items():
                assert _same(stats[stat], theirs), (key, column, stat, stats[stat], theirs)
    table = text_of(result).split("--- results ---\n", 1)[1]
    assert table.startswith("| region | column | count | sum | average | std | min | 25% | median | 75% | max |")
    assert "| Nord, Süd | amount |" in table


async def test_a_header_only_file_has_columns_and_no_rows(module_session: Client) -> None:
    answer = await _analyze(
        module_session, {"filepath": "h.csv", "operations": ["sum", "count"], "files": upload("h.csv", "a,b,c\n")}
    )
    assert answer["file"]["rows"] == 0
    assert [c["name"] for c in answer["file"]["columns"]] == ["a", "b", "c"]
    assert all(answer["results"][0]["columns"][c]["count"] == 0 for c in "abc")
    assert all(item["reason"] == "the file has no data rows" for item in answer["skipped"])


@pytest.mark.parametrize(
    ("encoding", "delimiter", "label"),
    [
        ("utf-8-sig", ",", "UTF-8 with BOM"),
        ("utf-16", ";", "UTF-16 LE"),
        ("utf-16-be", ",", "UTF-16 BE"),
        ("latin-1", "\t", "cp1252"),  # Windows-1252 reads every Latin-1 letter; a 5-row file cannot tell more
    ],
)
async def test_encoding_and_delimiter_are_detected(
    module_session: Client, encoding: str, delimiter: str, label: str
) -> None:
    rows = [["stadt", "betrag"], ["Zürich", "1.5"], ["Genève", "2.25"], ["Köln", ""], ["Bâle", "4"]]
    text = "".join(delimiter.join(row) + "\n" for row in rows)
    data = text.encode(encoding)
    if encoding == "utf-16-be":
        data = "\ufeff".encode("utf-16-be") + data
    answer = await _analyze(
        module_session, {"filepath": "e.csv", "operations": ["sum", "distinct"], "files": upload("e.csv", data)}
    )
    assert answer["file"]["encoding"].startswith(label)
    assert answer["file"]["delimiter"] == delimiter
    stats = answer["results"][0]["columns"]
    assert stats["betrag"]["sum"] == pytest.approx(7.75)
    assert stats["stadt"]["distinct"] == 4


async def test_no_header_and_binary_files_are_named(module_session: Client) -> None:
    answer = await _analyze(
        module_session, {"filepath": "n.csv", "operations": ["sum"], "files": upload("n.csv", "1,2\n3,4\n5,6\n")}
    )
    assert answer["file"]["header"] is False
    assert answer["results"][0]["columns"]["column1"]["sum"] == 12
    assert any("no header row" in note for note in answer["notes"])
    binary = await module_session.call_tool(
        "analyze_csv",
        {"filepath": "b.csv", "operations": ["sum"], "files": upload("b.csv", b"\x00\x01\x02garbage\x00\xff")},
    )
    assert binary.is_error and "does not look like a text CSV" in text_of(binary) and "NUL bytes" in text_of(binary)
    for noise in (b"\x00\x01\x02binary", bytes(range(256)) * 4, random.Random(5).randbytes(4096)):
        refused = await module_session.call_tool(
            "analyze_csv", {"filepath": "r.bin", "operations": ["count"], "files": upload("r.bin", noise)}
        )
        assert refused.is_error and "does not look like a text CSV" in text_of(refused), text_of(refused)
        assert refused.structured_content is not None and refused.structured_content["error"]["field"] == "filepath"
    empty = await module_session.call_tool(
        "analyze_csv", {"filepath": "z.csv", "operations": ["sum"], "files": upload("z.csv", b"")}
    )
    assert empty.is_error and "is empty (0 bytes)" in text_of(empty)


async def test_unknown_columns_are_named_with_what_exists(module_session: Client) -> None:
    result = await module_session.call_tool(
        "analyze_csv",
        {
            "filepath": "d.csv",
            "operations": ["sum"],
            "columns": ["Amount"],
            "files": upload("d.csv", "amount,x\n1,2\n"),
        },
    )
    assert result.is_error
    message, *notes = text_of(result).splitlines()
    assert message == "columns[0]: no column 'Amount' in the file; did you mean 'amount'? (columns: 'amount', 'x')"
    assert notes == ["note: workspace changes: 1 created (d.csv)"]  # the file sent stays in the kept workspace


def _chunks(png: bytes) -> list[bytes]:
    """Chunk types of a PNG whose signature and every chunk CRC are valid."""
    assert png.startswith(b"\x89PNG\r\n\x1a\n")
    kinds, offset = [], 8
    while offset < len(png):
        (length,) = struct.unpack(">I", png[offset : offset + 4])
        kind = png[offset + 4 : offset + 8]
        body = png[offset + 8 : offset + 8 + length]
        (crc,) = struct.unpack(">I", png[offset + 8 + length : offset + 12 + length])
        assert zlib.crc32(kind + body) == crc, kind
        kinds.append(kind)
        offset += 12 + length
    return kinds


@pytest.mark.parametrize(
    "plot",
    [
        {"kind": "histogram", "x": "amount", "bins": 12},
        {"kind": "bar", "y": "amount"},
        {"kind": "line", "x": "id", "y": "qty"},
        {"kind": "scatter", "x": "amount", "y": "qty"},
    ],
)
async def test_each_plot_is_a_valid_png(module_session: Client, plot: dict[str, Any]) -> None:
    arguments: dict[str, Any] = {
        "filepath": "p.csv",
        "operations": ["sum"],
        "plot": plot,
        "files": upload("p.csv", _generated_csv(200, seed=3)),
    }
    if plot["kind"] == "bar":
        arguments["group_by"] = ["region"]
    result = await module_session.call_tool("analyze_csv", arguments)
    assert not result.is_error, text_of(result)
    [image] = [block for block in result.content if isinstance(block, types.ImageContent)]
    png = base64.b64decode(image.data)
    kinds = _chunks(png)
    assert kinds[0] == b"IHDR" and b"IDAT" in kinds and kinds[-1] == b"IEND"
    width, height = struct.unpack(">II", png[16:24])
    assert width >= 400 and height >= 200


async def test_a_data_mount_is_readable_and_symlinks_out_of_it_are_refused(
    runtime: DockerRuntime, tmp_path: Path
) -> None:
    data = tmp_path / "data"
    data.mkdir()
    (data / "sales.csv").write_text("region,amount\nnorth,10\nsouth,32\nnorth,5\n")
    (data / "escape.csv").symlink_to("/etc/passwd")
    (data / "inside.csv").symlink_to("sales.csv")
    data.chmod(0o755)
    (data / "sales.csv").chmod(0o644)
    policy = tmp_path / "mounted.yaml"
    policy.write_text(
        f"name: mounted\nextends: default\ndefaults:\n  mounts:\n    - {{host: {data}, sandbox: /data, mode: ro}}\n"
    )
    async with connect(stdio_parameters("--policy", str(policy))) as session:
        answer = await _analyze(session, {"filepath": "/data/sales.csv", "operations": ["sum"], "group_by": ["region"]})
        assert [(r["group"]["region"], r["columns"]["amount"]["sum"]) for r in answer["results"]] == [
            ("north", 15),
            ("south", 32),
        ]
        linked = await _analyze(session, {"filepath": "/data/inside.csv", "operations": ["count"]})
        assert linked["file"]["rows"] == 3
        escape = await session.call_tool("analyze_csv", {"filepath": "/data/escape.csv", "operations": ["count"]})
        assert escape.is_error
        assert text_of(escape).startswith(
            "refused: /data/escape.csv resolves to /etc/passwd, outside the readable roots"
        )


def test_sandbox_paths_stay_under_their_roots() -> None:
    roots = ["/data", "/workspace"]
    assert sandbox_path("a/b.csv", roots) == "/workspace/a/b.csv"
    assert sandbox_path("./a//b.csv", roots) == "/workspace/a/b.csv"
    assert sandbox_path("/data/x/y.csv", roots) == "/data/x/y.csv"
    for outside in ("/data", "/datax/y.csv", "/etc/passwd", "a/../b.csv", "/data/../etc", "x\x00.csv", "/"):
        assert sandbox_path(outside, roots) is None, outside


def test_the_markdown_table_escapes_cells_and_is_cut_at_its_row_budget() -> None:
    answer = {
        "file": {"rows": 3},
        "group_by": ["k"],
        "statistics": ["count", "sum"],
        "results": [
            {"group": {"k": "a|b\nc"}, "rows": 2, "columns": {"x": {"count": 2, "sum": 1234567.5}}},
            {"group": {"k": None}, "rows": 1, "columns": {"x": {"count": 1, "sum": 0.0001234}}},
        ],
    }
    table, cut = markdown_table(answer)
    assert table.splitlines() == [
        "| k | column | count | sum |",
        "|---|---|---|---|",
        "| a\\|b c | x | 2 | 1,234,567.5 |",
        "| (missing) | x | 1 | 0.0001234 |",  # a group of its own, named as its bar is
    ]
    assert not cut
    assert markdown_table(answer, max_rows=1) == ("\n".join(table.splitlines()[:3]), True)


async def test_a_plot_that_cannot_be_drawn_says_what_it_needs(module_session: Client) -> None:
    files = upload("q.csv", "name,amount\na,1\nb,2\n")
    bar = await module_session.call_tool(
        "analyze_csv", {"filepath": "q.csv", "operations": ["sum"], "plot": {"kind": "bar"}, "files": files}
    )
    assert bar.is_error
    assert text_of(bar).splitlines()[0] == "a bar plot needs group_by, or plot.x to count the rows of each value"
    scatter = await module_session.call_tool(
        "analyze_csv",
        {
            "filepath": "q.csv",
            "operations": ["sum"],
            "plot": {"kind": "scatter", "x": "name", "y": "amount"},
            "files": files,
        },
    )
    assert scatter.is_error
    assert text_of(scatter).splitlines()[0] == "plot.x 'name' is not numeric or temporal; a scatter plot needs one"
