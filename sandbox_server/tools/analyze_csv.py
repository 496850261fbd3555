"""analyze_csv: statistics, groups and a plot of a CSV file, computed inside the sandbox.

The host checks the path against the roots the policy makes readable (its data
mounts and the workspace) before anything runs; the launcher in the python-data
image resolves symbolic links and checks again, reads the file with DuckDB as a
stream, and writes its answer to /workspace/out/analysis.json. The answer becomes
a markdown table for the model, structuredContent per group and column, and the
plot as a PNG.
"""

from __future__ import annotations

import json
import posixpath
from collections.abc import Mapping
from dataclasses import replace
from typing import Any

from sandbox_server.errors import FailureKind, Refusal
from sandbox_server.policy import ToolPolicy
from sandbox_server.sandbox import wire
from sandbox_server.sandbox.spec import ExecutionResult
from sandbox_server.tools.arguments import sandbox_spec
from sandbox_server.tools.base import (
    FILES_SCHEMA,
    SANDBOX_ANNOTATIONS,
    TIMEOUT_SCHEMA,
    WORKSPACE,
    WORKSPACE_ARGUMENT,
    Sandboxed,
    ToolContext,
    ToolOutcome,
)
from sandbox_server.tools.csv_answer import OUTPUT_SCHEMA, TABLE_ROWS, markdown_table
from sandbox_server.tools.outcome import outcome_from_execution

__all__ = ["AnalyzeCsv", "analysis_request", "sandbox_path"]

OPERATIONS = ["sum", "average", "count", "min", "max", "median", "std", "distinct", "nulls", "describe"]
PLOT_STATS = [*OPERATIONS[:-1], "25%", "75%"]
"""What a plot of groups may draw: every statistic an operation computes (describe adds the quartiles)."""
PLOTS = ["histogram", "bar", "line", "scatter"]
MEMORY_HINT = (
    "sums, averages, counts, std, min and max stream in constant memory, but median and distinct keep "
    "every value of their columns: drop them, ask for fewer columns, or raise limits.memory_mb"
)


def sandbox_path(filepath: str, roots: list[str]) -> str | None:
    """The absolute path inside the sandbox, or None when it is not under one of the roots.

    Relative paths are taken from /workspace (where uploaded files land). A `..`
    component is refused outright rather than normalised away.
    """
    if "\x00" in filepath or ".." in filepath.split("/"):
        return None
    absolute = filepath if filepath.startswith("/") else f"{WORKSPACE}/{filepath}"
    normalised = posixpath.normpath(absolute)
    for root in roots:
        root = posixpath.normpath(root)
        if normalised.startswith(root.rstrip("/") + "/"):
            return normalised
    return None


def analysis_request(args: Mapping[str, Any], policy: ToolPolicy, policy_name: str) -> dict[str, Any]:
    """The request the launcher reads (its keys are wire.ANALYSIS_REQUEST_KEYS); a Refusal for a path out of bounds."""
    roots = [mount.sandbox_path for mount in policy.mounts] + [WORKSPACE]
    path = sandbox_path(args["filepath"], roots)
    if path is None:
        raise Refusal(
            f"refused: filepath {args['filepath']!r} is not inside a readable root of policy "
            f"'{policy_name}' ({', '.join(roots)}; field mounts adds data folders); "
            "'..' is never accepted",
            "mounts",
        )
    limits = policy.limits
    return {
        "path": path,
        "roots": roots,
        "operations": args["operations"],
        "columns": args.get("columns"),
        "group_by": args.get("group_by", []),
        "max_groups": args.get("max_groups", 50),
        "encoding": args.get("encoding"),
        "decimal": args.get("decimal"),
        "thousands": args.get("thousands"),
        "sheet": args.get("sheet"),
        "period": args.get("period"),
        "plot": args.get("plot"),
        "image_bytes": limits.returned_image_bytes // max(1, limits.returned_images),
        "max_bytes": policy.max_csv_bytes,
        "max_line_bytes": policy.max_csv_line_bytes,
        "policy": policy_name,
        "delimiter": args.get("delimiter"),
        "header": args.get("header"),
        "header_row": args.get("header_row"),
        "drop_totals": args.get("drop_totals", False),
        "skip_bad_rows": args.get("skip_bad_rows", True),
    }


def _failure(
    answer: Mapping[str, Any] | None, result: ExecutionResult, outcome: ToolOutcome, policy_name: str
) -> ToolOutcome:
    """An analysis that gave no answer, in this tool's own shape: what went wrong, and the program's last words."""
    if answer is not None:  # the launcher refused the request (a missing column, a file too big …)
        field = answer.get("field")
        return ToolOutcome.failed(
            "refused", str(answer["error"]), policy_name, field if isinstance(field, str) else None,
            extra={"duration_ms": result.duration_ms}, audit=outcome.audit,
        )  # fmt: skip
    kind: FailureKind
    if result.oom_killed:
        kind, message = "out_of_memory", f"{outcome.headline}; {MEMORY_HINT}"
    elif result.timed_out:
        kind, message = "timed_out", outcome.headline
    elif result.flooded or result.killed:
        kind, message = "killed", outcome.headline
    else:
        last = result.stderr.decode("utf-8", "replace").strip().rsplit("\n", 1)[-1]
        kind, message = "failed", f"analysis failed (exit code {result.exit_code}): {last or 'no answer written'}"
    field = "limits.memory_mb" if kind == "out_of_memory" else "limits.timeout_s" if kind == "timed_out" else None
    details = {"duration_ms": result.duration_ms, "stderr": result.stderr.decode("utf-8", "replace")[-4000:]}
    failed = ToolOutcome.failed(kind, message, policy_name, field, extra=details, audit=outcome.audit)
    return replace(failed, sections=outcome.sections, notes=outcome.notes)


class AnalyzeCsv(Sandboxed):
    """Statistics of a CSV file under the policy's data mounts or uploaded with the call."""

    name = "analyze_csv"
    title = "Analyze a CSV file"
    description = (
        "Statistics of a CSV file, streamed, per column and per group (`group_by`, `period` for dates), with a "
        "PNG plot. Its delimiter, header, encoding, number style and bad rows are detected and said; gzip, zstd, "
        "Parquet and xlsx are read alike. The table also comes back as result.csv.\n"
        'Example: {"filepath": "s.csv", "operations": ["sum"], "group_by": ["region"], '
        '"files": [{"path": "s.csv", "content": "region,amount\\nn,1\\ns,2\\n"}]}'
    )
    input_schema: dict[str, Any] = {
        "type": "object",
        "properties": {
            "filepath": {
                "type": "string",
                "minLength": 1,
                "maxLength": 4096,
                "description": "Under a data mount (/data/sales.csv) or sent in `files`.",
            },
            "operations": {
                "type": "array",
                "items": {"enum": OPERATIONS},
                "minItems": 1,
                "uniqueItems": True,
                "description": "Statistics per column. The std is the sample's; describe gives count, mean, std, "
                "min, quartiles and max.",
            },
            "columns": {
                "type": "array",
                "items": {"type": "string"},
                "maxItems": 1000,
                "description": "Columns to analyze (default: all).",
            },
            "group_by": {
                "type": "array",
                "items": {"type": "string"},
                "maxItems": 4,
                "description": "Columns whose values form the groups.",
            },
            "max_groups": {
                "type": "integer",
                "minimum": 1,
                "maximum": 500,
                "default": 50,
                "description": "Groups returned, in key order. The answer says how many exist.",
            },
            "encoding": {
                "type": "string",
                "maxLength": 40,
                "pattern": "^[A-Za-z0-9_.:-]+$",
                "description": "A Python codec name (cp1252, utf-16, ...).",
            },
            "delimiter": {"type": "string", "minLength": 1, "maxLength": 1},
            "header": {"type": "boolean", "description": "The first row names the columns."},
            "header_row": {
                "type": "integer",
                "minimum": 1,
                "maximum": 10000,
                "description": "The line naming the columns (from 1). Lines above are skipped (a title above the "
                "header is found without it).",
            },
            "drop_totals": {"type": "boolean", "description": "Leave out a totals row (the others' sums)."},
            "skip_bad_rows": {
                "type": "boolean",
                "default": True,
                "description": "Skip and count rows of the wrong width. False: refuse such a file.",
            },
            "decimal": {"type": "string", "enum": [".", ","]},
            "thousands": {
                "type": "string",
                "enum": ["", ",", ".", " ", "'"],
                "description": "'' for none.",
            },
            "sheet": {
                "type": "string",
                "maxLength": 200,
                "description": "Default: the first.",
            },
            "period": {
                "type": "string",
                "enum": ["day", "week", "month", "year"],
                "description": "Group by date, by this period. Each group is named by its first day.",
            },
            "plot": {
                "type": "object",
                "properties": {
                    "kind": {"enum": PLOTS},
                    "x": {"type": "string", "description": "Column on the x axis (histogram: the column)."},
                    "y": {"type": "string", "description": "Column on the y axis (bar: the statistic's column)."},
                    "stat": {
                        "enum": PLOT_STATS,
                        "description": "With group_by (bar, line): the statistic drawn; by default the first of "
                        "the operations that describes values (sum, average, …), else the count.",
                    },
                    "bins": {"type": "integer", "minimum": 1, "maximum": 200, "default": 30},
                },
                "required": ["kind"],
                "additionalProperties": False,
            },
            "timeout_s": TIMEOUT_SCHEMA,
            "files": FILES_SCHEMA,
            "workspace": WORKSPACE_ARGUMENT,
        },
        "title": "analyze_csv: arguments",
        "required": ["filepath", "operations"],
        "additionalProperties": False,
    }
    output_schema = OUTPUT_SCHEMA
    annotations = {**SANDBOX_ANNOTATIONS, "readOnlyHint": True}

    def refuse(self, args: Mapping[str, Any], policy: ToolPolicy, policy_name: str) -> None:
        """A path outside the readable roots."""
        analysis_request(args, policy, policy_name)

    async def run(self, args: Mapping[str, Any], ctx: ToolContext) -> ToolOutcome:
        """Check the path, analyze in the sandbox, and turn the answer into a table, data and a plot."""
        stdin = json.dumps(analysis_request(args, ctx.policy, ctx.policy_name)).encode()
        spec = sandbox_spec(args, ctx, ("python3", wire.ANALYZE_CSV), stdin)
        result = await ctx.runtime.run(spec, ctx.hooks)
        outcome = outcome_from_execution(result, spec)
        answer_file = next((f for f in result.files if f.path == wire.ANALYSIS_ANSWER), None)
        answer = None
        if answer_file is not None and result.exit_code in (0, wire.ANALYSIS_REFUSED_EXIT):
            try:
                answer = json.loads(answer_file.content)
            except ValueError:
                answer = None
        if answer is None or "error" in answer:
            return _failure(answer, result, outcome, ctx.policy_name)
        files = tuple(f for f in result.files if f.path != wire.ANALYSIS_ANSWER)
        table, cut = markdown_table(answer)
        notes = list(answer["notes"])
        if cut:
            notes.append(f"the table shows its first {TABLE_ROWS} rows; result.csv and the structured result hold all")
        shape = answer["file"]
        headline = (
            f"{args['filepath']}: {shape['rows']:,} rows, {len(shape['columns'])} columns "
            f"({shape['encoding']}, delimiter {shape['delimiter']!r}, "
            f"{'header' if shape['header'] else 'no header'}"
            + (f"; {shape['bad_rows']['count']:,} bad rows skipped" if shape.get("bad_rows") else "")
            + f") · {result.duration_ms} ms"
        )
        keys = ("file", "group_by", "statistics", "groups", "results", "skipped", "notes", "engine")
        structured = {key: answer[key] for key in keys if key in answer}
        structured["duration_ms"] = result.duration_ms
        return ToolOutcome(
            headline=headline,
            is_error=False,
            sections=(("results", table),),
            structured=structured,
            files=files,
            notes=(*notes, *result.skipped_files),
            audit=outcome.audit,
        )
