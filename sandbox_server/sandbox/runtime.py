"""The SandboxRuntime protocol: what tools need from a container engine."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Protocol

from sandbox_server.sandbox.spec import ExecutionResult, SandboxSpec

__all__ = ["ProgressCallback", "SandboxRuntime"]

ProgressCallback = Callable[[float, int, int, str], Awaitable[None]]
"""Called about once a second while a program runs: (elapsed_s, stdout_bytes, stderr_bytes, last_line), the
last line being the latest of either stream ("" before any)."""


class SandboxRuntime(Protocol):
    """Runs a spec in a fresh sandbox that is destroyed afterwards."""

    async def run(self, spec: SandboxSpec, on_progress: ProgressCallback | None = None) -> ExecutionResult:
        """Run one program; engine failures raise EngineError, program failures are data."""
        ...
