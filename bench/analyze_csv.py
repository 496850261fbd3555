"""analyze_csv on a generated ~1 GB CSV: the sandbox (through the real server and MCP client)
against DuckDB reading the same file on the host, and pandas in chunks on the host.

    scripts/run bench analyze_csv [--size-mb 1000] [--repeat 3] [--memory-mb 512]

The sandbox gets less memory than the file's size (512 MiB by default for a 1 GB
file), which proves the file is streamed rather than loaded. Each measurement is
repeated; medians are reported, and the sandbox's answers are compared with the
host's. Wall time of a sandbox call includes starting and removing its container.

The same table is then written as spreadsheets in other locales write it: in GB18030 with
Chinese text, and with decimal commas (with and without '.' between thousands). DuckDB on
the host reads each after the same conversion: the GB18030 file decoded to UTF-8 first
(that time counted), the decimal commas read by DuckDB's own option or the same SQL
conversion.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import anyio
import duckdb
from mcp import Client

from bench.common import median, print_table, write_results
from sandbox_server.cli.client import server_parameters

BYTES_PER_ROW = 47.7
"""Average row size of the generated file, to aim at the requested size."""

WORKLOADS: dict[str, dict[str, Any]] = {
    "totals": {"operations": ["sum", "average", "count"], "columns": ["id", "amount", "qty"]},
    "by_category": {
        "operations": ["sum", "average", "count", "std", "min", "max"],
        "columns": ["amount", "qty"],
        "group_by": ["category"],
    },
    "median_by_category": {"operations": ["median"], "columns": ["amount"], "group_by": ["category"]},
}
"""Streaming aggregates run within --memory-mb; median keeps every value, so it gets --median-memory-mb."""
HOLDS_VALUES = {"median", "distinct"}
SQL_OF = {
    "sum": "sum", "average": "avg", "count": "count", "median": "median",
    "std": "stddev_samp", "min": "min", "max": "max",
}  # fmt: skip

HOST_DUCKDB = """
import duckdb, json, sys
con = duckdb.connect(config={"threads": int(sys.argv[2])})
con.execute("SET enable_progress_bar = false")
print(json.dumps(con.execute(sys.argv[1]).fetchall(), default=float))
"""

TRANSCODE = """
import sys
source_path, source_encoding, target_path, target_encoding = sys.argv[1:5]
with open(source_path, encoding=source_encoding, newline="") as source, \\
        open(target_path, "w", encoding=target_encoding, newline="") as sink:
    while block := source.read(1 << 20):
        sink.write(block)
"""
"""A text file re-encoded in 1 MiB blocks: how the GB18030 variant is written, and the host's conversion
of it back to UTF-8 that DuckDB's time is measured after."""

BEFORE: dict[str, str | float] = {
    "measured_at": "2026-11-21T06:26:15+0000",
    "totals": 1.35,
    "by_category": 1.34,
    "median_by_category": 1.3,
}
"""The UTF-8 file's sandbox/host ratios before encodings, number styles and containers were detected
(the committed bench/results/analyze_csv.json of that run): what "the UTF-8 path keeps its speed" is
measured against, as a ratio of ratios."""

VARIANTS = ("gb18030", "decimal_comma", "decimal_comma_thousands")
LOCALE_WORKLOADS = ("totals", "by_category")
"""The workloads the locale variants of the file run (streaming ones: the 512 MiB sandbox)."""

CHINESE_CATEGORY = "'类别_' || (hash(i) % 40)::VARCHAR"
"""Category names in the GB18030 variant."""


def variant_sql(variant: str, rows: int) -> tuple[str, str]:
    """The query writing the table (`utf8`) or a locale variant of it, and its COPY options."""
    category = CHINESE_CATEGORY if variant == "gb18030" else "'cat_' || (hash(i) % 40)::VARCHAR"
    note = "'备注，' || (i % 997)::VARCHAR" if variant == "gb18030" else "'note, ' || (i % 997)::VARCHAR"
    amount = "round((hash(i * 7) % 1000000) / 100.0 - 2000, 2)"
    if variant == "decimal_comma":
        amount = f"replace(({amount})::VARCHAR, '.', ',')"
    elif variant == "decimal_comma_thousands":
        amount = f"translate(format('{{:,.2f}}', {amount}), ',.', '.,')"
    query = f"""SELECT i AS id, {category} AS category,
                  CASE WHEN i % 17 = 0 THEN NULL ELSE {amount} END AS amount,
                  (hash(i * 13) % 100)::INTEGER AS qty,
                  CASE WHEN i % 10 = 0 THEN NULL ELSE {note} END AS note,
                  DATE '2020-01-01' + (i % 1500)::INTEGER AS day
                FROM range({rows}) t(i)"""
    return query, "HEADER" if variant in ("utf8", "gb18030") else "HEADER, DELIMITER ';'"


def generate_variant(path: Path, variant: str, rows: int) -> None:
    """Write the table or a locale variant of it (the GB18030 one is written as UTF-8, then re-encoded)."""
    query, options = variant_sql(variant, rows)
    connection = duckdb.connect()
    connection.execute("SET enable_progress_bar = false")
    target = path.with_suffix(".utf8") if variant == "gb18030" else path
    connection.execute(f"COPY ({query}) TO '{target}' ({options})")
    if variant == "gb18030":
        subprocess.run([sys.executable, "-c", TRANSCODE, str(target), "utf-8", str(path), "gb18030"], check=True)
        target.unlink()


def variant_source(variant: str, path: Path) -> str:
    """How DuckDB on the host reads a variant, after the same conversion the sandbox makes."""
    if variant == "decimal_comma":
        return f"read_csv('{path}', delim=';', decimal_separator=',')"
    if variant == "decimal_comma_thousands":
        return (
            "(SELECT * REPLACE (CAST(replace(replace(trim(amount), '.', ''), ',', '.') AS DOUBLE) AS amount) "
            f"FROM read_csv('{path}', delim=';', types={{'amount': 'VARCHAR'}}))"
        )
    return f"read_csv('{path}')"


HOST_PANDAS = """
import json, sys
import pandas as pd
columns = json.loads(sys.argv[2])
sums, counts = {c: 0.0 for c in columns}, {c: 0 for c in columns}
for chunk in pd.read_csv(sys.argv[1], usecols=columns, chunksize=1_000_000):
    for c in columns:
        sums[c] += float(chunk[c].sum())
        counts[c] += int(chunk[c].count())
print(json.dumps([[v for c in columns for v in (sums[c], sums[c] / counts[c], counts[c])]]))
"""


def generate(path: Path, size_mb: int) -> int:
    """Write the CSV (numbers with gaps, quoted commas, dates) and return its row count."""
    rows = int(size_mb * 1_000_000 / BYTES_PER_ROW)
    generate_variant(path, "utf8", rows)
    return rows


def host_sql(path: Path, workload: dict[str, Any], source: str | None = None) -> str:
    """The query DuckDB on the host runs for a workload, in the sandbox answer's order."""
    keys = workload.get("group_by", [])
    aggregates = [
        f'{SQL_OF[operation]}("{column}")' for column in workload["columns"] for operation in workload["operations"]
    ]
    source = source or f"read_csv('{path}')"
    if not keys:
        return f"SELECT {', '.join(aggregates)} FROM {source}"
    key_list = ", ".join(f'"{key}"' for key in keys)
    return f"SELECT {key_list}, {', '.join(aggregates)} FROM {source} GROUP BY {key_list} ORDER BY {key_list}"


def sandbox_rows(answer: dict[str, Any], workload: dict[str, Any]) -> list[list[Any]]:
    """The sandbox answer flattened like the host query's rows."""
    rows = []
    for result in answer["results"]:
        keys = [result["group"][key] for key in workload.get("group_by", [])]
        values = [result["columns"][c][o] for c in workload["columns"] for o in workload["operations"]]
        rows.append(keys + values)
    return rows


def same(left: list[list[Any]], right: list[list[Any]]) -> bool:
    """Row lists equal up to float rounding."""
    if len(left) != len(right):
        return False
    for a_row, b_row in zip(left, right, strict=True):
        for a, b in zip(a_row, b_row, strict=False):
            if isinstance(a, (int, float)) and isinstance(b, (int, float)):
                if not math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-9):
                    return False
            elif a != b:
                return False
    return True


def measure_process(argv: list[str]) -> tuple[float, float, str]:
    """Wall seconds, peak RSS in MiB and stdout of one host process."""
    started = time.perf_counter()
    process = subprocess.Popen(argv, stdout=subprocess.PIPE)
    assert process.stdout is not None
    output = process.stdout.read().decode()
    _, status, usage = os.wait4(process.pid, 0)
    process.returncode = os.waitstatus_to_exitcode(status)
    if process.returncode != 0:
        raise RuntimeError(f"{argv[:3]} failed with exit code {process.returncode}")
    return time.perf_counter() - started, usage.ru_maxrss / 1024, output


def host_duckdb(sql: str, options: argparse.Namespace) -> list[tuple[float, float, str]]:
    """DuckDB on the host running `sql` `repeat` times, each in a fresh process: (seconds, peak MiB, rows JSON)."""
    return [measure_process([sys.executable, "-c", HOST_DUCKDB, sql, str(options.cpus)]) for _ in range(options.repeat)]


def memory_for(workload: dict[str, Any], options: argparse.Namespace) -> int:
    """The sandbox memory a workload runs with."""
    return int(options.median_memory_mb if HOLDS_VALUES & set(workload["operations"]) else options.memory_mb)


Runs = dict[tuple[str, str], list[tuple[float, dict[str, Any]]]]
"""(file, workload) -> (seconds, answer) of each sandbox call."""


async def sandbox_runs(
    policies: dict[int, Path], files: dict[str, tuple[str, ...]], options: argparse.Namespace
) -> Runs:
    """Each file's workloads `repeat` times through a real stdio session on the policy with their memory."""
    runs: Runs = {}
    for memory_mb, policy in policies.items():
        async with Client(server_parameters(["--policy", str(policy)]), mode="legacy") as client:
            for file, names in files.items():
                for name in names:
                    if memory_for(WORKLOADS[name], options) == memory_mb:
                        await _workload(client, file, name, options, runs)
    return runs


async def _workload(client: Client, file: str, name: str, options: argparse.Namespace, runs: Runs) -> None:
    for _ in range(options.repeat):
        started = time.perf_counter()
        result = await client.call_tool("analyze_csv", {"filepath": f"/data/{file}", **WORKLOADS[name]})
        elapsed = time.perf_counter() - started
        if result.is_error or result.structured_content is None:
            text = getattr(result.content[0], "text", "")
            raise RuntimeError(f"sandbox call {name} on {file} failed: {text}")
        runs.setdefault((file, name), []).append((elapsed, result.structured_content))


def main(argv: list[str]) -> int:
    """Run the benchmark, print its table and write bench/results/analyze_csv.json."""
    parser = argparse.ArgumentParser(prog="python -m bench analyze_csv", description=__doc__.split("\n\n")[0])
    parser.add_argument("--size-mb", type=int, default=1000, help="size of the generated CSV (default 1000)")
    parser.add_argument("--repeat", type=int, default=3, help="runs per measurement (default 3)")
    parser.add_argument("--memory-mb", type=int, default=512, help="the sandbox's memory limit (default 512)")
    parser.add_argument(
        "--median-memory-mb", type=int, default=2048, help="memory for workloads that keep values (default 2048)"
    )
    parser.add_argument("--cpus", type=int, default=2, help="the sandbox's CPUs, and DuckDB's threads on the host")
    options = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="sandbox-bench-csv-", dir="/var/tmp") as work:
        data = Path(work) / "data"
        data.mkdir()
        data.chmod(0o755)
        csv_path = data / "big.csv"
        print(f"generating {options.size_mb} MB of CSV ...", flush=True)
        rows = generate(csv_path, options.size_mb)
        csv_path.chmod(0o644)
        size = csv_path.stat().st_size
        for variant in VARIANTS:
            print(f"writing the {variant} variant ...", flush=True)
            generate_variant(data / f"{variant}.csv", variant, rows)
            (data / f"{variant}.csv").chmod(0o644)
        files = {"big.csv": tuple(WORKLOADS), **{f"{variant}.csv": LOCALE_WORKLOADS for variant in VARIANTS}}
        policies = {}
        for memory_mb in sorted({memory_for(workload, options) for workload in WORKLOADS.values()}):
            policies[memory_mb] = Path(work) / f"bench-{memory_mb}.yaml"
            policies[memory_mb].write_text(
                f"name: bench-analyze-csv-{memory_mb}\nextends: default\ndefaults:\n"
                f"  limits: {{timeout_s: 600, max_timeout_s: 600, memory_mb: {memory_mb}, cpus: {options.cpus}}}\n"
                f"  mounts: [{{host: {data}, sandbox: /data, mode: ro}}]\n"
            )
        print(f"{rows:,} rows, {size / 1e6:.0f} MB; sandbox: {options.cpus} CPUs", flush=True)
        runs = anyio.run(sandbox_runs, policies, files, options)
        report: dict[str, Any] = {}
        table = []
        for name, workload in WORKLOADS.items():
            sql = host_sql(csv_path, workload)
            host = host_duckdb(sql, options)
            sandboxed = runs[("big.csv", name)]
            entry: dict[str, Any] = {
                "workload": workload,
                "sandbox_memory_mb": memory_for(workload, options),
                "sandbox_s": median([elapsed for elapsed, _ in sandboxed]),
                "sandbox_peak_rss_mb": max(answer["engine"]["peak_rss_mb"] for _, answer in sandboxed),
                "sandbox_detect_ms": median([answer["engine"]["detect_ms"] for _, answer in sandboxed]),
                "host_duckdb_s": median([elapsed for elapsed, _, _ in host]),
                "host_duckdb_peak_rss_mb": round(max(rss for _, rss, _ in host), 1),
                "results_match_host_duckdb": same(sandbox_rows(sandboxed[0][1], workload), json.loads(host[0][2])),
            }
            entry["sandbox_over_host_duckdb"] = round(entry["sandbox_s"] / entry["host_duckdb_s"], 2)
            entry["detect_share_of_call"] = round(entry["sandbox_detect_ms"] / 1000 / entry["sandbox_s"], 4)
            row = [name, entry["sandbox_memory_mb"], entry["sandbox_s"], entry["sandbox_peak_rss_mb"],
                   entry["host_duckdb_s"], entry["host_duckdb_peak_rss_mb"], entry["sandbox_over_host_duckdb"]]  # fmt: skip
            if not workload.get("group_by"):
                pandas = [
                    measure_process([sys.executable, "-c", HOST_PANDAS, str(csv_path), json.dumps(workload["columns"])])
                    for _ in range(options.repeat)
                ]
                entry["host_pandas_chunked_s"] = median([elapsed for elapsed, _, _ in pandas])
                entry["host_pandas_chunked_peak_rss_mb"] = round(max(rss for _, rss, _ in pandas), 1)
                entry["results_match_host_pandas"] = same(
                    sandbox_rows(sandboxed[0][1], workload), json.loads(pandas[0][2])
                )
                row += [entry["host_pandas_chunked_s"], entry["host_pandas_chunked_peak_rss_mb"]]
            else:
                row += ["-", "-"]
            row.append(entry["results_match_host_duckdb"])
            report[name] = entry
            table.append(row)
        print()
        print_table(
            ["workload", "limit MiB", "sandbox s", "sandbox MiB", "host duckdb s", "host duckdb MiB", "ratio",
             "host pandas s", "host pandas MiB", "same answers"],
            table,
        )  # fmt: skip
        locales = measure_locales(data, Path(work), runs, options)
    against_before = {
        "before_measured_at": BEFORE["measured_at"],
        **{
            name: {
                "before": BEFORE[name],
                "now": entry["sandbox_over_host_duckdb"],
                "change": round(entry["sandbox_over_host_duckdb"] / float(BEFORE[name]), 3),
            }  # fmt: skip
            for name, entry in report.items()
        },
    }
    print("\nUTF-8 file, sandbox/host ratio now against before detection was added, and detection's share:")
    for name, change in against_before.items():
        if isinstance(change, dict):
            share = report[name]["detect_share_of_call"]
            print(f"  {name}: {change['before']} -> {change['now']} ({change['change']:.3f}x); detection {share:.1%}")
    path = write_results(
        "analyze_csv",
        {
            "file": {"bytes": size, "rows": rows},
            "sandbox": {"cpus": options.cpus},
            "repeat": options.repeat,
            "workloads": report,
            "utf8_against_before": against_before,
            "locales": locales,
        },
    )
    print(f"\nwritten: {path}", flush=True)
    answers = [entry["results_match_host_duckdb"] for entry in report.values()]
    answers += [entry["results_match_host_duckdb"] for variant in locales.values() for entry in variant.values()]
    return 0 if all(answers) else 1


def measure_locales(data: Path, work: Path, runs: Runs, options: argparse.Namespace) -> dict[str, dict[str, Any]]:
    """Each locale variant's workloads in the sandbox beside DuckDB on the host after the same conversion."""
    locales: dict[str, dict[str, Any]] = {}
    table = []
    for variant in VARIANTS:
        path = data / f"{variant}.csv"
        converted, conversion_s = path, 0.0
        if variant == "gb18030":
            converted = work / "gb18030-as-utf8.csv"
            argv = [sys.executable, "-c", TRANSCODE, str(path), "gb18030", str(converted), "utf-8"]
            conversion_s = median([measure_process(argv)[0] for _ in range(options.repeat)])
        for name in LOCALE_WORKLOADS:
            workload = WORKLOADS[name]
            sql = host_sql(converted, workload, variant_source(variant, converted))
            host = host_duckdb(sql, options)
            sandboxed = runs[(f"{variant}.csv", name)]
            answer = sandboxed[0][1]
            entry: dict[str, Any] = {
                "bytes": path.stat().st_size,
                "sandbox_s": median([elapsed for elapsed, _ in sandboxed]),
                "sandbox_peak_rss_mb": max(a["engine"]["peak_rss_mb"] for _, a in sandboxed),
                "sandbox_detect_ms": median([a["engine"]["detect_ms"] for _, a in sandboxed]),
                "host_conversion_s": conversion_s,
                "host_duckdb_s": median([elapsed for elapsed, _, _ in host]),
                "encoding_found": answer["file"]["encoding"],
                "numbers_found": answer["file"].get("numbers"),
                "results_match_host_duckdb": same(sandbox_rows(answer, workload), json.loads(host[0][2])),
            }
            entry["host_s"] = round(conversion_s + entry["host_duckdb_s"], 3)
            entry["sandbox_over_host"] = round(entry["sandbox_s"] / entry["host_s"], 2)
            locales.setdefault(variant, {})[name] = entry
            table.append([variant, name, entry["sandbox_s"], entry["host_conversion_s"], entry["host_duckdb_s"],
                          entry["sandbox_over_host"], entry["results_match_host_duckdb"]])  # fmt: skip
        if converted != path:
            converted.unlink()
    print()
    print_table(["file", "workload", "sandbox s", "host conversion s", "host duckdb s", "ratio", "same answers"], table)
    return locales
