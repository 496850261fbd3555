"""`serve`'s options read from the command line and the environment."""

import argparse

import pytest

from sandbox_server.cli.options import add_serve_arguments


def _parsed(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_serve_arguments(parser)
    return parser.parse_args(argv)


def test_the_most_pool_sandboxes_come_from_the_flag_else_the_environment_else_the_policy(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("SANDBOX_POOL_SANDBOXES", raising=False)
    assert _parsed().pool_sandboxes is None  # the server policy's host.pool_sandboxes
    assert _parsed("--pool-sandboxes", "0").pool_sandboxes == 0
    monkeypatch.setenv("SANDBOX_POOL_SANDBOXES", "12")
    assert _parsed().pool_sandboxes == 12
    assert _parsed("--pool-sandboxes", "3").pool_sandboxes == 3
    monkeypatch.setenv("SANDBOX_POOL_SANDBOXES", "")
    assert _parsed().pool_sandboxes is None


@pytest.mark.parametrize("given", ["-1", "many", "2.5"])
def test_a_count_of_pool_sandboxes_that_is_not_one_is_refused_saying_so(
    given: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit):
        _parsed("--pool-sandboxes", given)
    assert f"{given!r} is not a count of sandboxes (0 or more)" in capsys.readouterr().err
