"""The audit trail: one JSON line per call, appended and flushed before the result is returned."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

__all__ = ["AuditLog", "Spent", "call_record", "event_record"]


class AuditLog:
    """An append-only JSONL file, rotated by size (path.1 … path.N)."""

    def __init__(
        self, path: str | os.PathLike[str], max_bytes: int = 10_000_000, keep: int = 5, replica: str | None = None
    ) -> None:
        self.path = Path(path)
        self.replica = replica
        """Replicas: each writes its own file, every line naming the replica that wrote it."""
        self.max_bytes = max_bytes
        self.keep = keep
        self._lock = threading.Lock()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with contextlib.suppress(FileNotFoundError):
            os.chmod(self.path, 0o600)  # one an earlier version made readable by others

    def write(self, record: Mapping[str, Any]) -> None:
        """Append one record and flush it to the disk."""
        if self.replica is not None:
            record = {**record, "replica": self.replica}
        line = json.dumps(record, ensure_ascii=False, separators=(",", ":"), default=str) + "\n"
        with self._lock:
            self._rotate_if_needed(len(line.encode()))
            descriptor = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o600)
            with open(descriptor, "a", encoding="utf-8") as handle:  # the server's user alone reads who did what
                handle.write(line)
                handle.flush()
                os.fsync(handle.fileno())

    def _rotate_if_needed(self, incoming: int) -> None:
        try:
            size = self.path.stat().st_size
        except FileNotFoundError:
            return
        if size + incoming <= self.max_bytes:
            return
        for index in range(self.keep - 1, 0, -1):
            older = self.path.with_name(f"{self.path.name}.{index}")
            if older.exists():
                os.replace(older, self.path.with_name(f"{self.path.name}.{index + 1}"))
        os.replace(self.path, self.path.with_name(f"{self.path.name}.1"))


def call_record(
    client: str, tool: str, exposed_as: str, arguments: Mapping[str, Any], policy_name: str, policy_digest: str,
    include_arguments: bool,
) -> dict[str, Any]:  # fmt: skip
    """The start of a call's audit record: who called what, under which policy; the arguments only by hash."""
    encoded = json.dumps(arguments, ensure_ascii=False, sort_keys=True).encode("utf-8", "surrogatepass")
    record: dict[str, Any] = {
        "time": datetime.now(UTC).isoformat(timespec="milliseconds"),
        "client": client,
        "tool": tool,
        "exposed_as": exposed_as,
        "arguments_sha256": hashlib.sha256(encoded).hexdigest(),
        "arguments_bytes": len(encoded),
        "policy": policy_name,
        "policy_sha256": policy_digest,
    }
    if include_arguments:
        record["arguments"] = arguments
    return record


def event_record(event: str, **fields: Any) -> dict[str, Any]:
    """An audit line for something other than a call (a task's or a service's life): when, what, and its fields."""
    return {"time": datetime.now(UTC).isoformat(timespec="milliseconds"), "event": event, **fields}


@dataclass(frozen=True, slots=True)
class Spent:
    """What one audit record says was used: a call's `usage`, or a stopped service's (the Prometheus metrics and
    `sandbox-server usage` read records through this alone)."""

    service: bool
    wall_s: float
    cpu_s: float
    peak_memory_bytes: int | None
    network_in_bytes: int
    network_out_bytes: int
    task: bool

    @classmethod
    def of(cls, record: Mapping[str, Any]) -> Spent | None:
        """None for a record that spends nothing (the other events of tasks' and services' lives)."""
        event = record.get("event")
        if event not in (None, "service_stopped"):
            return None
        usage = record.get("usage") or {}
        peak = usage.get("peak_memory_bytes")
        return cls(
            service=event is not None,
            wall_s=float(usage.get("wall_s") or 0),
            cpu_s=float(usage.get("cpu_s") or 0),
            peak_memory_bytes=int(peak) if peak is not None else None,
            network_in_bytes=int(usage.get("network_in_bytes") or 0),
            network_out_bytes=int(usage.get("network_out_bytes") or 0),
            task=bool(usage.get("task")),
        )
