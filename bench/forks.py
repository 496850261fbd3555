"""Forks and snapshots of a kept workspace: how long one takes, what new disk it costs, and what the first call in a fork costs
beside the same call in the workspace it came from; for both ways of keeping (a mounted filesystem, an archive).

    scripts/run bench forks [--mib 1024] [--files 1000] [--forks 5]

The workspace is filled with `--mib` MiB of random bytes in `--files` files; each fork is one `workspaces` call
through the real client over stdio, timed end to end; the new disk is what the state folder's allocated blocks
grew by over the forks (`du`), divided by their count; the first call in each fork (`ls | wc -l`) is timed beside
the same call in the origin, one after the other; then as many snapshots of the origin are timed, and their new
disk counted the same way. The disk's sequential write speed is measured in the same run
(a file of the same size written and synced in the state folder), for a sense of what a full copy would take.
Last, a named fork is exported through the tool twice (answered once its file is written: first with the fork's
files read from the disk, then again from the page cache), then, the server stopped, exported to one file and
imported into another state folder with the command line, each timed whole (the interpreter's start included);
each export beside what the disk takes to write as much, measured right after the tool's exports. Writes
bench/results/forks.json.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import anyio
from mcp import Client

from bench.common import print_table, write_results
from bench.measure import percentiles
from sandbox_server.cli.client import server_parameters

POLICY = (
    "extends: default\nworkspace: {persist: true, size_mb: %(size)d, files: 20000, max_per_client: 64, "
    "named_per_caller: 64, snapshots_per_caller: 64}\ndefaults: {limits: {max_timeout_s: 600, memory_mb: %(memory)d}}\nhost: {workspace_storage_mb: 200000}\n"
)
COUNT = "ls | wc -l"


def allocated_kib(folder: Path) -> int:
    """What a folder's files take on the host's disk (allocated blocks, holes not counted; -x: not what is mounted
    under it, so a pool of images counts as its one file, whose clones share their blocks)."""
    os.sync()  # what is written but not yet on the disk (a fill's last 100s of MiB) is counted when it is written
    os.sync()  # (twice: a workspace's filesystem writes into its image, whose own filesystem then writes)
    said = subprocess.run(["du", "-skx", str(folder)], capture_output=True, text=True, check=True).stdout
    return int(said.split()[0])


def write_speed_mib_s(folder: Path, mib: int) -> float:
    """Sequential write speed of the disk under `folder`: `mib` MiB written and synced."""
    path = folder / "speed.bin"
    block = os.urandom(1 << 20)
    started = time.perf_counter()
    with open(path, "wb") as out:
        for _ in range(mib):
            out.write(block)
        out.flush()
        os.fsync(out.fileno())
    elapsed = time.perf_counter() - started
    path.unlink()
    return round(mib / elapsed, 1)


async def row(work: Path, keeping: str, mib: int, files: int, forks: int) -> dict[str, Any]:
    policy = work / f"{keeping}.yaml"
    # An archived workspace is a tmpfs in the sandbox, whose pages count against its memory.
    policy.write_text(POLICY % {"size": mib + mib // 4 + 64, "memory": mib + mib // 2 + 256})
    state = work / f"state-{keeping}"
    arguments = ["--policy", str(policy), "--state-dir", str(state), "--workspaces", keeping]
    per_file = mib * 1024 // files
    fill = f"for i in $(seq 1 {files}); do head -c {per_file}K /dev/urandom > f$i; done; {COUNT}"
    async with Client(server_parameters(arguments), mode="legacy") as client:
        filled = await client.call_tool("execute_command", {"command": fill, "timeout_s": 600})
        assert not filled.is_error, filled.content
        origin = filled.structured_content["workspace"] if filled.structured_content else ""
        counted = filled.structured_content["stdout"] if filled.structured_content else ""
        before = allocated_kib(state)
        forked, firsts, beside = [], [], []
        for index in range(forks):
            started = time.perf_counter()
            made = await client.call_tool("workspaces", {"action": "fork", "workspace": origin, "name": f"f{index}"})
            forked.append(time.perf_counter() - started)
            assert not made.is_error, made.content
            started = time.perf_counter()
            first = await client.call_tool("execute_command", {"command": COUNT, "workspace": f"f{index}"})
            firsts.append(time.perf_counter() - started)
            assert first.structured_content and first.structured_content["stdout"] == counted, first
            started = time.perf_counter()
            await client.call_tool("execute_command", {"command": COUNT, "workspace": origin})
            beside.append(time.perf_counter() - started)
        after = allocated_kib(state)
        snapshots = []
        for _ in range(forks):
            started = time.perf_counter()
            taken = await client.call_tool("workspaces", {"action": "snapshot", "workspace": origin})
            snapshots.append(time.perf_counter() - started)
            assert not taken.is_error, taken.content
        snapshotted = allocated_kib(state)
        tool_exports = []  # through the tool, answered once its file is written: first the fork's files read from
        for _ in range(2):  # the disk (a fork's pages were never read), then again with them in the page cache
            started = time.perf_counter()
            exported = await client.call_tool("workspaces", {"action": "export", "workspace": "f0"})
            tool_exports.append(time.perf_counter() - started)
            assert not exported.is_error, exported.content
        disk_mib_s = write_speed_mib_s(work, mib)  # the disk, measured beside the exports
    # A named fork outlives the session: exported to one file with the command line (the server stopped), then
    # imported into a state folder of its own.
    exported_s, exported_bytes = (
        _timed_cli(
            "workspace", "export", "f0", "-o", str(work / "f0.tar.zst"), *arguments[:4], "--workspaces", keeping
        ),
        (work / "f0.tar.zst").stat().st_size,
    )
    imported_s = _timed_cli(
        "workspace", "import", str(work / "f0.tar.zst"), "--name", "f0", "--policy", str(policy), "--state-dir",
        str(work / f"imported-{keeping}"), "--workspaces", keeping,
    )  # fmt: skip
    (work / "f0.tar.zst").unlink()
    return {
        "export_s": round(exported_s, 2),
        "tool_export_cold_s": round(tool_exports[0], 2),
        "tool_export_s": round(tool_exports[1], 2),
        "disk_write_mib_s": disk_mib_s,
        "export_file_mib": round(exported_bytes / 2**20, 1),
        "import_s": round(imported_s, 2),
        "fork": percentiles(forked),
        "new_disk_per_fork_mib": round((after - before) / 1024 / forks, 1),
        "snapshot": percentiles(snapshots),
        "new_disk_per_snapshot_mib": round((snapshotted - after) / 1024 / forks, 1),
        "first_call_in_fork": percentiles(firsts),
        "same_call_in_origin": percentiles(beside),
        "first_call_ratio": round(percentiles(firsts)["p50"] / percentiles(beside)["p50"], 2),
    }


def _timed_cli(*args: str) -> float:
    """How long one `sandbox-server` command took, whole (its interpreter's start included)."""
    started = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "sandbox_server", *args], capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr
    return time.perf_counter() - started


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench forks", description=__doc__.split("\n\n")[0])
    parser.add_argument("--mib", type=int, default=1024, help="what the workspace holds (default 1024 MiB)")
    parser.add_argument("--files", type=int, default=1000, help="in how many files (default 1000)")
    parser.add_argument("--forks", type=int, default=5, help="forks timed per way of keeping (default 5)")
    options = parser.parse_args(argv)
    report: dict[str, Any] = {"mib": options.mib, "files": options.files, "forks": options.forks}
    with tempfile.TemporaryDirectory(prefix="sandbox-bench-forks-") as folder:
        work = Path(folder)
        report["disk_write_mib_s"] = write_speed_mib_s(work, options.mib)
        for keeping in ("mounted", "archived"):
            print(f"{keeping} ...", flush=True)
            report[keeping] = anyio.run(row, work, keeping, options.mib, options.files, options.forks)
    table = [
        [keeping, report[keeping]["fork"]["p50"], report[keeping]["fork"]["p95"],
         report[keeping]["new_disk_per_fork_mib"], report[keeping]["first_call_in_fork"]["p50"],
         report[keeping]["same_call_in_origin"]["p50"], report[keeping]["first_call_ratio"],
         report[keeping]["snapshot"]["p50"], report[keeping]["new_disk_per_snapshot_mib"]]
        for keeping in ("mounted", "archived")
    ]  # fmt: skip
    print()
    print_table(["kept as", "fork p50 ms", "fork p95 ms", "new disk per fork MiB", "first call in fork p50 ms",
                 "same call in origin p50 ms", "ratio", "snapshot p50 ms", "new disk per snapshot MiB"],
                table)  # fmt: skip
    print(f"disk write speed at the start of the run: {report['disk_write_mib_s']} MiB/s")
    for keeping in ("mounted", "archived"):
        row_ = report[keeping]
        at_disk_speed = options.mib / row_["disk_write_mib_s"]
        for name in ("export", "tool_export", "tool_export_cold"):
            row_[f"{name}_vs_disk"] = round(row_[f"{name}_s"] / at_disk_speed, 2)
        print(
            f"{keeping}: the disk writes {options.mib} MiB in {at_disk_speed:.2f} s beside the exports; export through "
            f"the tool {row_['tool_export_s']} s ({row_['tool_export_vs_disk']}x; the first, its files read from the "
            f"disk, {row_['tool_export_cold_s']} s, {row_['tool_export_cold_vs_disk']}x); on the command line "
            f"{row_['export_s']} s, its start included ({row_['export_file_mib']} MiB file, {row_['export_vs_disk']}x), "
            f"import {row_['import_s']} s"
        )
    print(f"written: {write_results('forks', report)}")
    return 0
