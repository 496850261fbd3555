"""The layering of docs/design.md: the engine modules talk to Docker, one module to the MCP SDK's server side."""

import ast
import re
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
    assert _importers("docker") == {
        "sandbox/engine.py",
        "sandbox/host_config.py",
        "sandbox/removal.py",
        "sandbox/docker_runtime.py",
        "network/proxies.py",
    }


def test_only_the_server_its_authentication_and_the_one_shot_client_import_mcp() -> None:
    # auth.py is the server's HTTP front door: the SDK's token verifier and access token; transports.py serves
    # the server over the SDK's stdio and Streamable HTTP.
    assert _importers("mcp") | _importers("mcp_types") == {"protocol/server.py", "protocol/transports.py", "access/auth.py", "cli/client.py"}


def test_every_document_the_code_names_is_in_the_repository() -> None:
    root = PACKAGE.parent
    named: set[str] = set()
    for folder in ("sandbox_server", "images", "policies", "scripts", "tests", "bench"):
        for path in (root / folder).rglob("*"):
            if (
                path.is_file()
                and path.suffix in ("", ".py", ".yaml", ".json", ".sh")
                and "__pycache__" not in path.parts
            ):
                named |= set(re.findall(r"[\w./-]+\.md\b", path.read_text(errors="replace")))
    missing = sorted(name for name in named if not (root / name).is_file())
    assert named and not missing, f"the code names documents the repository does not hold: {missing}"
