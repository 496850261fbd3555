"""A kept workspace's files as MCP resources: listed by their URIs, read by a caller who may see them.

The store decides which workspaces a caller sees (`WorkspaceStore.find`); this module shows their files, never
the tools' own folders inside them.
"""

from __future__ import annotations

from typing import Any

from sandbox_server.workspaces.contents import mime_type
from sandbox_server.workspaces.naming import internal, parse_resource_uri, resource_uri, shown_name, shown_time
from sandbox_server.workspaces.records import WorkspaceRecord
from sandbox_server.workspaces.store import WorkspaceStore

__all__ = ["read_workspace_file", "session_entries", "workspace_entries", "workspace_listing"]


def workspace_entries(store: WorkspaceStore, record: WorkspaceRecord) -> list[tuple[str, str, str, int]]:
    """A workspace's files as resources, (URI, name, MIME type, size)."""
    return [
        (resource_uri(record.id, path), shown_name(path), mime_type(path), size)
        for path, (size, _, _) in sorted(store.contents.states(record.id).items())
        if not internal(path)
    ]


def workspace_listing(store: WorkspaceStore, record: WorkspaceRecord) -> list[dict[str, Any]]:
    """A workspace's files as its listing resource shows them: path, size, MIME type, URI and when each was last
    changed (one walk of its files)."""
    return [
        {
            "path": shown_name(path),
            "size": size,
            "mimeType": mime_type(path),
            "uri": resource_uri(record.id, path),
            "modified": shown_time(mtime_ns / 1e9),
        }
        for path, (size, mtime_ns, _) in sorted(store.contents.states(record.id).items())
        if not internal(path)
    ]


def session_entries(store: WorkspaceStore, session: str, tenant: str | None = None) -> list[tuple[str, str, str, int]]:
    """A handshake session's workspace files as resources (none when it has no workspace)."""
    record = store.of_session(session, tenant)
    return [] if record is None else workspace_entries(store, record)


def read_workspace_file(
    store: WorkspaceStore,
    uri: str,
    session: str | None,
    max_bytes: int,
    tenant: str | None = None,
    window: tuple[int, int | None] = (0, None),
) -> tuple[str, int, bytes] | None:
    """A workspace file by its resource URI, as (MIME type, its size, its bytes from the window's offset, at most
    its length), when this tenant may read it."""
    parsed = parse_resource_uri(uri)
    record = store.find(parsed[0], session, tenant) if parsed and not internal(parsed[1]) else None
    if parsed is None or record is None:
        return None
    found = store.contents.read_file(record.id, parsed[1], max_bytes, *window)
    return None if found is None else (mime_type(parsed[1]), *found)
