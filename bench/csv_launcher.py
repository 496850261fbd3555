"""The analyze_csv launcher today against the launcher from before it detected encodings, number
styles, dates and containers, on the same ~1 GB UTF-8 file, in the same image, in the same run.

    scripts/run bench csv_launcher [--size-mb 1000] [--repeat 5]

Both launchers run in identical fresh containers of the python-data image (512 MiB, 2 CPUs, no
network, read-only root, the file mounted at /data), taking turns, so that the only difference
is the launcher's code. The earlier launcher is taken from the repository's history
(BEFORE_COMMIT) and mounted beside the image's own. The time is the launcher process's wall
time inside the container (interpreter start, imports, detection, the query), measured there
by a small wrapper: container start and removal are left out, since they are the same for both.
The answers of the two launchers are compared (up to float rounding: DuckDB's parallel sums
add in no fixed order).
"""

from __future__ import annotations

import argparse
import io
import json
import subprocess
import tarfile
import tempfile
from pathlib import Path
from typing import Any

import docker

from bench.analyze_csv import WORKLOADS, generate, same, sandbox_rows
from bench.common import median, print_table, write_results
from sandbox_server.sandbox import wire

BEFORE_COMMIT = "793d056c72fa44430f789d352f98a9895892fe5e"
"""The last commit before the launcher detected encodings (its python-data launcher and wire contract)."""
BEFORE_KEYS = (
    "encoding", "decimal", "thousands", "sheet", "period", "delimiter", "header", "header_row", "drop_totals",
    "skip_bad_rows",
)  # fmt: skip
"""Request keys the earlier launcher's contract does not have."""
IMAGE = "sandbox-server/python-data:latest"
NOW = f"/usr/local/lib/sandbox/{wire.ANALYZE_CSV.rsplit('/', 1)[-1]}"
BEFORE = "/opt/before/analyze_csv.py"
REPO = Path(__file__).resolve().parent.parent

TIMED = """
import json, subprocess, sys, time
started = time.perf_counter()
status = subprocess.run(["python3", sys.argv[1]], stdin=open("/request/request.json", "rb")).returncode
seconds = time.perf_counter() - started
with open(sys.argv[2], encoding="utf-8") as handle:
    answer = json.load(handle)
print(json.dumps({"seconds": seconds, "status": status, "answer": answer}))
"""
"""Runs a launcher on the mounted request and prints its wall time, exit status and answer."""


def before_launcher(target: Path) -> None:
    """The earlier launcher's files (and its wire contract, as the image names it) under `target`."""
    if not (REPO / ".git").exists():
        raise SystemExit("csv_launcher needs the repository's history (a git clone) for the earlier launcher")
    archive = subprocess.run(
        ["git", "-C", str(REPO), "archive", BEFORE_COMMIT, "images/python-data", "sandbox_server/sandbox/wire.py"],
        check=True,
        capture_output=True,
    ).stdout
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        for member in tar.getmembers():
            if member.isfile() and member.name.endswith(".py"):
                name = "sandbox_wire.py" if member.name.endswith("/wire.py") else Path(member.name).name
                source = tar.extractfile(member)
                assert source is not None
                (target / name).write_bytes(source.read())
    target.chmod(0o755)
    for path in target.iterdir():
        path.chmod(0o644)


def request(workload: dict[str, Any], earlier: bool) -> dict[str, Any]:
    """The request the server sends for `workload` (the earlier contract lacks the newer keys)."""
    document = {
        "path": "/data/big.csv",
        "roots": ["/data", "/workspace"],
        "operations": workload["operations"],
        "columns": workload["columns"],
        "group_by": workload.get("group_by", []),
        "max_groups": 50,
        "encoding": None,
        "decimal": None,
        "thousands": None,
        "sheet": None,
        "period": None,
        "plot": None,
        "image_bytes": 1 << 20,
        "max_bytes": 1 << 40,
        "max_line_bytes": 1 << 20,
        "policy": "bench",
        "delimiter": None,
        "header": None,
        "header_row": None,
        "drop_totals": False,
        "skip_bad_rows": True,
    }
    assert sorted(document) == sorted(wire.ANALYSIS_REQUEST_KEYS), "the bench's request is not the contract's"
    return {key: value for key, value in document.items() if not (earlier and key in BEFORE_KEYS)}


def run_once(
    client: docker.DockerClient, launcher: str, data: Path, before: Path, requests: Path, options: argparse.Namespace
) -> dict[str, Any]:
    """One launcher run in a fresh container: its seconds, exit status and answer."""
    container = client.containers.create(
        IMAGE,
        ["python3", "-c", TIMED, launcher, f"{wire.OUTPUT_DIR}/{wire.ANALYSIS_ANSWER}"],
        user="1000:1000",
        mem_limit=f"{options.memory_mb}m",
        memswap_limit=f"{options.memory_mb}m",
        nano_cpus=options.cpus * 1_000_000_000,
        network_mode="none",
        read_only=True,
        tmpfs={"/tmp": "size=256m", "/workspace": "size=64m,uid=1000,gid=1000"},
        volumes={
            str(data): {"bind": "/data", "mode": "ro"},
            str(before): {"bind": "/opt/before", "mode": "ro"},
            str(requests): {"bind": "/request", "mode": "ro"},
        },
    )
    try:
        container.start()
        status = container.wait()["StatusCode"]
        output = container.logs(stdout=True, stderr=False).decode()
        if status != 0:
            raise RuntimeError(f"{launcher} failed: {container.logs(stderr=True).decode()[-2000:]}")
        run: dict[str, Any] = json.loads(output.strip().splitlines()[-1])
        return run
    finally:
        container.remove(force=True)


def main(argv: list[str]) -> int:
    """Run both launchers in turn on each workload, print the table and write bench/results/csv_launcher.json."""
    parser = argparse.ArgumentParser(prog="python -m bench csv_launcher", description=__doc__.split("\n\n")[0])
    parser.add_argument("--size-mb", type=int, default=1000, help="size of the generated CSV (default 1000)")
    parser.add_argument("--repeat", type=int, default=5, help="runs of each launcher per workload (default 5)")
    parser.add_argument("--memory-mb", type=int, default=2048, help="the containers' memory limit (default 2048)")
    parser.add_argument("--cpus", type=int, default=2, help="the containers' CPUs (default 2)")
    options = parser.parse_args(argv)
    client = docker.from_env()
    report: dict[str, Any] = {}
    table = []
    with tempfile.TemporaryDirectory(prefix="sandbox-bench-launcher-", dir="/var/tmp") as work:
        root = Path(work)
        root.chmod(0o755)
        data, before = root / "data", root / "before"
        data.mkdir(mode=0o755)
        before.mkdir()
        before_launcher(before)
        print(f"generating {options.size_mb} MB of CSV ...", flush=True)
        rows = generate(data / "big.csv", options.size_mb)
        (data / "big.csv").chmod(0o644)
        for name, workload in WORKLOADS.items():
            requests = root / f"request-{name}"
            requests.mkdir(mode=0o755)
            seconds: dict[str, list[float]] = {"now": [], "before": []}
            answers: dict[str, Any] = {}
            for _ in range(options.repeat):
                for label, launcher in (("before", BEFORE), ("now", NOW)):
                    (requests / "request.json").write_text(json.dumps(request(workload, label == "before")))
                    (requests / "request.json").chmod(0o644)
                    run = run_once(client, launcher, data, before, requests, options)
                    if run["status"] != 0:
                        raise RuntimeError(f"the {label} launcher refused {name}: {run['answer']}")
                    seconds[label].append(run["seconds"])
                    answers[label] = sandbox_rows(run["answer"], workload)
            entry: dict[str, Any] = {
                "now_s": median(seconds["now"]),
                "before_s": median(seconds["before"]),
                "now_runs_s": [round(value, 3) for value in seconds["now"]],
                "before_runs_s": [round(value, 3) for value in seconds["before"]],
                "same_answers": same(answers["now"], answers["before"]),
            }
            entry["now_over_before"] = round(entry["now_s"] / entry["before_s"], 3)
            report[name] = entry
            table.append([name, entry["before_s"], entry["now_s"], entry["now_over_before"], entry["same_answers"]])
            print(f"  {name}: before {entry['before_s']} s, now {entry['now_s']} s", flush=True)
    print()
    print_table(["workload", "before s", "now s", "now / before", "same answers"], table)
    path = write_results(
        "csv_launcher",
        {
            "file": {"rows": rows, "size_mb": options.size_mb},
            "before_commit": BEFORE_COMMIT,
            "container": {"memory_mb": options.memory_mb, "cpus": options.cpus},
            "repeat": options.repeat,
            "workloads": report,
        },
    )
    print(f"\nwritten: {path}", flush=True)
    return 0 if all(entry["same_answers"] for entry in report.values()) else 1
