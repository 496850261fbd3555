"""Branches compared: what each of several workspaces (forks of one, say, each given a different call) holds that
differs from a base, in files and in run_python's kept variables.

Files are compared by their states (size, modification time, inode): a fork is a copy that keeps all three, so a
file neither side touched is the same. Variables are compared by run_python's index of them (which file holds
each, and a line the sandbox wrote saying what it is), read as data: nothing kept is unpickled on the host.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from sandbox_server.errors import Refusal
from sandbox_server.sandbox import wire
from sandbox_server.sandbox.host_files import FileState
from sandbox_server.workspaces.changes import changes_between
from sandbox_server.workspaces.records import WorkspaceRecord

__all__ = ["INDEX_PATH", "Kept", "compared", "kept_variables", "variables_between"]

INDEX_PATH = f"{wire.CELL_STATE_DIR}/index.json"
"""run_python's index of the kept variables, in a workspace."""
INDEX_BYTES = 1 << 20
"""An index larger than this is not read (a sandbox wrote it)."""
ABOUT_CHARS = 120
"""What is shown of the sandbox's line on a variable."""
MAX_VARIABLES = 50

Kept = dict[str, tuple[str, str, str | None]]
"""Kept variable -> (the file holding it, the sandbox's line on what it is, its content's SHA-256 when the index
says it)."""


def kept_variables(index: bytes | None) -> Kept:
    """The kept variables an index names (none when there is no index or it cannot be read: a sandbox wrote it)."""
    if not index:
        return {}
    try:
        read = json.loads(index)
        values, about, digests = read.get("values", {}), read.get("about", {}), read.get("digests", {})
    except (ValueError, AttributeError):
        return {}
    if not isinstance(values, dict) or not isinstance(about, dict) or not isinstance(digests, dict):
        return {}
    return {
        str(name)[:ABOUT_CHARS]: (
            str(file),
            str(about.get(name, "?"))[:ABOUT_CHARS],
            str(digests[name])[:64] if name in digests else None,
        )
        for name, file in list(values.items())[:10_000]
    }


def variables_between(
    before: Kept, after: Kept, before_states: Mapping[str, FileState], after_states: Mapping[str, FileState]
) -> dict[str, Any]:
    """Kept variables added, changed and removed, each with what it is now (or was). Changed: its content's
    digest differs (a cell that loaded it and left it as it was changed nothing); for an index without digests
    (an earlier version's), held in another file or its file changed."""

    def state(states: Mapping[str, FileState], file: str) -> FileState | None:
        return states.get(f"{wire.CELL_STATE_DIR}/{file}")

    def differs(name: str) -> bool:
        (file, _, digest), (earlier, _, was) = after[name], before[name]
        if digest is not None and was is not None:
            return digest != was
        return file != earlier or state(after_states, file) != state(before_states, earlier)

    added = [{"name": n, "about": after[n][1]} for n in after if n not in before]
    removed = [{"name": n, "about": before[n][1]} for n in before if n not in after]
    changed = [{"name": n, "about": after[n][1], "was": before[n][1]} for n in after if n in before and differs(n)]
    listed: dict[str, Any] = {
        "added": added[:MAX_VARIABLES],
        "changed": changed[:MAX_VARIABLES],
        "removed": removed[:MAX_VARIABLES],
    }
    shown = sum(len(v) for v in listed.values())
    listed["more"] = len(added) + len(changed) + len(removed) - shown
    return listed


def compared(
    base: WorkspaceRecord,
    branch: WorkspaceRecord,
    states: Mapping[str, Mapping[str, FileState]],
    indexes: Mapping[str, bytes | None],
) -> dict[str, Any]:
    """One branch against the base: its files and variables changed, and its size."""
    if branch.id == base.id:
        raise Refusal(f"refused: {branch.name or branch.id} is the base it would be compared with", "branches")
    return {
        "workspace": branch.id,
        "name": branch.name,
        "size_bytes": branch.size_bytes,
        "files": changes_between(states[base.id], states[branch.id]),
        "variables": variables_between(
            kept_variables(indexes[base.id]), kept_variables(indexes[branch.id]), states[base.id], states[branch.id]
        ),
    }


def compared_line(row: Mapping[str, Any]) -> str:
    """One branch's differences for the text a model reads."""
    files, variables = row["files"], row["variables"]
    counts = [f"{len(files[k])} {k}" for k in ("created", "modified", "deleted", "renamed") if files[k]]
    said = ", ".join(counts) or "no file changed"
    names = [*files["created"], *files["modified"], *files["deleted"]][:6]
    shown = f" ({', '.join(names)}{', …' if files['more'] else ''})" if names else ""
    parts = [f"+{v['name']}: {v['about']}" for v in variables["added"]]
    parts += [f"~{v['name']}: {v['was']} -> {v['about']}" for v in variables["changed"]]
    parts += [f"-{v['name']}" for v in variables["removed"]]
    more = "; …" if len(parts) > 8 or variables["more"] else ""
    kept = "; variables: " + "; ".join(parts[:8]) + more if parts else ""
    return f"{row['name'] or row['workspace']}: {said}{shown}{kept}"
