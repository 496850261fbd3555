"""The audit trail: one JSON line per call, appended and flushed before the result is returned."""

from __future__ import annotations

import hashlib
import json
import os
import threading
from collections.abc import Mapping
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

__all__ = ["AuditLog", "call_record", "event_record"]


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

    def write(self, record: Mapping[str, Any]) -> None:
        """Append one record and flush it to the disk."""
        if self.replica is not None:
            record = {**record, "replica": self.replica}
        line = json.dumps(record, ensure_ascii=False, separators=(",", ":"), default=str) + "\n"
        with self._lock:
            self._rotate_if_needed(len(line.encode()))
            with open(self.path, "a", encoding="utf-8") as handle:
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
