"""One tool call as it arrived: who asks, in which session, under which policy, for which tool, and how to reach
them while it runs. It is built once where the request comes in (the policy and the tool looked up once) and
handed down whole; nothing about a call is kept aside in a context variable.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any

from sandbox_server.access.admission import Waiting
from sandbox_server.access.approval import Approval
from sandbox_server.access.identity import Identity
from sandbox_server.calls.hosts import Question
from sandbox_server.policy import Policy, ToolPolicy
from sandbox_server.sandbox.runtime import ProgressCallback
from sandbox_server.sandbox.streams import CappedBuffer
from sandbox_server.tools import Tool

__all__ = ["AskApproval", "Call", "TaskStart", "branch_calls", "branching", "starts_sandbox"]

AskApproval = Callable[[Approval, Policy, dict[str, Any]], Awaitable[Any]]
"""Asks a person to approve a call (given what needs approval, the call's policy and its audit record): None
when they approved, a Refusal raised when not, or a question the call is answered with instead (the client asks
it and calls again with the answer)."""


@dataclass(frozen=True, slots=True)
class TaskStart:
    """A call that runs as a task: its id, what to do once it is past its checks and approval (from then on it is
    a task; a refusal before that answers the request itself), and who reads its output while it runs. It takes
    no slot of rate.concurrent_calls (the tasks' own caps counted it) and may run for up to limits.max_task_s."""

    id: str
    created: Callable[[], Awaitable[None]]
    output: Callable[[CappedBuffer, CappedBuffer], None] | None = None


@dataclass(frozen=True, slots=True)
class Call:
    """One call of the tool clients see as `exposed` (`tool` is None when its policy offers none such)."""

    exposed: str
    arguments: Mapping[str, Any]
    identity: Identity
    client: str
    """How the client names itself (for the audit record only)."""
    session: str | None
    """The handshake session whose workspace the call works in (None: the 2026-07-28 era, where a result's
    `workspace` id is passed back)."""
    policy: Policy
    """One policy for the whole call, even if a new one is swapped in meanwhile: the caller's, else the server's."""
    tool: Tool | None
    task: TaskStart | None = None
    progress: ProgressCallback | None = None
    waiting: Waiting | None = None
    """Hears how many calls are ahead while the call waits for a slot."""
    approval: AskApproval | None = None
    """Asks a person to approve the call when its policy says so (None: nobody can be asked)."""
    question: Question | None = None
    """Asks the person about a host the allow list does not name (None: nobody can be asked, `unable` says why)."""
    unable: str = ""
    in_task: bool = False
    """A call a task runs (a `branch` run as a task runs one per fork): it may ask for up to limits.max_task_s,
    and is admitted against its caller's limits as any call is."""

    @property
    def tool_policy(self) -> ToolPolicy:
        """The tool's part of the call's policy (a call of an unknown tool has none)."""
        assert self.tool is not None
        return self.policy.for_tool(self.tool.name)


def branch_calls(call: Call) -> int:
    """The calls a `branch` runs side by side (each a sandbox of its own); 1 for any other call."""
    asked = call.arguments.get("calls") if branching(call) else None
    return max(1, len(asked)) if isinstance(asked, list) else 1


def branching(call: Call) -> bool:
    """Whether a call is the `workspaces` tool's `branch`: it runs no sandbox of its own, and each call it runs in
    a fork is admitted as any call is (held itself, it would keep one of them waiting for its own slot)."""
    return call.tool is not None and call.tool.name == "workspaces" and call.arguments.get("action") == "branch"


def starts_sandbox(call: Call) -> bool:
    """Whether a call may start a sandbox: every tool's but the bookkeeping of workspaces and services (a
    workspace's `resume` starts its services again), which the host's load never refuses."""
    bookkeeping = call.tool is not None and not call.tool.sandbox
    return not bookkeeping or call.arguments.get("action") == "resume"
