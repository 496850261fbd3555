"""Static bearer tokens for small teams: who may call over HTTP, and under which policy.

The tokens file holds, per caller, a name, a policy and the SHA-256 of the caller's token,
never the token itself: `sandbox-server token add` prints a new token once and stores its
hash. `serve --transport http --tokens FILE` checks each request's `Authorization: Bearer`
against every stored hash in constant time, and reads the file again when it changes, so a
revoked token stops working at the next request. A file with an error leaves the previous
one in force and is logged with the field at fault.
"""

from __future__ import annotations

import contextlib
import datetime
import hashlib
import hmac
import json
import logging
import os
import re
import secrets
import tempfile
import threading
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass
from pathlib import Path

from sandbox_server.errors import ConfigError
from sandbox_server.policy.references import same_policy

__all__ = [
    "TOKEN_PREFIX", "Caller", "TokensFile", "add_caller", "caller_of", "new_caller", "read_callers", "revoke_caller",
    "token_digest",
]  # fmt: skip

log = logging.getLogger("sandbox_server")

TOKEN_PREFIX = "sbx_"
"""Tokens this server issues start with it, so a leaked one is recognised by secret scanners and people."""
NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._@-]{0,63}")
DIGEST = re.compile(r"[0-9a-f]{64}")


@dataclass(frozen=True, slots=True)
class Caller:
    """One holder of a token: its name (in the audit log), the policy its calls run under, the token's hash."""

    name: str
    policy: str
    sha256: str
    created: str


def token_digest(token: str) -> str:
    """The stored form of a token. A token carries 256 random bits, so a plain hash cannot be reversed."""
    return hashlib.sha256(token.encode("utf-8", "surrogateescape")).hexdigest()


def _caller(entry: object, index: int, errors: list[str]) -> Caller | None:
    field = f"tokens[{index}]"
    if not isinstance(entry, dict):
        errors.append(f"{field}: expected an object with name, policy, sha256 and created")
        return None
    problems = []
    name, policy, digest, created = (entry.get(key) for key in ("name", "policy", "sha256", "created"))
    if not isinstance(name, str) or not NAME.fullmatch(name):
        problems.append(f"{field}.name: {name!r} is not a caller name (letters, digits, . _ @ -, at most 64)")
    if not isinstance(policy, str) or not policy:
        problems.append(f"{field}.policy: expected a shipped policy name or a policy file")
    if not isinstance(digest, str) or not DIGEST.fullmatch(digest):
        problems.append(f"{field}.sha256: expected 64 lowercase hexadecimal digits (the token's SHA-256)")
    if not isinstance(created, str):
        problems.append(f"{field}.created: expected the time it was added")
    unknown = sorted(set(entry) - {"name", "policy", "sha256", "created"})
    if unknown:
        problems.append(f"{field}: unknown field(s) {', '.join(unknown)}")
    errors.extend(problems)
    return None if problems else Caller(str(name), str(policy), str(digest), str(created))


def read_callers(path: Path, check_policy: Callable[[str], str | None] = lambda policy: None) -> list[Caller]:
    """The callers of a tokens file; ConfigError naming the file and every field at fault.

    `check_policy` says what is wrong with a policy reference (None when it loads).
    """
    try:
        document = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ConfigError(
            f"{path}: no such tokens file (`sandbox-server token add NAME --tokens {path}` makes one)"
        ) from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ConfigError(f"{path}: cannot be read as JSON ({exc})") from None
    errors: list[str] = []
    entries = document.get("tokens") if isinstance(document, dict) else None
    if not isinstance(entries, list):
        raise ConfigError(f"{path}: tokens: expected a list of callers")
    callers = [caller for index, entry in enumerate(entries) if (caller := _caller(entry, index, errors))]
    seen: set[str] = set()
    for index, caller in enumerate(callers):
        if caller.name in seen:
            errors.append(f"tokens[{index}].name: {caller.name!r} appears twice")
        seen.add(caller.name)
        problem = check_policy(caller.policy)
        if problem is not None:
            errors.append(f"tokens[{index}].policy: {problem}")
    if errors:
        raise ConfigError(f"{path}: " + "; ".join(errors))
    return callers


def _write(path: Path, callers: Iterable[Caller]) -> None:
    """Replace the file at once (readers see the old file or the new one), readable by its owner only."""
    text = json.dumps({"tokens": [asdict(caller) for caller in callers]}, indent=2) + "\n"
    path.parent.mkdir(parents=True, exist_ok=True)
    handle, temporary = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(handle, "w", encoding="utf-8") as out:
            out.write(text)
        os.chmod(temporary, 0o600)
        os.replace(temporary, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(temporary)
        raise


def new_caller(name: str, policy: str, check_policy: Callable[[str], str | None]) -> tuple[Caller, str]:
    """A new caller, its name and policy checked, and its token (shown once; the caller keeps only its hash)."""
    if not NAME.fullmatch(name):
        raise ConfigError(f"NAME: {name!r} is not a caller name (letters, digits, . _ @ -, at most 64)")
    problem = check_policy(policy)
    if problem is not None:
        raise ConfigError(f"--policy: {problem}")
    token = TOKEN_PREFIX + secrets.token_urlsafe(32)
    created = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
    return Caller(name, policy, token_digest(token), created), token


def caller_of(callers: Iterable[Caller], token: str) -> Caller | None:
    """The caller whose token this is: every stored hash is compared, in constant time each."""
    digest = token_digest(token)
    found = None
    for caller in callers:
        if hmac.compare_digest(caller.sha256, digest):
            found = caller
    return found


def add_caller(path: Path, name: str, policy: str, check_policy: Callable[[str], str | None]) -> str:
    """Add a caller and return its new token (shown once; only its hash is kept)."""
    callers = read_callers(path, check_policy) if path.exists() else []
    if any(caller.name == name for caller in callers):  # a name in the file is a valid one
        raise ConfigError(f"{path}: a caller named {name!r} exists; `token revoke {name}` first to replace its token")
    caller, token = new_caller(name, policy, check_policy)
    _write(path, [*callers, caller])
    return token


def revoke_caller(path: Path, name: str) -> None:
    """Remove a caller: its token stops working at the next request a server with this file checks."""
    callers = read_callers(path)
    if not any(caller.name == name for caller in callers):
        raise ConfigError(f"{path}: no caller named {name!r} (`token list` names them)")
    _write(path, [caller for caller in callers if caller.name != name])


class TokensFile:
    """The tokens file a server checks: read again whenever it changes; one with an error keeps the last good."""

    def __init__(self, path: Path, check_policy: Callable[[str], str | None]) -> None:
        self.path = path
        self._check_policy = check_policy
        self._lock = threading.Lock()
        self._stamp = self._stat()
        self._callers = read_callers(path, check_policy)  # at start an error stops the server
        self._rejected: tuple[int, ...] | None = None

    def _stat(self) -> tuple[int, ...]:
        try:
            found = os.stat(self.path)
        except OSError:
            return ()
        return (found.st_ino, found.st_size, found.st_mtime_ns)

    def callers(self) -> list[Caller]:
        """The callers in force now."""
        stamp = self._stat()
        with self._lock:
            if stamp != self._stamp and stamp != self._rejected:
                try:
                    self._callers = read_callers(self.path, self._check_policy)
                    self._stamp, self._rejected = stamp, None
                    log.info("tokens file %s read again: %d caller(s)", self.path, len(self._callers))
                except ConfigError as exc:
                    self._rejected = stamp
                    log.warning("%s; the previous tokens stay in force", exc)
            return list(self._callers)

    def find(self, token: str) -> Caller | None:
        """The caller whose token this is (every stored hash compared, in constant time each)."""
        return caller_of(self.callers(), token)


def policies_said(callers: list[Caller], served: str) -> tuple[list[str], str | None]:
    """What a server says at its start of the policies its callers' tokens name: a line per policy with its callers,
    and a warning when some name another than the server's (their calls run under the token's policy)."""
    by_policy: dict[str, list[str]] = {}
    for caller in callers:
        by_policy.setdefault(caller.policy, []).append(caller.name)
    lines = [
        f"callers' policy {policy}: {len(names)} caller(s) ({', '.join(names[:5])}"
        + (f" and {len(names) - 5} more)" if len(names) > 5 else ")")
        for policy, names in by_policy.items()
    ]
    others = [policy for policy in by_policy if not same_policy(policy, served)]
    if not others:
        return lines, None
    count = sum(len(by_policy[policy]) for policy in others)
    return lines, (
        f"{count} caller(s) run under another policy than this server's {served}, as their tokens name it "
        f"({', '.join(others)}); `sandbox-server token add NAME --policy {served}` gives a caller the server's"
    )
