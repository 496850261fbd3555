"""The audit trail's chain: what linking each line to the one before costs a write, against the same line appended
and flushed without it (the write before the chain existed), in one run; and how fast `audit verify` reads.

    scripts/run bench audit [--writes 2000] [--verify-lines 100000]

The added cost is also given as a share of a spaced `true` call's p50 (bench/results/sandboxes.json, runc's path),
the call it is written for. Prints a table and writes bench/results/audit.json.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from bench.common import RESULTS, median, print_table, write_results
from sandbox_server.access.audit import AuditLog, line_digest
from sandbox_server.access.audit_verify import verify_trail

RECORD = {
    "time": "2026-11-28T10:00:00.000+00:00", "client": "bench", "tool": "execute_command", "policy": "default",
    "outcome": "ok", "usage": {"wall_s": 0.012, "cpu_s": 0.004}, "limits": {f"limit_{n}": n for n in range(16)},
}  # fmt: skip


def _plain_write(path: Path, line: str) -> None:
    """An append and a flush to the disk, as each audit line had before the chain."""
    descriptor = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o600)
    with open(descriptor, "a", encoding="utf-8") as handle:
        handle.write(line)
        handle.flush()
        os.fsync(handle.fileno())


def _timed(writes: int, write: Callable[[], None]) -> float:
    samples = []
    for _ in range(writes):
        started = time.perf_counter()
        write()
        samples.append(time.perf_counter() - started)
    return median([sample * 1e6 for sample in samples])


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench audit", description=__doc__.split("\n\n")[0])
    parser.add_argument("--writes", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--verify-lines", type=int, default=100_000)
    options = parser.parse_args(argv)
    chained: list[float] = []
    plain: list[float] = []
    line = json.dumps(RECORD, separators=(",", ":")) + "\n"
    with tempfile.TemporaryDirectory() as work:
        folder = Path(work)
        for number in range(options.rounds):
            log = AuditLog(folder / f"chained-{number}.jsonl", max_bytes=1 << 40)
            chained.append(_timed(options.writes, functools.partial(log.write, RECORD)))
            plain.append(
                _timed(options.writes, functools.partial(_plain_write, folder / f"plain-{number}.jsonl", line))
            )
        with open(folder / "long.jsonl", "ab") as handle:  # a long trail, linked as the server links it
            previous = "0" * 64
            for _ in range(options.verify_lines):
                written = (json.dumps({**RECORD, "previous_sha256": previous}, separators=(",", ":")) + "\n").encode()
                handle.write(written)
                previous = line_digest(written)
        started = time.perf_counter()
        verdict = verify_trail(folder / "long.jsonl")
        verify_s = time.perf_counter() - started
        assert verdict.holds and verdict.lines == options.verify_lines
    added_us = median(chained) - median(plain)
    sandboxes = RESULTS / "sandboxes.json"
    p50_ms = json.loads(sandboxes.read_text())["summary"]["runc"]["spaced_p50_ms"] if sandboxes.exists() else None
    share = round(added_us / 1000 / p50_ms * 100, 2) if p50_ms else None
    summary = {
        "chained_write_us": median(chained), "plain_write_us": median(plain), "added_us": round(added_us, 1),
        "true_spaced_p50_ms": p50_ms, "added_share_of_a_call_pct": share,
        "verify_lines": options.verify_lines, "verify_s": round(verify_s, 2),
    }  # fmt: skip
    print_table(["measure", "value"], [[name, value] for name, value in summary.items()])
    print(f"wrote {write_results('audit', {'summary': summary, 'runs': {'chained': chained, 'plain': plain}})}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
