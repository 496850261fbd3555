"""Workspaces mounted on their home replica (`serve --state … --workspaces mounted`).

A workspace lives on one replica, its home: its image is mounted there, its calls run side by side there as on
one server, and its services run beside them. Every other replica forwards its calls there
(protocol/forwarding.py). After each call that changed its files, the home saves the workspace's archive to the
database as an archived replica saves its own, so a home that is lost loses no finished call: the next replica
asked for the workspace takes it over (state.homes) and mounts it anew from that archive. Until a replica has
mounted a workspace itself, what it reads of one (a resource, an export) is that saved archive.
"""

from __future__ import annotations

import contextlib
import hashlib
import math
import tarfile
import threading
from collections.abc import Callable
from pathlib import Path
from typing import IO

from sandbox_server.errors import Refusal
from sandbox_server.policy import WorkspaceSettings
from sandbox_server.sandbox.activity import Activity
from sandbox_server.sandbox.archive import WORKSPACE_DIR
from sandbox_server.sandbox.host_files import FileState
from sandbox_server.sandbox.spec import ExecutionResult, SandboxSpec
from sandbox_server.state.database import REPLICA_LOST_S
from sandbox_server.state.homes import Claim, Homes
from sandbox_server.workspaces.contents import Add, Room
from sandbox_server.workspaces.mounted import MountedContents
from sandbox_server.workspaces.shared import SharedArchives

__all__ = ["HomedMounts"]


class HomedMounts(MountedContents):
    """Mounted workspaces of the replica that is their home; the database keeps each one's last saved archive."""

    def __init__(
        self,
        root: Path,
        process: str,
        process_alive: Callable[[str], bool],
        activity: Activity | None,
        archives: SharedArchives,
        homes: Homes,
        settings: WorkspaceSettings,
        ask_hand_over: Callable[[str], bool] | None = None,
    ) -> None:
        self._here: set[str] = set()
        """Workspaces this process is the home of, mounted from their saved archive (or made here)."""
        self.archives, self.homes, self.settings = archives, homes, settings
        self._saved: dict[str, str] = {}
        """Per workspace, the fingerprint of its files at its last save (a call that changed nothing saves none)."""
        self._homing: dict[str, threading.RLock] = {}
        self.ask_hand_over = ask_hand_over
        """Asks the live replica that is a workspace's home to let go of it for this one (whether it did), over the
        replicas' signed channel (protocol/handover.py); None: nobody is asked."""
        super().__init__(root, process, process_alive, activity)  # (its first sweep reads what is set above)
        self.homed = self

    def _lock_of(self, workspace_id: str) -> threading.RLock:
        with self._lock:
            return self._homing.setdefault(workspace_id, threading.RLock())

    def homed_here(self, workspace_id: str) -> bool:
        return workspace_id in self._here

    def come_home(self, workspace_id: str, user: str) -> str | None:
        """Make this replica the workspace's home, mounted from its saved archive: the replica it was taken over
        from, when that one had stopped answering. A Refusal (busy) when another live replica is its home (the
        call reached this one before it knew)."""
        with self._lock_of(workspace_id):
            if workspace_id in self._here:
                return None
            claim = self.homes.claim(workspace_id)
            elsewhere = claim.home is not None and claim.home != self.homes.me
            if elsewhere and claim.answering and self.ask_hand_over is not None:
                # a call that was not forwarded to the home (a handshake-era session's lives here): the workspace
                # comes here, from the home's last save, once no call works in it there
                if self.ask_hand_over(workspace_id):
                    claim = self.homes.claim(workspace_id)
            if claim.home is not None and claim.home != self.homes.me:
                raise _elsewhere(workspace_id, claim)
            super().remove(workspace_id)  # what this host may hold of it from before is stale
            self.archives.refresh(workspace_id)
            saved = self.archives.archive_path(workspace_id)
            if saved.exists():
                kept = saved.with_name(f".{workspace_id}.tar.home")
                saved.replace(kept)
                self.archives.remove(workspace_id)
                super().load(workspace_id, kept, self.settings, user)
            self._here.add(workspace_id)
            return claim.lost

    def begin(self, workspace_id: str, spec: SandboxSpec) -> SandboxSpec:
        self.come_home(workspace_id, spec.user)  # (under its lock: never while it is handed over)
        return super().begin(workspace_id, spec)

    def hand_over(self, workspace_id: str, in_use: Callable[[str], bool]) -> bool:
        """Let go of a workspace homed here, for the replica that asked to continue it: saved, unmounted and homed
        nowhere. False while a call works in it (`in_use`), or when it could not be saved: it stays here."""
        with self._lock_of(workspace_id):
            if workspace_id not in self._here:
                return True
            if in_use(workspace_id) or self.save(workspace_id) is not None:
                return False
            self._here.discard(workspace_id)
            self._saved.pop(workspace_id, None)
            self.homes.let_go(workspace_id)
            self.release(workspace_id)
            return True

    def finish(self, workspace_id: str, result: ExecutionResult, settings: WorkspaceSettings, room: Room) -> str | None:
        super().finish(workspace_id, result, settings, room)
        return self.save(workspace_id)

    def save(self, workspace_id: str) -> str | None:
        """Keep the workspace's files in the database as they are now, unless they are as its last save left them:
        the problem, when they could not be kept."""
        if workspace_id not in self._here:
            return None
        with self._lock_of(workspace_id):
            states = super().states(workspace_id)
            fingerprint = hashlib.sha256(repr(sorted(states.items())).encode()).hexdigest()
            if self._saved.get(workspace_id) == fingerprint:
                return None
            made = self.root / f".{workspace_id}.tar.save"
            try:
                with tarfile.open(made, "w", format=tarfile.PAX_FORMAT) as tar:

                    def add(entry: tarfile.TarInfo, content: IO[bytes] | None) -> None:
                        entry.name = f"{WORKSPACE_DIR}/{entry.name}"
                        if entry.islnk():
                            entry.linkname = f"{WORKSPACE_DIR}/{entry.linkname}"
                        tar.addfile(entry, content)

                    super().entries(workspace_id, add)
                problem = self.archives.keep(workspace_id, made)
            finally:
                made.unlink(missing_ok=True)
            self.archives.remove(workspace_id)  # the database's copy is the one kept; the mount is this one's
            if problem is None:
                self._saved[workspace_id] = fingerprint
            return problem

    # -- reads: the mount where it is home, else the saved archive ----------------------------

    def states(self, workspace_id: str) -> dict[str, FileState]:
        return super().states(workspace_id) if workspace_id in self._here else self.archives.states(workspace_id)

    def read_file(
        self, workspace_id: str, path: str, max_bytes: int, offset: int = 0, length: int | None = None
    ) -> tuple[int, bytes] | None:
        if workspace_id in self._here:
            return super().read_file(workspace_id, path, max_bytes, offset, length)
        return self.archives.read_file(workspace_id, path, max_bytes, offset, length)

    def entries(self, workspace_id: str, add: Add) -> None:
        if workspace_id in self._here:
            super().entries(workspace_id, add)
        else:
            self.archives.entries(workspace_id, add)

    # -- copies, imports and removals: the database's copy first ------------------------------

    def copy(self, source_id: str, target_id: str) -> None:
        """A fork or a snapshot: the database's copy of the source's saved archive (so any replica may continue
        it), and where this replica is the source's home, its image cloned too, so it continues here at once."""
        problem = self.save(source_id)
        if problem is not None:
            raise Refusal(f"refused: workspace {source_id} could not be saved to copy it: {problem}", "workspace")
        self.archives.copy(source_id, target_id)
        if source_id in self._here and self.homes.claim(target_id).home == self.homes.me:
            super().copy(source_id, target_id)
            self._here.add(target_id)
            self._saved[target_id] = self._saved.get(source_id, "")

    def ready(self, workspace_id: str) -> None:
        if workspace_id in self._here:
            super().ready(workspace_id)

    def load(self, workspace_id: str, kept: Path, settings: WorkspaceSettings, user: str) -> int:
        """An imported workspace: made here, its home, and saved."""
        self.homes.claim(workspace_id)
        size = super().load(workspace_id, kept, settings, user)
        self._here.add(workspace_id)
        problem = self.save(workspace_id)
        if problem is not None:
            self.remove(workspace_id)
            raise Refusal(f"refused: the imported workspace could not be saved: {problem}", "workspace")
        return size

    def remove(self, workspace_id: str, later: bool = False) -> None:
        with self._lock:
            self._here.discard(workspace_id)
            self._saved.pop(workspace_id, None)
        self.archives.remove(workspace_id)
        with contextlib.suppress(Refusal):
            self.homes.let_go(workspace_id)
        super().remove(workspace_id, later)

    def sweep(self) -> None:
        """Also let go of the workspaces homed here that another replica removed (expired, or deleted)."""
        super().sweep()
        here = sorted(self._here)
        if here:
            rows = self.archives.database.run("SELECT id FROM workspaces WHERE id = ANY(%s)", (here,))
            for workspace_id in set(here) - {row[0] for row in rows}:
                self.remove(workspace_id)

    def kept_files(self, workspace_ids: list[str]) -> set[str]:
        return super().kept_files(workspace_ids) | self.archives.kept_files(workspace_ids)

    def let_go_of_homes(self) -> None:
        """This replica stops (after draining): every workspace saved, unmounted, and homed nowhere, for the next
        replica asked to continue it from what was saved."""
        here = sorted(self._here)
        for workspace_id in here:
            self.save(workspace_id)
        self._here.clear()
        self.homes.let_go()  # first: no call runs here any more, and another replica may continue them at once
        for workspace_id in here:
            self.release(workspace_id)

    def close(self) -> None:
        with contextlib.suppress(Refusal):
            self.let_go_of_homes()
        super().close()


def _elsewhere(workspace_id: str, claim: Claim) -> Refusal:
    """The refusal of a call that reached this replica for a workspace another live replica is the home of: busy
    while that home says it is alive; once it has missed its beats, that it does not answer and when it is taken
    for lost (a handshake-era session, whose calls are never forwarded, asks again then rather than every second)."""
    if claim.answering:
        return Refusal(
            f"busy: workspace {workspace_id} lives on replica {claim.shown}, which answers its calls; retry",
            "workspace",
            kind="busy",
            retry_after_s=1,
        )
    left = max(1.0, math.ceil(REPLICA_LOST_S - claim.silent_s + 1))
    return Refusal(
        f"workspace {workspace_id} lives on replica {claim.shown}, which has not said it is alive for "
        f"{claim.silent_s:.0f} s; nothing of this request ran. It is taken for lost {REPLICA_LOST_S:.0f} s after "
        f"its last word, and this replica then continues the workspace from its last saved call: send it again in "
        f"{left:.0f} s",
        "workspace",
        kind="engine_unavailable",
        retry_after_s=left,
    )
