"""A caller's kept workspaces by name: listed, named (kept past their session and restarts of the server, for
workspace.keep_s unused) and deleted at their caller's word. Part of the store (WorkspaceStore), which holds the
records and their lock."""

from __future__ import annotations

import secrets
import threading
import time
from dataclasses import replace
from typing import TYPE_CHECKING

from sandbox_server.errors import Refusal
from sandbox_server.policy import WorkspaceSettings
from sandbox_server.workspaces.contents import Contents
from sandbox_server.workspaces.naming import NAME_IN_WORDS, NAME_PATTERN
from sandbox_server.workspaces.records import WorkspaceRecord

if TYPE_CHECKING:
    from sandbox_server.state.calls import SharedCall

__all__ = ["NamedWorkspaces"]


class NamedWorkspaces:
    """The store's naming side (the store provides the records, their lock and what it means to be visible)."""

    _lock: threading.Lock
    _records: dict[str, WorkspaceRecord]
    _users: dict[str, int]
    settings: WorkspaceSettings
    storage_bytes: int
    contents: Contents

    # The store's own (WorkspaceStore):
    def _fresh(self, workspace_id: str | None = None, shared: SharedCall | None = None) -> None:
        raise NotImplementedError

    def _visible(self, record: WorkspaceRecord, session: str | None, tenant: str | None, now: float) -> bool:
        raise NotImplementedError

    def _expired(self, record: WorkspaceRecord, now: float) -> bool:
        raise NotImplementedError

    def _in_use(self, workspace_id: str) -> bool:
        raise NotImplementedError

    def _remove(self, workspace_id: str, later: bool = False) -> None:
        raise NotImplementedError

    def _write_record(self, record: WorkspaceRecord) -> None:
        raise NotImplementedError

    @staticmethod
    def unknown(requested: str) -> Refusal:
        raise NotImplementedError

    # Its naming side:
    def _named(self, name: str, tenant: str | None, now: float) -> WorkspaceRecord | None:
        """This caller's live workspace of that name (under the lock)."""
        self._fresh()
        found = [r for r in self._records.values() if r.name == name and r.tenant == tenant]
        return found[0] if found and not self._expired(found[0], now) else None

    def listed(self, session: str | None, tenant: str | None) -> list[WorkspaceRecord]:
        """The workspaces this caller may open now: its named ones, and this session's (or, without sessions, the
        unnamed ones it holds by id), most recently used first."""
        now = time.time()
        with self._lock:
            self._fresh()
            seen = [r for r in self._records.values() if self._visible(r, session, tenant, now)]
        return sorted(seen, key=lambda r: r.last_used, reverse=True)

    def keep(self, record: WorkspaceRecord, name: str, policy_name: str) -> WorkspaceRecord:
        """Name a workspace for its caller: its session goes on in it, but it outlives that session and restarts
        of the server, any session of the caller opens it by name, and it lasts workspace.keep_s unused. Refused, naming the field, past workspace.named_per_caller or for a name
        the caller already gave another workspace."""
        with self._lock:
            self._fresh()
            current = self._records.get(record.id)
            if current is None:
                raise self.unknown(record.id)
            self._may_name(current.tenant, name, policy_name, current)
            kept = replace(current, name=name, continued=True, last_used=time.time())  # its session goes on in it
            self._records[kept.id] = kept
            self._write_record(kept)
        return kept

    def _may_name(self, tenant: str | None, name: str, policy_name: str, taker: WorkspaceRecord | None) -> None:
        """Refuse a name this caller gave another workspace, or a new one past workspace.named_per_caller (under
        the lock). `taker`: the workspace that takes the name (None: a new one, a fork); a named one is renamed."""
        _check_name(name)
        taken = self._named(name, tenant, time.time())
        if taken is not None and (taker is None or taken.id != taker.id):
            raise Refusal(
                f"refused: this caller already has a workspace named {name!r} ({taken.id}); choose another name, "
                "or delete or rename that one first",
                "name",
            )
        if taker is None or taker.name is None:
            theirs = [r for r in self._records.values() if r.tenant == tenant and r.name is not None]
            most = self.settings.named_per_caller
            if len(theirs) >= most:
                raise Refusal(
                    f"refused: this caller keeps {len(theirs)} named workspaces, the most policy '{policy_name}' "
                    f"allows (field workspace.named_per_caller: {most}); delete one first",
                    "workspace.named_per_caller",
                )

    def fork(self, record: WorkspaceRecord, name: str | None, policy_name: str) -> WorkspaceRecord:
        """A new workspace of the same caller holding what `record` holds now (files and run_python's kept
        variables), named if `name` is given, else reached by its id from any session of that caller. Bounded as
        any new workspace is, but never by removing another: a fork past a cap is refused, naming the field."""
        now = time.time()
        with self._lock:
            self._fresh()
            current = self._records.get(record.id)
            if current is None:
                raise self.unknown(record.id)
            if name is not None:
                self._may_name(current.tenant, name, policy_name, None)
            else:
                theirs = [r for r in self._records.values() if r.holder == current.holder and r.name is None]
                most = self.settings.max_per_client
                if len(theirs) >= most:
                    raise Refusal(
                        f"refused: this client holds {len(theirs)} workspaces, the most policy '{policy_name}' "
                        f"allows (field workspace.max_per_client: {most}); a fork removes none to make room: delete "
                        "one, or fork under a name (workspace.named_per_caller)",
                        "workspace.max_per_client",
                    )
            taken = sum(r.size_bytes for r in self._records.values()) + current.size_bytes
            if taken > self.storage_bytes:
                raise Refusal(
                    f"refused: no fork: all workspaces together would take {taken} bytes, above the host's cap of "
                    f"{self.storage_bytes} (policy field host.workspace_storage_mb)",
                    "host.workspace_storage_mb",
                )
            fork = replace(
                current, id=f"ws-{secrets.token_urlsafe(16)}", session=None, created=now, last_used=now,
                continued=True, name=name,
            )  # fmt: skip
            self._records[fork.id] = fork  # held (in use) while its files are copied: no sweep takes it
            self._users[fork.id] = self._users.get(fork.id, 0) + 1
        try:
            self.contents.copy(current.id, fork.id)
        except BaseException:
            with self._lock:
                self._records.pop(fork.id, None)
            self.contents.remove(fork.id, later=True)
            raise
        finally:
            with self._lock:
                self._users[fork.id] -= 1
                if not self._users[fork.id]:
                    del self._users[fork.id]
        with self._lock:
            self._write_record(fork)
        return fork

    def forget(self, record: WorkspaceRecord) -> None:
        """Remove a workspace at its caller's word: its files, its name, its record."""
        with self._lock:
            if self._in_use(record.id):
                raise Refusal(
                    f"busy: another call is working in workspace {record.id}; retry when it has finished",
                    "workspace",
                    kind="busy",
                    retry_after_s=1,
                )
            self._remove(record.id, later=True)


def _check_name(name: str) -> None:
    if not NAME_PATTERN.fullmatch(name):
        raise Refusal(f"refused: {name!r} is not a workspace name: a name is {NAME_IN_WORDS}", "name")
