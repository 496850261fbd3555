"""`sandbox-server audit verify`: whether an audit trail's chain holds, from its oldest kept file to its newest, and
where it breaks.

Each record names the hash of the line before it (sandbox_server.access.audit). Read in order (`audit.jsonl.N` …
`audit.jsonl.1`, `audit.jsonl`), a line whose link is not the hash of the line read before it is a break: that line
was changed, or lines were removed or added there. A line that names no link, after the chain began, is a break too
(added by hand); lines before the chain began (written by a version that kept none) are counted, not checked. The
oldest kept file may start after lines rotated away: said, not a break.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sandbox_server.access.audit import CHAIN_FIELD, FIRST, line_digest

__all__ = ["Break", "Verdict", "trail_files", "verify_trail"]


def trail_files(path: Path) -> list[Path]:
    """A trail's files, oldest first: its rotated files by number, then itself."""
    numbered = re.compile(rf"^{re.escape(path.name)}\.(\d+)$")
    rotated = sorted(
        (int(match.group(1)), sibling)
        for sibling in path.parent.glob(f"{path.name}.*")
        if (match := numbered.match(sibling.name))
    )
    return [sibling for _, sibling in reversed(rotated)] + ([path] if path.exists() else [])


@dataclass(frozen=True, slots=True)
class Break:
    """Where the chain does not hold: a file's line (from 1), and what is wrong there."""

    file: str
    line: int
    reason: str

    def said(self) -> str:
        return f"{self.file} line {self.line}: {self.reason}"


@dataclass(slots=True)
class Verdict:
    files: list[str] = field(default_factory=list)
    lines: int = 0
    unchained: int = 0
    """Lines written before the chain began (not checked)."""
    starts_after_rotated: bool = False
    first_time: str | None = None
    last_time: str | None = None
    breaks: list[Break] = field(default_factory=list)

    @property
    def holds(self) -> bool:
        return not self.breaks and bool(self.files)

    def as_json(self) -> dict[str, Any]:
        return {
            "holds": self.holds, "files": self.files, "lines": self.lines, "unchained_lines": self.unchained,
            "starts_after_rotated_lines": self.starts_after_rotated, "from": self.first_time, "to": self.last_time,
            "breaks": [{"file": b.file, "line": b.line, "reason": b.reason} for b in self.breaks],
        }  # fmt: skip


def _lines(path: Path) -> Iterator[bytes]:
    with open(path, "rb") as handle:
        yield from handle


def verify_trail(path: Path) -> Verdict:
    """Read every kept file of the trail at `path`, streamed, and check each link."""
    verdict = Verdict()
    previous: tuple[str, int, str] | None = None  # (file, line number, hash) of the last line read
    for file in trail_files(path):
        verdict.files.append(file.name)
        for number, raw in enumerate(_lines(file), start=1):
            verdict.lines += 1
            here = line_digest(raw)
            try:
                record = json.loads(raw)
                link = record.get(CHAIN_FIELD) if isinstance(record, dict) else None
            except ValueError:
                record, link = None, None
            if isinstance(record, dict) and isinstance(record.get("time"), str):
                verdict.first_time = verdict.first_time or record["time"]
                verdict.last_time = record["time"]
            if record is None:
                verdict.breaks.append(Break(file.name, number, "not a JSON record: written by hand, or cut short"))
            elif link is None:
                if previous is None or previous[2] == "":
                    verdict.unchained += 1
                    previous = (file.name, number, "")
                    continue
                verdict.breaks.append(Break(file.name, number, f"names no {CHAIN_FIELD}: added after the chain began"))
            elif previous is None or previous[2] == "":
                if link != FIRST and previous is None:
                    verdict.starts_after_rotated = True
            elif link != previous[2]:
                where = previous[0] if previous[0] != file.name else ""
                before = f"line {previous[1]}" + (f" of {where}" if where else "")
                verdict.breaks.append(
                    Break(
                        file.name,
                        number,
                        f"does not follow {before}: that line was changed, or lines were removed or added between them",
                    )
                )
            previous = (file.name, number, here)
    return verdict
