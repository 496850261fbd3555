"""A task as it is kept: one JSON file per task (and its output beside it), written whole and replaced, so a
restarted server finds every task as the last server left it; and the task as each MCP era writes it."""

from __future__ import annotations

import json
import os
import re
import time
import uuid
from dataclasses import asdict, dataclass, field, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

__all__ = ["TERMINAL", "TaskRecord", "TaskFiles", "new_task_id"]

TERMINAL = frozenset({"completed", "failed", "cancelled"})
"""The statuses a task never leaves."""
_ID = re.compile(r"^[0-9a-f]{8}-[0-9a-f]{4}-4[0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}$")


def new_task_id() -> str:
    """A task id nobody can guess (122 random bits)."""
    return str(uuid.uuid4())


@dataclass(frozen=True, slots=True)
class TaskRecord:
    """What is known of one task: whose it is, what it runs, where it stands and, once ended, how."""

    id: str
    holder: str
    """Whose task it is (Identity.holder: an authenticated caller, else the handshake session or the local user):
    to everyone else it does not exist. Records written before the name was settled call it `owner`."""
    caller: str
    """Who created it, as the audit record names them."""
    tool: str
    policy: str
    server: str
    """The server process that runs it (its owner label)."""
    created_at: float
    updated_at: float
    ttl_s: float
    poll_interval_ms: int
    status: str = "working"
    message: str = ""
    result: dict[str, Any] | None = None
    """The call's result as the tools/call answer would have been (completed)."""
    error: dict[str, Any] | None = None
    """The JSON-RPC error that ended it (failed)."""
    extra: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def of(cls, fields: dict[str, Any]) -> TaskRecord:
        """A record as a file or a row keeps it (an earlier version's `owner` read as `holder`)."""
        if "owner" in fields:
            fields = {("holder" if name == "owner" else name): value for name, value in fields.items()}
        return cls(**fields)

    @property
    def ended(self) -> bool:
        return self.status in TERMINAL

    def expired(self, now: float) -> bool:
        return now >= self.created_at + self.ttl_s

    def moved(self, status: str, message: str, **changes: Any) -> TaskRecord:
        """The record in a new status, updated now."""
        return replace(self, status=status, message=message, updated_at=time.time(), **changes)

    def wire(self, era_2026: bool, message: str | None = None) -> dict[str, Any]:
        """The task as the era writes it (2026-07-28 inlines the result or error of a finished task)."""
        said = self.message if message is None else message
        task: dict[str, Any] = {
            "taskId": self.id,
            "status": self.status,
            "createdAt": _iso(self.created_at),
            "lastUpdatedAt": _iso(self.updated_at),
        }
        if said:
            task["statusMessage"] = said
        if era_2026:
            task |= {"ttlMs": int(self.ttl_s * 1000), "pollIntervalMs": self.poll_interval_ms}
            if self.status == "completed" and self.result is not None:
                task["result"] = self.result
            if self.status == "failed" and self.error is not None:
                task["error"] = self.error
        else:
            task |= {"ttl": int(self.ttl_s * 1000), "pollInterval": self.poll_interval_ms}
        return task


class TaskFiles:
    """The folder of task records: `<id>.json` and `<id>.out` (its stdout and stderr as last read)."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        folder.mkdir(parents=True, exist_ok=True, mode=0o700)

    @staticmethod
    def valid(task_id: str) -> bool:
        """Whether an id is of the form this server makes (no other string touches the disk)."""
        return bool(_ID.match(task_id))

    def save(self, record: TaskRecord) -> None:
        self._write(self.folder / f"{record.id}.json", json.dumps(asdict(record), ensure_ascii=False).encode())

    def save_output(self, task_id: str, text: str) -> None:
        self._write(self.folder / f"{task_id}.out", text.encode("utf-8", "replace"))

    def output(self, task_id: str) -> str | None:
        try:
            return (self.folder / f"{task_id}.out").read_text("utf-8", "replace")
        except OSError:
            return None

    def load(self, task_id: str) -> TaskRecord | None:
        if not self.valid(task_id):
            return None
        try:
            return TaskRecord.of(json.loads((self.folder / f"{task_id}.json").read_text()))
        except (OSError, ValueError, TypeError):
            return None

    def all(self) -> list[TaskRecord]:
        found = []
        for path in sorted(self.folder.glob("*.json")):
            record = self.load(path.stem)
            if record is not None:
                found.append(record)
        return found

    def working(self) -> list[TaskRecord]:
        """The tasks that have not ended."""
        return [record for record in self.all() if not record.ended]

    def remove(self, task_id: str) -> None:
        for suffix in (".json", ".out"):
            (self.folder / f"{task_id}{suffix}").unlink(missing_ok=True)

    def _write(self, path: Path, data: bytes) -> None:
        partial = path.with_name(path.name + ".partial")
        descriptor = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(descriptor, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(partial, path)


def _iso(moment: float) -> str:
    return datetime.fromtimestamp(moment, UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")
