"""A caller's kept workspaces by name: listed, named (kept past their session and restarts of the server, for
workspace.keep_s unused) and deleted at their caller's word. Part of the store (WorkspaceStore), which holds the
records and their lock."""

from __future__ import annotations

import secrets
import threading
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

from sandbox_server.errors import Refusal
from sandbox_server.policy import WorkspaceSettings
from sandbox_server.state.folder import servers_folders
from sandbox_server.workspaces.caps import CappedWorkspaces
from sandbox_server.workspaces.compare import INDEX_BYTES, INDEX_PATH
from sandbox_server.workspaces.naming import ID_PATTERN, NAME_IN_WORDS, NAME_PATTERN
from sandbox_server.workspaces.records import FileBook, WorkspaceRecord

if TYPE_CHECKING:
    pass

__all__ = ["NamedWorkspaces", "counted", "named_elsewhere", "not_a_snapshot", "refuse_change"]


class NamedWorkspaces(CappedWorkspaces):
    """The store's naming side (the store provides the records, their lock and what it means to be visible)."""

    root: Path
    _lock: threading.Lock
    _records: dict[str, WorkspaceRecord]
    _users: dict[str, int]
    settings: WorkspaceSettings

    # The store's own (WorkspaceStore), declared for the naming side's use:
    _fresh: Callable[..., None]
    _visible: Callable[[WorkspaceRecord, str | None, str | None, float], bool]
    _expired: Callable[[WorkspaceRecord, float], bool]
    _remove: Callable[..., bool]
    _write_record: Callable[[WorkspaceRecord], None]
    unknown: Callable[[str], Refusal]
    names_elsewhere: Callable[[str, str | None], str | None] | None
    """Where else on this host a caller's name is kept, said when it is not kept here (`named_elsewhere`)."""

    # Its naming side:
    def _unknown_name(self, name: str, tenant: str | None) -> Refusal:
        """The answer for a name this caller has not given here: `unknown`, or where on this host it lives."""
        where = self.names_elsewhere(name, tenant) if self.names_elsewhere is not None else None
        if where is None:
            return self.unknown(name)
        return Refusal(f"refused: unknown workspace {name!r} here: {where}", "workspace")

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
        self._name_free(tenant, name, taker)
        if taker is None or taker.name is None:
            theirs = [r for r in self._records.values() if r.tenant == tenant and r.name is not None and not r.snapshot]
            _below(len(theirs), self.settings.named_per_caller, "named workspaces", policy_name, "named_per_caller")

    def fork(self, record: WorkspaceRecord, name: str | None, policy_name: str) -> WorkspaceRecord:
        """A new workspace of the same caller holding what `record` holds now (files and run_python's kept
        variables), named if `name` is given, else reached by its id from any session of that caller. Bounded as
        any new workspace is, but never by removing another: a fork past a cap is refused, naming the field. A
        snapshot forks as its restore into a new workspace."""
        with self._lock:
            current = self._current(record)
            self._may_hold_new(current.tenant, current.holder, name, policy_name, "a fork")
            made = self._begin_copy(current, name, snapshot=False)
        return self._copy(current, made)

    def _may_hold_new(self, tenant: str | None, holder: str, name: str | None, policy_name: str, what: str) -> None:
        """Refuse a new workspace that removes none to make room (a fork, an import) past workspace.named_per_caller
        when it is named, else past workspace.max_per_client (under the lock)."""
        if name is not None:
            self._may_name(tenant, name, policy_name, None)
            return
        theirs = [r for r in self._records.values() if r.holder == holder and counted(r)]
        _below(
            len(theirs), self.settings.max_per_client, "workspaces", policy_name, "max_per_client",
            f"; {what} removes none to make room: delete one, or give it a name (workspace.named_per_caller)",
            who="this client holds",
        )  # fmt: skip

    def snapshot(self, record: WorkspaceRecord, name: str | None, policy_name: str) -> WorkspaceRecord:
        """A copy of what `record` holds now (its files and run_python's kept variables), kept as it is: no call
        works in it; it is restored into a new workspace or the same one, and lasts workspace.keep_s from now.
        Refused, naming the field, past workspace.snapshots_per_caller."""
        with self._lock:
            current = self._current(record)
            if current.snapshot:
                raise Refusal(f"refused: {current.id} is a snapshot already; restore it to work in it", "workspace")
            if name is not None:
                self._name_free(current.tenant, name, None)
            theirs = [r for r in self._records.values() if r.tenant == current.tenant and r.snapshot]
            _below(len(theirs), self.settings.snapshots_per_caller, "snapshots", policy_name, "snapshots_per_caller")
            made = self._begin_copy(current, name, snapshot=True)
        return self._copy(current, made)

    def restore(self, snapshot: WorkspaceRecord, into: WorkspaceRecord) -> WorkspaceRecord:
        """Make `into`'s files and kept variables the snapshot's (what it held is gone), when no call works in
        it but this one; its name, owner and lifetime stay."""
        with self._lock:
            source = self._current(snapshot)
            target = self._current(into)
            refuse_change(target, self._in_use(target.id))
            self._users[target.id] = self._users.get(target.id, 0) + 1
        try:
            self.contents.remove(target.id)
            self.contents.copy(source.id, target.id)
            self.contents.ready(target.id)
        finally:
            with self._lock:
                self._users[target.id] -= 1
                if not self._users[target.id]:
                    del self._users[target.id]
        with self._lock:
            restored = replace(
                target, size_bytes=source.size_bytes, origin=source.id, last_used=time.time(), services=source.services
            )
            self._records[restored.id] = restored
            self._write_record(restored)
        return restored

    def resolve(self, requested: str, session: str | None, tenant: str | None) -> WorkspaceRecord:
        """A workspace or snapshot this caller may see, by its id or its name (the one answer for every other
        case: unknown)."""
        now = time.time()
        with self._lock:
            if NAME_PATTERN.fullmatch(requested):
                found = self._named(requested, tenant, now)
            else:
                self._fresh(requested if ID_PATTERN.fullmatch(requested) else None)
                found = self._records.get(requested)
            if found is None and NAME_PATTERN.fullmatch(requested):
                raise self._unknown_name(requested, tenant)
            if found is None or not self._visible(found, session, tenant, now):
                raise self.unknown(requested)
        return found

    def whose(self, requested: str, session: str | None, tenant: str | None) -> str | None:
        """For the audit trail alone (a caller is told `unknown` whatever the case): what a workspace id a call was
        refused is, when it is a live one that is not this caller's, or not this session's."""
        if not ID_PATTERN.fullmatch(requested):
            return None  # names are each caller's own: another's name is no one's here
        with self._lock:
            self._fresh(requested)
            found = self._records.get(requested)
        if found is None or self._expired(found, time.time()):
            return None
        if found.tenant != tenant:
            return "workspace of another caller"
        if found.session not in (None, session) and found.name is None:
            return "workspace of another session"
        return None

    def variables_index(self, record: WorkspaceRecord) -> bytes | None:
        """run_python's index of a workspace's kept variables, as the sandbox wrote it (None: none, or too large)."""
        try:
            found = self.contents.read_file(record.id, INDEX_PATH, INDEX_BYTES)
        except Refusal:
            return None
        return found[1] if found is not None else None

    def _current(self, record: WorkspaceRecord) -> WorkspaceRecord:
        """The record as it is now (under the lock)."""
        self._fresh()
        current = self._records.get(record.id)
        if current is None:
            raise self.unknown(record.id)
        return current

    def _name_free(self, tenant: str | None, name: str, taker: WorkspaceRecord | None) -> None:
        """Refuse a name that is not a name, or one this caller gave another workspace or snapshot than `taker`
        (under the lock)."""
        _check_name(name)
        taken = self._named(name, tenant, time.time())
        if taken is not None and (taker is None or taken.id != taker.id):
            raise Refusal(
                f"refused: this caller already has a workspace named {name!r} ({taken.id}); choose another name, "
                "or delete or rename that one first",
                "name",
            )

    def _begin_copy(self, current: WorkspaceRecord, name: str | None, snapshot: bool) -> WorkspaceRecord:
        """The record of a copy of `current`, held (in use) while its files are copied: no sweep takes it (under
        the lock); refused when the host's cap has no room for it."""
        self._within_share(current.tenant, current.size_bytes, "no copy")
        self._within_host(current.size_bytes, "no copy")
        now = time.time()
        made = replace(
            current, id=f"ws-{secrets.token_urlsafe(16)}", session=None, created=now, last_used=now,
            continued=True, name=name, origin=current.id, snapshot=snapshot, paused=False,
        )  # fmt: skip
        self._records[made.id] = made
        self._users[made.id] = self._users.get(made.id, 0) + 1
        return made

    def _copy(self, current: WorkspaceRecord, made: WorkspaceRecord) -> WorkspaceRecord:
        try:
            self.contents.copy(current.id, made.id)
            if not made.snapshot:
                self.contents.ready(made.id)
        except BaseException:
            with self._lock:
                self._records.pop(made.id, None)
            self.contents.remove(made.id, later=True)
            raise
        finally:
            with self._lock:
                self._users[made.id] -= 1
                if not self._users[made.id]:
                    del self._users[made.id]
        with self._lock:
            self._write_record(made)
        return made

    def forget(self, record: WorkspaceRecord) -> None:
        """Remove a workspace at its caller's word: its files, its name, its record."""
        with self._lock:
            refuse_change(record, self._in_use(record.id), snapshot=True)
            self._remove(record.id, later=True)


def counted(record: WorkspaceRecord) -> bool:
    """Whether a workspace counts against workspace.max_per_client (named ones and snapshots are counted apart)."""
    return record.name is None and not record.snapshot


def refuse_change(record: WorkspaceRecord, in_use: bool, snapshot: bool = False) -> None:
    """Refuse to change a workspace a call works in, or a snapshot (kept as it was taken) unless `snapshot`."""
    if record.snapshot and not snapshot:
        raise Refusal(f"refused: {record.id} is a snapshot, kept as it was taken", "workspace")
    if in_use:
        raise Refusal(
            f"busy: another call is working in workspace {record.id}; retry when it has finished",
            "workspace",
            kind="busy",
            retry_after_s=1,
        )


def not_a_snapshot(record: WorkspaceRecord, requested: str) -> WorkspaceRecord:
    if record.snapshot:
        raise Refusal(
            f"refused: {requested!r} is a snapshot, kept as it was taken: no call works in it; restore it with the "
            'workspaces tool ({"action": "restore", "snapshot": "' + requested + '"}) and work in what that makes',
            "workspace",
        )
    return record


def _below(
    count: int, most: int, what: str, policy_name: str, field: str, advice: str = "; delete one first",
    who: str = "this caller keeps",
) -> None:  # fmt: skip
    """Refuse one more past a per-caller count the policy bounds, naming its field."""
    if count >= most:
        raise Refusal(
            f"refused: {who} {count} {what}, the most policy '{policy_name}' allows (field workspace.{field}: "
            f"{most}){advice}",
            f"workspace.{field}",
        )


def _check_name(name: str) -> None:
    if not NAME_PATTERN.fullmatch(name):
        raise Refusal(f"refused: {name!r} is not a workspace name: a name is {NAME_IN_WORDS}", "name")


def named_elsewhere(default: Path, own: Path, name: str, tenant: str | None) -> str | None:
    """Where a caller's name is kept in another server's state folder on this host, said for a refusal: a second
    server started from the same environment (another MCP client's, a terminal's `sandbox-server call`) keeps its
    workspaces in a subfolder of the default one (state.folder), so a name given through one is not the other's."""
    for folder, holder in servers_folders(default):
        workspaces = folder / "workspaces"
        if folder == own or not workspaces.is_dir():
            continue
        if any(r.name == name and r.tenant == tenant for r in FileBook(workspaces).load().values()):
            held = (
                f"which the server of process {holder} holds (another client's, or a terminal's): call it there"
                if holder is not None
                else "which no server holds now: stop this server and start it again once the others have "
                "stopped, and it takes that folder"
            )
            return (
                f"it is kept in {folder}, {held}; this server keeps its workspaces in {own}, as each server on a "
                "host has a state folder of its own"
            )
    return None
