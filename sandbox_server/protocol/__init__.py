"""The only code that speaks MCP: the server's handlers (thin: each hands off), tools/list, resources, asking
a person through the client in both eras, results as content blocks, the `_meta` keys, and the stdio and
Streamable HTTP transports with their bounds.

It may import calls, access, workspaces, tools, policy, network, sandbox and the top-level modules; only
the command line imports it.
"""
