"""The layering of docs/design.md: the engine modules talk to Docker, one module to the MCP SDK's server side."""

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "sandbox_server"


def _importers(top_level: str) -> set[str]:
    found = set()
    for path in PACKAGE.rglob("*.py"):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            names = []
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names = [node.module]
            if any(name == top_level or name.startswith(top_level + ".") for name in names):
                found.add(path.relative_to(PACKAGE).as_posix())
    return found


def test_only_the_engine_modules_import_docker() -> None:
    assert _importers("docker") == {"sandbox/engine.py", "sandbox/removal.py", "sandbox/docker_runtime.py"}


def test_only_the_server_and_the_one_shot_client_import_mcp() -> None:
    assert _importers("mcp") | _importers("mcp_types") == {"server.py", "client.py"}
