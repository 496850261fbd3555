"""Tasks: calls that outlive their request. The records kept on disk until their time to live has passed, and
the running tasks in the server's own task group, with their output read while they run.

It may import calls (a task is a call), access (the audit trail), policy, sandbox (the output buffers) and the
top-level modules; protocol, which speaks MCP for it, and cli import it.
"""
