"""sandbox-server: an MCP tool server that runs every call in a fresh, hardened container."""

__version__ = "0.1.0"
