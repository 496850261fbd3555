"""The `_meta` keys this server writes: one namespace, `org.sandbox-server/`, as MCP asks of an
implementation's own keys (a reverse-DNS prefix, never the `modelcontextprotocol`/`mcp` ones)."""

from __future__ import annotations

__all__ = ["APPROVAL_META", "OWN_NAME_META", "PART_META", "PATH_META"]

PREFIX = "org.sandbox-server/"
OWN_NAME_META = PREFIX + "tool"
"""A tool's: its own name, when a prefix changes the name clients see."""
PATH_META = PREFIX + "path"
"""An image block's: the file's path under the output folder."""
PART_META = PREFIX + "part"
"""A part of a file read with `?offset=`: its offset, length, the file's size and the next part's URI."""
APPROVAL_META = PREFIX + "approval"
"""A tool's: what the policy asks a person to approve before the tool's calls run."""
