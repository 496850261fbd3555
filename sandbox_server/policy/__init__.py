"""Policies: what a sandbox may use and what callers may ask for. The model, loading a file (with `extends`,
checks against the schema and the host), explaining one, and watching its file for changes.

It may import network (allow lists), sandbox (container settings) and the top-level modules; tools,
workspaces, access and everything above import it.
"""

from sandbox_server.policy.model import (
    ApprovalSettings,
    AuditSettings,
    HostAdmission,
    Policy,
    RateLimits,
    ServiceSettings,
    TaskSettings,
    ToolPolicy,
    WorkspaceSettings,
)

__all__ = [
    "ApprovalSettings",
    "AuditSettings",
    "HostAdmission",
    "Policy",
    "RateLimits",
    "ServiceSettings",
    "TaskSettings",
    "ToolPolicy",
    "WorkspaceSettings",
]
