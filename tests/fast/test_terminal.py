"""What a terminal's output reads as once drawn (execute_command's `tty`)."""

from __future__ import annotations

from sandbox_server.tools.terminal import rendered, size_of, tty_argv


def test_escapes_go_and_a_line_redrawn_in_place_reads_as_last_drawn() -> None:
    assert rendered(b"\x1b[1;31mred\x1b[0m\r\n") == b"red\n"
    assert rendered(b"[#   ] 25%\r[##  ] 50%\r[####] 100%\r\n") == b"[####] 100%\n"
    assert rendered(b"abc\bX\r\n") == b"abX\n"
    assert rendered(b"long line\rshort\n") == b"shortline\n"  # what the terminal shows: the rest stays
    assert rendered(b"\x1b]0;title\x07text") == b"text"


def test_the_size_asked_for_is_the_terminals_and_the_command_stays_one_word() -> None:
    assert size_of(False) is None and size_of(True) == (80, 24) and size_of({"columns": 100}) == (100, 24)
    argv = tty_argv(("/bin/sh", "-c", "echo 'it''s'; exit 3"), (100, 30))
    assert argv[:4] == ("script", "--quiet", "--return", "--command")
    assert (
        argv[4] == "stty cols 100 rows 30 2>/dev/null; exec /bin/sh -c 'echo '\"'\"'it'\"'\"''\"'\"'s'\"'\"'; exit 3'"
    )
