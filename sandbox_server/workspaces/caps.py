"""What a caller's workspaces, snapshots and exports may take together, and all of them on the host, against
workspace.storage_per_caller_mb and host.workspace_storage_mb: each counted at what its files take, and a
workspace whose calls write its files in place (a mounted one) at that plus a bounded reserve while a call or a
service works in it, since that call may write more (the kernel still stops each at its own size: the reserve is
what the caps hold back for it, not what it may take). Part of the store (WorkspaceStore), which holds the records,
the exports and their lock."""

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

__all__ = ["RESERVE_MIN_BYTES", "CappedWorkspaces", "bounded_reserve"]

RESERVE_MIN_BYTES = 256 * 1024 * 1024
"""The least a mounted workspace in use is counted above what its files take (or its whole size, if less)."""


def bounded_reserve(whole: int) -> int:
    """What the caps hold back for a mounted workspace's calls to write: an eighth of its size, at least 256 MiB, at
    most the whole (a 4 GiB workspace in use holding 18 MB counts 530 MB, not 4 GiB)."""
    return min(whole, max(RESERVE_MIN_BYTES, whole // 8))


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
        """What a workspace or snapshot is counted at while in use: where its calls write its files in place (a
        mounted one), what they take plus the bounded reserve, within its whole size; else what its files take."""
        whole = self.contents.reserve(self.settings)
        if not whole:
            return record.size_bytes
        return max(record.size_bytes, min(whole, record.size_bytes + bounded_reserve(whole)))

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
                f"the host's cap of {self.storage_bytes} (policy field host.workspace_storage_mb); {self._holders()}"
                + ("; retry when older workspaces have expired" if busy else ""),
                "host.workspace_storage_mb",
                kind="busy" if busy else "refused",
                retry_after_s=60 if busy else None,
            )

    def _holders(self) -> str:
        """The workspaces that hold the most of the host's cap, said for a refusal (under the lock)."""
        counted = sorted(((self._counted(r), r) for r in self._records.values()), key=lambda c: -c[0])[:3]
        said = []
        for size, record in counted:
            name = f"{'snapshot' if record.snapshot else 'workspace'} {record.name or record.id}"
            using = ""
            if self._in_use(record.id, opening=True):  # as `_counted` counts it
                services = [str(entry.get("name")) for entry in record.services if entry.get("name")]
                using = f" in use by its service{'s' if len(services) > 1 else ''} {', '.join(services)}"
                using = using if services else " in use (a call works in it)"
            said.append(f"{name}{using} counts {size} bytes")
        exports = self.exports.total()
        return "held most by: " + ", ".join(said + ([f"exports {exports} bytes"] if exports else []))

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
