"""Warm interpreters: python-data containers import the data libraries before their call exists."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from sandbox_server.sandbox.engine.runtime import DockerRuntime
from tests.mcp_harness import CheckedClient, audit_records, connect, preloaded, stdio_parameters, text_of

pytestmark = pytest.mark.anyio

DATA = "sandbox-server/python-data:latest"

PROBE = (
    "import sys, os\n"
    "import pandas as pd\n"
    "mine = sorted(k for k in globals() if not k.startswith('__'))\n"
    "warm = open('/tmp/.sandbox-warm/errors').read() if os.path.exists('/tmp/.sandbox-warm/errors') else ''\n"
    "import matplotlib.pyplot as plt\n"
    "(mine, 'duckdb' in sys.modules, pd is sys.modules['pandas'], __name__, plt.get_fignums(), os.getcwd(),\n"
    " os.environ.get('SANDBOX_PRELOAD'), 'preloaded in' in warm)"
)


async def _cell(session: CheckedClient, code: str) -> dict[str, Any]:
    result = await session.call_tool("run_python", {"code": code})
    assert result.structured_content is not None, text_of(result)
    return {**result.structured_content, "is_error": result.is_error, "text": text_of(result)}


def _policy(tmp_path: Path, body: str) -> str:
    policy = tmp_path / "policy.yaml"
    policy.write_text("extends: default\nworkspace: {persist: false}\n" + body)
    return str(policy)


async def test_a_cell_in_a_warm_interpreter_sees_a_clean_namespace_and_the_preloaded_modules(
    tmp_path: Path, runtime: DockerRuntime
) -> None:
    audit = tmp_path / "audit.jsonl"
    async with connect(stdio_parameters("--policy", _policy(tmp_path, ""), "--audit-log", str(audit))) as session:
        await preloaded(runtime.api, tmp_path)
        first = await _cell(session, PROBE)
        await preloaded(runtime.api, tmp_path)  # the pool's next interpreter, not one still importing
        second = await _cell(session, PROBE)
    assert not first["is_error"], first["text"]
    values = first["stdout"].strip()
    # Only what the cell made; duckdb imported before the cell (it never imports it); the user's own
    # `import pandas` is the preloaded module; no figure it did not make; the cold start's folder.
    assert values == ("(['os', 'pd', 'sys'], True, True, '__main__', [], '/workspace', None, True)"), values
    assert second["stdout"] == first["stdout"]
    containers = [record["container_id"] for record in audit_records(audit)]
    assert len(set(containers)) == 2  # still one container per call


async def test_a_cell_that_breaks_the_preloaded_libraries_breaks_only_itself(
    tmp_path: Path, runtime: DockerRuntime
) -> None:
    breaking = (
        "import sys, matplotlib.pyplot as plt, pandas\n"
        "plt.plot = None\n"
        "pandas.DataFrame = None\n"
        "del sys.modules['numpy']\n"
        "plt.figure()\n"
        "'broken'"
    )
    working = (
        "import matplotlib.pyplot as plt, pandas as pd\n"
        "plt.plot(pd.DataFrame({'x': [1, 2, 3]}).x)\n"
        "len(plt.get_fignums())"
    )
    async with connect(stdio_parameters("--policy", _policy(tmp_path, ""))) as session:
        broken = await _cell(session, breaking)
        after = await _cell(session, working)
    assert not broken["is_error"] and broken["stdout"].strip() == "'broken'", broken["text"]
    assert not after["is_error"] and after["stdout"].strip() == "1", after["text"]
    assert [f["path"] for f in after["files"]] == ["figure-1.png"]


async def test_a_call_that_comes_while_its_interpreter_imports_waits_for_no_library_it_does_not_use(
    tmp_path: Path, runtime: DockerRuntime
) -> None:
    """The server's first container is made before it answers; a call at once finds it importing a long list, and
    the interpreter stops at the next module: the cell runs without waiting for statsmodels or polars. (Where each
    sandbox has an interpreter of its own: one forked from a warm template finds it has imported them all.)"""
    long = (
        "tools:\n  run_python:\n    preload: [numpy, pandas, sklearn, scipy.stats, statsmodels.api, seaborn, polars]\n"
    )
    async with connect(stdio_parameters("--policy", _policy(tmp_path, long), "--sandboxes", "runc")) as session:
        cell = await _cell(
            session, "import sys\n('statsmodels' in sys.modules, open('/tmp/.sandbox-warm/errors').read())"
        )
    assert not cell["is_error"], cell["text"]
    assert cell["stdout"].startswith("(False, "), cell["stdout"]  # never imported: the cell did not use it
    assert "a call came: " in cell["stdout"] and "are left to the program" in cell["stdout"]


async def test_a_module_that_cannot_be_preloaded_leaves_the_call_working(
    tmp_path: Path, runtime: DockerRuntime
) -> None:
    policy = _policy(tmp_path, "tools:\n  run_python:\n    preload: [no_such_module, pandas]\n")
    async with connect(stdio_parameters("--policy", policy)) as session:
        await preloaded(runtime.api, tmp_path)  # a call that came sooner would stop it before the missing module
        cell = await _cell(session, "import sys\n(open('/tmp/.sandbox-warm/errors').read(), 'pandas' in sys.modules)")
    assert not cell["is_error"], cell["text"]
    assert "preload no_such_module: ModuleNotFoundError" in cell["stdout"] and cell["stdout"].strip().endswith("True)")


async def test_a_program_that_is_not_the_images_own_python_stops_the_warm_interpreter_first(
    tmp_path: Path, runtime: DockerRuntime
) -> None:
    body = "tools:\n  execute_command:\n    image: sandbox-server/python-data:latest\n    preload: [pandas]\n"
    listing = "for f in /proc/[0-9]*/cmdline; do tr '\\0' ' ' < $f; echo; done"
    async with connect(stdio_parameters("--policy", _policy(tmp_path, body))) as session:
        result = await session.call_tool("execute_command", {"command": listing})
    assert result.structured_content is not None and not result.is_error, text_of(result)
    assert "warm_python" not in result.structured_content["stdout"]
    assert "for f in" in result.structured_content["stdout"]  # the listing saw its own shell


@pytest.mark.parametrize(
    ("sandboxes", "imported"),
    [("runc", "True"), ("auto", "False")],
    ids=["a container imports the list on the call's path", "a forked one while its template imports: what it uses"],
)
async def test_a_cold_sandbox_runs_the_cell_as_a_warm_one_does(
    tmp_path: Path, runtime: DockerRuntime, sandboxes: str, imported: str
) -> None:
    """No sandbox waits (no pool), so the first call's is cold. A container started by runc imports the preload
    list on the call's path; one forked while its warm template is still importing that list leaves the cell to
    import what it uses (no second interpreter importing it all beside the template). The cell sees the same."""
    policy = _policy(tmp_path, "")
    async with connect(stdio_parameters("--policy", policy, "--no-pool", "--sandboxes", sandboxes)) as session:
        cold = await _cell(session, PROBE)
    assert not cold["is_error"], cold["text"]
    # duckdb never imported: a call coming at once stops the preloading at the next module
    expected = f"(['os', 'pd', 'sys'], False, True, '__main__', [], '/workspace', None, {imported})"
    assert cold["stdout"].strip() == expected, cold["text"]


async def test_a_warm_interpreter_gives_the_program_the_environment_a_plain_one_has(
    tmp_path: Path, runtime: DockerRuntime
) -> None:
    tricky = 'it\'s "quoted"\nover = two lines, $HOME `x` \\ ü'
    environment = "defaults:\n  env:\n    set: {TRICKY: " + json.dumps(tricky) + "}\n"
    cell = (
        "import os\nprint(repr(os.environ['TRICKY']))\n"
        "(os.path.exists('/tmp/.sandbox-warm/errors'), sorted(os.environ.items()))"
    )
    seen = []
    for preload in ("", "tools:\n  run_python: {preload: []}\n"):
        async with connect(stdio_parameters("--policy", _policy(tmp_path, environment + preload))) as session:
            if not preload:
                await preloaded(runtime.api, tmp_path)  # a warm interpreter waiting, not a sandbox made cold
            result = await _cell(session, cell)
        assert not result["is_error"], result["text"]
        first, _, rest = result["stdout"].partition("\n")
        assert first == repr(tricky)
        seen.append(rest)
    warm, plain = seen
    assert warm.startswith("(True, ") and plain.startswith("(False, ")
    assert warm.removeprefix("(True, ") == plain.removeprefix("(False, ") and "SANDBOX_" not in warm


async def test_matplotlibs_font_list_comes_built_with_the_image(tmp_path: Path, runtime: DockerRuntime) -> None:
    policy = _policy(tmp_path, "tools:\n  run_python: {preload: []}\n")
    cell = "import os, sys\n(sorted(os.listdir(os.environ['MPLCONFIGDIR'])), 'matplotlib' in sys.modules)"
    async with connect(stdio_parameters("--policy", policy, "--no-pool")) as session:
        result = await _cell(session, cell)
    # Before the cell imports matplotlib, its cache folder already holds the image's font list.
    assert not result["is_error"] and result["stdout"].startswith("(['fontlist-v"), result["text"]
    assert result["stdout"].strip().endswith("False)"), result["text"]


USER_SITE = ".local/lib/python3.11/site-packages"


async def test_a_warm_interpreter_finds_packages_in_the_workspaces_user_site_as_a_plain_one_does(
    tmp_path: Path, runtime: DockerRuntime
) -> None:
    """What `pip install --user` leaves in the workspace (PYTHONUSERBASE) is importable, and first on the path."""
    files = [
        {"path": f"{USER_SITE}/usermark.py", "content": "WHERE = __file__\n"},
        # Ahead of the image's own packages (not of the standard library), as in a fresh interpreter.
        {"path": f"{USER_SITE}/openpyxl.py", "content": "SHADOWED = True\n"},
        {"path": f"{USER_SITE}/extra.pth", "content": "/workspace/extra\n"},
        {"path": "extra/frompth.py", "content": ""},
    ]
    cell = (
        "import os, sys, usermark, frompth, openpyxl\n"
        "(os.path.exists('/tmp/.sandbox-warm/errors'), usermark.WHERE, hasattr(openpyxl, 'SHADOWED'), sys.path)"
    )
    seen = []
    for preload in ("", "tools:\n  run_python: {preload: []}\n"):
        async with connect(stdio_parameters("--policy", _policy(tmp_path, preload))) as session:
            if not preload:
                await preloaded(runtime.api, tmp_path)  # a warm interpreter waiting, not a sandbox made cold
            result = await session.call_tool("run_python", {"code": cell, "files": files})
        assert result.structured_content is not None and not result.is_error, text_of(result)
        seen.append(result.structured_content["stdout"].strip())
    warm, plain = seen
    assert warm.startswith(f"(True, '/workspace/{USER_SITE}/usermark.py', True, ['/usr/local/lib/sandbox', "), warm
    assert warm.removeprefix("(True, ") == plain.removeprefix("(False, ")
    assert f"'/workspace/{USER_SITE}', '/workspace/extra', '/usr/local/lib/python3.11/dist-packages'" in warm


async def test_a_user_site_with_its_own_version_of_a_preloaded_library_gets_a_fresh_interpreter(
    tmp_path: Path, runtime: DockerRuntime
) -> None:
    """Say `pip install --user -U duckdb`: the preloaded one cannot be taken back, so the call starts afresh."""
    files = [{"path": f"{USER_SITE}/duckdb/__init__.py", "content": "MINE = True\n"}]
    cell = (
        "import os, sys, duckdb\n"
        "(os.path.exists('/tmp/.sandbox-warm/errors'), getattr(duckdb, 'MINE', False), 'pandas' in sys.modules)"
    )
    async with connect(stdio_parameters("--policy", _policy(tmp_path, ""))) as session:
        await preloaded(
            runtime.api, tmp_path
        )  # duckdb imported before the call: only a fresh interpreter gives the user's
        result = await session.call_tool("run_python", {"code": cell, "files": files})
        await preloaded(runtime.api, tmp_path)  # the pool's next container has imported too
        plain = await _cell(
            session, "import os, sys\n(os.path.exists('/tmp/.sandbox-warm/errors'), 'pandas' in sys.modules)"
        )
    assert result.structured_content is not None and not result.is_error, text_of(result)
    # A warm container (it had preloaded), yet the program's duckdb is the user's and nothing was imported before it.
    assert result.structured_content["stdout"].strip() == "(True, True, False)", text_of(result)
    assert plain["stdout"].strip() == "(True, True)", plain["text"]  # without one, the warm interpreter serves


FORKED_THEN_KILLED = (
    "import os, signal, time\n"
    "if os.fork() == 0:\n"
    "    time.sleep(60)  # a child of the cell, alive when its parent dies\n"
    "    os._exit(0)\n"
    "os.kill(os.getpid(), signal.SIGKILL)\n"
)


async def test_a_warm_interpreters_exit_code_is_its_programs_and_a_forked_child_does_not_hold_the_answer_back(
    tmp_path: Path, runtime: DockerRuntime
) -> None:
    # The launcher answers once the interpreter has ended: its exit code is the program's, and a child it forked
    # that outlives it (killed with the sandbox's other leftovers) does not keep the call waiting until its
    # deadline, to be reported as timed out.
    policy = _policy(tmp_path, "tools:\n  run_python:\n    limits: {timeout_s: 20}\n")
    async with connect(stdio_parameters("--policy", policy)) as session:
        await preloaded(runtime.api, tmp_path)
        exits = await _cell(session, "print('before')\nraise SystemExit(3)")
        zero = await _cell(session, "import sys\nprint('ok', flush=True)")
        killed = await _cell(session, FORKED_THEN_KILLED)
    assert (exits["exit_code"], exits["stdout"]) == (3, "before\n"), exits["text"]
    assert (zero["exit_code"], zero["is_error"], zero["stdout"]) == (0, False, "ok\n"), zero["text"]
    assert not killed["timed_out"] and killed["exit_code"] in (None, 137), killed["text"]
    assert killed["is_error"] and "timed out" not in killed["text"], killed["text"]
