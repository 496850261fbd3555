"""A call in a kept workspace: its files restored before it runs and saved after."""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING, Any

import anyio
import anyio.to_thread

from sandbox_server.sandbox import wire
from sandbox_server.sandbox.host_files import FileState
from sandbox_server.sandbox.runtime import NO_HOOKS, RunHooks, SandboxRuntime
from sandbox_server.sandbox.spec import ExecutionResult, SandboxSpec
from sandbox_server.workspaces.changes import changes_between
from sandbox_server.workspaces.store import WorkspaceRecord, WorkspaceStore

if TYPE_CHECKING:  # the PostgreSQL driver is imported only by a server given --state
    from sandbox_server.state.calls import SharedCall

__all__ = ["KeptWorkspace"]

WAIT_NOTED_S = 0.1
"""A cell that waited this long for the one before it says so in its answer."""


class KeptWorkspace:
    """A SandboxRuntime that runs each call in a kept workspace: restored before, saved after (side by side with
    the workspace's other calls where the store allows it)."""

    def __init__(
        self, inner: SandboxRuntime, store: WorkspaceStore, record: WorkspaceRecord, shared: SharedCall | None = None
    ) -> None:
        self.inner, self.store, self.record, self.shared = inner, store, record, shared
        self.notes: list[str] = []
        self.saved = False
        """Whether a call saved the workspace (its files, and so the caller's resources, may have changed)."""
        self.changes: dict[str, Any] | None = None
        """What the call changed in the workspace (workspaces.changes), once it ran."""
        self.size_bytes: int | None = None
        """What the workspace's files take as the call left them, once it ran."""
        self.deleted = False
        """The call deleted the workspace (the `workspaces` tool): its answer names none to continue."""

    @classmethod
    def open(
        cls,
        inner: SandboxRuntime,
        store: WorkspaceStore | None,
        requested: str | None,
        session: str | None,
        holder: str,
        tenant: str | None = None,
        shared: SharedCall | None = None,
        bookkeeping: bool = False,
    ) -> KeptWorkspace | None:
        """The kept workspace a call works in; None when nothing is kept (then an id is refused as unknown).
        `shared` is the replicas' side of the call (its admission may have read the record and taken its lock)."""
        if store is None:
            if requested is not None:
                raise WorkspaceStore.unknown(requested)
            return None
        record, notes = store.open(requested, session, holder, tenant, shared, bookkeeping)
        kept = cls(inner, store, record, shared)
        kept.notes.extend(notes)
        return kept

    def _begin(self, spec: SandboxSpec) -> tuple[SandboxSpec, dict[str, FileState]]:
        """The call's spec in the workspace, and its files as the call finds them (one trip to a thread)."""
        return self.store.begin(self.record, spec), self._states(spec)

    def _finish(self, spec: SandboxSpec, result: ExecutionResult) -> tuple[str | None, dict[str, FileState]]:
        """Keep what the call left, and its files as it left them."""
        return self.store.finish(self.record, result), self._states(spec)

    def _states(self, spec: SandboxSpec) -> dict[str, FileState]:
        """The workspace's files and their states; none looked at for a call that only reads (the files tool's
        read, find and grep): a walk of 10,000 files each side would be most of its time, to compare nothing."""
        return {} if spec.reads_only else self.store.states(self.record)

    async def run(self, spec: SandboxSpec, hooks: RunHooks = NO_HOOKS) -> ExecutionResult:
        """Run in the workspace as its previous call left it; keep it as this call leaves it."""
        alone = dict(spec.call_env).get(wire.KEEP_VARIABLES_ENV) == "1"  # kept variables: one cell at a time
        async with self.store.using(self.record, spec.limits.timeout_s, alone, self.shared) as waited:
            if alone and waited >= WAIT_NOTED_S:
                self.notes.append(
                    f"this cell waited {waited:.1f} s for the workspace's previous cell: cells that keep their "
                    "variables run one at a time in a workspace, so each sees the variables of the one before"
                )
            shaped, before = await anyio.to_thread.run_sync(self._begin, spec)
            result = await self.inner.run(shaped, hooks)
            problem, after = await anyio.to_thread.run_sync(self._finish, spec, result)
            self.changes = changes_between(before, after)
            held = self.record.size_bytes if spec.reads_only else sum(size for size, _, _ in after.values())
            self.saved, self.size_bytes = problem is None, held
            self.store.last_changes.remember(self.record.id, self.changes)
        notes = [*result.skipped_files, *self.notes]
        if problem is None and (result.timed_out or result.killed or result.oom_killed or result.flooded):
            notes.append("the workspace is kept as the program left it when it was stopped")
        return replace(result, skipped_files=tuple(notes), workspace=None, workspace_problem=problem)
