"""Where a policy's files are: a policy by its shipped name or its path, a seccomp profile beside it, and a
reference as a file that outlives the command keeps it."""

from __future__ import annotations

from pathlib import Path

from sandbox_server.shipped import policies_dir, seccomp_dir

__all__ = ["policy_path", "seccomp_path", "stored_reference"]


def policy_path(reference: str, relative_to: Path | None = None) -> Path:
    """A policy file from a shipped name (`strict`) or a path."""
    if "/" in reference or reference.endswith((".yaml", ".yml")):
        path = Path(reference)
        if not path.is_absolute() and relative_to is not None:
            path = relative_to / path
        return path
    return policies_dir() / f"{reference}.yaml"


def stored_reference(reference: str) -> str:
    """A policy reference as a file that outlives the command keeps it: a shipped name as it is, a path made
    absolute (a relative one would be read from wherever the server that reads it was started)."""
    if "/" in reference or reference.endswith((".yaml", ".yml")):
        return str(Path(reference).resolve())
    return reference


def seccomp_path(reference: str, relative_to: Path) -> Path:
    """A seccomp profile from a shipped name (`no-io-uring`) or a JSON file relative to the policy file."""
    if "/" not in reference and not reference.endswith(".json"):
        return seccomp_dir() / f"{reference}.json"
    path = Path(reference)
    return path if path.is_absolute() else relative_to / path
