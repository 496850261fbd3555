"""The SandboxRuntime protocol: what tools need from a container engine, and the hooks a call hands it."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Protocol

from sandbox_server.sandbox.spec import ExecutionResult, SandboxSpec
from sandbox_server.sandbox.streams import CappedBuffer

__all__ = ["NO_HOOKS", "ProgressCallback", "RunHooks", "SandboxRuntime"]

ProgressCallback = Callable[[float, int, int, str], Awaitable[None]]
"""Called about once a second while a program runs: (elapsed_s, stdout_bytes, stderr_bytes, last_line), the
last line being the latest of either stream ("" before any)."""


@dataclass(frozen=True, slots=True)
class RunHooks:
    """What one call wants to hear while its program runs, handed down with the spec (never set aside in a
    context variable: every hook a runtime calls is in its signature)."""

    progress: ProgressCallback | None = None
    output: Callable[[CappedBuffer, CappedBuffer], None] | None = None
    """Handed the program's stdout and stderr buffers as its sandbox starts (a task's output is read while it
    runs), to be read from any thread: their bytes are only ever appended and cut."""
    address: Callable[[str], Callable[[], None]] | None = None
    """Told the address of the call's sandbox before its program starts (the proxy's questions find the call by
    it); what it returns ends the watch once the program has ended."""

    def watch_address(self, address: str) -> Callable[[], None]:
        """Tell the address hook (if any) the sandbox's address; what ends the watch."""
        return self.address(address) if self.address is not None and address else (lambda: None)


NO_HOOKS = RunHooks()


class SandboxRuntime(Protocol):
    """Runs a spec in a fresh sandbox that is destroyed afterwards."""

    async def run(self, spec: SandboxSpec, hooks: RunHooks = NO_HOOKS) -> ExecutionResult:
        """Run one program; engine failures raise EngineError, program failures are data."""
        ...
