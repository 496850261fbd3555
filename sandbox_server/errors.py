"""The one exception tree of sandbox-server.

    SandboxServerError            anything the server itself cannot do
    ├── Refusal                   a call not run: why, and the policy field (or argument) that decided it
    ├── UsageError                a command line asks for something impossible (exit code 2)
    ├── ConfigError               a policy or setting is invalid (names file and field)
    ├── EngineError               the container engine failed a request
    │   └── EngineUnavailable     no engine answers (down, restarting, wrong DOCKER_HOST)
    └── ImageError                a sandbox image is missing or failed to build

What the sandboxed program does (non-zero exit, timeout, out of memory, truncated
output) is never an exception: it is data in an ExecutionResult. A Refusal is raised
where the reason is found (arguments, policy, admission, paths) and becomes an
`isError` result in one place, the server's call handler, which also turns an engine
that does not answer into a refusal.
"""

from __future__ import annotations

from typing import Literal, get_args

__all__ = [
    "ERROR_KINDS",
    "ConfigError",
    "EngineError",
    "EngineUnavailable",
    "FailureKind",
    "ImageError",
    "Refusal",
    "RefusalKind",
    "SandboxServerError",
    "UsageError",
]


class SandboxServerError(Exception):
    """Base of every error sandbox-server raises on purpose."""


class UsageError(SandboxServerError):
    """A command line asks for something impossible."""


class ConfigError(SandboxServerError):
    """A policy file or setting is invalid."""


class EngineError(SandboxServerError):
    """The container engine refused or failed a request."""


class EngineUnavailable(EngineError):
    """No container engine answers."""


class ServerStopping(EngineError):
    """A sandbox asked for as the server stops (a warm pool's, ahead of calls): it is not made."""


class ImageError(SandboxServerError):
    """A sandbox image is missing, stale or failed to build."""


RefusalKind = Literal[
    "invalid_arguments",
    "refused",
    "declined",
    "busy",
    "rate_limited",
    "engine_unavailable",
    "engine_error",
    "network_unavailable",
]
"""Why a call was refused, or failed before the tool could answer."""
FailureKind = Literal["timed_out", "out_of_memory", "killed", "failed"]
"""Why a tool that answers with an error, rather than its output, failed (analyze_csv's)."""
ERROR_KINDS: tuple[str, ...] = (*get_args(RefusalKind), *get_args(FailureKind))
"""Every `structuredContent.error.kind` a result may carry: the tools' output schemas list these."""


class Refusal(SandboxServerError):
    """A call that is not run, and why; `field` names the policy field or argument that decided it."""

    def __init__(
        self,
        message: str,
        field: str | None = None,
        *,
        kind: RefusalKind = "refused",
        retry_after_s: float | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.field = field
        self.kind: RefusalKind = kind
        self.retry_after_s = retry_after_s
