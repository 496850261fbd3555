"""Every `sandbox-server …` command the README and docs/ show parses as the command line reads it: a reader who
copies one gets the command, not `unrecognized arguments`; those that need no engine (policy, token) are run as
each page shows them, in its order (those that need it: tests/test_doc_commands_run.py). A synopsis
(`fork|snapshot`, `[NAME…]`, `…`) is a summary rather than a command, and what follows a shell operator
(`> file`, `| jq`) is the shell's."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from sandbox_server.cli.main import build_parser
from tests.conftest import run_cli

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
INLINE = re.compile(r"`((?:\.venv/bin/)?sandbox-server [^`]+)`")
FENCED = re.compile(r"```[a-z]*\n(.*?)```", re.DOTALL)
NOT_COMMANDS = {"sandbox-server egress": "the comment that marks the server's firewall rules"}
SHELL = {">", ">>", "|", "&&", ";", "2>&1", "&"}


def _synopsis(command: str) -> bool:
    unquoted = re.sub(r"'[^']*'|\"[^\"]*\"", "", command)
    return "…" in unquoted or re.search(r"\w\|\w|\[\w", unquoted) is not None


def _commands() -> list[tuple[str, str]]:
    found = []
    for page in PAGES:
        text = page.read_text()
        shown = [" ".join(match.split()) for match in INLINE.findall(text)]
        for block in FENCED.findall(text):
            for line in block.replace("\\\n", " ").splitlines():
                line = line.strip().removeprefix("$ ")
                if re.match(r"(\.venv/bin/)?sandbox-server ", line):
                    shown.append(line.split(" # ", 1)[0].strip())
        found += [(page.name, c) for c in shown if c not in NOT_COMMANDS and not _synopsis(c)]
    return found


COMMANDS = _commands()


def test_the_pages_show_commands() -> None:
    assert len(COMMANDS) >= 30, COMMANDS


@pytest.mark.parametrize(("page", "command"), COMMANDS, ids=[f"{p}: {c[:70]}" for p, c in COMMANDS])
def test_a_command_the_docs_show_parses(page: str, command: str) -> None:
    words = shlex.split(command)[1:]
    words = words[: next((i for i, word in enumerate(words) if word in SHELL), len(words))]
    try:
        build_parser().parse_args(words)
    except SystemExit as exited:
        raise AssertionError(f"{page}: `{command}` does not parse (exit {exited.code})") from None


def test_the_readme_names_every_tool_the_prefix_renames() -> None:
    from sandbox_server.tools import all_tools

    paragraph = next(part for part in (ROOT / "README.md").read_text().split("\n\n") if "--tool-prefix sbx_" in part)
    named = set(re.findall(r"`sbx_(\w+)`", paragraph))
    assert named == {tool.name for tool in all_tools()}, named


RUN = ("policy", "token")
"""Commands run whole, in the order each page shows them: they need no engine and take a moment each."""


@pytest.mark.parametrize("page", sorted({page for page, c in COMMANDS if c.split()[1] in RUN}))
def test_the_policy_and_token_commands_a_page_shows_run_as_shown(page: str, tmp_path: Path) -> None:
    (tmp_path / "my-policy.yaml").write_text("extends: default\n")  # the reader's own policy, as the page supposes
    (tmp_path / "my-policy.tests.yaml").write_text("cases: [{tool: execute_command, arguments: {command: ls}, "
                                                   "expect: allowed}]\n")  # fmt: skip
    (tmp_path / "changed.yaml").write_text("extends: default\nname: default\n")  # a change that changes nothing
    (tmp_path / "audit.jsonl").write_text("")  # a trail of no calls yet
    for _, command in ((p, c) for p, c in COMMANDS if p == page and c.split()[1] in RUN):
        words = shlex.split(command)
        cut = next((i for i, word in enumerate(words) if word in SHELL), len(words))
        done = run_cli(*words[1:cut], cwd=tmp_path)
        differ = words[1:3] == ["policy", "diff"]  # exits 1 when the two differ, as the pages' two do
        assert done.returncode == (1 if differ else 0), f"{page}: `{command}` failed: {done.stderr or done.stdout}"
        if words[cut : cut + 1] == [">"]:
            (tmp_path / words[cut + 1]).write_text(done.stdout)
