"""A workspace's services as its record keeps them, and pausing it: what its next call starts again. Part of the
store (WorkspaceStore), which holds the records and their lock.

A service is recorded as the call that started it asked (its tool and arguments), once it listens. It stays
recorded when it stops because its workspace was paused, its server stopped or was killed, or (a named workspace)
its session ended; it is dropped when its caller stops it or it stops by itself (idle, its lifetime, its program
ended, it did not start again). Forks and snapshots copy the list. What does not survive a pause: the memory of
every process (a service starts afresh from its command) and its open connections.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import replace
from typing import Any

from sandbox_server.workspaces.names import NamedWorkspaces, refuse_change
from sandbox_server.workspaces.records import WorkspaceRecord

__all__ = ["PausedWorkspaces", "service_entry"]


def service_entry(name: str, port: int, tool: str, arguments: Mapping[str, Any]) -> dict[str, Any]:
    """A service as a record keeps it: how to start it again (the call's arguments, less its workspace)."""
    kept = {key: value for key, value in arguments.items() if key not in ("workspace", "files", "timeout_s")}
    return {"name": name, "port": port, "tool": tool, "arguments": kept}


class PausedWorkspaces(NamedWorkspaces):
    """The store's record of each workspace's services, and its pause (the store provides the records and lock)."""

    def record_service(self, workspace_id: str, entry: dict[str, Any]) -> None:
        """A service started (or started again) in the workspace: kept in its record, in place of one of its name."""
        self._change_services(workspace_id, lambda found: (*_without(found, entry["name"]), entry))

    def drop_service(self, workspace_id: str, name: str) -> bool:
        """A service that is not to start again (stopped by its caller, or by itself): whether it was recorded."""
        dropped = False

        def without(found: tuple[dict[str, Any], ...]) -> tuple[dict[str, Any], ...]:
            nonlocal dropped
            kept = _without(found, name)
            dropped = len(kept) != len(found)
            return kept

        self._change_services(workspace_id, without)
        return dropped

    def arrive(self, record: WorkspaceRecord, user: str) -> str | None:
        """Replicas keeping each workspace mounted on its home (workspaces.homed): this replica becomes the
        workspace's home unless a live one is; the note for its caller when it was taken over from a replica that
        stopped answering (its recorded services are then started again here, as after a restart)."""
        homed = self.contents.homed
        lost = homed.come_home(record.id, user) if homed is not None else None
        if lost is None:
            return None
        names = ", ".join(str(entry.get("name")) for entry in self.current(record).services)
        return (
            f"workspace {record.id} lived on replica {lost}, which stopped answering: it continues here from what "
            "its last finished call saved"
            + (f"; its services there ({names}) are gone with that replica, and start again here" if names else "")
        )

    def outlives_sessions(self, workspace_id: str) -> bool:
        """Whether a workspace lives on when its session ends (it is named): its services then start again."""
        with self._lock:
            found = self._records.get(workspace_id)
        return found is not None and found.name is not None

    def current(self, record: WorkspaceRecord) -> WorkspaceRecord:
        """The record as it is now (another call may have changed its services)."""
        with self._lock:
            return self._current(record)

    def pause(self, record: WorkspaceRecord) -> tuple[WorkspaceRecord, bool]:
        """Mark a workspace paused and let go of its mount (its services were stopped first, and stay recorded):
        the record, and whether a mount was let go of. Refused while a call works in it."""
        with self._lock:
            current = self._current(record)
            refuse_change(current, self._in_use(current.id))
            paused = replace(current, paused=True, last_used=time.time())
            self._records[paused.id] = paused
            self._write_record(paused)
            released = self.contents.release(paused.id)
        return paused, released

    def unpause(self, record: WorkspaceRecord) -> WorkspaceRecord:
        """A call works in the workspace again: no longer paused (the record as it is now)."""
        with self._lock:
            current = self._current(record)
            if current.paused:
                current = replace(current, paused=False)
                self._records[current.id] = current
                self._write_record(current)
        return current

    def _change_services(self, workspace_id: str, change: Any) -> None:
        with self._lock:
            self._fresh(workspace_id)
            found = self._records.get(workspace_id)
            if found is None:
                return  # removed meanwhile (its session ended, its caller deleted it)
            services = tuple(change(found.services))
            if services != found.services:
                changed = replace(found, services=services)
                self._records[workspace_id] = changed
                self._write_record(changed)


def _without(found: tuple[dict[str, Any], ...], name: str) -> tuple[dict[str, Any], ...]:
    return tuple(entry for entry in found if entry.get("name") != name)
