"""execute_command's `tty`: the program runs under a pseudo-terminal, and what it drew comes back as text.

Programs change behaviour without a terminal: a REPL prints no prompt, a progress bar goes silent,
a tool refuses to run. `script` (util-linux, in every Debian image) gives the program a terminal of
the asked size, feeds it the call's stdin as typed input (and the end of it as the end of input),
and copies what the terminal shows. A model reads that as text: colours and cursor movements are
dropped, and a line redrawn in place (a progress bar, a spinner) is read as it was last drawn.
"""

from __future__ import annotations

import re
import shlex
from collections.abc import Mapping
from typing import Any

__all__ = ["TTY_SCHEMA", "rendered", "size_of", "tty_argv"]

TTY_SCHEMA: dict[str, Any] = {
    "type": ["boolean", "object"],
    "properties": {
        "columns": {"type": "integer", "minimum": 20, "maximum": 500},
        "rows": {"type": "integer", "minimum": 5, "maximum": 500},
    },
    "additionalProperties": False,
    "description": "A terminal: true (80x24) or {columns, rows}. Stdout is what it shows.",
}
SIZE = (80, 24)

_CONTROL = re.compile(rb"\x1b\[[0-?]*[ -/]*[@-~]|\x1b\][^\x07\x1b]*(?:\x07|\x1b\\)|\x1b[@-Z\\-_]")
"""Escape sequences: CSI (colours, cursor moves, erasing), OSC (titles, links) and the two-byte ones."""


def size_of(tty: bool | Mapping[str, int]) -> tuple[int, int] | None:
    """The terminal's (columns, rows), or None for no terminal."""
    if tty is False:
        return None
    if tty is True:
        return SIZE
    return tty.get("columns", SIZE[0]), tty.get("rows", SIZE[1])


def tty_argv(argv: tuple[str, ...], size: tuple[int, int]) -> tuple[str, ...]:
    """`argv` run under a pseudo-terminal of `size` whose input is the call's stdin."""
    columns, rows = size
    inner = f"stty cols {columns} rows {rows} 2>/dev/null; exec {shlex.join(argv)}"
    return ("script", "--quiet", "--return", "--command", inner, "/dev/null")


def rendered(output: bytes) -> bytes:
    """What a terminal's output reads as once drawn: escapes dropped, each line as its last redraw left it."""
    text = _CONTROL.sub(b"", output).replace(b"\r\n", b"\n")
    return b"\n".join(_drawn(line) for line in text.split(b"\n"))


def _drawn(line: bytes) -> bytes:
    """One line after its carriage returns (back to its start) and backspaces (one column back)."""
    if b"\r" not in line and b"\b" not in line:
        return line
    shown = bytearray()
    column = 0
    for byte in line:
        if byte == 0x0D:
            column = 0
        elif byte == 0x08:
            column = max(0, column - 1)
        else:
            if column < len(shown):
                shown[column] = byte
            else:
                shown.append(byte)
            column += 1
    return bytes(shown)
