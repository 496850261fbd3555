"""The audit trail's chain: each line names the hash of the one before it, across rotations, restarts and writers;
a line changed, removed or added is found where it was."""

from __future__ import annotations

import json
from datetime import UTC, datetime
from pathlib import Path

from sandbox_server.access.audit import CHAIN_FIELD, FIRST, AuditLog, line_digest
from sandbox_server.access.audit_verify import trail_files, verify_trail


def _trail(path: Path, lines: int, max_bytes: int = 10_000_000) -> None:
    log = AuditLog(path, max_bytes=max_bytes, keep=5)
    for number in range(lines):
        log.write({"time": f"2026-11-28T10:00:{number:02d}", "tool": "execute_command", "n": number})


def _lines(path: Path) -> list[str]:
    return path.read_text().splitlines(keepends=True)


def test_a_trail_written_across_rotations_restarts_and_two_writers_holds(tmp_path: Path) -> None:
    path = tmp_path / "audit.jsonl"
    _trail(path, 12, max_bytes=600)  # rotated every few lines
    first, second = AuditLog(path, max_bytes=600), AuditLog(path, max_bytes=600)  # a restart; a one-shot call
    for number in range(6):
        (first if number % 2 else second).write({"time": "2026-11-28T11:00:00", "n": 100 + number})
    files = trail_files(path)
    assert len(files) > 2 and files[-1] == path and files[0].name == f"audit.jsonl.{len(files) - 1}"
    verdict = verify_trail(path)
    assert verdict.holds and verdict.lines == 18 and not verdict.starts_after_rotated, verdict.breaks
    assert json.loads(_lines(files[0])[0])[CHAIN_FIELD] == FIRST
    joined = [line for file in files for line in _lines(file)]
    for before, after in zip(joined, joined[1:], strict=False):  # each names the one before, whatever file it is in
        assert json.loads(after)[CHAIN_FIELD] == line_digest(before.encode())


def test_an_edited_a_deleted_and_an_inserted_line_are_each_found_where_they_are(tmp_path: Path) -> None:
    path = tmp_path / "audit.jsonl"
    _trail(path, 10)
    lines = _lines(path)
    edited = lines[:3] + [lines[3].replace('"n":3', '"n":33')] + lines[4:]
    deleted = lines[:5] + lines[6:]
    forged = json.loads(lines[2]) | {"n": 99, CHAIN_FIELD: line_digest(lines[2].encode())}  # even with a good link
    inserted = lines[:3] + [json.dumps(forged) + "\n"] + lines[3:]
    found = {}
    for name, text in {"edited": edited, "deleted": deleted, "inserted": inserted}.items():
        path.write_text("".join(text))
        verdict = verify_trail(path)
        found[name] = [(b.line, b.reason.split(":")[0]) for b in verdict.breaks]
    assert found == {
        "edited": [(5, "does not follow line 4")],  # line 4 changed
        "deleted": [(6, "does not follow line 5")],  # what was line 7 now follows line 5
        "inserted": [(5, "does not follow line 4")],  # the old line 4, now 5, does not follow the new one
    }
    path.write_text("".join(lines[:4] + ['{"time": "2026-11-28T12:00:00", "tool": "x"}\n'] + lines[4:]))
    [unlinked, after] = verify_trail(path).breaks
    assert (unlinked.line, after.line) == (5, 6) and "names no previous_sha256" in unlinked.reason


def test_lines_from_before_the_chain_are_counted_and_the_chain_starts_after_them(tmp_path: Path) -> None:
    path = tmp_path / "audit.jsonl"
    path.write_text('{"time": "2026-11-01T00:00:00", "tool": "old"}\n{"time": "2026-11-01T00:00:01", "tool": "old"}\n')
    _trail(path, 3)
    verdict = verify_trail(path)
    assert verdict.holds and verdict.unchained == 2 and verdict.lines == 5
    assert json.loads(_lines(path)[2])[CHAIN_FIELD] == line_digest(_lines(path)[1].encode())


def test_a_trail_whose_oldest_file_rotation_removed_holds_and_one_whose_first_lines_were_cut_does_not(
    tmp_path: Path,
) -> None:
    path = tmp_path / "audit.jsonl"
    log = AuditLog(path, max_bytes=600, keep=2)
    for number in range(20):  # rotation removes the oldest file again and again, and says so each time
        log.write({"time": f"2026-11-28T10:00:{number:02d}", "tool": "execute_command", "n": number})
    verdict = verify_trail(path)
    assert verdict.holds and verdict.starts_after_rotated, verdict.breaks
    oldest = trail_files(path)[0]
    oldest.unlink()  # as rotation would, but by hand: nothing said which link the trail now starts from
    [cut] = verify_trail(path).breaks
    assert "the trail's first lines were cut" in cut.reason, cut
    lines = _lines(path)
    path.write_text("".join(lines[3:]))  # the first lines of the only file, cut
    assert "first lines were cut" in verify_trail(path).breaks[0].reason


def test_unlinked_lines_forged_before_the_first_are_breaks(tmp_path: Path) -> None:
    path = tmp_path / "audit.jsonl"
    _trail(path, 3)
    forged = '{"time": "2026-11-01T00:00:00", "tool": "execute_command", "caller": "mallory"}\n'
    path.write_text(forged + path.read_text())
    [found] = verify_trail(path).breaks
    assert found.line == 1 and "no chained line follows it" in found.reason


def test_a_trail_rotates_by_age_once_its_first_line_is_older_than_the_cap_and_its_chain_runs_on(
    tmp_path: Path,
) -> None:
    path = tmp_path / "audit.jsonl"
    log = AuditLog(path, keep=3, max_age_s=3600)
    log.write({"time": "2026-01-01T00:00:00.000+00:00", "n": 0})  # the file's first line, long ago
    log.write({"time": "2026-11-28T10:00:00.000+00:00", "n": 1})  # rotates first: the file is older than an hour
    fresh = datetime.now(UTC).isoformat(timespec="milliseconds")
    log.write({"time": fresh, "n": 2})  # its file began with line 1, also old: rotated again
    log.write({"time": fresh, "n": 3})
    log.write({"time": fresh, "n": 4})  # its file began now: kept
    assert [len(_lines(file)) for file in trail_files(path)] == [1, 1, 3]
    assert verify_trail(path).holds
    sized = AuditLog(tmp_path / "sized.jsonl")  # no age: by size alone
    sized.write({"time": "2026-01-01T00:00:00.000+00:00"})
    sized.write({"time": fresh})
    assert trail_files(tmp_path / "sized.jsonl") == [tmp_path / "sized.jsonl"]


def test_a_copy_shipped_whole_holds_and_one_whose_long_line_a_shipper_cut_does_not(tmp_path: Path) -> None:
    """docs/policies.md: rsyslog cuts a message at 8 KiB unless `global(maxMessageSize=…)` says more; a copy whose
    16 KiB line was cut is found at that line (its own text unreadable) and the one after it."""
    path = tmp_path / "audit.jsonl"
    log = AuditLog(path, max_bytes=10_000_000, keep=5)
    log.write({"time": "2026-11-28T10:00:00", "tool": "execute_command", "n": 0})
    log.write({"time": "2026-11-28T10:00:01", "tool": "execute_command", "notes": ["x" * 16_300]})
    log.write({"time": "2026-11-28T10:00:02", "tool": "execute_command", "n": 2})
    lines = _lines(path)
    assert len(lines[1]) > 16_000
    whole, cut = tmp_path / "whole.jsonl", tmp_path / "cut.jsonl"
    whole.write_text("".join(lines))
    cut.write_text(lines[0] + lines[1][:8096] + "\n" + lines[2])
    assert verify_trail(whole).holds
    found = verify_trail(cut)
    assert not found.holds and 3 in [b.line for b in found.breaks], found.breaks
