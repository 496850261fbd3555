"""What analyze_csv answers: the shape of its structured answer (per group and column, with the file's facts and
what was skipped), and the Markdown table a model reads, cut at TABLE_ROWS."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from sandbox_server.sandbox import wire
from sandbox_server.tools.base import result_schema

__all__ = ["ANSWER_PROPERTIES", "OUTPUT_SCHEMA", "TABLE_ROWS", "markdown_table"]

TABLE_ROWS = 200
"""Rows of the markdown table; the full table is in result.csv and structuredContent."""

_VALUE: dict[str, Any] = {"type": ["number", "string", "integer", "boolean", "null"]}
ANSWER_PROPERTIES: dict[str, Any] = {
    "file": {
        "type": "object",
        "properties": {
            "path": {"type": "string"},
            "encoding": {"type": "string"},
            "format": {"type": "string", "enum": ["csv", "parquet", "xlsx"]},
            "numbers": {
                "type": "object",
                "description": "How the file writes numbers: its decimal mark and thousands separator.",
                "properties": {
                    "decimal": {"type": "string"},
                    "thousands": {"type": ["string", "null"]},
                    "detected": {"type": "boolean"},
                },
            },
            "delimiter": {"type": "string"},
            "header": {"type": "boolean"},
            "rows": {"type": "integer"},
            "bad_rows": {
                "type": "object",
                "description": "Rows skipped for a field too many or too few: how many, their first lines, by kind.",
                "properties": {
                    "count": {"type": "integer"},
                    "lines": {"type": "array", "items": {"type": "integer"}},
                    "kinds": {"type": "object", "additionalProperties": {"type": "integer"}},
                },
            },
            "columns": {
                "type": "array",
                "items": {
                    "type": "object",
                    "properties": {"name": {"type": "string"}, "type": {"type": "string"}},
                    "required": ["name", "type"],
                },
            },
        },
        "required": ["path", "encoding", "delimiter", "header", "rows", "columns"],
    },
    "group_by": {"type": "array", "items": {"type": "string"}},
    "statistics": {"type": "array", "items": {"type": "string"}, "description": "Statistic names, in order."},
    "groups": {"type": ["integer", "null"], "description": "How many groups exist (results may show fewer)."},
    "results": {
        "type": "array",
        "description": "One entry per group (one entry with group null without group_by).",
        "items": {
            "type": "object",
            "properties": {
                "group": {"type": ["object", "null"], "additionalProperties": _VALUE},
                "rows": {"type": "integer"},
                "columns": {
                    "type": "object",
                    "description": "Column name -> statistic name -> value.",
                    "additionalProperties": {"type": "object", "additionalProperties": _VALUE},
                },
            },
            "required": ["group", "rows", "columns"],
        },
    },
    "skipped": {
        "type": "array",
        "items": {
            "type": "object",
            "properties": {
                "column": {"type": "string"},
                "type": {"type": "string"},
                "operations": {"type": "array", "items": {"type": "string"}},
                "reason": {"type": "string"},
            },
            "required": ["column", "operations", "reason"],
        },
    },
    "notes": {"type": "array", "items": {"type": "string"}},
    "engine": {
        "type": "object",
        "description": "What computed the answer inside the sandbox, and the most memory it held (RSS).",
        "properties": {
            "name": {"type": "string"},
            "threads": {"type": "integer"},
            "memory_limit_mb": {"type": "integer"},
            "peak_rss_mb": {"type": "number"},
            "detect_ms": {
                "type": "integer",
                "description": "How long finding how the file is written took (container, encoding, delimiter, "
                "number and date styles), before the query read it.",
            },
        },
    },
    "duration_ms": {"type": "integer"},
    "stderr": {"type": "string", "description": "Only when the analysis failed: the end of its error output."},
}
OUTPUT_SCHEMA = result_schema(
    "analyze_csv: result", ANSWER_PROPERTIES, ["file", "group_by", "results", "skipped", "notes", "duration_ms"]
)


def _cell(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, float):
        text = f"{value:.6g}" if value != 0 and abs(value) < 1e-3 else f"{value:,.4f}".rstrip("0").rstrip(".")
        return text
    if isinstance(value, int):
        return f"{value:,}"
    return str(value).replace("\\", "\\\\").replace("|", "\\|").replace("\n", " ").replace("\r", " ")


def _key(value: Any) -> Any:
    """A group's key as the table names it: an empty key is a group of its own, named, never a blank cell."""
    return wire.MISSING_GROUP if value is None else value


def markdown_table(answer: Mapping[str, Any], max_rows: int = TABLE_ROWS) -> tuple[str, bool]:
    """A compact markdown table: one row per (group, column), one column per statistic; and whether it was cut."""
    group_by = list(answer.get("group_by") or [])
    stats = list(answer.get("statistics") or [])
    header = [*group_by, "column", *stats]
    lines = ["| " + " | ".join(_cell(name) for name in header) + " |", "|" + "---|" * len(header)]
    rows = 0
    for result in answer["results"]:
        keys = [_key((result["group"] or {}).get(name)) for name in group_by]
        for column, values in result["columns"].items():
            if rows == max_rows:
                return "\n".join(lines), True
            cells = [*keys, column, *(values.get(stat) for stat in stats)]
            lines.append("| " + " | ".join(_cell(cell) for cell in cells) + " |")
            rows += 1
    if rows == 0:
        rows_line = f"(no statistics: {answer['file']['rows']} rows)"
        return rows_line, False
    return "\n".join(lines), False
