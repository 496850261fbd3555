"""The tools this server offers, one per module, on a shared base (schemas, input files, the sandbox spec a call
asks for, the outcome of a run).

It may import policy, network, sandbox and the top-level modules (and names the services layer's scope for
types only); calls and protocol import it.
"""

from sandbox_server.policy import Policy
from sandbox_server.tools.analyze_csv import AnalyzeCsv
from sandbox_server.tools.base import Tool, ToolContext, ToolOutcome
from sandbox_server.tools.execute_command import ExecuteCommand
from sandbox_server.tools.files import Files
from sandbox_server.tools.run_python import RunPython
from sandbox_server.tools.services import ServicesTool
from sandbox_server.tools.workspaces import WorkspacesTool

__all__ = ["Tool", "ToolContext", "ToolOutcome", "all_tools", "offers"]


def all_tools() -> list[Tool]:
    """Every tool, in the order tools/list shows them."""
    return [ExecuteCommand(), Files(), RunPython(), AnalyzeCsv(), ServicesTool(), WorkspacesTool()]


def offers(policy: Policy, tool: Tool) -> bool:
    """Whether a policy offers a tool: enabled, and (a tool that runs no sandbox: services, workspaces) of use
    there."""
    return policy.for_tool(tool.name).enabled and tool.of_use(policy)
