"""Policies and their tests files read as hostile input: an alias bomb, nesting a hundred thousand deep, a link to an
endless device and a FIFO each come back as a finding naming the file, at once, never a traceback or a hang."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from sandbox_server.errors import ConfigError
from sandbox_server.ops.policy_tests import load_cases
from sandbox_server.policy.loader import HostFacts, policy_errors
from sandbox_server.tools import all_tools

TOOLS = [tool.name for tool in all_tools()]
LAUGHS = "a: &a [x, x, x, x, x, x, x, x, x]\n" + "".join(
    f"{chr(98 + n)}: &{chr(98 + n)} [{', '.join([f'*{chr(97 + n)}'] * 9)}]\n" for n in range(9)
)


def _written(folder: Path, name: str, text: str) -> Path:
    path = folder / name
    path.write_text(text)
    return path


def test_an_alias_bomb_in_a_tests_file_is_refused_at_once(tmp_path: Path) -> None:
    bomb = _written(tmp_path, "p.tests.yaml", LAUGHS + "cases: *j\n")
    started = time.monotonic()
    with pytest.raises(ConfigError) as refused:
        load_cases(bomb)
    assert time.monotonic() - started < 2 and "alias bomb" in str(refused.value)  # 54 s to a MemoryError before


@pytest.mark.parametrize("shape", ["deep-yaml", "deep-json", "bomb"])
def test_a_policy_nested_without_end_or_made_of_aliases_is_a_finding(tmp_path: Path, shape: str) -> None:
    text = {
        "deep-yaml": "defaults: " + "[" * 100_000 + "]" * 100_000 + "\n",
        "deep-json": "{" + '"a": {' * 200_000 + "}" * 200_001,
        "bomb": LAUGHS + "description: *j\n",
    }[shape]
    path = _written(tmp_path, "p.yaml", text)
    [error] = policy_errors(path, TOOLS, HostFacts(frozenset({"runc"})))
    assert error.startswith(f"{path}: not valid YAML: ") and ("nested" in error or "alias" in error), error[:300]


def test_a_policy_that_is_a_link_to_an_endless_device_or_a_fifo_is_not_read(tmp_path: Path) -> None:
    os.symlink("/dev/zero", tmp_path / "zero.yaml")
    os.mkfifo(tmp_path / "fifo.yaml")
    for name in ("zero.yaml", "fifo.yaml"):
        [error] = policy_errors(tmp_path / name, TOOLS, HostFacts(frozenset({"runc"})))
        assert error.endswith(": not a regular file") and ": cannot read: " in error, error
