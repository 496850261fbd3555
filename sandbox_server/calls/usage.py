"""What each call used, in its answer and its audit record (`usage`; the Prometheus metrics count it from there, calls.metrics).

The sandbox's CPU time and peak memory come from its cgroup (sandbox.meter), network bytes from its proxy's
log, the workspace's size from its files after the call; the wall time is the call's, from its arrival to its
answer (a task's: from its start to its end).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from typing import Any

from sandbox_server.tools.base import ToolOutcome

__all__ = ["usage_of", "with_usage"]

_CARRIED = frozenset({"cpu_s", "peak_memory_bytes", "workspace_bytes"})
"""What the sandbox's part of the audit record carries to `usage` (and no further)."""


def usage_of(outcome: ToolOutcome, wall_s: float, task: bool) -> dict[str, Any]:
    """The `usage` object of a call's answer (refused calls ran nothing: only their wall time counts)."""
    audit: Mapping[str, Any] = outcome.audit or {}
    requests = (audit.get("network") or {}).get("requests") or []
    usage: dict[str, Any] = {
        "wall_s": round(max(wall_s, 0.0), 4),
        "cpu_s": audit.get("cpu_s"),
        "peak_memory_bytes": audit.get("peak_memory_bytes"),
        "network_in_bytes": sum(int(request.get("bytes_in") or 0) for request in requests),
        "network_out_bytes": sum(int(request.get("bytes_out") or 0) for request in requests),
    }
    if audit.get("workspace_bytes") is not None:
        usage["workspace_bytes"] = audit["workspace_bytes"]
    if task:
        usage["task"] = True
    return usage


def with_usage(outcome: ToolOutcome, wall_s: float, task: bool) -> ToolOutcome:
    """The outcome with what its call used in its answer (and so in its audit record, once, as `usage`)."""
    usage = usage_of(outcome, wall_s, task)
    audit = None if outcome.audit is None else {k: v for k, v in outcome.audit.items() if k not in _CARRIED}
    return replace(outcome, structured={**(outcome.structured or {}), "usage": usage}, audit=audit)
