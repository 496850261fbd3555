"""The house of docs/design.md: layers that import only downward, no circle, small modules, the engine behind
a few modules and MCP behind the protocol layer."""

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "sandbox_server"
LAYERS = [  # lowest first: a module imports from its own layer and those below, never from above
    {"__init__", "errors", "shipped"},
    {"state"},
    {"sandbox"},
    {"network"},
    {"policy"},
    {"tools", "workspaces", "access", "services"},
    {"calls", "ops", "tasks"},
    {"protocol"},
    {"cli", "__main__"},
]
MAX_LINES = 450


def _modules(package: Path) -> dict[str, Path]:
    """Every module of a package by dotted name (a package by its own name)."""
    found = {}
    for path in package.rglob("*.py"):
        parts = path.relative_to(package.parent).with_suffix("").parts
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def _imports(path: Path, known: dict[str, Path]) -> set[str]:
    """The modules of `known` a file imports, at the top or inside functions."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            # `from package import module` imports the module; `from module import name` the module
            names = [f"{node.module}.{alias.name}" for alias in node.names if f"{node.module}.{alias.name}" in known]
            names = names or [node.module]
        found |= {name for name in names if name in known}
    return found


def _graph(package: Path) -> dict[str, set[str]]:
    known = _modules(package)
    return {name: _imports(path, known) - {name} for name, path in known.items()}


def _rank(module: str) -> int:
    parts = module.split(".")
    room = parts[1] if len(parts) > 1 else "__init__"
    return next(index for index, layer in enumerate(LAYERS) if room in layer)


def _cycle(graph: dict[str, set[str]]) -> list[str]:
    """One import circle, or [] when there is none."""
    state: dict[str, int] = {}
    trail: list[str] = []

    def visit(node: str) -> list[str]:
        state[node] = 1
        trail.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return trail[trail.index(nxt) :] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        state[node] = 2
        trail.pop()
        return []

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return []


def _importers(top_level: str) -> set[str]:
    found = set()
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names = [node.module]
            if any(name == top_level or name.startswith(top_level + ".") for name in names):
                found.add(path.relative_to(PACKAGE).as_posix())
    return found


def test_every_folder_sits_in_one_layer_and_says_what_it_owns() -> None:
    rooms = {path.parent.name for path in PACKAGE.glob("*/__init__.py")} | {path.stem for path in PACKAGE.glob("*.py")}
    placed = set().union(*LAYERS)
    assert rooms == placed, f"not in a layer: {sorted(rooms - placed)}; gone: {sorted(placed - rooms)}"
    for init in PACKAGE.glob("*/__init__.py"):
        docstring = ast.get_docstring(ast.parse(init.read_text())) or ""
        assert "import" in docstring, f"{init.parent.name}/__init__.py must say what it owns and may import"


def test_no_import_runs_back_up_the_layers() -> None:
    graph = _graph(PACKAGE)
    back = sorted(f"{a} -> {b}" for a, targets in graph.items() for b in targets if _rank(b) > _rank(a))
    assert not back, f"imports that run back up the layers: {back}"


def test_the_layer_rule_sees_a_new_back_arrow(tmp_path: Path) -> None:
    planted = tmp_path / "sandbox_server"
    for name, body in {
        "__init__.py": "",
        "sandbox/__init__.py": '"""Imports nothing above."""',
        "sandbox/engine.py": "from sandbox_server.protocol.server import X\n",
        "protocol/__init__.py": '"""May import anything below."""',
        "protocol/server.py": "from sandbox_server.sandbox import engine\nX = 1\n",
    }.items():
        (planted / name).parent.mkdir(parents=True, exist_ok=True)
        (planted / name).write_text(body)
    graph = _graph(planted)
    assert graph["sandbox_server.sandbox.engine"] == {"sandbox_server.protocol.server"}
    assert _rank("sandbox_server.protocol.server") > _rank("sandbox_server.sandbox.engine")
    assert _cycle(graph) == [
        "sandbox_server.protocol.server",
        "sandbox_server.sandbox.engine",
        "sandbox_server.protocol.server",
    ]


def test_no_import_circle_in_the_package_or_the_benchmarks() -> None:
    assert _cycle(_graph(PACKAGE)) == []
    assert _cycle(_graph(ROOT / "bench")) == []


def test_modules_stay_small_and_the_top_level_holds_few() -> None:
    long = {
        path.relative_to(PACKAGE).as_posix(): lines
        for path in PACKAGE.rglob("*.py")
        if (lines := len(path.read_text().splitlines())) > MAX_LINES
    }
    assert not long, f"modules over {MAX_LINES} lines: {long}"
    assert len(list(PACKAGE.glob("*.py"))) <= 8


def test_only_the_engine_modules_import_docker() -> None:
    assert _importers("docker") == {
        "sandbox/engine.py",
        "sandbox/host_config.py",
        "sandbox/removal.py",
        "sandbox/docker_runtime.py",
        "sandbox/service_containers.py",
        "network/proxies.py",
    }


def test_only_the_protocol_layer_the_token_check_and_the_one_shot_client_import_mcp() -> None:
    # access/auth.py checks bearer tokens through the SDK's verifier interface; cli/client.py is an MCP client.
    speaking = _importers("mcp") | _importers("mcp_types")
    outside = {name for name in speaking if not name.startswith("protocol/")}
    assert outside == {"access/auth.py", "cli/client.py"}
    assert "protocol/server.py" in speaking


def test_every_document_the_code_names_is_in_the_repository() -> None:
    named: set[str] = set()
    for folder in ("sandbox_server", "images", "policies", "scripts", "tests", "bench"):
        for path in (ROOT / folder).rglob("*"):
            if (
                path.is_file()
                and path.suffix in ("", ".py", ".yaml", ".json", ".sh")
                and "__pycache__" not in path.parts
                and "node_modules" not in path.parts  # packages npm installed for a test, not the project's
            ):
                named |= set(re.findall(r"[\w./-]+\.md\b", path.read_text(errors="replace")))
    missing = sorted(name for name in named if not (ROOT / name).is_file())
    assert named and not missing, f"the code names documents the repository does not hold: {missing}"


def test_the_wheel_carries_every_folder_of_the_package() -> None:
    import tomllib

    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    folders = {f"sandbox_server.{path.parent.name}" for path in PACKAGE.glob("*/__init__.py")}
    assert folders <= listed, f"folders the wheel would leave out: {sorted(folders - listed)}"
