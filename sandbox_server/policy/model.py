"""Frozen policy objects, built once; every limit's unit is in its name."""

from __future__ import annotations

from dataclasses import dataclass, field

from sandbox_server.sandbox.spec import ResourceLimits

__all__ = ["Policy", "ToolPolicy"]


@dataclass(frozen=True, slots=True)
class ToolPolicy:
    """What one tool runs in and may do."""

    image: str = "sandbox-server/base:latest"
    runtime: str = "runc"
    user: str = "1000:1000"
    limits: ResourceLimits = field(default_factory=ResourceLimits)
    max_timeout_s: float = 120.0
    """The most a caller may ask for with `timeout_s`; more is refused, never lowered."""
    allow_shell: bool = True
    max_argument_bytes: int = 16 * 1024 * 1024
    """Arguments larger than this (JSON-encoded) are refused before anything runs."""
    max_input_file_bytes: int = 64 * 1024 * 1024


@dataclass(frozen=True, slots=True)
class Policy:
    """A named set of tool policies with a default."""

    name: str = "default"
    default: ToolPolicy = field(default_factory=ToolPolicy)
    tools: tuple[tuple[str, ToolPolicy], ...] = ()

    def for_tool(self, tool_name: str) -> ToolPolicy:
        """The effective policy of one tool."""
        return dict(self.tools).get(tool_name, self.default)
