"""The `sandbox-server …` commands the README and docs/ show that need the engine, run as shown: each `call`, the
`usage` summaries and the listings, from a folder holding the files the pages suppose (`args.json`, `data.csv`,
`notes.txt`) and a state folder of the test's own. A path a page gives as the reader's own (`/var/log/…`,
`/etc/…`) is put in that folder; the command is otherwise the page's. The others are run by the tests named in
ELSEWHERE, and every command a page shows is in one of the two, so that a new one is placed before it lands."""

from __future__ import annotations

import json
import shlex
from pathlib import Path

from sandbox_server.sandbox.engine.runtime import DockerRuntime
from tests.conftest import left_by_exited_servers, run_cli
from tests.fast.test_doc_commands import COMMANDS, SHELL

RUN = ("call", "usage", "images list", "workspace list")
ELSEWHERE = {
    "setup": "the first step of every run of the suite (scripts/run setup, then the tests)",
    "serve": "every engine test's server, under the official client (stdio and Streamable HTTP)",
    "doctor": "tests/test_doctor.py (doctor, and --posture on default, strict, data-science and an allow list)",
    "images build": "tests/test_images.py (a policy's own packages built into an image of its own)",
    "workspace export": "tests/test_workspace_transfer.py (export and import through the command line)",
    "workspace import": "tests/test_workspace_transfer.py",
    "replicas": "tests/test_draining.py (list and drain on a real PostgreSQL)",
    "audit": "tests/test_audit_trail.py (verify, and verify --key, on a real server's sealed trail)",
}
CELL = "import os, pandas as pd\ndf = pd.read_csv('data.csv')\nprint(df)\nos.makedirs('out', exist_ok=True)\ndf.to_csv('out/sales.csv', index=False)"
"""What the reader's args.json asks: the uploaded file read, and a file sent back for --save."""
READERS_PATHS = {"/var/log/sandbox/audit.jsonl": "audit.jsonl"}
"""Paths a page gives as the reader's own, and where this test puts them."""


def _kind(command: str) -> str:
    words = command.split()[1:]
    return " ".join(words[:2]) if words[0] in ("images", "workspace") else words[0]


RUNNING = sorted({c for _, c in COMMANDS if _kind(c) in RUN or _kind(c).split()[0] in RUN})


def test_every_command_the_pages_show_is_run_here_by_the_fast_tier_or_by_a_named_test() -> None:
    kinds = {_kind(c) for _, c in COMMANDS}
    placed = set(RUN) | set(ELSEWHERE) | {"policy", "token"}  # policy and token: tests/fast/test_doc_commands.py
    assert kinds <= placed, f"shown but run nowhere: {kinds - placed}"
    assert {"call", "usage", "images list", "workspace list"} <= kinds


def test_the_engine_commands_the_pages_show_run_as_shown(runtime: DockerRuntime, tmp_path: Path) -> None:
    (tmp_path / "args.json").write_text(json.dumps({"code": CELL}))
    (tmp_path / "data.csv").write_text("city,sales\nOslo,3\nLima,4\n")
    (tmp_path / "notes.txt").write_text("notes\n")
    env = {"SANDBOX_STATE_DIR": str(tmp_path / "state")}
    # The calls first, so that the usage summaries read their audit trail; the listings last.
    order = sorted(RUNNING, key=lambda c: (_kind(c) != "call", c))
    for command in order:
        words = shlex.split(command)
        words = [str(tmp_path / "state" / READERS_PATHS[w]) if w in READERS_PATHS else w for w in words]
        cut = next((i for i, word in enumerate(words) if word in SHELL), len(words))
        done = run_cli(*words[1:cut], cwd=tmp_path, env=env)
        said = done.stdout + done.stderr
        assert "usage: sandbox-server" not in said, f"`{command}` was not understood: {said}"
        if "make test" in command:  # docs/tasks.md's long task: a folder without a Makefile, as make says
            assert done.returncode == 1 and "No rule to make target 'test'" in said and "completed" in said, said
            continue
        assert done.returncode == 0, f"`{command}` failed: {said}"
        if command.startswith("sandbox-server call run_python --json @args.json"):
            assert "Oslo" in done.stdout, said
            assert (tmp_path / "out" / "sales.csv").read_text().startswith("city,sales"), said
        if _kind(command) == "usage":
            assert "local user" in done.stdout, said  # the calls above, summed from the trail
    assert not left_by_exited_servers()
