"""`sandbox-server usage`: what callers and tools used, summed from the audit trail (each call's `usage`).

The audit trail is the record: this reads its file and the rotated ones beside it (path.1 … path.N), so what it
prints is what the records say, and nothing is counted twice. Lines it cannot read are counted and said, never
guessed at.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from sandbox_server.access.audit import Spent
from sandbox_server.access.audit_verify import trail_files, trail_lines
from sandbox_server.errors import UsageError

__all__ = ["Totals", "parse_since", "read_records", "summarize"]

_DURATION = re.compile(r"^(\d+(?:\.\d+)?)([smhd])$")
_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400}


@dataclass
class Totals:
    """One caller's or tool's calls and what they used."""

    calls: int = 0
    ok: int = 0
    errors: int = 0
    refused: int = 0
    wall_s: float = 0.0
    cpu_s: float = 0.0
    peak_memory_bytes: int = 0
    """The largest of its calls' peaks."""
    network_in_bytes: int = 0
    network_out_bytes: int = 0
    task_s: float = 0.0
    """Wall time of its calls that ran as tasks."""
    service_s: float = 0.0
    """Running time of its services that stopped."""
    service_cpu_s: float = 0.0

    def add(self, record: dict[str, Any], spent: Spent) -> None:
        self.peak_memory_bytes = max(self.peak_memory_bytes, spent.peak_memory_bytes or 0)
        if spent.service:
            self.service_s += spent.wall_s
            self.service_cpu_s += spent.cpu_s
            return
        outcome = record.get("outcome")
        self.calls += 1
        self.ok += outcome == "ok"
        self.errors += outcome == "error"
        self.refused += outcome not in ("ok", "error")
        self.wall_s += spent.wall_s
        self.cpu_s += spent.cpu_s
        self.network_in_bytes += spent.network_in_bytes
        self.network_out_bytes += spent.network_out_bytes
        self.task_s += spent.wall_s if spent.task else 0.0

    def shown(self) -> dict[str, Any]:
        fields = asdict(self)
        for name in ("wall_s", "cpu_s", "task_s", "service_s", "service_cpu_s"):
            fields[name] = round(fields[name], 3)
        return fields


def parse_since(text: str, now: datetime | None = None) -> datetime:
    """`--since`: a duration back from now (90s, 15m, 2h, 7d) or an ISO 8601 time (UTC when it names no zone)."""
    now = now or datetime.now(UTC)
    matched = _DURATION.match(text.strip())
    if matched:
        return now - timedelta(seconds=float(matched[1]) * _UNITS[matched[2]])
    try:
        when = datetime.fromisoformat(text.strip())
    except ValueError:
        raise UsageError(f"--since {text!r}: give a duration (90s, 15m, 2h, 7d) or a time (2026-11-24T08:00)") from None
    return when if when.tzinfo is not None else when.replace(tzinfo=UTC)


def read_records(path: Path) -> tuple[list[dict[str, Any]], int]:
    """The records of an audit trail that say what was used: calls and stopped services (the other events of
    tasks' and services' lives left out); and how many lines could not be read."""
    files = trail_files(path)
    if not files:
        raise UsageError(f"{path}: no audit trail there (serve writes one with --audit-log or the policy's audit.path)")
    records, unreadable = [], 0
    for line in trail_lines(path):
        record = line.record
        if record is None:
            unreadable += 1
        elif "tool" in record and Spent.of(record) is not None:
            records.append(record)
    return records, unreadable


def summarize(records: Iterable[dict[str, Any]], by: str, since: datetime | None = None) -> dict[str, Totals]:
    """Totals per caller (`caller`, anonymous calls as "-") or per tool, of the calls since `since`."""
    totals: dict[str, Totals] = {}
    for record in records:
        if since is not None:
            try:
                when = datetime.fromisoformat(str(record.get("time")))
            except ValueError:
                continue
            if when < since:
                continue
        spent = Spent.of(record)
        if spent is not None:
            totals.setdefault(str(record.get(by) or "-"), Totals()).add(record, spent)
    return dict(sorted(totals.items()))
