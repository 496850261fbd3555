"""The SandboxRuntime protocol: what tools need from a container engine."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from contextvars import ContextVar
from typing import Protocol

from sandbox_server.sandbox.spec import ExecutionResult, SandboxSpec

__all__ = ["ADDRESS_WATCH", "ProgressCallback", "SandboxRuntime", "watch_address"]

ProgressCallback = Callable[[float, int, int, str], Awaitable[None]]
"""Called about once a second while a program runs: (elapsed_s, stdout_bytes, stderr_bytes, last_line), the
last line being the latest of either stream ("" before any)."""

ADDRESS_WATCH: ContextVar[Callable[[str], Callable[[], None]] | None] = ContextVar("address_watch", default=None)
"""Told the address of the call's sandbox before its program starts (the proxy's questions find the call by it);
what it returns ends the watch once the program has ended."""


def watch_address(address: str) -> Callable[[], None]:
    """Tell the call's watch (if any) its sandbox's address; what ends the watch."""
    watch = ADDRESS_WATCH.get()
    return watch(address) if watch is not None and address else (lambda: None)


class SandboxRuntime(Protocol):
    """Runs a spec in a fresh sandbox that is destroyed afterwards."""

    async def run(self, spec: SandboxSpec, on_progress: ProgressCallback | None = None) -> ExecutionResult:
        """Run one program; engine failures raise EngineError, program failures are data."""
        ...
