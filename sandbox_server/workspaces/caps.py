"""What a caller's workspaces, snapshots and exports may take together, and all of them on the host, against
workspace.storage_per_caller_mb and host.workspace_storage_mb: each counted at what its files take, and a
workspace whose calls write its files in place (a mounted one) at its whole size while a call works in it, since
that call may fill it. Part of the store (WorkspaceStore), which holds the records, the exports and their lock."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TYPE_CHECKING

from sandbox_server.errors import Refusal
from sandbox_server.policy import WorkspaceSettings
from sandbox_server.workspaces.exports import Exports
from sandbox_server.workspaces.records import WorkspaceRecord

if TYPE_CHECKING:
    from sandbox_server.state.calls import SharedCall
    from sandbox_server.workspaces.contents import Contents

__all__ = ["CappedWorkspaces"]


class CappedWorkspaces:
    """The store's room: what is taken, and refusals past the caller's share and the host's cap (under the
    lock)."""

    _lock: threading.Lock
    _records: dict[str, WorkspaceRecord]
    settings: WorkspaceSettings
    storage_bytes: int
    exports: Exports
    contents: Contents
    _in_use: Callable[..., bool]
    """Whether a call works in a workspace (the store's own)."""
    callers_share_the_host: bool
    """Whether callers by token share this host (`serve --tokens` or `--issuer`): then a caller whose policy gives no
    share of its own (workspace.storage_per_caller_mb: 0) has half the host's cap, so that no one caller's forks,
    imports and exports leave the others no room."""

    def _fresh(self, workspace_id: str | None = None, shared: SharedCall | None = None) -> None:
        raise NotImplementedError

    def _at_most(self, record: WorkspaceRecord) -> int:
        """The most a workspace or snapshot may take: its whole size where its calls write its files in place (a
        mounted one), else what its files take."""
        return max(record.size_bytes, self.contents.reserve(self.settings))

    def _counted(self, record: WorkspaceRecord) -> int:
        """What a workspace or snapshot takes of the caps now (under the lock): the most it may take while a call
        works in it."""
        return self._at_most(record) if self._in_use(record.id, opening=True) else record.size_bytes

    def _within_share(self, tenant: str | None, more: int, what: str, besides: str | None = None) -> None:
        """Refuse `more` bytes for this caller past workspace.storage_per_caller_mb (under the lock); `besides`: a
        workspace whose size `more` replaces."""
        share = self.settings.storage_per_caller_mb * 1024 * 1024
        said = "policy field workspace.storage_per_caller_mb"
        if not share and self.callers_share_the_host:
            share = self.storage_bytes // 2
            said += " is 0: half of host.workspace_storage_mb, as callers by token share this host"
        if not share:
            return
        theirs = sum(self._counted(r) for r in self._records.values() if r.tenant == tenant and r.id != besides)
        theirs += self.exports.held_by(tenant)
        if theirs + more > share:
            raise Refusal(
                f"refused: {what}: this caller's workspaces, snapshots and exports would take {theirs + more} bytes, "
                f"above its share of {share} ({said}; each counted at what its files take, at its whole size while a "
                "call works in it, an export for an hour after it is made); delete some first",
                "workspace.storage_per_caller_mb",
            )

    def _held_bytes(self, besides: str | None = None) -> int:
        """What all workspaces, snapshots and live exports take of the host's cap (under the lock)."""
        return sum(self._counted(r) for r in self._records.values() if r.id != besides) + self.exports.total()

    def _within_host(self, more: int, what: str, busy: bool = False, besides: str | None = None) -> None:
        """Refuse `more` bytes past host.workspace_storage_mb (under the lock); `busy`: room may come once older
        workspaces expire; `besides`: a workspace whose size `more` replaces."""
        taken = self._held_bytes(besides) + more
        if taken > self.storage_bytes:
            raise Refusal(
                f"refused: {what}: all workspaces, snapshots and exports together would take {taken} bytes, above "
                f"the host's cap of {self.storage_bytes} (policy field host.workspace_storage_mb)"
                + ("; retry when older workspaces have expired" if busy else ""),
                "host.workspace_storage_mb",
                kind="busy" if busy else "refused",
                retry_after_s=60 if busy else None,
            )

    def holdings(self) -> dict[tuple[str | None, str], tuple[int, int]]:
        """Per caller and kind (workspace, snapshot): how many it holds and what their files take (the meters'
        gauge)."""
        with self._lock:
            self._fresh()
            held: dict[tuple[str | None, str], tuple[int, int]] = {}
            for r in self._records.values():
                key = (r.tenant, "snapshot" if r.snapshot else "workspace")
                many, size = held.get(key, (0, 0))
                held[key] = (many + 1, size + r.size_bytes)
        return held
