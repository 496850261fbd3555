"""`sandbox-server audit verify`: whether an audit trail's chain and seals hold, from its oldest kept file to its
newest, and where they break.

Each record names the hash of the line before it (sandbox_server.access.audit). Read in order (`audit.jsonl.N` …
`audit.jsonl.1`, `audit.jsonl`), a line whose link is not the hash of the line read before it is a break: that line
was changed, or lines were removed or added there. Once a trail has a chain, a line that names no link is a break
(added by hand), unless it comes before the chain's first line and that line links to it (a trail begun by a version
that kept no chain). The oldest kept file may start after lines rotated away only where the writer said so (an
`audit_rotated_away` record naming the link it starts from); otherwise its first lines were cut.

Seals (sandbox_server.access.audit_seal) are checked with the verification key: each must hold for its epoch, the
epochs must follow one another, and the verdict names the last sealed line and counts the lines after it, which no
seal vouches for yet. Read as hostile input: regular files only, each line bounded, a bounded count of breaks kept.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import stat
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from sandbox_server.access.audit import CHAIN_FIELD, FIRST, ROTATED_EVENT
from sandbox_server.access.audit_seal import (
    SEAL_EVENT,
    KeyChain,
    SealingKey,
    VerificationKey,
    seal_mac,
    sealing_key_path,
)

__all__ = ["MAX_LINE_BYTES", "Break", "TrailLine", "Verdict", "trail_files", "trail_lines", "verify_trail"]

MAX_LINE_BYTES = 16 * 1024 * 1024
"""A longer line is hashed as it streams by, never held (an audit line is a few kB; an egress record up to 1 MB)."""
BREAKS_KEPT = 100
"""Breaks named one by one; past them, counted."""
CLOCK_SLACK_S = 5
"""How far a seal's time may stray from its epoch, and a line wait past two intervals for its seal."""


def trail_files(path: Path) -> list[Path]:
    """A trail's files, oldest first: its rotated files by number, then itself."""
    numbered = re.compile(rf"^{re.escape(path.name)}\.(\d+)$")
    rotated = sorted(
        (int(match.group(1)), sibling)
        for sibling in path.parent.glob(f"{path.name}.*")
        if (match := numbered.match(sibling.name))
    )
    return [sibling for _, sibling in reversed(rotated)] + ([path] if path.exists() or path.is_symlink() else [])


@dataclass(frozen=True, slots=True)
class TrailLine:
    """One line of a trail's file: where it is, its record (None: not a JSON object, or too long), its hash."""

    file: str
    number: int
    record: dict[str, Any] | None
    sha256: str
    problem: str = ""
    """Why there is no record: "" for a line that is not a JSON object, else what is wrong with it or its file."""


def trail_lines(path: Path) -> Iterator[TrailLine]:
    """Every line of every kept file of the trail at `path`, oldest first, read as hostile input: a file that is not
    a regular one is one line with its problem said, a line longer than MAX_LINE_BYTES is hashed and not parsed."""
    for file in trail_files(path):
        try:
            descriptor = os.open(file, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
        except OSError as exc:
            yield TrailLine(file.name, 0, None, "", f"not readable as a regular file ({exc.strerror})")
            continue
        with open(descriptor, "rb") as handle:
            if not stat.S_ISREG(os.fstat(descriptor).st_mode):
                yield TrailLine(file.name, 0, None, "", "not a regular file (a device, a pipe or a folder)")
                continue
            for number, (raw, digest) in enumerate(_raw_lines(handle), start=1):
                if raw is None:
                    yield TrailLine(file.name, number, None, digest, f"longer than {MAX_LINE_BYTES} bytes")
                    continue
                try:
                    record = json.loads(raw)
                except (ValueError, RecursionError):
                    record = None
                yield TrailLine(file.name, number, record if isinstance(record, dict) else None, digest)


def _raw_lines(handle: Any) -> Iterator[tuple[bytes | None, str]]:
    """Each line's bytes without its newline (None past MAX_LINE_BYTES) and their SHA-256, in bounded memory."""
    held, hasher = bytearray(), None
    while chunk := handle.read(1 << 20):
        start = 0
        while (end := chunk.find(b"\n", start)) >= 0:
            part = chunk[start:end]
            if hasher is not None:
                hasher.update(part)
                yield None, hasher.hexdigest()
            else:
                held += part
                yield bytes(held), hashlib.sha256(held).hexdigest()
            held, hasher = bytearray(), None
            start = end + 1
        rest = chunk[start:]
        if hasher is None and len(held) + len(rest) > MAX_LINE_BYTES:
            hasher = hashlib.sha256(held)
            held = bytearray()
        if hasher is not None:
            hasher.update(rest)
        else:
            held += rest
    if hasher is not None:
        yield None, hasher.hexdigest()
    elif held:
        yield bytes(held), hashlib.sha256(held).hexdigest()


@dataclass(frozen=True, slots=True)
class Break:
    """Where the chain does not hold: a file's line (from 1), and what is wrong there."""

    file: str
    line: int
    reason: str

    def said(self) -> str:
        return f"{self.file} line {self.line}: {self.reason}" if self.line else f"{self.file}: {self.reason}"


@dataclass(slots=True)
class Verdict:
    files: list[str] = field(default_factory=list)
    lines: int = 0
    unchained: int = 0
    """Lines written before the chain began, vouched for by the chain's first link."""
    starts_after_rotated: bool = False
    first_time: str | None = None
    last_time: str | None = None
    breaks: list[Break] = field(default_factory=list)
    breaks_not_listed: int = 0
    seals: int = 0
    """Seals found (checked when `seals_checked`)."""
    seals_checked: bool = False
    sealed_through: tuple[str, int] | None = None
    """The last line a seal that holds vouches for: (file, line)."""
    unvouched: int = 0
    """Lines after the last seal that holds."""

    @property
    def holds(self) -> bool:
        return not self.breaks and not self.breaks_not_listed and bool(self.files)

    def broke(self, file: str, line: int, reason: str) -> None:
        if len(self.breaks) < BREAKS_KEPT:
            self.breaks.append(Break(file, line, reason))
        else:
            self.breaks_not_listed += 1

    def as_json(self) -> dict[str, Any]:
        through = {"file": self.sealed_through[0], "line": self.sealed_through[1]} if self.sealed_through else None
        return {
            "holds": self.holds, "files": self.files, "lines": self.lines, "unchained_lines": self.unchained,
            "starts_after_rotated_lines": self.starts_after_rotated, "from": self.first_time, "to": self.last_time,
            "breaks": [{"file": b.file, "line": b.line, "reason": b.reason} for b in self.breaks],
            "breaks_not_listed": self.breaks_not_listed, "seals": self.seals, "seals_checked": self.seals_checked,
            "sealed_through": through, "unvouched_lines": self.unvouched,
        }  # fmt: skip


class _Reading:
    """The state of one pass over a trail: the line before, the lines before the chain, the seals so far."""

    def __init__(self, verdict: Verdict, keys: KeyChain | None) -> None:
        self.verdict, self.keys = verdict, keys
        self.previous: TrailLine | None = None
        self.chained = False
        self.loose: list[TrailLine] = []
        """Lines naming no link, read before the chain's first line."""
        self.start = ""
        """The link the trail's first chained line names (FIRST for a trail's very first line)."""
        self.rotated: set[str] = set()
        """The links rotation said the oldest kept file may start from."""
        self.seal_lines: set[str] = set()
        """The hashes of the seals' own lines."""
        self.since_seal = 0
        """Lines read since the last seal that holds (all of them before one)."""
        self.waiting: tuple[str, int, float] | None = None
        """The first line read since the last seal that holds, and its own time."""

    def read(self, line: TrailLine) -> None:
        verdict = self.verdict
        if line.number == 0:
            verdict.broke(line.file, 0, line.problem)
            return
        verdict.lines += 1
        record = line.record
        if record is None:
            verdict.broke(line.file, line.number, line.problem or "not a JSON record: written by hand, or cut short")
        else:
            if isinstance(record.get("time"), str):
                verdict.first_time = verdict.first_time or record["time"]
                verdict.last_time = record["time"]
            if self.waiting is None and record.get("event") != SEAL_EVENT:
                self._wait(line, _timestamp(record.get("time")))
            self._link(line, record)
            if record.get("event") == ROTATED_EVENT and isinstance(record.get("through_sha256"), str):
                self.rotated.add(record["through_sha256"])
            if record.get("event") == SEAL_EVENT:
                self._seal(line, record)
        self.since_seal += 1
        self.previous = line

    def _wait(self, line: TrailLine, written: float | None) -> None:
        """The first line since the last seal waits for the next, unless written before sealing began."""
        if self.keys is not None and written is not None and written >= self.keys.verification.start:
            self.waiting = (line.file, line.number, written)

    def _link(self, line: TrailLine, record: dict[str, Any]) -> None:
        link = record.get(CHAIN_FIELD)
        verdict, previous = self.verdict, self.previous
        if not isinstance(link, str):
            if self.chained:
                verdict.broke(line.file, line.number, f"names no {CHAIN_FIELD}: added after the chain began")
            else:
                self.loose.append(line)
            return
        if not self.chained:
            self.chained = True
            if self.loose and link == self.loose[-1].sha256:
                verdict.unchained = len(self.loose)  # a trail begun before the chain: its first link vouches
            else:
                for loose in self.loose:
                    verdict.broke(loose.file, loose.number, f"names no {CHAIN_FIELD} and no chained line follows it")
                self.start = link
            return
        if previous is not None and link != previous.sha256:
            where = f" of {previous.file}" if previous.file != line.file else ""
            verdict.broke(
                line.file,
                line.number,
                f"does not follow line {previous.number}{where}: that line was changed, or lines were removed or "
                "added between them",
            )

    def _seal(self, line: TrailLine, record: dict[str, Any]) -> None:
        verdict = self.verdict
        verdict.seals += 1
        self.seal_lines.add(line.sha256)
        said = record.get("seal")
        seal: dict[str, Any] = said if isinstance(said, dict) else {}
        epoch, mac = seal.get("epoch"), seal.get("hmac_sha256")
        if self.keys is None:
            return
        verification = self.keys.verification
        when, sealed = _timestamp(record.get("time")), record.get(CHAIN_FIELD)
        latest = int(time.time() - verification.start) // verification.interval_s + 1
        if not (isinstance(epoch, int) and 0 <= epoch <= latest and isinstance(mac, str) and when is not None):
            verdict.broke(line.file, line.number, "a seal without its epoch, time or HMAC, or of an epoch to come")
            return
        begins, ends = verification.window(epoch)
        key = self.keys.key_of(epoch)
        if key is None:
            verdict.broke(line.file, line.number, f"a seal of epoch {epoch} after a later one: copied or replayed")
        elif not isinstance(sealed, str) or seal_mac(key, epoch, record["time"], sealed) != mac:
            verdict.broke(
                line.file, line.number,
                f"the seal of epoch {epoch} does not hold: a line before it was changed, or the seal was forged",
            )  # fmt: skip
        elif not begins - CLOCK_SLACK_S <= when < ends + CLOCK_SLACK_S:
            verdict.broke(line.file, line.number, f"a seal dated outside its epoch ({epoch}): forged")
        else:
            late = verification.interval_s * 2 + CLOCK_SLACK_S
            if self.waiting is not None and self.waiting[2] < when - late:
                file, number, written = self.waiting
                verdict.broke(
                    file, number,
                    f"first vouched for by the seal at {line.file} line {line.number}, made {when - written:.0f} s "
                    "after this line's own time: rewritten by whoever held the key then, or written while no "
                    "sealing server ran (a server killed before it sealed)",
                )  # fmt: skip
            verdict.sealed_through, self.since_seal, self.waiting = (line.file, line.number), -1, None

    def finish(self, files: list[Path]) -> None:
        verdict = self.verdict
        verdict.unvouched = self.since_seal if verdict.seals_checked else 0
        for loose in self.loose if not self.chained else ():
            verdict.broke(loose.file, loose.number, f"names no {CHAIN_FIELD}: no chain vouches for it")
        if self.start and self.start != FIRST:
            if self.start in self.rotated:
                verdict.starts_after_rotated = True
            else:
                first = files[0].name if files else "?"
                verdict.broke(
                    first, 1, "the trail's first lines were cut: its oldest line follows a line that no rotation said "
                    "it removed",
                )  # fmt: skip


def verify_trail(path: Path, verification_key: VerificationKey | None = None) -> Verdict:
    """Read every kept file of the trail at `path`, streamed, and check each link; and each seal, with the key."""
    verdict = Verdict(seals_checked=verification_key is not None)
    reading = _Reading(verdict, KeyChain(verification_key) if verification_key is not None else None)
    files = trail_files(path)
    verdict.files = [file.name for file in files]
    for line in trail_lines(path):
        reading.read(line)
    reading.finish(files)
    here = _sealing_key(path)  # the writer's key, when it is here, names the last seal it wrote
    if here is not None and here.sealed_line and here.sealed_line not in reading.seal_lines and verdict.files:
        verdict.broke(
            verdict.files[-1], 0,
            "the last seal is gone: the sealing key beside the trail names a seal that no file holds as written, "
            "so seals, and the lines they vouched for, were cut from the end, or the last seal's line was changed",
        )  # fmt: skip
    return verdict


def _timestamp(value: object) -> float | None:
    """A record's `time` as a Unix time (None: none, or not a time)."""
    if not isinstance(value, str):
        return None
    try:
        when = datetime.fromisoformat(value)
    except ValueError:
        return None
    return (when if when.tzinfo is not None else when.replace(tzinfo=UTC)).timestamp()


def _sealing_key(path: Path) -> SealingKey | None:
    if not sealing_key_path(path).is_file():
        return None
    try:
        return SealingKey.load(sealing_key_path(path))
    except (OSError, ValueError, KeyError, TypeError):
        return None
