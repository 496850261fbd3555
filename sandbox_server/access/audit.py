"""The audit trail: one JSON line per call, appended and flushed before the result is returned."""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from sandbox_server.access.audit_seal import SEAL_EVENT, SealingKey, sealing_key_path, verification_key_path

__all__ = ["CHAIN_FIELD", "ROTATED_EVENT", "AuditLog", "Spent", "call_record", "event_record", "line_digest"]


CHAIN_FIELD = "previous_sha256"
"""Each record's link to the line before it: the SHA-256 of that line's bytes (its newline left out)."""
FIRST = "0" * 64
"""The link of a trail's very first line."""
ROTATED_EVENT = "audit_rotated_away"
"""The record a writer appends when rotation removes the oldest file: the link the oldest kept file now starts from,
so that a trail whose first lines were cut by anyone else is told from one rotated."""


def line_digest(line: bytes) -> str:
    """The hash the next record names: of one line as written, without its newline."""
    return hashlib.sha256(line.rstrip(b"\n")).hexdigest()


def last_line_digest(path: Path) -> str | None:
    """The hash of a file's last line (None: no file, or an empty one)."""
    try:
        with open(path, "rb") as handle:
            end = handle.seek(0, os.SEEK_END)
            block, tail = 1 << 16, b""
            while end > 0:
                start = max(0, end - block)
                handle.seek(start)
                tail = handle.read(end - start) + tail
                lines = tail.rstrip(b"\n").rsplit(b"\n", 1)
                if len(lines) == 2 or start == 0:
                    return line_digest(lines[-1]) if lines[-1] else None
                end = start
    except FileNotFoundError:
        return None
    return None


class AuditLog:
    """An append-only JSONL file, rotated by size and age (path.1 … path.N), each line chained to the one before it.

    Every record names the SHA-256 of the line written before it (`previous_sha256`), across rotations and restarts
    and whichever process wrote that line (writers take an exclusive lock on the file while they append), so a line
    changed, removed or added shows as a broken link where it was (`sandbox-server audit verify`). With sealing
    (`seal_interval_s` not None, and a sealing key beside the trail), a seal follows a record once the last seal is
    that old (sandbox_server.access.audit_seal).
    """

    def __init__(
        self, path: str | os.PathLike[str], max_bytes: int = 10_000_000, keep: int = 5, replica: str | None = None,
        max_age_s: float = 0.0, seal_interval_s: float | None = None,
    ) -> None:  # fmt: skip
        self.path = Path(path)
        self.seal_interval_s = seal_interval_s
        """Seal at most this long after a record (None: the trail is not sealed here); a running server's timer
        calls tick() at this interval."""
        self.max_age_s = max_age_s
        """Rotate once the file's first line is older than this (0: by size alone)."""
        self._born: tuple[int, float] | None = None
        """(the file's inode, when its first line was written)."""
        self.replica = replica
        """Replicas: each writes its own file, every line naming the replica that wrote it."""
        self.max_bytes = max_bytes
        self.keep = keep
        self._lock = threading.Lock()
        self._last: tuple[int, str] | None = None
        """(the file's size after this writer's last line, that line's hash)."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with contextlib.suppress(FileNotFoundError):
            os.chmod(self.path, 0o600)  # one an earlier version made readable by others

    def begin_sealing(self) -> Path | None:
        """Make the trail's sealing key when it is sealed and has none, and write its verification key once, beside
        the trail (mode 0400), for the operator to move elsewhere: that file's path then."""
        if self.seal_interval_s is None:
            return None
        with self._lock, open(self._lock_path(), "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            if sealing_key_path(self.path).exists():
                return None
            verification = SealingKey.create(sealing_key_path(self.path), int(self.seal_interval_s), time.time())[1]
            kept = verification_key_path(self.path)
            with contextlib.suppress(FileNotFoundError):
                kept.unlink()  # one of an earlier key, whose trail's key is gone: it verifies nothing now
            descriptor = os.open(kept, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o400)
            with open(descriptor, "w") as handle:
                handle.write(verification + "\n")
            return kept

    def tick(self) -> None:
        """On a timer, and as the server stops: seal the lines written since the last seal, and let the key of an
        epoch that ended go even when there is nothing to seal."""
        if self.seal_interval_s is None:
            return
        with self._lock, open(self._lock_path(), "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            key = SealingKey.load(sealing_key_path(self.path))
            if key is None:
                return
            previous = self._previous()
            if previous != FIRST and previous != key.sealed_line:
                self._seal(key, previous)
            elif key.advance(time.time()):
                key.save()

    def write(self, record: Mapping[str, Any]) -> None:
        """Append one record, linked to the line before it, and flush it to the disk; then a seal, when one is due."""
        with self._lock, open(self._lock_path(), "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # another process appending to this trail (a one-shot call) waits
            previous = self._previous()
            line = self._line(record, previous)
            dropped = self._rotate_if_needed(len(line))
            if dropped is not None:  # the oldest file went: say what the oldest kept one starts from
                said = {"time": _now(), "event": ROTATED_EVENT, "through_sha256": dropped}
                previous = self._append(self._line(said, previous))
                line = self._line(record, previous)
            previous = self._append(line)
            if self.seal_interval_s is not None:
                self._seal_if_due(previous)

    def _line(self, record: Mapping[str, Any], previous: str) -> bytes:
        if self.replica is not None:
            record = {**record, "replica": self.replica}
        body = json.dumps({**record, CHAIN_FIELD: previous}, ensure_ascii=False, separators=(",", ":"), default=str)
        return (body + "\n").encode("utf-8", "surrogatepass")

    def _append(self, line: bytes) -> str:
        """Append one line, flushed to the disk; its hash."""
        descriptor = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o600)
        with open(descriptor, "ab") as handle:  # the server's user alone reads who did what
            handle.write(line)
            handle.flush()
            os.fsync(handle.fileno())
            self._last = (handle.tell(), line_digest(line))
        return self._last[1]

    def _seal_if_due(self, previous: str) -> None:
        """A seal over the line just written, when the last is `seal_interval_s` old (the key's file says when)."""
        key = SealingKey.load(sealing_key_path(self.path))
        if key is not None and time.time() - key.sealed_at >= (self.seal_interval_s or 0.0):
            self._seal(key, previous)

    def _seal(self, key: SealingKey, previous: str) -> None:
        """Append the seal of the line hashed `previous`; the key is saved first, naming the seal's own line."""
        when = _now()
        seal = key.seal(when, time.time(), previous)
        line = self._line({"time": when, "event": SEAL_EVENT, "seal": seal}, previous)
        key.sealed_line = line_digest(line)
        key.save()
        self._append(line)

    def _lock_path(self) -> Path:
        return self.path.with_name(f".{self.path.name}.lock")

    def _previous(self) -> str:
        """The hash of the trail's last line: this writer's own when no one appended since, else read back (from
        the newest rotated file when the trail's file is new)."""
        try:
            size = self.path.stat().st_size
        except FileNotFoundError:
            size = 0
        if self._last is not None and self._last[0] == size and size:
            return self._last[1]
        for path in (self.path, self.path.with_name(f"{self.path.name}.1")):
            found = last_line_digest(path)
            if found is not None:
                return found
        return FIRST

    def _rotate_if_needed(self, incoming: int) -> str | None:
        """Rotate when the file is full or old; the link the oldest kept file starts from, when one was removed."""
        try:
            found = self.path.stat()
        except FileNotFoundError:
            return None
        if found.st_size + incoming <= self.max_bytes and not self._too_old(found.st_ino):
            return None
        oldest = self.path.with_name(f"{self.path.name}.{self.keep}")
        dropped = last_line_digest(oldest) if oldest.exists() else None
        for index in range(self.keep - 1, 0, -1):
            older = self.path.with_name(f"{self.path.name}.{index}")
            if older.exists():
                os.replace(older, self.path.with_name(f"{self.path.name}.{index + 1}"))
        os.replace(self.path, self.path.with_name(f"{self.path.name}.1"))
        return dropped

    def _too_old(self, inode: int) -> bool:
        """Whether the file's first line is older than max_age_s (read once per file: its `time`)."""
        if not self.max_age_s:
            return False
        if self._born is None or self._born[0] != inode:
            born = time.time()
            with contextlib.suppress(OSError, ValueError, TypeError, AttributeError), open(self.path, "rb") as handle:
                born = datetime.fromisoformat(json.loads(handle.readline())["time"]).timestamp()
            self._born = (inode, born)
        return time.time() - self._born[1] > self.max_age_s


def _now() -> str:
    return datetime.now(UTC).isoformat(timespec="milliseconds")


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
