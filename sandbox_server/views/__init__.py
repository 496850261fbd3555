"""The MCP Apps views: one HTML page each, with the script and style they share (inlined by protocol.apps)."""
