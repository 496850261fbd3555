"""The audit trail's chain: what linking each line to the one before costs a write, against the same line appended
and flushed without it (the write before the chain existed), in one run; how fast `audit verify` reads; and how fast
`policy replay` judges a long trail again, and in how much memory (a tenth of the trail replayed beside it: the
memory a replay holds does not grow with the trail).

    scripts/run bench audit [--writes 2000] [--verify-lines 100000] [--replay-lines 100000]

The added cost is also given as a share of a spaced `true` call's p50 (bench/results/sandboxes.json, runc's path),
the call it is written for. Prints a table and writes bench/results/audit.json.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import subprocess
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


CALL = {
    "client": "bench", "caller": "ada", "exposed_as": "execute_command", "policy": "replayed", "arguments_bytes": 120,
    "outcome": "ok", "limits": {"timeout_s": 30, "memory_mb": 512, "output_bytes": 100000}, "run_ms": 240,
    "timed_out": False, "oom_killed": False, "stdout_bytes": 2000, "stderr_bytes": 0,
    "usage": {"wall_s": 0.3, "cpu_s": 0.1, "peak_memory_bytes": 40_000_000},
    "network": {"requests": [{"method": "CONNECT", "host": "pypi.org", "port": 443, "allowed": True, "status": 200,
                              "bytes_in": 9000, "bytes_out": 900}], "denied": []},
}  # fmt: skip
SHAPES = [
    ("execute_command", {"arguments": {"command": "pip ; grep ; wc"}}),
    ("execute_command", {"arguments": {"command": "curl", "args": []}}),
    ("run_python", {"arguments": {"timeout_s": 90}, "files": 2, "files_bytes": 4000, "executable_files": 0}),
    ("analyze_csv", {"arguments": {"filepath": "/workspace/a.csv", "operations": []}}),
]
CHANGED = """\
name: replayed
extends: default
defaults:
  limits: {timeout_s: 10, max_timeout_s: 60, memory_mb: 256}
  commands: {shell: false, allow: [grep, wc, curl]}
tools:
  execute_command:
    network: {allow: [files.pythonhosted.org]}
approval: {tools: [analyze_csv]}
"""
REPLAY = """\
import json, resource, sys, time
from sandbox_server.ops.replay import replay_trail
from sandbox_server.policy.loader import load_policy
from sandbox_server.tools import all_tools
from pathlib import Path
policy = load_policy(sys.argv[2], [tool.name for tool in all_tools()])
started = time.perf_counter()
found = replay_trail(Path(sys.argv[1]), policy)
print(json.dumps({"s": time.perf_counter() - started, "judged": found.judged, "changed": sum(found.counts.values()),
                  "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))
"""


def _replay_trail(path: Path, lines: int) -> None:
    """A trail of calls of several shapes, each judged again under CHANGED."""
    with open(path, "w") as handle:
        for number in range(lines):
            tool, judged = SHAPES[number % len(SHAPES)]
            time_of = f"2026-11-28T10:{number // 60000 % 60:02d}:{number // 1000 % 60:02d}.{number % 1000:03d}+00:00"
            handle.write(json.dumps({**CALL, "time": time_of, "tool": tool, "judged": judged}) + "\n")


def _replayed(trail: Path, policy: Path) -> dict[str, float]:
    """One replay in a process of its own: its time, what it judged, and the process's peak memory."""
    said = subprocess.run([sys.executable, "-c", REPLAY, str(trail), str(policy)], capture_output=True, text=True,
                          check=True)  # fmt: skip
    return dict(json.loads(said.stdout))


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
    parser.add_argument("--replay-lines", type=int, default=100_000)
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
        policy = folder / "replayed.yaml"
        policy.write_text(CHANGED)
        _replay_trail(folder / "replay.jsonl", options.replay_lines)
        _replay_trail(folder / "tenth.jsonl", options.replay_lines // 10)
        replays = [_replayed(folder / "replay.jsonl", policy) for _ in range(options.rounds)]
        tenth = _replayed(folder / "tenth.jsonl", policy)
        assert all(r["judged"] == options.replay_lines and r["changed"] for r in replays), replays
    added_us = median(chained) - median(plain)
    sandboxes = RESULTS / "sandboxes.json"
    p50_ms = json.loads(sandboxes.read_text())["summary"]["runc"]["spaced_p50_ms"] if sandboxes.exists() else None
    share = round(added_us / 1000 / p50_ms * 100, 2) if p50_ms else None
    summary = {
        "chained_write_us": median(chained), "plain_write_us": median(plain), "added_us": round(added_us, 1),
        "true_spaced_p50_ms": p50_ms, "added_share_of_a_call_pct": share,
        "verify_lines": options.verify_lines, "verify_s": round(verify_s, 2),
        "replay_lines": options.replay_lines, "replay_s": round(median([r["s"] for r in replays]), 2),
        "replay_changes": replays[0]["changed"], "replay_peak_rss_mb": round(replays[0]["peak_rss_mb"], 1),
        "replay_tenth_peak_rss_mb": round(tenth["peak_rss_mb"], 1),
    }  # fmt: skip
    print_table(["measure", "value"], [[name, value] for name, value in summary.items()])
    print(f"wrote {write_results('audit', {'summary': summary, 'runs': {'chained': chained, 'plain': plain}})}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
