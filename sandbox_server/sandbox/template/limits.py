"""The sandbox's resource limits that are the process's own (its cgroup's are the host's to set)."""

from __future__ import annotations

import resource
from collections.abc import Mapping, Sequence
from typing import Any

KINDS = {"RLIMIT_NOFILE": resource.RLIMIT_NOFILE, "RLIMIT_FSIZE": resource.RLIMIT_FSIZE,
         "RLIMIT_CORE": resource.RLIMIT_CORE, "RLIMIT_NPROC": resource.RLIMIT_NPROC}  # fmt: skip
"""The OCI config's rlimit types the sandbox's configs name."""


def rlimits(limits: Sequence[Mapping[str, Any]]) -> None:
    for limit in limits:
        resource.setrlimit(KINDS[limit["type"]], (int(limit["soft"]), int(limit["hard"])))
