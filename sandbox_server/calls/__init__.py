"""The call pipeline, with no MCP in it: the tool registry (tools by the names clients see, the policies calls
run under, the warm pools they want), argument checks, and one call's route: check, ask, admit, workspace,
proxy, run, engine faults made refusals, the audit record.

It may import access, workspaces, tools, policy, network, sandbox and the top-level modules; the protocol
layer hands it what it needs (who calls, a progress callback, a way to ask a person).
"""
