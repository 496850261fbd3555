"""Views: the MCP Apps pages a host renders beside a result, one HTML file each, with the script and style they
share (protocol.apps inlines them and serves each as a `ui://` resource). Data files only: it imports nothing, and
only protocol reads it.
"""
