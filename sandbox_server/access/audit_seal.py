"""Forward-secure seals on the audit trail: a key of each epoch of time, evolved when the epoch ends, its past erased.

The chain of hashes (access/audit.py) shows a line changed, removed or added, unless whoever changed it recomputed
every link after it, which anyone who can write the file can do. Seals close that, as journald's Forward Secure
Sealing does. Time is cut into epochs of `seal_interval_s` from the key's start. At intervals (after a record once
the last seal is that old, on a timer while lines wait, and when the server stops) the writer appends a seal: an
HMAC-SHA256, under the current epoch's key, of the epoch, the seal's time and the hash of the line before it (which
the chain ties to every line before that). When an epoch ends its key is replaced on disk by the next one, the SHA-256
of it: the keys of past epochs are gone from the machine. The verification key is the first epoch's key with the
start and the interval (`<key>/<start>-<interval>`, hexadecimal, as journald writes its own); every later key is
derived from it. It is given to the operator once, to keep elsewhere (`audit verify --key`).

What it gives: whoever takes the machine during epoch N holds key N alone, so cannot make a seal of an earlier epoch;
a seal's time must fall in its epoch, and every line must be vouched for by a seal made soon after the line's own
time, so lines rewritten later, even with every seal after them remade, are found (sealed late). What it does not:
lines after the last seal are unvouched until the next (at most about one interval on a running server), and an
intruder can cut them, or add lines and seal them with the key it holds; lines sealed earlier in the current epoch
can be rewritten with that epoch's key; and the verification key, wherever it is kept, can forge every seal, so it
must not stay on the machine that writes the trail.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import json
import os
import secrets
from dataclasses import dataclass
from pathlib import Path

__all__ = [
    "SEAL_EVENT",
    "KeyChain",
    "SealingKey",
    "VerificationKey",
    "seal_mac",
    "sealing_key_path",
    "verification_key_path",
]

SEAL_EVENT = "audit_seal"
"""The `event` of a seal's line."""
KEY_BYTES = 32


def sealing_key_path(trail: Path) -> Path:
    """Where a trail's current sealing key is kept: beside it, readable by the server's user alone."""
    return trail.with_name(f".{trail.name}.seal-key")


def verification_key_path(trail: Path) -> Path:
    """Where the first server to seal a trail leaves its verification key, for the operator to move elsewhere."""
    return trail.with_name(f"{trail.name}.verification-key")


def evolve(key: bytes) -> bytes:
    """The next epoch's key: one way, so a key says nothing of the keys before it."""
    return hashlib.sha256(b"sandbox-server audit seal key\0" + key).digest()


def seal_mac(key: bytes, epoch: int, time: str, sealed_sha256: str) -> str:
    """A seal's HMAC: over its epoch, its time and the hash of the line it vouches for (and, through the chain, every
    line before it)."""
    message = f"{epoch}\0{time}\0{sealed_sha256}".encode()
    return hmac.new(key, message, hashlib.sha256).hexdigest()


@dataclass(slots=True)
class SealingKey:
    """The writer's side: the current epoch's key, on disk beside the trail, rewritten at each seal."""

    path: Path
    start: int
    """The first epoch's start (a Unix time, whole seconds)."""
    interval_s: int
    epoch: int
    key: bytes
    sealed_at: float = 0.0
    """When the last seal was written (a Unix time; 0: never)."""
    sealed_line: str = ""
    """The hash of the last seal's own line: lines after it wait for the next seal."""

    @classmethod
    def load(cls, path: Path) -> SealingKey | None:
        """The key as its file says (None: no file: the trail is not sealed)."""
        try:
            said = json.loads(path.read_text())
        except FileNotFoundError:
            return None
        return cls(
            path, int(said["start"]), int(said["interval_s"]), int(said["epoch"]), bytes.fromhex(said["key"]),
            float(said.get("sealed_at", 0)), str(said.get("sealed_line", "")),
        )  # fmt: skip

    @classmethod
    def create(cls, path: Path, interval_s: int, now: float) -> tuple[SealingKey, str]:
        """A new key, its first epoch starting now, and its verification key (to be kept elsewhere, not here)."""
        first = secrets.token_bytes(KEY_BYTES)
        made = cls(path, int(now), max(1, interval_s), 0, first)
        made.save()
        return made, f"{first.hex()}/{made.start:x}-{made.interval_s:x}"

    def epoch_at(self, now: float) -> int:
        return max(0, int(now - self.start) // self.interval_s)

    def seal(self, when: str, now: float, sealed_sha256: str) -> dict[str, object]:
        """The seal, in the current epoch, of the line hashed `sealed_sha256`; the keys of the epochs since the last
        seal are passed through and erased (the file is saved by the caller, with the seal's own line named)."""
        self.advance(now)
        self.sealed_at = now
        return {"epoch": self.epoch, "hmac_sha256": seal_mac(self.key, self.epoch, when, sealed_sha256)}

    def advance(self, now: float) -> bool:
        """Evolve past every epoch that has ended, erasing their keys; whether the key changed (then save it)."""
        moved = False
        while self.epoch < self.epoch_at(now):
            self.epoch, self.key, moved = self.epoch + 1, evolve(self.key), True
        return moved

    def save(self) -> None:
        """Replace the key file whole (written beside it, flushed, then renamed over it)."""
        body = json.dumps(
            {
                "start": self.start, "interval_s": self.interval_s, "epoch": self.epoch, "key": self.key.hex(),
                "sealed_at": self.sealed_at, "sealed_line": self.sealed_line,
            }
        ).encode()  # fmt: skip
        fresh = self.path.with_name(self.path.name + ".new")
        with contextlib.suppress(FileNotFoundError):
            fresh.unlink()
        descriptor = os.open(fresh, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
        try:
            os.write(descriptor, body)
            os.fsync(descriptor)
        finally:
            os.close(descriptor)
        os.replace(fresh, self.path)
        with contextlib.suppress(OSError):
            directory = os.open(self.path.parent, os.O_RDONLY | os.O_DIRECTORY)
            try:
                os.fsync(directory)
            finally:
                os.close(directory)


@dataclass(frozen=True, slots=True)
class VerificationKey:
    """The verifier's side: the first epoch's key, the start and the interval, as `<key>/<start>-<interval>`."""

    key: bytes
    start: int
    interval_s: int

    @classmethod
    def parse(cls, text: str) -> VerificationKey:
        """ValueError names what is wrong."""
        key, _, timing = text.strip().partition("/")
        start, _, interval = timing.partition("-")
        try:
            parsed = cls(bytes.fromhex(key), int(start, 16), int(interval, 16))
        except ValueError:
            parsed = None
        if parsed is None or len(parsed.key) != KEY_BYTES or parsed.interval_s < 1:
            raise ValueError("a verification key reads <64 hex digits>/<start>-<interval> (as `serve` wrote it)")
        return parsed

    def window(self, epoch: int) -> tuple[float, float]:
        """When a seal of this epoch may be made: [start, end)."""
        begins = self.start + epoch * self.interval_s
        return begins, begins + self.interval_s


class KeyChain:
    """Each epoch's key derived from the verification key, in order (a trail is read so)."""

    def __init__(self, verification: VerificationKey) -> None:
        self.verification = verification
        self._epoch, self._key = 0, verification.key

    def key_of(self, epoch: int) -> bytes | None:
        """Epoch `epoch`'s key (None for an epoch before the last asked: seals come in order)."""
        if epoch < self._epoch:
            return None
        while self._epoch < epoch:
            self._epoch, self._key = self._epoch + 1, evolve(self._key)
        return self._key
