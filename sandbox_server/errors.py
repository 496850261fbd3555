"""The one exception tree of sandbox-server.

    SandboxServerError            anything the server itself cannot do
    ├── ConfigError               a policy or setting is invalid (names file and field)
    ├── EngineError               the container engine failed a request
    │   └── EngineUnavailable     no engine answers (down, restarting, wrong DOCKER_HOST)
    └── ImageError                a sandbox image is missing or failed to build

What the sandboxed program does (non-zero exit, timeout, out of memory, truncated
output) is never an exception: it is data in an ExecutionResult.
"""

__all__ = ["ConfigError", "EngineError", "EngineUnavailable", "ImageError", "SandboxServerError"]


class SandboxServerError(Exception):
    """Base of every error sandbox-server raises on purpose."""


class ConfigError(SandboxServerError):
    """A policy file or setting is invalid."""


class EngineError(SandboxServerError):
    """The container engine refused or failed a request."""


class EngineUnavailable(EngineError):
    """No container engine answers."""


class ImageError(SandboxServerError):
    """A sandbox image is missing, stale or failed to build."""
