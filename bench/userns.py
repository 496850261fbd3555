"""The user namespace of a sandbox with host ids of its own (a shell's, on runc's and the template's paths): made by
the server's maker, against the way it was made before, a helper of three programs (`setpriv` to the range's first
id, which executes `unshare --user`, which executes `sh`), started for each.

    scripts/run bench userns [--count 200] [--rounds 3]

Each round makes `--count` namespaces each way, alternating which goes first, in this process (no server: this is
the server's own step, timed alone): each one made, its maps written and bound on a file, as a sandbox's is. Wall
time per namespace, and the machine's CPU per namespace (every core's busy time from /proc/stat, so the programs
the helper starts and the maker's children count). Medians of the rounds. Writes bench/results/userns.json.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench.common import print_table, write_results
from sandbox_server.sandbox import mounts
from sandbox_server.sandbox.runc import host_ids, userns_maker

FIRST = host_ids.first_id(host_ids.RANGES - 1)
"""A range no sandbox of a server takes while this runs (they are handed out from the lowest free one)."""


def by_three_programs(held: Path, first: int) -> None:
    """The way a namespace was made before the maker: a helper started per namespace, which so owns it."""
    helper = subprocess.Popen(
        ["setpriv", f"--reuid={first}", f"--regid={first}", "--clear-groups", "--",
         "unshare", "--user", "--", "sh", "-c", "echo made; read _"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
        cwd="/", env={"PATH": "/usr/bin:/bin"}, close_fds=True,
    )  # fmt: skip
    assert helper.stdin is not None and helper.stdout is not None
    try:
        if helper.stdout.readline() != b"made\n":
            raise OSError("unshare --user failed")
        userns_maker.hold(helper.pid, first, held)  # (as the maker's children's are)
    finally:
        helper.stdin.close()
        helper.wait()
        helper.stdout.close()


def busy_s() -> float:
    """Every core's busy time so far (not idle, not waiting for the disk)."""
    with open("/proc/stat") as stat:
        ticks = [int(field) for field in stat.readline().split()[1:]]
    return (sum(ticks) - ticks[3] - ticks[4]) / os.sysconf("SC_CLK_TCK")


def timed(make: Callable[[Path, int], None], folder: Path, count: int) -> tuple[float, float]:
    """Wall ms and machine CPU ms per namespace, over `count` made one after the other (then let go)."""
    started, busy = time.perf_counter(), busy_s()
    for number in range(count):
        make(folder / str(number), FIRST)
    wall, cpu = time.perf_counter() - started, busy_s() - busy
    for number in range(count):
        mounts.detach(str(folder / str(number)))
        (folder / str(number)).unlink()
    return 1000 * wall / count, 1000 * cpu / count


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="bench userns", description=__doc__.split("\n\n")[0])
    parser.add_argument("--count", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args(argv)
    ways: dict[str, Callable[[Path, int], None]] = {"maker": userns_maker.make, "three programs": by_three_programs}
    seen: dict[str, list[tuple[float, float]]] = {name: [] for name in ways}
    with tempfile.TemporaryDirectory() as folder:
        userns_maker.make(Path(folder) / "warm-up", FIRST)  # (the maker started once, as a server's first is)
        mounts.detach(str(Path(folder) / "warm-up"))
        for round_ in range(args.rounds):
            for name in list(ways) if round_ % 2 == 0 else list(reversed(ways)):
                seen[name].append(timed(ways[name], Path(folder), args.count))
    userns_maker.close()
    rows: dict[str, Any] = {}
    for name, runs in seen.items():
        rows[name] = {
            "wall_ms": round(statistics.median(wall for wall, _ in runs), 2),
            "machine_cpu_ms": round(statistics.median(cpu for _, cpu in runs), 2),
            "rounds": [[round(wall, 2), round(cpu, 2)] for wall, cpu in runs],
        }
    print_table(
        ["made by", "wall ms", "machine CPU ms"],
        [[name, row["wall_ms"], row["machine_cpu_ms"]] for name, row in rows.items()],
    )
    path = write_results("userns", {"count": args.count, "rounds": args.rounds, "per_namespace": rows})
    print(f"written to {path}")
    return 0
