"""How a file writes its numbers: the decimal mark and the thousands separator, from a sample of its rows.

European exports write `10,5` and `1.234,5`; others `1,234.5`; French ones `1 234,5`. Each
value of the sample votes only when it can be read one way; a column votes for the file's
style, and the answer says what was found. Numbers with a percent sign or a currency symbol
are named, not silently read as text or dropped.
"""

import re

from csv_values import quote_literal

SPACES = " \u00a0\u202f"
"""Thousands separators that are spaces: plain, no-break, narrow no-break."""
SIGN = r"^[+-]?"
UNAMBIGUOUS = (
    # (pattern, decimal mark, thousands separator)
    (re.compile(SIGN + r"\d{1,3}(\.\d{3})+,\d+$"), ",", "."),
    (re.compile(SIGN + r"\d{1,3}(,\d{3})+\.\d+$"), ".", ","),
    (re.compile(SIGN + r"\d{1,3}([" + SPACES + r"]\d{3})+,\d+$"), ",", " "),
    (re.compile(SIGN + r"\d{1,3}([" + SPACES + r"]\d{3})+\.\d+$"), ".", " "),
    (re.compile(SIGN + r"\d{1,3}([" + SPACES + r"]\d{3})+$"), None, " "),
    (re.compile(SIGN + r"\d{1,3}(,\d{3}){2,}$"), ".", ","),
    (re.compile(SIGN + r"\d{1,3}(\.\d{3}){2,}$"), ",", "."),
    (re.compile(SIGN + r"\d{1,3}('\d{3})+(\.\d+)?$"), ".", "'"),
    (re.compile(SIGN + r"\d*,\d{1,2}$|" + SIGN + r"\d*,\d{4,}$|" + SIGN + r"0,\d+$"), ",", None),
    (re.compile(SIGN + r"\d*\.\d{1,2}$|" + SIGN + r"\d*\.\d{4,}$|" + SIGN + r"0\.\d+$"), ".", None),
)
DEPARTURE = "number in another style: "
"""What the SQL conversion's error starts with when a value is not written in the file's number style."""
AMBIGUOUS = re.compile(SIGN + r"\d{1,3}[.,]\d{3}$")
"""`1,234` and `1.234`: a thousand or a fraction, depending on the file's style."""
PLAIN = re.compile(SIGN + r"\d+$")
NUMBERISH = re.compile(r"\s*[+-]?[\d.,'" + SPACES + r"]*\d[\d.,'" + SPACES + r"]*\s*$")
"""What any number of any style looks like at the least: a quick test before the exact patterns."""
SYMBOLS = re.compile(r"^[+-]?\s*([$€£¥₹]|CHF|EUR|USD)?\s*[+-]?\d[\d.,'" + SPACES + r"]*\s*(%|[$€£¥₹]|CHF|EUR|USD)?$")


class NumberStyle:
    """The file's decimal mark and thousands separator, the columns written in it, and what stays text."""

    def __init__(self, decimal=".", thousands=None, given=False):
        self.decimal = decimal
        self.thousands = thousands
        self.columns = []
        """Columns whose sample values are all numbers in this style (read through `expression`)."""
        self.symbols = {}
        """Column -> an example value holding a percent sign or a currency symbol."""
        self.given = given
        self.numeric = []
        """Columns whose sample values are all numbers, some written in this style (not just digits)."""
        self.mixed = []
        """Of those, the columns where some numbers are written in another style."""

    def describe(self):
        thousands = {None: "no thousands separator", " ": "spaces between thousands"}.get(
            self.thousands, f"{self.thousands!r} between thousands"
        )
        how = "as asked" if self.given else "detected from the first rows"
        return f"numbers use {self.decimal!r} as the decimal mark and {thousands} ({how})"

    @property
    def plain(self):
        """Whether DuckDB reads these numbers itself (a '.' decimal mark, nothing between thousands)."""
        return self.decimal == "." and self.thousands is None

    @property
    def pattern(self):
        """A regular expression matching exactly the numbers written in this style (Python's and DuckDB's
        syntax alike)."""
        if self.thousands is None:
            whole = r"\d+"
        else:
            separator = "[" + SPACES + "]" if self.thousands == " " else re.escape(self.thousands)
            whole = r"\d{1,3}(" + separator + r"\d{3})+|\d+"
        mark = re.escape(self.decimal)
        return r"[+-]?((" + whole + ")(" + mark + r"\d*)?|" + mark + r"\d+)"

    def expression(self, quoted):
        """SQL turning a text column written in this style into a DOUBLE; a value that is not a number in this
        style stops the query with an error holding DEPARTURE (the launcher then finds its line)."""
        value = f"trim({quoted})"
        text = value
        for separator in SPACES if self.thousands == " " else self.thousands or "":
            text = f"replace({text}, {quote_literal(separator)}, '')"
        if self.decimal == ",":
            text = f"replace({text}, ',', '.')"
        return (
            f"CASE WHEN {value} = '' THEN NULL "
            f"WHEN regexp_full_match({value}, {quote_literal(self.pattern)}) THEN CAST({text} AS DOUBLE) "
            f"ELSE error({quote_literal(DEPARTURE)} || {value}) END"
        )

    def reads(self, value):
        """Whether a text value is a number written in this style."""
        value = value.strip()
        if PLAIN.match(value):
            return True
        for pattern, decimal, thousands in UNAMBIGUOUS:
            if pattern.match(value):
                return decimal in (None, self.decimal) and thousands in (None, self.thousands)
        if AMBIGUOUS.match(value):
            return value.lstrip("+-")[-4] in (self.decimal, self.thousands)
        return False


def is_number(value):
    """Whether a text value is a number in some style (plain, with a decimal comma or point, with thousands)."""
    if not NUMBERISH.match(value):
        return False
    value = value.strip()
    return bool(PLAIN.match(value) or AMBIGUOUS.match(value) or any(p.match(value) for p, _, _ in UNAMBIGUOUS))


def style_of(value):
    """How one number is written, in words (for an answer naming a value that departs from the file's style)."""
    value = value.strip()
    for pattern, mark, separator in UNAMBIGUOUS:
        if pattern.match(value):
            parts = [f"{mark!r} as the decimal mark"] if mark else []
            if separator:
                parts.append("spaces between thousands" if separator == " " else f"{separator!r} between thousands")
            return " and ".join(parts)
    if AMBIGUOUS.match(value):
        return f"{value.lstrip('+-')[-4]!r} as the decimal mark or between thousands"
    return "a style of its own"


def departure(rows, columns, style):
    """The first number written in another style than `style`, as (line, column, value), in a column of
    `columns` that also holds numbers written in `style` (not just digits); None when no column mixes the two.
    `rows` are (line, {column: value}) pairs. A column wholly in another style is not mixed: it is text."""
    kept, off = set(), {}
    for line, values in rows:
        for column in columns:
            value = (values.get(column) or "").strip()
            if not value or PLAIN.match(value):
                continue
            if style.reads(value):
                kept.add(column)
            elif is_number(value):
                off.setdefault(column, (line, column, value))
            else:
                continue
            if column in kept and column in off:
                return off[column]
    return None


def detect_style(names, rows, decimal=None, thousands=None, candidates=None):
    """The style of the sample's numbers; `decimal`/`thousands` given win. Only the `candidates` columns are
    looked at (all when None)."""
    looked = [i for i, name in enumerate(names) if candidates is None or name in candidates]
    votes = {}
    for row in rows:
        for index in looked:
            value = row[index]
            if not isinstance(value, str) or not NUMBERISH.match(value):
                continue
            value = value.strip()
            for pattern, mark, separator in UNAMBIGUOUS:
                if pattern.match(value):
                    votes[(mark, separator)] = votes.get((mark, separator), 0) + 1
                    break
    marks = {",": 0, ".": 0}
    separators = {}
    for (mark, separator), count in votes.items():
        if mark:
            marks[mark] += count
        if separator:
            separators[separator] = separators.get(separator, 0) + count
    given = decimal is not None or thousands is not None
    if decimal is None:
        decimal = "," if marks[","] > marks["."] else "."
    if thousands is None:
        fitting = {s: n for s, n in separators.items() if s != decimal}
        thousands = max(fitting, key=fitting.get) if fitting else None
    elif thousands == "":
        thousands = None
    style = NumberStyle(decimal, thousands, given=given)
    for index in looked:
        name = names[index]
        values = [row[index] for row in rows if isinstance(row[index], str) and row[index].strip()]
        if not values:
            continue
        if all(is_number(v) for v in values) and any(style.reads(v) and not PLAIN.match(v.strip()) for v in values):
            style.numeric.append(name)
            (style.columns if all(style.reads(v) for v in values) else style.mixed).append(name)
        else:
            example = next((v for v in values if not style.reads(v) and SYMBOLS.match(v.strip())), None)
            if example is not None and re.search("[%$€£¥₹]|CHF|EUR|USD", example):
                style.symbols[name] = example
    return style


DATE_FORMATS = (
    "%Y/%m/%d",
    "%Y.%m.%d",
    "%d.%m.%Y",
    "%b %d %Y",
    "%b %d, %Y",
    "%d %b %Y",
    "%B %d %Y",
    "%B %d, %Y",
    "%d %B %Y",
    "%m/%d/%Y",
    "%d/%m/%Y",
    "%Y/%m/%d %H:%M:%S",
    "%Y/%m/%d %H:%M",
    "%d.%m.%Y %H:%M:%S",
    "%d.%m.%Y %H:%M",
    "%m/%d/%Y %H:%M:%S",
    "%m/%d/%Y %H:%M",
    "%Y-%m-%dT%H:%M:%S%z",
    "%Y-%m-%d %H:%M:%S%z",
    "%Y-%m-%dT%H:%M:%S.%f%z",
)
"""Date and date-time formats recognised in text columns (DuckDB itself reads ISO dates and times)."""


def detect_dates(names, rows, text_columns):
    """Column -> (format, whether it has a time, another format that also reads every value) for the text
    columns whose sample values are all dates in one format."""
    import datetime

    found = {}
    for index, name in enumerate(names):
        if name not in text_columns:
            continue
        values = [row[index].strip() for row in rows if isinstance(row[index], str) and row[index].strip()]
        if not values:
            continue
        fitting = []
        for fmt in DATE_FORMATS:
            try:
                for value in values:
                    datetime.datetime.strptime(value, fmt)
            except ValueError:
                continue
            fitting.append(fmt)
        if fitting:
            timed = any(code in fitting[0] for code in ("%H", "%M", "%S"))
            found[name] = (fitting[0], timed, fitting[1] if len(fitting) > 1 else None)
    return found


def number_in(value, style):
    """A cell's number as the file writes it (its decimal mark and thousands separator), or None."""
    if not isinstance(value, str) or not value.strip():
        return None
    text = value.strip()
    for separator in SPACES if style.thousands == " " else style.thousands or "":
        text = text.replace(separator, "")
    try:
        return float(text.replace(style.decimal, ".") if style.decimal != "." else text)
    except ValueError:
        return None


def totals_row(names, rows, style, numeric):
    """The columns whose number in the last row is the sum of the rows above it, when every number of that row is
    (a totals row, as a spreadsheet's export ends with); None otherwise."""
    import math

    if len(rows) < 3:
        return None
    *above, last = rows
    summed = []
    for name in numeric:
        index = names.index(name)
        value = number_in(last[index], style) if index < len(last) else None
        if value is None:
            continue
        cells = (row[index] for row in above if index < len(row))
        total = math.fsum(v for v in (number_in(cell, style) for cell in cells) if v is not None)
        if abs(value - total) > 0.01 + 1e-9 * abs(total):
            return None
        if total:
            summed.append(name)
    return summed or None
