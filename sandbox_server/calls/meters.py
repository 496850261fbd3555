"""Each call's usage counted for Prometheus, per caller and tool, in a registry of the server's own (served at
`/metrics` on the HTTP transport when it is given a token: protocol.metrics)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram

__all__ = ["Meters"]

MEMORY_BUCKETS = tuple(float(2**power) for power in range(24, 36, 2))
"""16 MiB to 16 GiB, by fours."""


class Meters:
    """Counters of calls and what they used (CPU seconds, wall seconds, network bytes, tasks' seconds) by caller
    and tool, and the sandboxes' peak memory by tool."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        by = ("caller", "tool")
        self.calls = Counter("sandbox_calls", "Tool calls, by their outcome", (*by, "outcome"), registry=self.registry)
        self.wall = Counter("sandbox_call_wall_seconds", "Wall time of calls", by, registry=self.registry)
        self.cpu = Counter("sandbox_call_cpu_seconds", "CPU time of calls' sandboxes", by, registry=self.registry)
        self.network = Counter(
            "sandbox_network_bytes", "Bytes through the egress proxy", (*by, "direction"), registry=self.registry
        )
        self.tasks = Counter("sandbox_task_seconds", "Wall time of calls run as tasks", by, registry=self.registry)
        self.services = Counter(
            "sandbox_service_seconds", "Running time of stopped services", ("caller", "tool"), registry=self.registry
        )
        self.service_cpu = Counter(
            "sandbox_service_cpu_seconds", "CPU time of stopped services", ("caller", "tool"), registry=self.registry
        )
        self.memory = Histogram(
            "sandbox_call_peak_memory_bytes", "Sandboxes' peak memory", ("tool",), buckets=MEMORY_BUCKETS,
            registry=self.registry,
        )  # fmt: skip

    def observe(self, record: Mapping[str, Any]) -> None:
        """Count one call from its audit record (its caller, tool, outcome and usage), or a stopped service from
        its audit event (other events count nothing)."""
        caller, tool = str(record.get("caller") or "-"), str(record.get("tool") or "-")
        usage = record.get("usage") or {}
        if "event" in record:
            if record["event"] == "service_stopped":
                self.services.labels(caller, tool).inc(float(usage.get("wall_s") or 0))
                self.service_cpu.labels(caller, tool).inc(float(usage.get("cpu_s") or 0))
            return
        self.calls.labels(caller, tool, str(record.get("outcome") or "cancelled")).inc()
        wall = float(usage.get("wall_s") or 0)
        self.wall.labels(caller, tool).inc(wall)
        self.cpu.labels(caller, tool).inc(float(usage.get("cpu_s") or 0))
        self.network.labels(caller, tool, "in").inc(int(usage.get("network_in_bytes") or 0))
        self.network.labels(caller, tool, "out").inc(int(usage.get("network_out_bytes") or 0))
        if usage.get("task"):
            self.tasks.labels(caller, tool).inc(wall)
        if usage.get("peak_memory_bytes") is not None:
            self.memory.labels(tool).observe(float(usage["peak_memory_bytes"]))
