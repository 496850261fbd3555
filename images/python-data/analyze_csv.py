"""Answer one analyze_csv request inside the sandbox (the analyze_csv tool's launcher).

The request arrives on stdin as JSON; the answer is written as one JSON document
to analysis.json in the output folder (stdout stays free, and its cap does not apply):
either {"error": ..., "field": ...} (exit 2) or the file's shape, the statistics
per group and column, what was skipped and why, and the names of the other files
written to the output folder (result.csv, plot.png). Names and paths shared with the
host come from sandbox_wire; helpers shared with csv_plots from csv_values; finding,
decoding and sizing up the file and its container from csv_files.

DuckDB reads the file as a stream: aggregates need one pass and only the memory
their state needs (median and distinct keep values; nothing else does), bounded
below the container's own memory limit.
"""

import csv
import json
import os
import resource
import sys

from csv_files import (
    DELIMITERS,
    SAMPLE_BYTES,
    SAMPLE_ROWS,
    container_of,
    detect_delimiter,
    detect_encoding,
    engine_settings,
    resolve,
    sample_text,
    sheet_names,
    sheet_rows,
    text_rows,
    transcoding,
    workbook_rows,
)
from csv_numbers import DEPARTURE, NumberStyle, departure, detect_dates, detect_style, style_of, totals_row
from csv_values import Refusal, json_value, quote_ident, quote_literal
from sandbox_wire import ANALYSIS_ANSWER, ANALYSIS_REFUSED_EXIT, ANALYSIS_REQUEST_KEYS, ANALYSIS_TABLE, OUTPUT_DIR

NULL_STRINGS = ["", "NA", "N/A", "NaN", "nan", "null", "NULL", "None", "#N/A"]
"""Cells read as missing: empty ones and the spellings pandas treats as missing by default."""
NUMERIC_TYPES = {
    "TINYINT", "SMALLINT", "INTEGER", "BIGINT", "HUGEINT",
    "UTINYINT", "USMALLINT", "UINTEGER", "UBIGINT", "UHUGEINT", "FLOAT", "DOUBLE",
}  # fmt: skip
TEMPORAL_PREFIXES = ("DATE", "TIME", "TIMESTAMP")
FRACTION_TYPES = ("DOUBLE", "FLOAT", "DECIMAL")
NUMBER_ONLY = ("sum", "average", "median", "std")
ORDERED = ("min", "max")
ANY_TYPE = ("count", "distinct", "nulls")
DESCRIBE_NUMERIC = ("count", "average", "std", "min", "25%", "median", "75%", "max")
DESCRIBE_TEMPORAL = ("count", "nulls", "min", "max")
DESCRIBE_OTHER = ("count", "nulls", "distinct")
STAT_ORDER = ("count", "nulls", "distinct", "sum", "average", "std", "min", "25%", "median", "75%", "max")
"""The order statistics are listed in, whatever order they were asked for."""
FORMULA_PREFIXES = ("=", "+", "-", "@", "\t", "\r")
REREAD = {"CAST", "INVALID UNICODE", "LINE SIZE OVER MAXIMUM"}
"""Rows DuckDB set aside that say how to read the file, not that the row is bad (the others: a field too many or
too few, a quote left open)."""
SHOWN_LINES = 10


def neutralize(cell):
    """A cell a spreadsheet would take as a formula, made inert with a leading apostrophe."""
    if isinstance(cell, str) and cell.startswith(FORMULA_PREFIXES):
        try:
            float(cell)
        except ValueError:
            return "'" + cell
    return cell


class Analysis:
    def __init__(self, request):
        import duckdb

        self.duckdb = duckdb
        self.request = request
        self.notes = []
        threads, memory, self.memory_limit = engine_settings()
        self.engine = {
            "name": f"duckdb {duckdb.__version__}",
            "threads": threads,
            "memory_limit_mb": memory >> 20,
        }
        self.con = duckdb.connect(
            config={
                "threads": threads,
                "memory_limit": f"{memory // (1 << 20)}MB",
                "temp_directory": "/tmp/duckdb-spill",
                "autoinstall_known_extensions": False,
                "autoload_known_extensions": False,
            }
        )
        self.con.execute("SET enable_progress_bar = false")

    # -- reading -------------------------------------------------------------------

    def open(self):
        request = self.request
        self.path = resolve(request["path"], request["roots"])
        size = os.stat(self.path).st_size
        if size > request["max_bytes"]:
            raise Refusal(
                f"{request['path']} is {size:,} bytes, above the {request['max_bytes']:,} bytes analyze_csv reads "
                f"under policy '{request['policy']}' (field limits.csv_bytes); nothing was read",
                "filepath",
            )
        self.format = container_of(self.path) or "csv"
        self.transcoder = None
        self.skip = max(0, int(request.get("header_row") or 1) - 1)
        self.sample = None
        """The file as text, when its first MiB holds the whole of it (where a totals row is looked for)."""
        self.asked_delimiter = request.get("delimiter")
        if self.format == "parquet":
            self._open_parquet()
            return
        if self.format == "xlsx":
            sheets = sheet_names(self.path)
            sheet = request.get("sheet") or sheets[0]
            if sheet not in sheets:
                raise Refusal(
                    f"sheet {sheet!r} is not in {request['path']} (sheets: {', '.join(map(repr, sheets))})", "sheet"
                )
            self.sheet = sheet
            self.transcoder = workbook_rows(self.path, sheet)
            source_path, encoding, compression = self.transcoder.fifo, "utf-8", "none"
            self.encoding_label = f"an xlsx workbook, sheet {sheet!r}"
            if len(sheets) > 1:
                self.notes.append(f"sheet {sheet!r} was read; the workbook has {', '.join(map(repr, sheets))}")
        else:
            self.found = found = detect_encoding(self.path, request.get("encoding"))
            self.encoding_label = found.label
            if found.native is not None:
                source_path, encoding, compression = self.path, found.native, found.compression or "none"
            else:
                self.transcoder = transcoding(self.path, found)
                source_path, encoding, compression = self.transcoder.fifo, "utf-8", "none"
                self.notes.append(f"the file is {found.codec}; it was converted to UTF-8 as it was read")
            if found.compression:
                self.notes.append(f"the file is {found.compression}-compressed; it was decompressed as it was read")
            sample = sample_text(self.path, found)
            if len(sample.encode("utf-8")) < SAMPLE_BYTES:  # the whole file: its last line's number is known
                self.sample = sample
            # the delimiter most rows agree on, a few bad rows notwithstanding, and the lines above its table
            shape = detect_delimiter(sample, (self.asked_delimiter,) if self.asked_delimiter else DELIMITERS)
            if not self.asked_delimiter:
                self.asked_delimiter = shape[0] if shape is not None else None
            if shape is not None and not request.get("header_row") and request.get("header") is not False:
                self._skip_preamble(shape[3], sample)
        self.reader_options = {"encoding": encoding, "sample_size": 20480, "compression": compression}
        self.source_path = source_path
        self._define_source()

    def _skip_preamble(self, above, sample):
        """Lines above the header (a report's title, blank lines), which the width most rows share finds: skipped,
        and said with the first of them."""
        if above <= 0:
            return
        self.skip = above
        first = next((line.strip() for line in sample.splitlines()[:above] if line.strip()), "")
        shown = f": {first[:80]!r}" + (" …" if len(first) > 80 else "") if first else " (blank)"
        self.notes.append(
            f"the header is on line {above + 1}; the {above} line(s) above it were skipped{shown} (header_row names "
            "another line)"
        )

    def _open_parquet(self):
        """A Parquet file: DuckDB reads it natively (its own types; no encoding, delimiter or number style)."""
        self.encoding_label, self.delimiter, self.has_header = "Parquet", "", True
        self.numbers = NumberStyle()
        try:
            self.con.execute(
                f"CREATE OR REPLACE TEMP VIEW src AS SELECT * FROM read_parquet({quote_literal(self.path)})"
            )
            self.columns = [(row[0], row[1]) for row in self.con.execute("DESCRIBE src").fetchall()]
        except self.duckdb.Error as exc:
            raise Refusal(
                f"cannot read {self.request['path']} as Parquet: {str(exc).splitlines()[0]}", "filepath"
            ) from None

    @property
    def _header_asked(self):
        """Whether the caller said the file has a header (`header_row` says it has one there), None: detected."""
        return True if self.request.get("header_row") else self.request.get("header")

    def _reader_arguments(self):
        """The file and reading options, as both sniff_csv and read_csv take them."""
        header = self._header_asked
        return ", ".join(
            [
                quote_literal(self.source_path),
                f"encoding={quote_literal(self.reader_options['encoding'])}",
                f"compression={quote_literal(self.reader_options['compression'])}",
                f"sample_size={self.reader_options['sample_size']}",
                f"max_line_size={int(self.request['max_line_bytes'])}",
                "nullstr=[" + ", ".join(quote_literal(text) for text in NULL_STRINGS) + "]",
                *([f"delim={quote_literal(self.asked_delimiter)}"] if self.asked_delimiter else []),
                *([f"skip={self.skip}"] if self.skip else []),
                *([f"header={'true' if header else 'false'}"] if header is not None else []),
            ]
        )

    def _define_source(self):
        arguments = self._reader_arguments()
        try:
            sniffed = self.con.execute(
                f"SELECT Delimiter, HasHeader, Columns FROM sniff_csv({arguments}, ignore_errors=true)"
            )
        except self.duckdb.OutOfMemoryException:
            raise self._memory_refusal() from None
        except self.duckdb.InvalidInputException as exc:
            self._refuse_long_line(exc)
            raise
        self.delimiter, self.has_header, sniffed_columns = sniffed.fetchone()
        text = {column["name"] for column in sniffed_columns if column["type"] == "VARCHAR"}
        # Whole numbers and dates DuckDB read itself hold no decimal mark; `1.234` read as a fraction may be
        # a thousand in a file whose other columns write `1.234,5`.
        fractions = {column["name"] for column in sniffed_columns if column["type"].startswith(FRACTION_TYPES)}
        arguments += ", store_rejects=true"  # rows that do not fit set aside, counted, and said (see bad_rows)
        self.numbers = style = self._number_style(arguments, text | fractions)
        conversions = []
        if style.decimal == "," and style.thousands is None and self.delimiter != ",":
            arguments += ", decimal_separator=','"  # DuckDB reads these itself
        elif not style.plain and style.columns:
            arguments += ", types={" + ", ".join(f"{quote_literal(c)}: 'VARCHAR'" for c in style.columns) + "}"
            conversions += [f"{style.expression(quote_ident(c))} AS {quote_ident(c)}" for c in style.columns]
        numbers = [c["name"] for c in sniffed_columns if c["type"] in NUMERIC_TYPES or c["type"].startswith("DECIMAL")]
        totals = self._totals([*numbers, *style.columns])
        rows = self._sample_rows[:-1] if totals else self._sample_rows
        for name, (fmt, timed, other) in detect_dates(self._sample_names, rows, text - set(style.columns)).items():
            parse = "try_strptime" if totals else "strptime"  # (the totals row's label is no date)
            sql = f"{parse}(nullif(trim({quote_ident(name)}), ''), {quote_literal(fmt)})"
            conversions.append(f"{sql if timed else f'CAST({sql} AS DATE)'} AS {quote_ident(name)}")
            said = self._sample_rows[-1][self._sample_names.index(name)] if totals else None
            except_line = f" except line {totals[0]} ({said.strip()!r})" if said and said.strip() else ""
            self._note(
                f"column {name!r} holds dates written {fmt!r}{except_line}"
                + (f" (they also read as {other!r})" if other else "")
            )
        replaced = f"REPLACE ({', '.join(conversions)})" if conversions else ""
        where = self._without_totals(totals)
        self.con.execute(f"CREATE OR REPLACE TEMP VIEW src AS SELECT * {replaced} FROM read_csv({arguments}){where}")
        self.columns = [(row[0], row[1]) for row in self.con.execute("DESCRIBE src").fetchall()]
        self._check_stream()
        unread = [name for name, declared in self.columns if declared == "VARCHAR" and name in style.numeric]
        if unread:
            self._refuse_departure(style, unread)  # numbers at the start, and somewhere a value DuckDB did not read

    def _totals(self, numeric):
        """A last row whose numbers are the sums of the rows above it, when the sample holds the whole file: its
        line, the column and text that label it, and the columns it sums; said in a note. None when there is
        none (or the file is longer than the sample: its end is not looked at)."""
        import csv
        import io

        if self.sample is None or len(self._sample_rows) >= SAMPLE_ROWS or not numeric or not self.delimiter:
            return None
        # Every row as the file writes it, bad ones too: a total sums the rows a field too many set aside as well.
        rows = list(csv.reader(io.StringIO(self.sample, newline=""), delimiter=self.delimiter))[self.skip :]
        rows = [row for row in rows[1 if self.has_header else 0 :] if any(cell.strip() for cell in row)]
        summed = totals_row(self._sample_names, rows, self.numbers, numeric)
        if summed is None:
            return None
        last = self._sample_rows[-1]
        labels = [(name, cell) for name, cell in zip(self._sample_names, last, strict=False)
                  if name not in numeric and isinstance(cell, str) and cell.strip()]  # fmt: skip
        column, label = labels[0] if labels else (None, None)
        line = len(self.sample.rstrip("\r\n").splitlines())  # the file's last line
        called = f" ({label.strip()!r})" if label else ""
        leave = (
            "it is left out (drop_totals)" if self.request.get("drop_totals") and label
            else "drop_totals: true leaves it out of the statistics, groups and plot" if label
            else "it has no label to leave it out by: remove it from the file"
        )  # fmt: skip
        self.notes.append(
            f"line {line}{called} looks like a totals row: its {', '.join(map(repr, summed))} "
            f"{'is' if len(summed) == 1 else 'are'} the sum of the rows above; {leave}"
        )
        return line, column, label, summed

    def _without_totals(self, totals):
        """The WHERE clause leaving the totals row out, when drop_totals asks and a label names it."""
        if not totals or not self.request.get("drop_totals") or totals[1] is None:
            return ""
        _, column, label, _ = totals
        return f" WHERE {quote_ident(column)} IS DISTINCT FROM {quote_literal(label)}"

    def _note(self, text):
        """A note about how the file is read: once, though a re-read with wider settings finds it again."""
        if text not in self.notes:
            self.notes.append(text)

    def _number_style(self, arguments, candidates):
        """The decimal mark and thousands separator of the file's numbers, from its first 2,000 rows as text."""
        header = "" if self._header_asked is not None else f", header={'true' if self.has_header else 'false'}"
        cursor = self.con.execute(f"SELECT * FROM read_csv({arguments}, all_varchar=true{header}) LIMIT 2000")
        names = [column[0] for column in cursor.description]
        request = self.request
        self._sample_names, self._sample_rows = names, cursor.fetchall()
        style = detect_style(names, self._sample_rows, request.get("decimal"), request.get("thousands"), candidates)
        if style.mixed:
            self._refuse_departure(style, style.mixed)
        if not style.plain or style.given:
            self._note(style.describe())
        for column, example in style.symbols.items():
            self._note(
                f"column {column!r} holds numbers with a percent sign or a currency symbol (such as {example!r}): "
                "it is read as text, not as numbers"
            )
        return style

    def _refuse_departure(self, style, columns):
        """A number written in another style than the file's other numbers (`10.5` among `10,5`, or `1,234.5`
        among `1.234,5`) is refused, naming its line: never read as text, never read as a wrong number."""
        if self.format == "xlsx":
            where, rows = "row", sheet_rows(self.path, self.sheet)
        else:
            where, rows = "line", text_rows(self.path, self.found, self.delimiter, self.has_header, self.skip)
        found = departure(rows, columns, style)
        if found is None:
            return
        line, column, value = found
        raise Refusal(
            f"{self.request['path']} mixes two number styles: {where} {line}, column {column!r}, holds {value!r}, "
            f"written with {style_of(value)}, but its other {style.describe()}; nothing was computed. "
            "Give `decimal` and `thousands` for the style the file is written in, or correct that line",
            "decimal",
        )

    def _check_stream(self):
        """A conversion that stopped at a byte not in the file's encoding: refused, never half an answer."""
        if self.transcoder is not None and self.transcoder.error:
            raise Refusal(f"cannot read {self.request['path']}: {self.transcoder.error}", "encoding")

    def _memory_refusal(self):
        return Refusal(
            f"the analysis needs more memory than the sandbox has ({self.memory_limit >> 20} MiB, "
            "policy field limits.memory_mb); median and distinct keep every value: ask for fewer "
            "of them, fewer columns or fewer groups; reading buffers take 16 times limits.csv_line_bytes"
        )

    def _refuse_long_line(self, exc):
        """A line past the policy's line limit is the policy's refusal, not a reading error."""
        if "Maximum line size" in str(exc):
            request = self.request
            raise Refusal(
                f"{request['path']} has a line longer than {request['max_line_bytes']:,} bytes, the longest "
                f"analyze_csv reads under policy '{request['policy']}' (field limits.csv_line_bytes)",
                "filepath",
            ) from None

    def query(self, sql):
        """Run a query over the file, re-reading it once with wider settings when the first sample misled."""
        for attempt in range(3):
            try:
                rows = self.con.execute(sql).fetchall()
                self._check_stream()
                reread = self._set_aside(REREAD)
                if not reread or attempt == 2:
                    return rows
                raise self.duckdb.InvalidInputException(
                    "Invalid unicode" if "INVALID UNICODE" in reread else f"rows set aside: {', '.join(reread)}"
                )
            except self.duckdb.OutOfMemoryException:
                raise self._memory_refusal() from None
            except (self.duckdb.InvalidInputException, self.duckdb.ConversionException) as exc:
                self._refuse_long_line(exc)
                text = str(exc)
                if DEPARTURE in text:
                    self._refuse_departure(self.numbers, self.numbers.columns)
                if attempt == 2 or self.format == "parquet":
                    raise Refusal(f"cannot read {self.request['path']} as CSV: {text.splitlines()[0]}") from None
                if "Invalid unicode" in text and self.reader_options["encoding"] == "utf-8":
                    self.reader_options["encoding"] = "latin-1"
                    self.encoding_label = "Latin-1 (invalid UTF-8 past the first 64 KiB)"
                    self.notes.append("the file is not valid UTF-8 throughout; it was read as Latin-1")
                elif self.reader_options["sample_size"] != -1:
                    self.reader_options["sample_size"] = -1
                    self.notes.append(
                        "column types were detected on the whole file: a value late in the file did not "
                        "fit the types guessed from its first rows"
                    )
                else:
                    raise Refusal(f"cannot read {self.request['path']} as CSV: {text.splitlines()[0]}") from None
                self._forget_set_aside()
                self._define_source()
        raise AssertionError("unreachable")

    def _set_aside(self, kinds=None):
        """The kinds of rows DuckDB set aside while reading (of `kinds` when given): a line past the policy's
        limit is refused at once."""
        if self.format == "parquet":
            return set()
        try:
            found = {row[0] for row in self.con.execute("SELECT DISTINCT error_type FROM reject_errors").fetchall()}
        except self.duckdb.CatalogException:
            return set()
        if "LINE SIZE OVER MAXIMUM" in found:
            self._refuse_long_line(Exception("Maximum line size"))
        return found & kinds if kinds is not None else found

    def _forget_set_aside(self):
        """Before the file is read again with other settings: the rows set aside by the earlier reads go."""
        try:
            self.con.execute("DELETE FROM reject_errors")
            self.con.execute("DELETE FROM reject_scans")
        except self.duckdb.CatalogException:
            pass

    def bad_rows(self):
        """The rows skipped as bad (a field too many or too few, a quote left open): how many, their first lines,
        by kind; refused instead when skip_bad_rows is false. None when there are none."""
        if not self._set_aside():
            return None
        where = "FROM reject_errors WHERE error_type NOT IN ('CAST', 'INVALID UNICODE')"
        count = self.con.execute(f"SELECT count(DISTINCT line) {where}").fetchone()[0]
        if not count:
            return None
        found = self.con.execute(f"SELECT DISTINCT line {where} ORDER BY 1 LIMIT {SHOWN_LINES}").fetchall()
        lines = [row[0] for row in found]
        kinds = dict(
            self.con.execute(f"SELECT lower(error_type), count(DISTINCT line) {where} GROUP BY 1 ORDER BY 1").fetchall()
        )
        shown = ", ".join(map(str, lines)) + (" …" if count > len(lines) else "")
        said = "; ".join(f"{n} {kind}" for kind, n in kinds.items())
        columns = len(self.columns)
        if self.request.get("skip_bad_rows") is False:
            raise Refusal(
                f"{self.request['path']}: {count} row(s) do not have the file's {columns} fields (line {shown}: "
                f"{said}); nothing was computed. Correct them, or let skip_bad_rows (true by default) skip them",
                "skip_bad_rows",
            )
        self.notes.append(
            f"{count} bad row(s) skipped, not counted in the statistics: {said} where the file's rows have "
            f"{columns} fields (line {shown}); skip_bad_rows: false refuses such a file instead"
        )
        return {"count": count, "lines": lines, "kinds": kinds}

    def _refuse_most_dropped(self, bad, kept):
        """Most rows set aside as bad is a file misread (a header found on the wrong line, another delimiter), not a
        success with a few rows: refused, saying what to give."""
        if not bad or bad["count"] <= kept:
            return
        line = self.skip + 1
        raise Refusal(
            f"{self.request['path']}: {bad['count']:,} of {bad['count'] + kept:,} rows do not have the "
            f"{len(self.columns)} field(s) of the header read on line {line} (line {', '.join(map(str, bad['lines']))} "
            "…); nothing was computed: most of the file would be dropped. Give header_row (the line that names the "
            "columns) or delimiter",
            "delimiter" if self.request.get("delimiter") else "header_row",
        )

    # -- planning ------------------------------------------------------------------

    def kind(self, column):
        declared = dict(self.columns)[column]
        if declared in NUMERIC_TYPES or declared.startswith("DECIMAL"):
            return "numeric"
        if declared.startswith(TEMPORAL_PREFIXES):
            return "temporal"
        return "other"

    def check_names(self, names, field):
        known = [name for name, _ in self.columns]
        for index, name in enumerate(names):
            if name not in known:
                close = [k for k in known if k.lower() == name.lower()]
                hint = f"; did you mean {close[0]!r}?" if close else ""
                shown = ", ".join(repr(k) for k in known[:40]) + (" …" if len(known) > 40 else "")
                raise Refusal(f"{field}[{index}]: no column {name!r} in the file{hint} (columns: {shown})", field)

    def key_sql(self, name):
        """A group_by column as the query groups it: by `period` when it is a date column and one is asked."""
        period = self.request.get("period")
        if period and self.kind(name) == "temporal":
            return f"CAST(date_trunc({quote_literal(period)}, {quote_ident(name)}) AS DATE)"
        return quote_ident(name)

    def plan(self):
        """(column, statistic, SQL) triples, and what is skipped and why."""
        request = self.request
        self.group_by = request.get("group_by") or []
        self.check_names(self.group_by, "group_by")
        period = request.get("period")
        if period:
            dated = [name for name in self.group_by if self.kind(name) == "temporal"]
            if not dated:
                raise Refusal(f"period {period!r} groups a date column, and group_by has none", "period")
            self.notes.append(f"{', '.join(map(repr, dated))} grouped by {period} (each group is its first day)")
        if request.get("columns"):
            self.check_names(request["columns"], "columns")
            selected = list(request["columns"])
        else:
            selected = [name for name, _ in self.columns if name not in self.group_by]
        self.selected = selected
        aggregates, skipped = [], []
        for column in selected:
            q = quote_ident(column)
            kind = self.kind(column)
            declared = dict(self.columns)[column]
            refused = []
            for operation in request["operations"]:
                if operation == "describe":
                    stats = {"numeric": DESCRIBE_NUMERIC, "temporal": DESCRIBE_TEMPORAL}.get(kind, DESCRIBE_OTHER)
                    for stat in stats:
                        aggregates.append((column, stat, self.sql_for(stat, q)))
                elif operation in NUMBER_ONLY and kind != "numeric":
                    refused.append(operation)
                elif operation in ORDERED and kind == "other":
                    refused.append(operation)
                else:
                    aggregates.append((column, operation, self.sql_for(operation, q)))
            if refused:
                reason = f"not numeric (read as {declared})"
                skipped.append({"column": column, "type": declared, "operations": refused, "reason": reason})
        unique = {(column, stat): sql for column, stat, sql in aggregates}
        ordered = sorted(unique.items(), key=lambda item: (selected.index(item[0][0]), STAT_ORDER.index(item[0][1])))
        return [(column, stat, sql) for (column, stat), sql in ordered], skipped

    @staticmethod
    def sql_for(stat, q):
        return {
            "count": f"count({q})",
            "nulls": f"count(*) - count({q})",
            "distinct": f"count(DISTINCT {q})",
            "sum": f"coalesce(sum({q}), 0)",
            "average": f"avg({q})",
            "min": f"min({q})",
            "max": f"max({q})",
            "median": f"median({q})",
            "25%": f"quantile_cont({q}, 0.25)",
            "75%": f"quantile_cont({q}, 0.75)",
            "std": f"stddev_samp({q})",
        }[stat]

    # -- running -------------------------------------------------------------------

    def run(self):
        import time

        started = time.perf_counter()
        self.open()
        self.engine["detect_ms"] = round((time.perf_counter() - started) * 1000)
        if not self.has_header:
            self.notes.append("no header row was found; columns are named column0, column1, …")
        aggregates, skipped = self.plan()
        max_groups = int(self.request.get("max_groups", 50))
        select = [f"{sql} AS a{index}" for index, (_, _, sql) in enumerate(aggregates)]
        keys = [self.key_sql(name) for name in self.group_by]
        if keys:
            sql = (
                f"SELECT {', '.join(keys + select)}, count(*) AS n_rows, count(*) OVER () AS n_groups, "
                f"sum(count(*)) OVER () AS n_total FROM src GROUP BY {', '.join(keys)} "
                f"ORDER BY {', '.join(k + ' NULLS LAST' for k in keys)} LIMIT {max_groups}"
            )
        else:
            sql = f"SELECT {', '.join(select + ['count(*) AS n_rows'])} FROM src"
        rows = self.query(sql)
        bad = self.bad_rows()
        results, total_rows, total_groups = [], 0, 0
        for row in rows:
            group = None
            if keys:
                group = {name: json_value(value) for name, value in zip(self.group_by, row, strict=False)}
                row = row[len(keys) :]
                total_groups, total_rows = row[-2], int(row[-1])
            else:
                total_rows = row[-1]
            stats = {}
            for (column, stat, _), value in zip(aggregates, row, strict=False):
                stats.setdefault(column, {})[stat] = json_value(value)
            results.append({"group": group, "rows": row[len(aggregates)], "columns": stats})
        self._refuse_most_dropped(bad, total_rows)
        if total_rows == 0:
            self.notes.append("the file has a header and no data rows")
            for item in skipped:
                item["reason"] = "the file has no data rows"
        for item in skipped:
            self.notes.append(
                f"column {item['column']!r} skipped for {', '.join(item['operations'])}: {item['reason']}"
            )
        if keys and total_groups > len(results):
            self.notes.append(
                f"{total_groups} groups; the first {len(results)} (ordered by key) are shown (max_groups)"
            )
        os.makedirs(OUTPUT_DIR, exist_ok=True)
        written = [self.write_csv(results, aggregates)]
        plot = self.request.get("plot")
        if plot:
            from csv_plots import draw

            written.append(draw(self, plot, results, aggregates))
        return {
            "file": {
                "path": self.request["path"],
                "encoding": self.encoding_label,
                "format": self.format,
                "delimiter": self.delimiter,
                "numbers": {
                    "decimal": self.numbers.decimal,
                    "thousands": self.numbers.thousands,
                    "detected": not self.numbers.given,
                },
                "header": bool(self.has_header),
                "rows": total_rows,
                "columns": [{"name": name, "type": declared} for name, declared in self.columns],
                **({"bad_rows": bad} if bad else {}),
            },
            "group_by": self.group_by,
            "statistics": sorted({stat for _, stat, _ in aggregates}, key=STAT_ORDER.index),
            "groups": total_groups if keys else None,
            "results": results,
            "skipped": skipped,
            "notes": self.notes,
            "outputs": written,
            "engine": {
                **self.engine,
                "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
            },
        }

    def write_csv(self, results, aggregates):
        stats = sorted({stat for _, stat, _ in aggregates}, key=STAT_ORDER.index)
        path = os.path.join(OUTPUT_DIR, ANALYSIS_TABLE)
        with open(path, "w", newline="", encoding="utf-8") as handle:
            writer = csv.writer(handle)
            writer.writerow([neutralize(name) for name in [*self.group_by, "column", "rows", *stats]])
            for result in results:
                keys = [(result["group"] or {}).get(name) for name in self.group_by]
                for column, values in result["columns"].items():
                    cells = [*keys, column, result["rows"], *(values.get(stat) for stat in stats)]
                    writer.writerow(["" if cell is None else neutralize(cell) for cell in cells])
        return ANALYSIS_TABLE


def main():
    request = json.loads(sys.stdin.read())
    status = 0
    try:
        if sorted(request) != sorted(ANALYSIS_REQUEST_KEYS):
            raise Refusal(
                f"the request's keys {sorted(request)} are not the contract's {sorted(ANALYSIS_REQUEST_KEYS)}"
            )
        answer = Analysis(request).run()
    except Refusal as refusal:
        answer, status = {"error": str(refusal), "field": refusal.field}, ANALYSIS_REFUSED_EXIT
    os.makedirs(OUTPUT_DIR, exist_ok=True)
    with open(os.path.join(OUTPUT_DIR, ANALYSIS_ANSWER), "w", encoding="utf-8") as handle:
        json.dump(answer, handle, ensure_ascii=False, default=json_value)
    return status


if __name__ == "__main__":
    sys.exit(main())
