"""Each call's usage counted for Prometheus, per caller and tool, in a registry of the server's own (served at
`/metrics` on the HTTP transport when it is given a token: protocol.metrics)."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from sandbox_server.access.audit import Spent

__all__ = ["Metrics", "StorageCollector"]

OUTCOMES = ("ok", "error", "refused", "cancelled", "awaiting_approval")
"""Every value of `sandbox_calls_total`'s outcome label, as the audit record says it (the page on meters lists each)."""

Holdings = Mapping[tuple[str | None, str], tuple[int, int]]
"""(caller, kind: workspace or snapshot) -> (how many, bytes), as the workspace store counts them."""

MEMORY_BUCKETS = tuple(float(2**power) for power in range(24, 36, 2))
"""16 MiB to 16 GiB, by fours."""


class Metrics:
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
        spent = Spent.of(record)
        if spent is None:
            return
        caller, tool = str(record.get("caller") or "-"), str(record.get("tool") or "-")
        if spent.service:
            self.services.labels(caller, tool).inc(spent.wall_s)
            self.service_cpu.labels(caller, tool).inc(spent.cpu_s)
            return
        self.calls.labels(caller, tool, str(record.get("outcome") or "cancelled")).inc()
        self.wall.labels(caller, tool).inc(spent.wall_s)
        self.cpu.labels(caller, tool).inc(spent.cpu_s)
        self.network.labels(caller, tool, "in").inc(spent.network_in_bytes)
        self.network.labels(caller, tool, "out").inc(spent.network_out_bytes)
        if spent.task:
            self.tasks.labels(caller, tool).inc(spent.wall_s)
        if spent.peak_memory_bytes is not None:
            self.memory.labels(tool).observe(float(spent.peak_memory_bytes))


class StorageCollector(Collector):
    """What each caller's kept workspaces and snapshots take, read from the store at each scrape (a gauge of the
    records as they are, not a counter of calls)."""

    def __init__(self, holdings: Callable[[], Holdings]) -> None:
        self.holdings = holdings

    def collect(self) -> Iterator[GaugeMetricFamily]:
        size = GaugeMetricFamily(
            "sandbox_workspace_bytes", "What a caller's kept workspaces or snapshots take (each at its whole size)",
            labels=("caller", "kind"),
        )  # fmt: skip
        count = GaugeMetricFamily(
            "sandbox_workspaces", "A caller's kept workspaces or snapshots", labels=("caller", "kind")
        )
        for (caller, kind), (many, held) in sorted(self.holdings().items(), key=lambda item: str(item[0])):
            size.add_metric((caller or "-", kind), float(held))
            count.add_metric((caller or "-", kind), float(many))
        yield size
        yield count
