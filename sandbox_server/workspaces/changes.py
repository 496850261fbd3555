"""What a call changed in its kept workspace: its files before and after, compared.

A file is created, deleted or modified (its size or modification time differ, or another
file now has its name); one whose inode, size and modification time moved to another
name was renamed (a deleted file's inode reused by a new one has a new time). A file made
and removed within the call was never seen, so it is not a change. Calls running side by
side in one workspace each see the others' changes too, as they would on one computer.
The tools' own folders and the call's output folder are not the workspace's files.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Mapping
from typing import Any

from sandbox_server.sandbox.host_files import FileState
from sandbox_server.workspaces.naming import internal, shown_name

__all__ = ["MAX_CHANGES", "LastChanges", "changes_between", "changes_line"]

MAX_CHANGES = 50
"""Paths a result lists at most (all kinds together); `more` counts the rest."""
SHOWN_IN_TEXT = 4
REMEMBERED = 4096
"""Workspaces whose last call's changes are remembered (the oldest forgotten first)."""


class LastChanges:
    """What the last call in each workspace changed, as its result said (what a workspace's view highlights): this
    process's calls only, the most recent workspaces only."""

    def __init__(self) -> None:
        self._changes: OrderedDict[str, dict[str, Any]] = OrderedDict()
        self._lock = threading.Lock()

    def remember(self, workspace_id: str, changes: dict[str, Any]) -> None:
        with self._lock:
            self._changes[workspace_id] = changes
            self._changes.move_to_end(workspace_id)
            while len(self._changes) > REMEMBERED:
                self._changes.popitem(last=False)

    def of(self, workspace_id: str) -> dict[str, Any] | None:
        with self._lock:
            return self._changes.get(workspace_id)


def changes_between(before: Mapping[str, FileState], after: Mapping[str, FileState]) -> dict[str, Any]:
    """The workspace's changes as a result's `changes`: created, modified, deleted, renamed, and how many more."""
    before = {path: state for path, state in before.items() if not internal(path)}
    after = {path: state for path, state in after.items() if not internal(path)}
    created = sorted(set(after) - set(before))
    deleted = sorted(set(before) - set(after))
    modified = sorted(path for path in set(after) & set(before) if after[path] != before[path])
    moved_from = {before[path][2]: path for path in deleted if before[path][2]}
    renamed = []
    for path in list(created):
        origin = moved_from.get(after[path][2])
        if origin is not None and before[origin] == after[path]:  # a freed inode reused has another time
            renamed.append({"from": shown_name(origin), "to": shown_name(path)})
            created.remove(path)
            deleted.remove(origin)
    room = MAX_CHANGES
    listed: dict[str, Any] = {}
    for kind, paths in (("created", created), ("modified", modified), ("deleted", deleted), ("renamed", renamed)):
        listed[kind] = [shown_name(p) if isinstance(p, str) else p for p in paths[: max(room, 0)]]
        room -= len(listed[kind])
    listed["more"] = len(created) + len(modified) + len(deleted) + len(renamed) - (MAX_CHANGES - room)
    return listed


def changes_line(changes: Mapping[str, Any]) -> str:
    """The changes in one line for the text a model reads ("" when nothing changed)."""
    counts = {kind: len(changes[kind]) for kind in ("created", "modified", "deleted", "renamed")}
    if not any(counts.values()) and not changes["more"]:
        return ""
    shown: list[str] = []
    for kind in ("created", "modified", "deleted"):
        shown += changes[kind]
    shown += [f"{pair['from']} -> {pair['to']}" for pair in changes["renamed"]]
    names = ", ".join(shown[:SHOWN_IN_TEXT]) + (", …" if len(shown) > SHOWN_IN_TEXT or changes["more"] else "")
    said = [f"{count} {kind}" for kind, count in counts.items() if count]
    more = f" and {changes['more']} more" if changes["more"] else ""
    return f"workspace changes: {', '.join(said)}{more} ({names})"
