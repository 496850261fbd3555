"""What a sandbox costs to make through the engine against runc itself, in one run: the same hardened sandbox
(the default policy's profile, limits, read-only root, no network) running `true`, made through the Docker SDK
(create, start, wait, remove) and as an OCI bundle run by runc (create, start, wait, delete), alternating.
Wall time per sandbox (p50, p95) and the engine's CPU per sandbox (dockerd, containerd, its shims and runc, from
/proc), each path against the other.

    python -m bench runtimes [--rounds 40]
"""

from __future__ import annotations

import argparse
import resource
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

import docker
import psutil

from bench.common import median, print_table, write_results
from sandbox_server.policy.loader import load_policy
from sandbox_server.sandbox.bundles import image_root, write_bundle
from sandbox_server.sandbox.host_config import host_config_kwargs
from sandbox_server.sandbox.spec import SandboxSpec
from sandbox_server.tools import all_tools

ENGINE = ("dockerd", "containerd", "containerd-shim", "containerd-shim-runc-v2", "runc")


def engine_cpu(names: tuple[str, ...] = ENGINE) -> float:
    """CPU seconds the processes so named (and the ones that ended, as far as their parents counted them) used."""
    used = 0.0
    for process in psutil.process_iter(["name", "cpu_times"]):
        if process.info["name"] in names and process.info["cpu_times"] is not None:
            times = process.info["cpu_times"]
            used += times.user + times.system + times.children_user + times.children_system
    return used


def _children_cpu() -> float:
    used = resource.getrusage(resource.RUSAGE_CHILDREN)
    return used.ru_utime + used.ru_stime


def _p95(values: list[float]) -> float:
    ordered = sorted(values)
    return round(ordered[min(len(ordered) - 1, int(len(ordered) * 0.95))], 3)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench runtimes")
    parser.add_argument("--rounds", type=int, default=40)
    options = parser.parse_args(argv)
    tool = load_policy("default", [t.name for t in all_tools()]).for_tool("execute_command")
    spec = SandboxSpec(
        image="sandbox-server/shell:latest", argv=("true",), limits=tool.limits, user=tool.user,
        seccomp_profile=tool.seccomp_profile,
    )  # fmt: skip
    api = docker.from_env().api
    folder = Path(tempfile.mkdtemp(prefix="bench-runtimes-"))
    rootfs = image_root(api, spec.image, folder / "images")
    bundle = write_bundle(folder / "bundle", spec, rootfs, ["true"])

    def through_engine() -> None:
        config = api.create_host_config(**host_config_kwargs(spec))
        created = api.create_container(spec.image, command=["true"], user=spec.user, host_config=config)
        api.start(created["Id"])
        api.wait(created["Id"])
        api.remove_container(created["Id"], force=True)

    def through_runc(index: int) -> None:
        subprocess.run(["runc", "run", "--bundle", str(bundle), f"bench-{index}"], check=True, capture_output=True)
        subprocess.run(["runc", "delete", "--force", f"bench-{index}"], check=False, capture_output=True)

    walls: dict[str, list[float]] = {"engine": [], "runc": []}
    cpu: dict[str, float] = {"engine": 0.0, "runc": 0.0}
    for index in range(options.rounds):
        for path in ("engine", "runc") if index % 2 == 0 else ("runc", "engine"):
            before, mine, began = engine_cpu(), _children_cpu(), time.perf_counter()
            through_engine() if path == "engine" else through_runc(index)
            walls[path].append((time.perf_counter() - began) * 1000)
            cpu[path] += engine_cpu() - before + _children_cpu() - mine  # (runc is this process's child)
    rows: list[list[Any]] = []
    for path in ("engine", "runc"):
        rows.append([path, median(walls[path]), _p95(walls[path]), round(cpu[path] * 1000 / options.rounds, 1)])
    ratio = round(median(walls["engine"]) / median(walls["runc"]), 2)
    print_table(["path", "p50 ms", "p95 ms", "engine CPU ms per sandbox"], rows)
    print(f"runc is {ratio}x faster at p50")
    written = write_results(
        "runtimes",
        {
            "rounds": options.rounds,
            "paths": {row[0]: {"p50_ms": row[1], "p95_ms": row[2], "engine_cpu_ms": row[3]} for row in rows},
            "p50_ratio_engine_over_runc": ratio,
        },
    )
    print(f"written to {written}")
    return 0
