"""The package stands on its own: built as a wheel, installed into a fresh virtualenv, used outside the clone."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

from sandbox_server.sandbox.engine.runtime import DockerRuntime
from tests.conftest import ROOT

INSTALL_TIMEOUT_S = 600
LOCAL_ONLY = (".git", ".venv", ".cache", "build", "dist", "*.egg-info", "__pycache__", ".pytest_cache", "results")
"""What a checkout may hold beside its sources."""


def _run(*command: str | Path, cwd: Path, timeout_s: float = 180) -> subprocess.CompletedProcess[str]:
    environment = {key: value for key, value in os.environ.items() if key not in ("PYTHONPATH", "VIRTUAL_ENV")}
    return subprocess.run(
        [str(part) for part in command],
        cwd=cwd,
        env=environment,
        capture_output=True,
        text=True,
        timeout=timeout_s,
        check=False,
    )


def test_an_installed_wheel_checks_its_policies_lists_its_images_and_runs_a_call(
    tmp_path: Path, runtime: DockerRuntime
) -> None:
    # From a copy of the sources alone: a build folder left in the checkout must not fill in missing files.
    source = tmp_path / "source"
    shutil.copytree(ROOT, source, ignore=shutil.ignore_patterns(*LOCAL_ONLY))
    built = _run(sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", tmp_path / "dist", source, cwd=tmp_path)
    assert built.returncode == 0, built.stderr
    [wheel] = (tmp_path / "dist").glob("sandbox_server-*.whl")
    venv = tmp_path / "venv"
    assert _run(sys.executable, "-m", "venv", venv, cwd=tmp_path).returncode == 0
    installed = _run(venv / "bin/pip", "install", "-q", wheel, cwd=tmp_path, timeout_s=INSTALL_TIMEOUT_S)
    assert installed.returncode == 0, installed.stderr
    command = venv / "bin/sandbox-server"

    where = _run(venv / "bin/python", "-c", "import sandbox_server.shipped as s; print(s.images_dir())", cwd=tmp_path)
    package = Path(where.stdout.strip()).parent
    assert package.is_relative_to(venv), f"the installed package was not the one used: {where.stdout}{where.stderr}"
    tracked = _run("git", "ls-files", "images", "policies", "scripts/engine-up", cwd=ROOT).stdout.split()
    missing = [name for name in tracked if not (package / name).is_file()]
    assert tracked and not missing, f"the wheel lacks shipped files: {missing}"

    views = _run("git", "ls-files", "sandbox_server/views", cwd=ROOT).stdout.split()
    missing = [name for name in views if not (package.parent / name).is_file()]
    assert views and not missing, f"the wheel lacks its views: {missing}"
    pages = "from sandbox_server.protocol.apps import VIEWS, page; print(sum(len(page(v)) > 5000 for v in VIEWS))"
    served = _run(venv / "bin/python", "-c", pages, cwd=tmp_path)
    assert served.stdout.strip() == "5", served.stdout + served.stderr  # each read whole from the installed package

    checked = _run(command, "policy", "check", "default", "strict", "data-science", cwd=tmp_path)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert checked.stdout.count(": ok") == 3, checked.stdout

    listed = _run(command, "images", "list", cwd=tmp_path)
    assert listed.returncode == 0, f"the installed build contexts differ from the built images:\n{listed.stdout}"

    called = _run(command, "call", "execute_command", "--arg", "command=echo from-the-wheel", cwd=tmp_path)
    assert called.returncode == 0, called.stdout + called.stderr
    assert "exit code 0" in called.stdout and "from-the-wheel" in called.stdout
