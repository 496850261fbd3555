"""The contract between host and launchers is written once and holds on both sides."""

from __future__ import annotations

import ast
import json

import pytest

from sandbox_server import shipped
from sandbox_server.policy import ToolPolicy
from sandbox_server.sandbox import wire
from sandbox_server.sandbox.engine.runtime import DockerRuntime
from sandbox_server.tools.analyze_csv import analysis_request
from tests.mcp_harness import connect, stdio_parameters, text_of

CONTRACT = {name: getattr(wire, name) for name in dir(wire) if name.isupper()}


def test_the_shell_launcher_and_the_base_image_use_the_contracts_paths() -> None:
    base = shipped.images_dir() / "base"
    launcher = (base / "sandbox-launch").read_text()
    assert f"cd {wire.OUTPUT_DIR} " in launcher
    assert f"{wire.REQUEST_DIR}/request" in launcher and f"{wire.REQUEST_DIR}/stdin" in launcher
    assert f"cd {wire.WORKSPACE} " in launcher
    assert f"[ -r {wire.WARM_PYTHON} ]" in launcher and f"python3 -s {wire.WARM_PYTHON} " in launcher
    assert f"mkfifo -m 600 {wire.WARM_JOB}" in launcher and f"{wire.WARM_DIR}/argv" in launcher
    assert f"python3:{wire.LAUNCHERS_DIR}/*.py" in launcher and f"${{{wire.PRELOAD_ENV}:-}}" in launcher
    assert f"COPY sandbox-launch {wire.LAUNCHER}" in (base / "Dockerfile").read_text()


def test_an_analysis_request_has_exactly_the_contracts_keys() -> None:
    request = analysis_request({"filepath": "data.csv", "operations": ["count"]}, ToolPolicy(), "default")
    assert sorted(request) == sorted(wire.ANALYSIS_REQUEST_KEYS)


def test_the_python_launchers_import_one_another_without_a_circle() -> None:
    folder = shipped.images_dir() / "python-data"
    local = {path.stem for path in folder.glob("*.py")} | {"sandbox_wire"}
    edges: dict[str, set[str]] = {}
    for path in folder.glob("*.py"):
        imported: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                imported |= {alias.name for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module:
                imported.add(node.module)
        edges[path.stem] = imported & local

    def reaches(start: str, target: str, seen: frozenset[str] = frozenset()) -> bool:
        return any(n == target or (n not in seen and reaches(n, target, seen | {n})) for n in edges.get(start, ()))

    assert [name for name in edges if reaches(name, name)] == []
    assert "sandbox_wire" in edges["run_cell"] and "sandbox_wire" in edges["analyze_csv"]


@pytest.mark.anyio
async def test_the_python_image_holds_the_hosts_contract(runtime: DockerRuntime) -> None:
    code = "import json, sandbox_wire as w\njson.dumps({n: getattr(w, n) for n in dir(w) if n.isupper()})"
    async with connect(stdio_parameters()) as session:
        result = await session.call_tool("run_python", {"code": code})
    assert not result.is_error, text_of(result)
    assert result.structured_content is not None
    in_image = json.loads(ast.literal_eval(result.structured_content["stdout"].strip()))
    assert in_image == json.loads(json.dumps(CONTRACT))


def test_the_base_image_holds_the_session_shell_at_the_path_the_host_names() -> None:
    from sandbox_server.tools.shell_session import SESSION, SHELL_STATE, SOURCE

    base = shipped.images_dir() / "base"
    assert f"COPY shell-session.bash {SESSION}" in (base / "Dockerfile").read_text()
    assert SESSION.startswith(wire.LAUNCHERS_DIR + "/")
    assert f"__sbx_state={wire.WORKSPACE}/{SHELL_STATE} " in SOURCE and f"{wire.REQUEST_DIR}/shell" in SOURCE


def test_the_session_shell_runs_from_the_image_only_in_the_catalogs_images() -> None:
    from sandbox_server.sandbox.engine.images import catalog
    from sandbox_server.tools.shell_session import OURS, SCRIPT, SESSION, session_argv

    assert set(OURS) == set(catalog()) - {"proxy"}
    ours = session_argv("make", "sandbox-server/toolchain:latest", False, True)
    assert ours == (("/bin/bash", "-c", "make", "bash"), (("BASH_ENV", SESSION), ("SANDBOX_SHELL", "reset")))
    inline, added = session_argv("make", "sandbox-server/team-tools:abc", True, False)
    assert inline[:2] == ("/bin/sh", "-c") and inline[3:6] == ("/bin/bash", "make", "workdir") and inline[6] == SCRIPT
    assert added == () and session_argv("ls", "debian:bookworm", False, False)[0][0] == "/bin/sh"
