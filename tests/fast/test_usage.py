"""`sandbox-server usage`'s sums, from audit trails written as the server writes them (the real CLI reads them in
tests/test_meters.py): rotated files read in order, events of services counted apart, a time bound."""

from __future__ import annotations

import re
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from sandbox_server.access.audit import AuditLog
from sandbox_server.calls.metrics import OUTCOMES
from sandbox_server.errors import UsageError
from sandbox_server.ops.usage import parse_since, read_records, summarize


def _call(caller: str, tool: str, outcome: str, when: datetime, **usage: object) -> dict[str, object]:
    return {"time": when.isoformat(), "caller": caller, "tool": tool, "outcome": outcome, "usage": usage}


def test_rotated_trails_are_summed_by_caller_and_tool_and_services_apart(tmp_path: Path) -> None:
    now = datetime.now(UTC)
    log = AuditLog(tmp_path / "audit.jsonl", max_bytes=200, keep=5)  # small: the lines rotate into .1, .2 …
    log.write(_call("alice", "run_python", "ok", now, wall_s=2.0, cpu_s=1.5, peak_memory_bytes=100, task=True))
    log.write(_call("alice", "execute_command", "error", now, wall_s=1.0, cpu_s=0.25, network_in_bytes=10))
    log.write(_call("bob", "execute_command", "refused", now - timedelta(hours=3), wall_s=0.01, cpu_s=None))
    log.write({"time": now.isoformat(), "event": "service_stopped", "caller": "alice", "tool": "execute_command",
               "usage": {"wall_s": 60.0, "cpu_s": 2.0, "peak_memory_bytes": 300}})  # fmt: skip
    log.write({"time": now.isoformat(), "event": "task_created", "tool": "run_python"})  # counts nothing
    assert len(list(tmp_path.glob("audit.jsonl.*"))) >= 2
    with open(tmp_path / "audit.jsonl", "a") as out:
        out.write("not json\n")

    records, unreadable = read_records(tmp_path / "audit.jsonl")
    assert unreadable == 1 and len(records) == 4
    by_caller = {name: totals.shown() for name, totals in summarize(records, "caller").items()}
    alice = by_caller["alice"]
    assert (alice["calls"], alice["ok"], alice["errors"], alice["refused"]) == (2, 1, 1, 0)
    assert (alice["wall_s"], alice["cpu_s"], alice["task_s"]) == (3.0, 1.75, 2.0)
    assert (alice["service_s"], alice["service_cpu_s"], alice["peak_memory_bytes"]) == (60.0, 2.0, 300)
    assert by_caller["bob"]["refused"] == 1 and by_caller["bob"]["cpu_s"] == 0.0
    recent = summarize(records, "caller", parse_since("1h", now))
    assert set(recent) == {"alice"}
    by_tool = summarize(records, "tool")
    assert by_tool["execute_command"].calls == 2 and by_tool["execute_command"].service_s == 60.0


def test_since_takes_a_duration_or_a_time_and_refuses_anything_else() -> None:
    now = datetime(2026, 11, 24, 12, 0, tzinfo=UTC)
    assert parse_since("90s", now) == now - timedelta(seconds=90)
    assert parse_since("2d", now) == now - timedelta(days=2)
    assert parse_since("2026-11-24T08:00", now) == datetime(2026, 11, 24, 8, 0, tzinfo=UTC)
    with pytest.raises(UsageError, match="--since 'last week'"):
        parse_since("last week", now)


def test_a_missing_trail_is_said(tmp_path: Path) -> None:
    with pytest.raises(UsageError, match="no audit trail there"):
        read_records(tmp_path / "nowhere.jsonl")


def test_every_outcome_a_call_record_can_say_is_a_documented_label_value() -> None:
    root = Path(__file__).resolve().parents[2]
    said = set()
    for source in (root / "sandbox_server").rglob("*.py"):
        for line in source.read_text().splitlines():  # where a record's outcome is set: each value it may take
            if re.search(r"\"outcome\"(\] =|: \")|setdefault\(\"outcome\", \"", line):
                said |= set(re.findall(r"\"(\w+)\"", line)) - {"outcome"}
    assert said == set(OUTCOMES), said
    row = next(line for line in (root / "docs/meters.md").read_text().splitlines() if "`sandbox_calls_total`" in line)
    assert set(re.findall(r"`(\w+)`", row.split("|")[3])) == set(OUTCOMES), row
