"""Forward-secure seals on the audit trail, and `audit verify` on hostile files: what a writer who can rewrite the
trail could do before (links recomputed after an edit, a deletion or an insertion; the end cut) is found with the
verification key, and no file makes the verifier hang, run out of memory or print without end."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from sandbox_server.access import audit
from sandbox_server.access.audit import CHAIN_FIELD, FIRST, AuditLog, line_digest
from sandbox_server.access.audit_seal import SealingKey, VerificationKey, sealing_key_path
from sandbox_server.access.audit_verify import BREAKS_KEPT, verify_trail


def _now(before_s: float = 0) -> str:
    return (datetime.now(UTC) - timedelta(seconds=before_s)).isoformat(timespec="milliseconds")


def _sealed(path: Path, lines: int, every: bool = True) -> VerificationKey:
    """A trail of `lines` calls, each sealed (`every`; else the first, the rest within the hour); its verification
    key."""
    log = AuditLog(path, seal_interval_s=1 if every else 3600)
    said = log.begin_sealing()
    assert said is not None and log.begin_sealing() is None  # made once
    for number in range(lines):
        log.write({"time": _now(), "tool": "execute_command", "caller": "ada", "n": number})
        if every:
            log.tick()  # the timer's seal of what waits
    return VerificationKey.parse(said.read_text())


def _relinked(lines: list[str]) -> str:
    """The trail as an intruder who can write it leaves it: every link recomputed after a change."""
    out, previous = [], FIRST
    for line in lines:
        record = json.loads(line) | {CHAIN_FIELD: previous}
        text = json.dumps(record, separators=(",", ":"))
        out.append(text + "\n")
        previous = line_digest(text.encode())
    return "".join(out)


def test_a_sealed_trail_holds_with_its_key_and_names_the_last_sealed_line(tmp_path: Path) -> None:
    path = tmp_path / "audit.jsonl"
    key = _sealed(path, 5)
    verdict = verify_trail(path, key)
    assert verdict.holds and verdict.seals == 5 and verdict.sealed_through == ("audit.jsonl", 10), verdict
    assert verdict.unvouched == 0
    other = VerificationKey(bytes(32), key.start, key.interval_s)
    assert not verify_trail(path, other).holds  # another key: no seal holds
    assert oct(sealing_key_path(path).stat().st_mode & 0o777) == "0o600"
    writer = SealingKey.load(sealing_key_path(path))
    assert writer is not None and writer.sealed_line == line_digest(path.read_bytes().splitlines()[-1])
    writer.advance(writer.start + writer.interval_s * (writer.epoch + 1))  # its epoch ends: its key goes
    writer.save()
    assert key.key.hex() not in sealing_key_path(path).read_text() and writer.epoch >= 1


def test_an_edit_a_deletion_and_an_insertion_with_every_link_recomputed_break_a_seal(tmp_path: Path) -> None:
    path = tmp_path / "audit.jsonl"
    key = _sealed(path, 6)
    lines = path.read_text().splitlines(keepends=True)
    forged = json.dumps(json.loads(lines[2]) | {"caller": "mallory"}) + "\n"  # its own time, in the epoch
    shapes = {
        "edited": lines[:2] + [lines[2].replace('"ada"', '"mallory"')] + lines[3:],
        "deleted": lines[:2] + lines[4:],  # a call and its seal
        "inserted": lines[:4] + [forged] + lines[4:],
    }
    for name, text in shapes.items():
        path.write_text(_relinked(text))
        assert not [b for b in verify_trail(path).breaks if b.line], name  # the chain alone is fooled
        verdict = verify_trail(path, key)
        assert not verdict.holds, name
        assert any("does not hold" in b.reason for b in verdict.breaks), (name, verdict.breaks)


class _Clock:
    """The writer's clock, two minutes back: a trail written then, while the verifier reads it now."""

    def __init__(self, behind_s: float) -> None:
        self.behind_s = behind_s

    def time(self) -> float:
        return time.time() - self.behind_s

    def now(self) -> str:
        return _now(self.behind_s)


def test_history_resealed_with_the_key_the_intruder_holds_is_found_sealed_late(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "audit.jsonl"
    clock = _Clock(120)
    monkeypatch.setattr(audit, "time", clock)
    monkeypatch.setattr(audit, "_now", clock.now)
    log = AuditLog(path, seal_interval_s=1)
    kept = log.begin_sealing()
    assert kept is not None and oct(kept.stat().st_mode & 0o777) == "0o400"
    key = VerificationKey.parse(kept.read_text())
    for number in range(3):  # written, and each sealed, two minutes ago
        log.write({"time": clock.now(), "tool": "execute_command", "caller": "ada", "n": number})
        log.tick()
    assert verify_trail(path, key).holds
    monkeypatch.undo()  # now: the intruder, holding the key of this epoch
    lines = path.read_text().splitlines(keepends=True)
    calls = [line for line in lines if '"audit_seal"' not in line]
    path.write_text(_relinked([calls[0].replace('"ada"', '"mallory"'), *calls[1:]]))  # the old seals gone
    log.tick()  # resealed now: the seal holds, but two minutes after the lines
    verdict = verify_trail(path, key)
    assert not verdict.holds and "first vouched for by the seal at audit.jsonl line 4, made 12" in (
        verdict.breaks[0].reason
    ), verdict.breaks


def test_the_end_cut_is_found_by_the_writers_key_and_unsealed_lines_are_counted(tmp_path: Path) -> None:
    path = tmp_path / "audit.jsonl"
    key = _sealed(path, 4)
    lines = path.read_text().splitlines(keepends=True)
    path.write_text("".join(lines[:-4]))  # the last two calls and their seals
    [cut] = verify_trail(path, key).breaks
    assert "cut from the end" in cut.reason and "the last seal is gone" in cut.reason, cut
    late = tmp_path / "late.jsonl"
    key = _sealed(late, 3, every=False)  # the first record is sealed at once, the next within the hour
    verdict = verify_trail(late, key)
    assert verdict.holds and verdict.sealed_through == ("late.jsonl", 2) and verdict.unvouched == 2, verdict


def test_hostile_files_are_findings_never_a_hang_a_traceback_or_endless_output(tmp_path: Path) -> None:
    path = tmp_path / "audit.jsonl"
    log = AuditLog(path)
    log.write({"time": "2026-12-01T10:00:00", "tool": "x"})
    os.mkfifo(tmp_path / "audit.jsonl.2")  # a FIFO: opened without blocking, and refused
    os.symlink("/dev/zero", tmp_path / "audit.jsonl.3")  # endless: refused, never read
    with open(path, "a") as handle:
        handle.write("[" * 200_000 + "]" * 200_000 + "\n")  # nests past Python's recursion limit
        handle.write("not json\n" * 3_000)
    verdict = verify_trail(path)
    reasons = [b.reason for b in verdict.breaks]
    assert "not readable as a regular file (Too many levels of symbolic links)" in reasons[0], reasons[:3]
    assert "not a regular file" in reasons[1], reasons[:3]
    assert len(verdict.breaks) == BREAKS_KEPT and verdict.breaks_not_listed > 2_900


def test_a_line_of_a_quarter_gigabyte_is_hashed_in_bounded_memory(tmp_path: Path) -> None:
    path = tmp_path / "audit.jsonl"
    with open(path, "wb") as handle:
        handle.truncate(1 << 28)  # a sparse 256 MiB of zeros, no newline
    measured = (  # in a process of its own, which says its own peak since its exec (ru_maxrss counts the fork's)
        "import json, sys; from pathlib import Path; from sandbox_server.access.audit_verify import "
        "verify_trail; found = verify_trail(Path(sys.argv[1])); peak = [line for line in open('/proc/self/status') "
        "if line.startswith('VmHWM:')][0].split()[1]; print(json.dumps([found.breaks[0].reason, int(peak) / 1024]))"
    )
    done = subprocess.run([sys.executable, "-c", measured, str(path)], capture_output=True, text=True, timeout=120)
    reason, peak_mb = json.loads(done.stdout)
    assert "longer than" in reason, reason
    assert peak_mb < 120, peak_mb  # a 1 GiB line held 2.1 GiB before
