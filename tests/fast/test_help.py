"""Help and README agree: every option of every command says what it does, and `call --help` its exit codes."""

from __future__ import annotations

import argparse
from collections.abc import Iterator

import pytest

from sandbox_server.cli.main import build_parser


def _commands(
    parser: argparse.ArgumentParser, trail: str = "sandbox-server"
) -> Iterator[tuple[str, argparse.ArgumentParser]]:
    yield trail, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, child in action.choices.items():
                yield from _commands(child, f"{trail} {name}")


def test_every_option_of_every_command_has_help() -> None:
    silent = [
        f"{trail} {action.option_strings[0] if action.option_strings else action.dest}"
        for trail, parser in _commands(build_parser())
        for action in parser._actions
        if not isinstance(action, (argparse._HelpAction, argparse._SubParsersAction)) and not action.help
    ]
    assert silent == []


def test_call_help_says_its_exit_codes_and_how_values_are_read() -> None:
    call = dict(_commands(build_parser()))["sandbox-server call"]
    text = " ".join(call.format_help().split())
    assert "exit codes: 0 the call succeeded; 1 it answered with an error (isError); 2 it could not be made" in text
    assert "VALUE is JSON where the tool's argument is not text" in text


def test_the_readme_is_short_and_every_link_of_the_documents_leads_somewhere() -> None:
    import re
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    readme = (root / "README.md").read_text()
    assert len(readme.splitlines()) <= 150, "the README is for a newcomer's five minutes: reference goes to docs/"
    assert "scripts/run demo" in readme and "scripts/run test" in readme
    broken = []
    for page in [root / "README.md", *sorted((root / "docs").glob("*.md"))]:
        for target in re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", page.read_text()):
            if not target.startswith(("http://", "https://")) and not (page.parent / target).exists():
                broken.append(f"{page.relative_to(root)} -> {target}")
    assert broken == []


def test_no_command_takes_an_option_by_a_prefix_of_its_name() -> None:
    """`serve --state x` once went to --state-dir without a word: now a prefix is an error in every command."""
    parser = build_parser()
    assert all(not sub.allow_abbrev for _, sub in _commands(parser)), "a command still takes prefixes"
    parsed = parser.parse_args(["serve", "--state", "postgresql://db/state", "--state-dir", "/srv/state"])
    assert parsed.state == "postgresql://db/state" and parsed.state_dir == "/srv/state"
    for line in (["serve", "--state-d", "/srv"], ["serve", "--trans", "http"], ["token", "add", "x", "--tok", "f"]):
        with pytest.raises(SystemExit) as exited:
            parser.parse_args(line)
        assert exited.value.code == 2, line
