"""Where workspace records are kept: a small JSON file per workspace in the store's folder (one server process),
or rows of the shared state (replicas, workspaces.shared). The store keeps the logic; a book keeps the records."""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import AsyncIterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from sandbox_server.workspaces.naming import ID_PATTERN

if TYPE_CHECKING:  # the PostgreSQL driver is imported only by a server given --state
    from sandbox_server.state.calls import SharedCall

__all__ = [
    "FileBook",
    "RecordBook",
    "WorkspaceRecord",
    "from_fields",
    "over_cap",
    "server_of",
    "session_key",
    "to_fields",
]

SESSION_PREFIX = "session:"


@dataclass(frozen=True, slots=True)
class WorkspaceRecord:
    """One kept workspace."""

    id: str
    session: str | None
    """`session:<server>|<session>` in the handshake era: the one session whose workspace it is; None when the id
    itself is the capability."""
    holder: str
    """Whose workspace it is, counted against `workspace.max_per_client` (Identity.holder)."""
    created: float
    last_used: float
    size_bytes: int = 0
    tenant: str | None = None
    """The tenant it was made for, who alone may use it (None: over stdio, where one client is served)."""
    continued: bool = False
    """A later call continued it (by its id, or as its session's): removed after those no call continued."""
    name: str | None = None
    """Its caller's name for it (the `workspaces` tool's `keep`): then it outlives its session and restarts of the
    server, any session of its caller opens it by that name, and it lasts workspace.keep_s unused."""
    origin: str | None = None
    """The workspace or snapshot it was copied from (a fork, a snapshot, a restore): what `compare` compares
    with by default."""
    snapshot: bool = False
    """A snapshot: a copy kept as it was taken, never opened by a call (restored into a workspace instead), for
    workspace.keep_s from when it was taken."""
    services: tuple[dict[str, Any], ...] = ()
    """The services to run while it is used, each as the call that started it asked (`name`, `port`, `tool`,
    `arguments`): kept when it is paused or its server stops, so its next call starts them again; a service its
    caller stopped, or that stopped by itself, is dropped. Copied into its forks and snapshots."""
    paused: bool = False
    """Paused by its caller (the `workspaces` tool's `pause`): it holds no container and no mount; its next call,
    or `resume`, starts its services again."""


def over_cap(total: int, storage_bytes: int) -> str:
    """Why a workspace of this size was not kept: the host's cap."""
    return (
        f"the workspace was not saved: all workspaces, snapshots and exports together would take {total} bytes, "
        f"above the host's cap of {storage_bytes} (policy field host.workspace_storage_mb); it is as the previous "
        "call left it"
    )


class RecordBook(Protocol):
    """Where a store's records live."""

    shared: bool
    """Other server processes change these records too (the store reads them again before each decision)."""

    def load(self) -> dict[str, WorkspaceRecord]:
        """Every record, by id."""

    def write(self, record: WorkspaceRecord) -> None:
        """Keep a record (a new one, or a new version of one)."""

    def get(self, workspace_id: str, call: SharedCall | None = None) -> WorkspaceRecord | None:
        """One record (None when there is none); `call`, the replicas' call asking, may have read it already."""

    def resize(self, record: WorkspaceRecord, storage_bytes: int, others_bytes: int) -> bool:
        """Write a record with its workspace's new size when all workspaces fit in `storage_bytes` with it (False
        when they do not); `others_bytes` is what the others take as this process knows it. A shared book writes
        it with the workspace's save instead, which counts the others in the same statement, and refuses it
        there."""

    def delete(self, workspace_id: str, unless_held: bool = False) -> bool:
        """Forget a record; `unless_held`: only when no call of another process works in it (a shared book: then
        False, and the record stays)."""

    def hold(
        self, workspace_id: str, wait_s: float, call: SharedCall | None = None
    ) -> contextlib.AbstractAsyncContextManager[bool]:
        """Hold the workspace against every other process for one call; yields False when it could not within
        `wait_s`."""

    def prelocked(self, workspace_id: str, call: SharedCall | None = None) -> bool:
        """Whether `call` (the replicas' side of the call being served) already holds the workspace against every
        other call, this process's included (it then waits for none of them)."""


class FileBook:
    """Records as `<id>.json` files in one folder, each written whole and replaced."""

    shared = False

    def __init__(self, root: Path) -> None:
        self.root = root

    def load(self) -> dict[str, WorkspaceRecord]:
        records = (self._read(path) for path in self.root.glob("ws-*.json"))
        return {record.id: record for record in records if record is not None}

    def _read(self, path: Path) -> WorkspaceRecord | None:
        try:
            record = from_fields(json.loads(path.read_text()))
        except (OSError, ValueError, TypeError):
            return None  # a record this version cannot read is swept with its files
        return record if ID_PATTERN.fullmatch(record.id) and path.stem == record.id else None

    def write(self, record: WorkspaceRecord) -> None:
        temporary = self.root / f".{record.id}.json.new"
        temporary.write_text(json.dumps(to_fields(record)))
        os.replace(temporary, self.root / f"{record.id}.json")

    def get(self, workspace_id: str, call: SharedCall | None = None) -> WorkspaceRecord | None:
        return self._read(self.root / f"{workspace_id}.json") if ID_PATTERN.fullmatch(workspace_id) else None

    def resize(self, record: WorkspaceRecord, storage_bytes: int, others_bytes: int) -> bool:
        if others_bytes + record.size_bytes > storage_bytes:
            return False
        self.write(record)
        return True

    def delete(self, workspace_id: str, unless_held: bool = False) -> bool:
        (self.root / f"{workspace_id}.json").unlink(missing_ok=True)
        return True  # one process: the store knows its own calls

    @contextlib.asynccontextmanager
    async def hold(self, workspace_id: str, wait_s: float, call: SharedCall | None = None) -> AsyncIterator[bool]:
        yield True  # one process: its own lock is enough

    def prelocked(self, workspace_id: str, call: SharedCall | None = None) -> bool:
        return False


_DISK_NAMES = {"session": "owner", "tenant": "caller", "holder": "client"}
"""Fields a record file names as earlier versions did, so that a server of either version reads the other's."""


def to_fields(record: WorkspaceRecord) -> dict[str, Any]:
    """A record as kept (JSON)."""
    return {_DISK_NAMES.get(name, name): value for name, value in asdict(record).items()}


def from_fields(fields: dict[str, Any]) -> WorkspaceRecord:
    """A record as kept, read back."""
    known = {disk: name for name, disk in _DISK_NAMES.items()}
    named = {known.get(name, name): value for name, value in fields.items()}
    named["services"] = tuple(named.get("services") or ())
    return WorkspaceRecord(**named)


def session_key(server: str, session: str) -> str:
    """A handshake session as kept workspaces name it: its server process and its session id."""
    return f"{SESSION_PREFIX}{server}|{session}"


def server_of(session: str) -> str:
    """The server process of a handshake session as kept workspaces name it."""
    return session.removeprefix(SESSION_PREFIX).split("|", 1)[0]
