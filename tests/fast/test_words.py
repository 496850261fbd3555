"""Durations as people say them, in answers and notes."""

import pytest

from sandbox_server.words import duration


@pytest.mark.parametrize(
    ("seconds", "said"),
    [
        (2_592_000, "30 days"),
        (86_400, "1 day"),
        (3_600, "1 hour"),
        (5_400, "90 minutes"),
        (100_000, "27.8 hours"),
        (120, "2 minutes"),
        (90, "90 s"),
        (2.5, "2.5 s"),
    ],
)
def test_a_duration_is_said_in_the_largest_unit_that_says_it(seconds: float, said: str) -> None:
    assert duration(seconds) == said


def test_each_line_of_the_servers_log_is_dated_unless_journald_dates_it(monkeypatch: pytest.MonkeyPatch) -> None:
    import io
    import logging
    import os
    import re

    from sandbox_server.cli.client import _reason
    from sandbox_server.cli.serve import _log_handler

    record = logging.LogRecord("sandbox_server", logging.INFO, __file__, 1, "warm pool ready", None, None)
    record.created = 1_796_589_612.345  # 2026-12-06T20:40:12.345Z
    monkeypatch.delenv("JOURNAL_STREAM", raising=False)
    dated = _log_handler().format(record)
    assert dated == "2026-12-06T20:40:12.345Z sandbox-server: warm pool ready", dated
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z sandbox-server: .*", dated)
    stderr = os.fstat(2)
    monkeypatch.setenv("JOURNAL_STREAM", f"{stderr.st_dev}:{stderr.st_ino}")
    assert _log_handler().format(record) == "sandbox-server: warm pool ready"
    # The one-shot client still finds the server's last words in a dated log.
    log = io.StringIO(f"{dated}\n2026-12-06T20:40:13.001Z sandbox-server: the engine is gone:\n  restart it\n")
    assert _reason(log) == "the engine is gone: restart it"
