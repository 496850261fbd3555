"""`python -m bench NAME [options]`: run one benchmark (see bench/README.md)."""

from __future__ import annotations

import importlib
import sys

BENCHMARKS = {
    "agent_shell": "bench.agent_shell",
    "analyze_csv": "bench.analyze_csv",
    "audit": "bench.audit",
    "csv_launcher": "bench.csv_launcher",
    "draining": "bench.draining",
    "forks": "bench.forks",
    "homes": "bench.homes",
    "humaneval": "bench.humaneval",
    "images": "bench.images",
    "kept_variables": "bench.kept_variables",
    "performance": "bench.performance",
    "queue": "bench.queue",
    "replicas": "bench.replicas",
    "runtimes": "bench.runtimes",
    "sandboxes": "bench.sandboxes",
    "sdk_floor": "bench.sdk_floor",
    "services": "bench.services",
    "sessions": "bench.sessions",
    "userns": "bench.userns",
    "views": "bench.views",
    "warm": "bench.warm",
    "warm_heap": "bench.warm_heap",
    "workspaces": "bench.workspaces",
}


def main() -> int:
    if len(sys.argv) < 2 or sys.argv[1] not in BENCHMARKS:
        print(f"usage: python -m bench {{{'|'.join(BENCHMARKS)}}} [options]", file=sys.stderr)
        return 2
    module = importlib.import_module(BENCHMARKS[sys.argv[1]])
    return int(module.main(sys.argv[2:]))


if __name__ == "__main__":
    sys.exit(main())
