"""Quantities said as people say them in the server's answers and notes: "30 days", not "2.592e+06 s"."""

from __future__ import annotations

__all__ = ["duration"]

UNITS = (("day", 86_400), ("hour", 3_600), ("minute", 60))


def duration(seconds: float) -> str:
    """A span of time in the largest unit that says it whole ("30 days", "90 minutes", "1 hour"), else in the
    largest that holds it at least twice, to three figures ("27.8 hours"); under two minutes, in seconds."""
    for unit, size in UNITS:
        if seconds >= size and seconds % size == 0:
            count = int(seconds // size)
            return f"{count} {unit}{'' if count == 1 else 's'}"
    for unit, size in UNITS:
        if seconds >= 2 * size:
            return f"{seconds / size:.3g} {unit}s"
    return f"{seconds:g} s"
