"""The house of docs/design.md: layers that import only downward, no circle, small modules, the engine behind
a few modules and MCP behind the protocol layer."""

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "sandbox_server"
LAYERS = [  # lowest first: a module imports from its own layer and those below, never from above
    {"__init__", "errors", "shipped", "views", "words"},
    {"state"},
    {"sandbox"},
    {"network"},
    {"policy"},
    {"tools", "workspaces", "access", "services"},
    {"calls", "ops", "tasks"},
    {"protocol"},
    {"cli", "__main__"},
]
SOFT_LINES = 400
"""A module past this holds one idea that is long to say, and is named in LONG_MODULES with that idea; others
split where their ideas part, never merely to stay under a number."""
HARD_LINES = 600
LONG_MODULES: dict[str, str] = {
    "sandbox/pool.py": "warm containers: made ahead in the pauses between calls, within a memory budget, each taken "
    "by one call",
    "tasks/manager.py": "the running tasks: started past their caps, run in the server's group, read, cancelled, "
    "ended and kept",
    "calls/pipeline.py": "one call's stages, from its arguments to its outcome",
    "network/proxies.py": "one server's egress proxies: each allow list's network, proxy container, log and "
    "firewall opening, started, watched, restarted and removed",
    "protocol/preview.py": "a service opened in a person's browser: who may open it, from which page, and its "
    "HTTP and WebSocket carried to it",
    "workspaces/transfer.py": "a workspace as one file: written in one pass, and read back (an export, or a plain tar "
    "of files) trusting nothing in it",
}
MAX_METHODS = 20
"""Methods of one class: past this it likely holds two ideas."""
WIDE_CLASSES: dict[str, str] = {}
MAX_FUNCTION_LINES = 80
TABLE_LINES = 120
"""A table too (one declaration after another) is cut where its declarations part, past this."""
"""Lines of one function, its docstring included: past this it does several things that could each be named."""
TABLES = {
    "cli/main.py:build_parser": "the commands' argument parsers, one declaration after another",
    "cli/options.py:add_serve_arguments": "serve's options, one declaration after another",
    "sandbox/runc/oci.py:oci_config": "the OCI runtime configuration of a sandbox, field by field",
    "network/egress.py:squid_config": "the proxy's configuration file, directive by directive",
}
"""Functions past MAX_FUNCTION_LINES that are declarative tables, with what they declare."""
FOREIGN_PROBES = {
    "protocol/stdio_errors.py": "the SDK's read stream, which has a sender's context on some transports alone",
    "sandbox/archive.py": "a tar's file object, a real file (whose descriptor is read in place) or a buffer",
    "sandbox/engine/runtime.py": "docker-py's attach socket, a socket or its wrapper depending on the version",
}
"""Modules that ask a foreign object (the SDK's, the standard library's, docker-py's) what it is, and why."""
MAX_PARAMETERS = 8
"""Parameters of one function (self aside): past this the call site cannot be read without the signature."""
WIDE_FUNCTIONS = {
    "tasks/manager.py:start": "what one task is: its caps, owner, caller, tool, memory, ttl, work and end",
    "sandbox/archive.py:build_request": "the launcher's request, each part a field of the wire format",
}


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
    sizes = {path.relative_to(PACKAGE).as_posix(): len(path.read_text().splitlines()) for path in PACKAGE.rglob("*.py")}
    long = {name: lines for name, lines in sizes.items() if lines > SOFT_LINES and name not in LONG_MODULES}
    assert not long, f"modules over {SOFT_LINES} lines that LONG_MODULES does not name with their one idea: {long}"
    too_long = {name: lines for name, lines in sizes.items() if lines > HARD_LINES}
    assert not too_long, f"modules over {HARD_LINES} lines: {too_long}"
    assert not set(LONG_MODULES) - {name for name, lines in sizes.items() if lines > SOFT_LINES}, "stale LONG_MODULES"
    assert len(list(PACKAGE.glob("*.py"))) <= 8


def _definitions() -> tuple[dict[str, int], dict[str, int]]:
    """Methods per class and parameters per function (self and cls aside), as `path:name`."""
    methods: dict[str, int] = {}
    parameters: dict[str, int] = {}
    for path in PACKAGE.rglob("*.py"):
        where = path.relative_to(PACKAGE).as_posix()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                body = [item for item in node.body if isinstance(item, ast.FunctionDef | ast.AsyncFunctionDef)]
                methods[f"{where}:{node.name}"] = len(body)
            elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                given = node.args
                named = [*given.posonlyargs, *given.args, *given.kwonlyargs, given.vararg, given.kwarg]
                count = sum(1 for arg in named if arg is not None and arg.arg not in ("self", "cls"))
                key = f"{where}:{node.name}"
                parameters[key] = max(parameters.get(key, 0), count)
    return methods, parameters


def test_classes_hold_one_idea_and_functions_take_few_parameters() -> None:
    methods, parameters = _definitions()
    wide = {name: count for name, count in methods.items() if count > MAX_METHODS and name not in WIDE_CLASSES}
    assert not wide, f"classes with more than {MAX_METHODS} methods (split them by idea, or say why): {wide}"
    many = {name: n for name, n in parameters.items() if n > MAX_PARAMETERS and name not in WIDE_FUNCTIONS}
    assert not many, f"functions with more than {MAX_PARAMETERS} parameters (hand a whole object): {many}"
    assert not {*WIDE_CLASSES} - {name for name, count in methods.items() if count > MAX_METHODS}, "stale WIDE_CLASSES"
    assert not {*WIDE_FUNCTIONS} - {n for n, count in parameters.items() if count > MAX_PARAMETERS}, "stale entries"


def test_functions_stay_short_and_parts_are_asked_nothing_of_what_they_are() -> None:
    """Every function under MAX_FUNCTION_LINES (tables under TABLE_LINES); no getattr/hasattr probe of the package's own parts
    (a part says what it is in its type); no private name of a package module used from another module."""
    long, probes, crossed = {}, [], []
    defined: dict[str, set[str]] = {}
    trees = {path.relative_to(PACKAGE).as_posix(): ast.parse(path.read_text()) for path in PACKAGE.rglob("*.py")}
    for where, tree in trees.items():
        own = defined.setdefault(where, set())
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                own.add(node.name)
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                own.add(node.attr)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                own.add(node.id)
    private_anywhere = {name for names in defined.values() for name in names if name.startswith("_")}
    for where, tree in trees.items():
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                lines = (node.end_lineno or node.lineno) - node.lineno + 1
                if lines > (TABLE_LINES if f"{where}:{node.name}" in TABLES else MAX_FUNCTION_LINES):
                    long[f"{where}:{node.name}"] = lines
            elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
                if node.func.id in ("getattr", "hasattr") and where not in FOREIGN_PROBES:
                    probes.append(f"{where}:{node.lineno}: {ast.unparse(node)}")
            elif isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
                base = ast.unparse(node.value)
                theirs = node.attr in private_anywhere and node.attr not in defined[where]
                if base not in ("self", "cls", "super()") and theirs:
                    crossed.append(f"{where}:{node.lineno}: {ast.unparse(node)}")
            elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("sandbox_server"):
                crossed += [f"{where}: from {node.module} import {a.name}" for a in node.names if a.name[0] == "_"]
    crossed = [c for c in crossed if not c.endswith("import __version__")]
    assert not long, (
        f"functions over {MAX_FUNCTION_LINES} lines (name their steps, or TABLES says what they declare): {long}"
    )
    assert not {*TABLES} - {
        f"{w}:{n.name}" for w, tr in trees.items() for n in ast.walk(tr) if isinstance(n, ast.FunctionDef)
    }
    assert not probes, f"parts asked what they are (declare it in their type): {probes}"
    assert not crossed, f"private names used outside their module (make them public, or keep them home): {crossed}"


def test_no_context_variable_carries_a_call_across_modules() -> None:
    """A call's hooks and state are handed down in signatures (calls.call.Call, sandbox.runtime.RunHooks), so the
    import graph shows every arrow: a ContextVar may serve its own module alone."""
    shared = {}
    for path in PACKAGE.rglob("*.py"):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Assign | ast.AnnAssign) and isinstance(node.value, ast.Call):
                called = ast.unparse(node.value.func)
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                if called.endswith("ContextVar") and any(not ast.unparse(t).startswith("_") for t in targets):
                    shared[path.relative_to(PACKAGE).as_posix()] = [ast.unparse(t) for t in targets]
    assert not shared, f"context variables other modules may use (hand them down instead): {shared}"


def test_the_wiring_hands_every_part_its_collaborators_in_its_constructor() -> None:
    """Where parts are built and served, nothing is set on a part after it was made (the SDK's and uvicorn's own
    objects aside)."""
    theirs = {"capabilities.tasks", "server.should_exit"}
    wiring = [*sorted((PACKAGE / "cli").glob("*.py")), PACKAGE / "protocol" / "server.py"]
    set_after = []
    for path in wiring:
        for node in ast.walk(ast.parse(path.read_text())):
            targets = (
                node.targets
                if isinstance(node, ast.Assign)
                else [node.target]
                if isinstance(node, ast.AnnAssign)
                else []
            )
            for target in targets:
                for part in ast.walk(target):
                    if isinstance(part, ast.Attribute) and ast.unparse(part.value) not in ("self", "cls"):
                        if ast.unparse(part) not in theirs:
                            set_after.append(f"{path.name}: {ast.unparse(part)}")
    assert not set_after, f"collaborators set after construction: {set_after}"


def test_only_the_engine_modules_import_docker() -> None:
    assert _importers("docker") == {
        "sandbox/engine/connection.py",
        "sandbox/engine/host_config.py",
        "sandbox/engine/removal.py",
        "sandbox/engine/runtime.py",
        "sandbox/engine/services.py",
        "sandbox/runc/runtime.py",
        "sandbox/runc/veth.py",
        "network/proxies.py",
        "network/upstream.py",
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
