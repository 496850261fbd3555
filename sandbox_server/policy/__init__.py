"""Policies: what a sandbox may use and what callers may ask for."""

from sandbox_server.policy.model import (
    ApprovalSettings,
    AuditSettings,
    HostAdmission,
    Policy,
    RateLimits,
    ToolPolicy,
    WorkspaceSettings,
)

__all__ = [
    "ApprovalSettings",
    "AuditSettings",
    "HostAdmission",
    "Policy",
    "RateLimits",
    "ToolPolicy",
    "WorkspaceSettings",
]
