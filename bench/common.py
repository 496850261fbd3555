"""What every benchmark shares: medians, the table it prints and the JSON it writes."""

from __future__ import annotations

import json
import os
import platform
import statistics
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).resolve().parent / "results"


UNCAPPED = """\
extends: default
rate: {calls_per_minute: 1000000}
host: {min_available_memory_mb: 64, max_load_per_cpu: 1000}
"""
"""The default policy with its rate and host-load caps lifted: a benchmark's calls would pass them (its
concurrency cap stays)."""


def median(values: Sequence[float]) -> float:
    """The median, rounded for reading."""
    return round(statistics.median(values), 3)


def machine() -> dict[str, Any]:
    """What the numbers were measured on."""
    return {
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "kernel": platform.release(),
        "measured_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }


def print_table(header: Sequence[str], rows: Sequence[Sequence[Any]]) -> None:
    """A plain aligned table on stdout."""
    cells = [[str(cell) for cell in header]] + [[str(cell) for cell in row] for row in rows]
    widths = [max(len(row[index]) for row in cells) for index in range(len(header))]
    for number, row in enumerate(cells):
        print("  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=False)).rstrip())
        if number == 0:
            print("  ".join("-" * width for width in widths))


def update_results(name: str, section: str, document: dict[str, Any]) -> Path:
    """Replace one section of bench/results/<name>.json (with the machine it was measured on), keeping the
    others as their last run left them."""
    RESULTS.mkdir(exist_ok=True)
    path = RESULTS / f"{name}.json"
    existing = json.loads(path.read_text()) if path.exists() else {"benchmark": name, "machine": machine()}
    existing[section] = {"machine": machine(), **document}
    path.write_text(json.dumps(existing, indent=2) + "\n")
    return path


def write_results(name: str, document: dict[str, Any]) -> Path:
    """bench/results/<name>.json, with the machine it was measured on."""
    RESULTS.mkdir(exist_ok=True)
    path = RESULTS / f"{name}.json"
    path.write_text(json.dumps({"benchmark": name, "machine": machine(), **document}, indent=2) + "\n")
    return path
