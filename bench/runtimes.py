"""What a sandbox costs to make through the engine against runc itself, in one run: the same hardened sandbox
(the default policy's profile, limits, read-only root, no network) running `true`, made through the Docker SDK
(create, start, wait, remove) and as an OCI bundle run by runc (create, start, wait, delete), alternating.
Wall time per sandbox (p50, p95) and the engine's CPU per sandbox: all the host ran meanwhile outside the
sandbox's own cgroup and this process (dockerd, containerd, the shim, runc, the kernel's work for them), read from
cgroups; and the sandbox's own beside it. Each path against the other.

    python -m bench runtimes [--rounds 40]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import docker
import psutil

from bench.common import median, print_table, write_results
from sandbox_server.policy.loader import load_policy
from sandbox_server.sandbox.engine.host_config import host_config_kwargs
from sandbox_server.sandbox.runc.bundles import image_root, write_bundle
from sandbox_server.sandbox.runc.state import CGROUP_PARENT
from sandbox_server.sandbox.spec import SandboxSpec
from sandbox_server.tools import all_tools

SANDBOX_CGROUPS = ("docker", CGROUP_PARENT)
"""Where the sandboxes run, the engine's and runc's: what is charged here is the sandbox's own (its init, its
programs, and the runtime's init once it joined), not the engine's."""


def cgroup_cpu(name: str = "") -> float:
    """CPU seconds charged to a cgroup and every cgroup ever under it (cgroup v1's cpuacct, or v2's cpu.stat; 0
    where there is none). The root's is everything the host ran, kernel threads included."""
    v1 = Path("/sys/fs/cgroup/cpuacct", name, "cpuacct.usage")
    if v1.exists():
        return int(v1.read_text()) / 1e9
    v2 = Path("/sys/fs/cgroup", name, "cpu.stat")
    if v2.exists():
        for line in v2.read_text().splitlines():
            if line.startswith("usage_usec "):
                return int(line.split()[1]) / 1e6
    if not name:  # no cgroup file for the root on v2: the kernel's own count of busy time
        ticks = [int(n) for n in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]]  # (guests are in user)
        return (sum(ticks) - ticks[3] - ticks[4]) / os.sysconf("SC_CLK_TCK")  # less idle and iowait
    return 0.0


@dataclass(frozen=True)
class EngineCpu:
    """A reading of what the host spent making and removing sandboxes: everything it ran, less the sandboxes' own
    cgroups, less the processes given (the server's own CPU, this process's), each in CPU seconds. Read from
    cgroups, not from the engine's processes: a container's shim is the child of PID 1, and what it and the runc
    it ran used is counted nowhere once it exits."""

    outside: float
    inside: float

    @classmethod
    def now(cls, *others: psutil.Process) -> EngineCpu:
        inside = sum(cgroup_cpu(name) for name in SANDBOX_CGROUPS)
        own = sum(times.user + times.system for times in (p.cpu_times() for p in (psutil.Process(), *others)))
        return cls(cgroup_cpu() - inside - own, inside)

    def since(self, earlier: EngineCpu) -> EngineCpu:
        return EngineCpu(self.outside - earlier.outside, self.inside - earlier.inside)

    def __add__(self, other: EngineCpu) -> EngineCpu:
        return EngineCpu(self.outside + other.outside, self.inside + other.inside)


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
    cgroup = f"/{CGROUP_PARENT}/bench-runtimes"  # where the server's own sandboxes go: theirs is counted apart
    bundle = write_bundle(folder / "bundle", spec, rootfs, ["true"], cgroups_path=cgroup)

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
    cpu: dict[str, EngineCpu] = {"engine": EngineCpu(0, 0), "runc": EngineCpu(0, 0)}
    for index in range(options.rounds):
        for path in ("engine", "runc") if index % 2 == 0 else ("runc", "engine"):
            before, began = EngineCpu.now(), time.perf_counter()
            through_engine() if path == "engine" else through_runc(index)
            walls[path].append((time.perf_counter() - began) * 1000)
            cpu[path] += EngineCpu.now().since(before)
    rows: list[list[Any]] = []
    for path in ("engine", "runc"):
        per = [round(cpu[path].outside * 1000 / options.rounds, 1), round(cpu[path].inside * 1000 / options.rounds, 1)]
        rows.append([path, median(walls[path]), _p95(walls[path]), *per])
    ratio = round(median(walls["engine"]) / median(walls["runc"]), 2)
    cpu_ratio = round(rows[1][3] / rows[0][3], 2)
    print_table(["path", "p50 ms", "p95 ms", "engine CPU ms per sandbox", "in the sandbox ms"], rows)
    print(f"runc is {ratio}x faster at p50; engine CPU, runc over engine: {cpu_ratio}")
    written = write_results(
        "runtimes",
        {
            "rounds": options.rounds,
            "paths": {
                row[0]: {"p50_ms": row[1], "p95_ms": row[2], "engine_cpu_ms": row[3], "sandbox_cpu_ms": row[4]}
                for row in rows
            },
            "p50_ratio_engine_over_runc": ratio,
            "engine_cpu_runc_over_engine": cpu_ratio,
        },
    )
    print(f"written to {written}")
    return 0
