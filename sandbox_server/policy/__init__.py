"""Policies: what a sandbox may use and what callers may ask for."""

from sandbox_server.policy.model import AuditSettings, HostAdmission, Policy, RateLimits, ToolPolicy, WorkspaceSettings

__all__ = ["AuditSettings", "HostAdmission", "Policy", "RateLimits", "ToolPolicy", "WorkspaceSettings"]
