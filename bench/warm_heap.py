"""What a preloaded cell's process costs the machine to fork and to tear down: the warm template's heap as imported,
against the same heap made huge pages where it is in use (what warm templates do since: template.kernel.collapse_heap).

    scripts/run bench warm_heap [--forks 30] [--rounds 3]

Two interpreters of the python-data image (its own `python3`, chrooted into its unpacked root with a /proc of its
own) import the default policy's preload list and freeze their objects, as a warm template does; one then makes
its heap huge pages. Each, in turn, forks `--forks` children one after the other, each running a cell and exiting:
`1 + 1`, then a small pandas cell (a DataFrame made and summed). The CPU per child (the parent's and the child's,
from os.times) is the cost a call's process adds to the machine, fork to reap; the rounds alternate which goes
first. Also: how much each holds (RSS) and how much of it is huge pages. Medians of the rounds. Writes
bench/results/warm_heap.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
from pathlib import Path
from typing import Any

import docker

from bench.common import print_table, write_results
from sandbox_server.sandbox.runc.bundles import image_root
from sandbox_server.sandbox.runc.state import IMAGES

IMAGE = "sandbox-server/python-data:latest"
PRELOAD = "numpy, pandas, matplotlib, matplotlib.pyplot, duckdb, sklearn"
KERNEL = Path(__file__).parents[1] / "sandbox_server" / "sandbox" / "template" / "kernel.py"


def _program(way: str) -> str:
    """What an interpreter runs: the preload, the heap as `way` says, then rounds asked for on its stdin."""
    return f"""
import gc, json, os, sys, types
kernel = types.ModuleType("kernel")
exec(compile(open("/tmp/.bench-kernel.py").read(), "kernel.py", "exec"), kernel.__dict__)
import {PRELOAD}
gc.collect()
gc.freeze()
huge = kernel.collapse_heap(os.open("/proc/self/maps", os.O_RDONLY)) if {way == "huge"} else 0
CELLS = {{"1 + 1": "1 + 1", "pandas": "import pandas as pd\\nstr(pd.DataFrame({{'a': [1, 2, 3]}}).sum())"}}
def forked(count, cell):
    before = os.times()
    for _ in range(count):
        pid = os.fork()
        if pid == 0:
            gc.freeze()
            exec(compile(CELLS[cell], "<cell>", "exec"), {{}})
            os._exit(0)
        os.waitpid(pid, 0)
    after = os.times()
    spent = sum(after[:4]) - sum(before[:4])
    return 1000 * spent / count
print(json.dumps({{"ready": huge}}), flush=True)
for line in sys.stdin:
    count, cell = json.loads(line)
    with open("/proc/self/smaps_rollup") as rollup:
        said = {{f.split()[0][:-1]: int(f.split()[1]) for f in rollup if f.split()[0] in ("Rss:", "AnonHugePages:")}}
    print(json.dumps({{"cpu_ms": forked(count, cell), "rss_kib": said["Rss"], "huge_kib": said["AnonHugePages"]}}), flush=True)
"""


def _interpreter(root: Path, way: str) -> subprocess.Popen[str]:
    command = f'mount -t proc proc {root}/proc && exec chroot {root} /usr/bin/python3 -I -c "$0"'
    process = subprocess.Popen(
        ["unshare", "--mount", "--pid", "--fork", "sh", "-c", command, _program(way)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    assert process.stdout is not None
    json.loads(process.stdout.readline())
    return process


def _ask(process: subprocess.Popen[str], count: int, cell: str) -> dict[str, Any]:
    assert process.stdin is not None and process.stdout is not None
    process.stdin.write(json.dumps([count, cell]) + "\n")
    process.stdin.flush()
    return dict(json.loads(process.stdout.readline()))


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="bench warm_heap", description=__doc__.split("\n\n")[0])
    parser.add_argument("--forks", type=int, default=30)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args(argv)
    root = image_root(docker.from_env().api, IMAGE, IMAGES)
    (root / "tmp" / ".bench-kernel.py").write_text(KERNEL.read_text())
    ways = {way: _interpreter(root, way) for way in ("as imported", "huge")}
    seen: dict[tuple[str, str], list[dict[str, Any]]] = {}
    try:
        for round_ in range(args.rounds):
            for way in list(ways) if round_ % 2 == 0 else list(reversed(ways)):
                for cell in ("1 + 1", "pandas"):
                    seen.setdefault((way, cell), []).append(_ask(ways[way], args.forks, cell))
    finally:
        for process in ways.values():  # (its stdin's end ends it)
            assert process.stdin is not None
            process.stdin.close()
            process.wait()
        (root / "tmp" / ".bench-kernel.py").unlink(missing_ok=True)
    rows = {
        f"{way}, {cell}": {
            "cpu_ms_per_call": round(statistics.median(run["cpu_ms"] for run in runs), 2),
            "rss_mib": round(statistics.median(run["rss_kib"] for run in runs) / 1024),
            "huge_mib": round(statistics.median(run["huge_kib"] for run in runs) / 1024),
            "rounds_cpu_ms": [round(run["cpu_ms"], 2) for run in runs],
        }
        for (way, cell), runs in seen.items()
    }
    print_table(
        ["heap, cell", "CPU ms per fork+cell+exit", "template RSS MiB", "of it huge MiB"],
        [[name, row["cpu_ms_per_call"], row["rss_mib"], row["huge_mib"]] for name, row in rows.items()],
    )
    path = write_results("warm_heap", {"forks": args.forks, "rounds": args.rounds, "preload": PRELOAD, "rows": rows})
    print(f"written to {path}")
    return 0
