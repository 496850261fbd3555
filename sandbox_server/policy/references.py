"""Where a policy's files are: a policy by its shipped name or its path, a seccomp profile beside it, and a
reference as a file that outlives the command keeps it."""

from __future__ import annotations

import functools
import os
from pathlib import Path

from sandbox_server.shipped import policies_dir, seccomp_dir

__all__ = [
    "CASES_SUFFIX",
    "cases_path",
    "policy_path",
    "same_policy",
    "seccomp_path",
    "shipped_policies",
    "stored_reference",
]

CASES_SUFFIX = ".tests.yaml"
"""A policy's test cases are a file beside it: `strict.yaml`'s are `strict.tests.yaml` (`policy test`)."""


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


def same_policy(first: str, second: str | None) -> bool:
    """Whether two references name one policy file: `./team.yaml`, its absolute path and a link to it alike, and a
    shipped name and its file's path."""
    return second is not None and (first == second or _file_of(first) == _file_of(second))


@functools.lru_cache(maxsize=256)
def _file_of(reference: str) -> str:
    return os.path.realpath(policy_path(reference))


def seccomp_path(reference: str, relative_to: Path) -> Path:
    """A seccomp profile from a shipped name (`no-io-uring`) or a JSON file relative to the policy file."""
    if "/" not in reference and not reference.endswith(".json"):
        return seccomp_dir() / f"{reference}.json"
    path = Path(reference)
    return path if path.is_absolute() else relative_to / path


def shipped_policies() -> list[str]:
    """The names of the shipped policies (their test cases aside)."""
    return sorted(p.stem for p in policies_dir().glob("*.yaml") if not p.name.endswith(CASES_SUFFIX))


def cases_path(policy_file: Path) -> Path:
    """Where a policy's test cases are: beside it, named after it."""
    return policy_file.with_name(policy_file.name.rsplit(".", 1)[0] + CASES_SUFFIX)
