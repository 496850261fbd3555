"""Policies: what a sandbox may use and what callers may ask for."""

from sandbox_server.policy.model import Policy, ToolPolicy

__all__ = ["Policy", "ToolPolicy"]
