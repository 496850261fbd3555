"""What the analyze_csv launcher and its plots share: the refusal type, value conversion, SQL quoting.

Both analyze_csv.py and csv_plots.py import this module, and neither imports the other
at load time, so there is one Refusal class however the launcher is started.
"""

import datetime
import decimal
import math

SCATTER_POINTS = 10_000
"""Points a scatter plot draws at most (a random sample beyond)."""
LINE_POINTS = 5_000
"""Points a line plot draws at most (a random sample beyond)."""


class Refusal(Exception):
    """A request this file cannot answer; the message says why, `field` names the argument."""

    def __init__(self, message, field=None):
        super().__init__(message)
        self.field = field


def quote_ident(name):
    """A column name as a DuckDB identifier."""
    return '"' + name.replace('"', '""') + '"'


def quote_literal(text):
    """Text as a DuckDB string literal."""
    return "'" + text.replace("'", "''") + "'"


def json_value(value):
    """A DuckDB value as JSON can hold it: non-finite floats as null, decimals as floats, dates as ISO text."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, decimal.Decimal):
        return float(value)
    if isinstance(value, (datetime.date, datetime.time, datetime.datetime)):
        return value.isoformat()
    if isinstance(value, (bytes, bytearray)):
        return value.decode("utf-8", "replace")
    return value
