"""How kept workspaces and their files are named: ids, resource URIs (and their template), names and times as
people read them, and the folders that are the tools' own and never resources."""

from __future__ import annotations

import re
import time
from urllib.parse import quote, unquote_to_bytes

from sandbox_server.sandbox import wire
from sandbox_server.sandbox.archive import safe_relative_path

__all__ = [
    "ID_PATTERN",
    "INTERNAL_FOLDERS",
    "LISTING_TEMPLATE",
    "NAME_IN_WORDS",
    "NAME_PATTERN",
    "RESOURCE_TEMPLATE",
    "internal",
    "listing_id",
    "parse_resource_uri",
    "resource_uri",
    "shown_name",
    "shown_time",
]

ID_PATTERN = re.compile(r"ws-[A-Za-z0-9_-]{22}")
NAME_PATTERN = re.compile(r"(?!ws-)[a-z0-9][a-z0-9._-]{0,62}")
"""A workspace's name as its caller gives it: lower-case letters, digits, '.', '_' and '-', up to 63, not
starting with `ws-` (ids do)."""
NAME_IN_WORDS = (
    "1 to 63 lower-case letters, digits, '.', '_' and '-', starting with a letter or digit and not with 'ws-' "
    "(e.g. sales-2024)"
)
RESOURCE_PREFIX = "sandbox://workspace/"
RESOURCE_TEMPLATE = RESOURCE_PREFIX + "{workspace}/{+path}"
"""How a kept workspace's files are named as MCP resources (RFC 6570)."""
LISTING_TEMPLATE = RESOURCE_PREFIX + "{workspace}/"
"""A kept workspace's list of files, read as one resource (for clients that pass ids, not sessions)."""


def listing_id(uri: str) -> str | None:
    """The workspace id of a listing URI (`sandbox://workspace/<id>/`), or None when the URI is not one."""
    if not uri.startswith(RESOURCE_PREFIX) or not uri.endswith("/"):
        return None
    workspace_id = uri.removeprefix(RESOURCE_PREFIX)[:-1]
    return workspace_id if _reference(workspace_id) else None


def resource_uri(workspace_id: str, path: str) -> str:
    """The resource URI of a file in a kept workspace (a name's bytes that are not UTF-8 percent-encoded as they are)."""
    return f"{RESOURCE_PREFIX}{workspace_id}/{quote(path.encode('utf-8', 'surrogateescape'), safe='/')}"


INTERNAL_FOLDERS = (wire.CELL_STATE_FILE.split("/", 1)[0], ".local", ".cache")
"""Folders of a workspace that hold the server's and the tools' own files, never listed or read as resources:
run_python's kept variables, and the user site and cache pip installs into (the python-data image's
PYTHONUSERBASE and PIP_CACHE_DIR)."""


def internal(path: str) -> bool:
    """Whether a workspace path lies in one of INTERNAL_FOLDERS."""
    return path.split("/", 1)[0] in INTERNAL_FOLDERS


def shown_name(path: str) -> str:
    """A workspace file's name as people read it: bytes that are not UTF-8 shown as `\\xNN`."""
    return path.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")


def shown_time(seconds: float) -> str:
    """A moment as answers write it: ISO 8601 in UTC, to the second."""
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(seconds))


def parse_resource_uri(uri: str) -> tuple[str, str] | None:
    """(workspace id, path) of a workspace resource URI; None when it is not one or the path leaves it."""
    if not uri.startswith(RESOURCE_PREFIX):
        return None
    workspace_id, _, quoted = uri.removeprefix(RESOURCE_PREFIX).partition("/")
    path = safe_relative_path(unquote_to_bytes(quoted).decode("utf-8", "surrogateescape"))
    return (workspace_id, path) if _reference(workspace_id) and path else None


def _reference(text: str) -> bool:
    """Whether a URI's workspace part names one: its id, or the name its caller gave it."""
    return ID_PATTERN.fullmatch(text) is not None or NAME_PATTERN.fullmatch(text) is not None
