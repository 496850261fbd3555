"""The command line: `sandbox-server` and its commands (`main`), `serve` wiring every part into a running
server, and the one-shot MCP client behind `call` and `demo`.

The top of the house: it may import from every layer below, and nothing imports from it.
"""
