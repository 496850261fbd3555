"""The plots of analyze_csv: histogram, bar, line and scatter, drawn with matplotlib.

Each function takes the running analysis (`analysis`: its query method, columns and
notes), so the statistics module stays about reading and computing.
"""

import math
import os
import warnings

from csv_values import LINE_POINTS, SCATTER_POINTS, Refusal, json_value, quote_ident
from sandbox_wire import ANALYSIS_PLOT, MISSING_GROUP, OUTPUT_DIR

DATE_LABELS = 12
"""At most this many labels on an axis of dates or periods: more overlap and none can be read."""
PERIOD_LABEL = {"month": 7, "year": 4}
"""How much of a period's first day ("2024-03-01") names it: "2024-03", "2024"; days and weeks keep the date."""


def draw(analysis, plot, results, aggregates):
    """Draw the requested plot into the output folder and return its name."""
    from sandbox_figures import save_png, seed_font_cache

    seed_font_cache()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    kind = plot["kind"]
    for field in ("x", "y"):
        if plot.get(field):
            analysis.check_names([plot[field]], f"plot.{field}")
    numeric = [c for c in analysis.selected if analysis.kind(c) == "numeric"]
    figure, axes = plt.subplots(figsize=(8, 4.5))
    if kind == "histogram":
        column = plot.get("x") or plot.get("y") or (numeric[0] if numeric else None)
        if column is None or analysis.kind(column) != "numeric":
            raise Refusal("a histogram needs a numeric column: name one in plot.x", "plot.x")
        histogram(analysis, axes, column, int(plot.get("bins", 30)))
    elif kind == "bar":
        bar(analysis, axes, plot, results, aggregates, numeric)
    elif kind == "line" and analysis.group_by:  # one point per group (per period), as the table has them
        grouped_line(analysis, axes, plot, results, aggregates, numeric)
    else:
        x = plot.get("x")
        y = plot.get("y") or next((c for c in numeric if c != x), None)
        if not x or not y:
            raise Refusal(f"a {kind} plot needs plot.x and a numeric plot.y", "plot.x" if not x else "plot.y")
        for column, field in ((x, "plot.x"), (y, "plot.y")):
            if analysis.kind(column) == "other":
                raise Refusal(f"{field} {column!r} is not numeric or temporal; a {kind} plot needs one", field)
        xy(analysis, axes, kind, x, y)
    readable(axes.yaxis)
    figure.tight_layout()
    with warnings.catch_warnings(record=True) as caught:  # a glyph no font has is drawn as a box: said, not hidden
        warnings.simplefilter("always")
        save_png(figure, os.path.join(OUTPUT_DIR, ANALYSIS_PLOT), int(analysis.request["image_bytes"]))
    missing = sorted({str(w.message) for w in caught if "missing from" in str(w.message)})
    if missing:
        analysis.notes.append(f"the plot could not draw some characters ({len(missing)}): {missing[0]}")
    plt.close(figure)
    return ANALYSIS_PLOT


def histogram(analysis, axes, column, bins):
    q = quote_ident(column)
    low, high, count = analysis.query(f"SELECT min({q}), max({q}), count({q}) FROM src")[0]
    if count == 0:
        raise Refusal(f"column {column!r} has no values to draw", "plot.x")
    low, high = float(low), float(high)
    width = (high - low) / bins if high > low else 1.0
    counts = dict(
        analysis.query(
            f"SELECT least(floor(({q} - {low!r}) / {width!r})::BIGINT, {bins - 1}) AS b, count(*) "
            f"FROM src WHERE {q} IS NOT NULL GROUP BY b"
        )
    )
    edges = [low + width * index for index in range(bins)]
    axes.bar(edges, [counts.get(index, 0) for index in range(bins)], width=width, align="edge")
    readable(axes.xaxis)
    axes.set_xlabel(column)
    axes.set_ylabel(f"count({column})")
    axes.set_title(f"{column} · n = {count:,}")


VALUE_STATS = ("sum", "average", "median", "min", "max", "std", "25%", "75%")
"""Statistics of a column's values, preferred over counts when the plot does not name one."""


def statistic(analysis, plot, y, aggregates):
    """The statistic a plot of groups draws: plot.stat, else the first statistic of the column's values among
    the operations asked for (in their order), else the first computed (a count)."""
    available = [stat for col, stat, _ in aggregates if col == y]
    asked = plot.get("stat")
    if asked:
        if asked not in available:
            computed = ", ".join(available) or "none"
            raise Refusal(
                f"plot.stat {asked!r} was not computed for {y!r} (computed: {computed}); add it to operations",
                "plot.stat",
            )
        return asked
    for operation in analysis.request["operations"]:
        expanded = [s for s in available if s in VALUE_STATS] if operation == "describe" else [operation]
        found = next((s for s in expanded if s in available and s in VALUE_STATS), None)
        if found is not None:
            return found
    found = next((s for s in available if s != "nulls"), None)
    if found is None:
        raise Refusal(f"plot.y {y!r} has no statistic to draw; include it in columns", "plot.y")
    return found


def group_y(analysis, plot, aggregates, numeric):
    return (
        plot.get("y")
        or next((c for c in numeric if any(col == c for col, *_ in aggregates)), None)
        or analysis.selected[0]
    )


def bar(analysis, axes, plot, results, aggregates, numeric):
    if analysis.group_by:
        y = group_y(analysis, plot, aggregates, numeric)
        stat = statistic(analysis, plot, y, aggregates)
        labels = group_labels(analysis, results)
        values = [r["columns"].get(y, {}).get(stat) or 0 for r in results]
        axes.bar(range(len(values)), values)
        label_groups(analysis, axes, labels)
        axes.set_ylabel(f"{stat}({y})")
        axes.set_title(title(analysis, stat, y))
        return
    x = plot.get("x")
    if not x:
        raise Refusal("a bar plot needs group_by, or plot.x to count the rows of each value", "plot.x")
    q = quote_ident(x)
    rows = analysis.query(f"SELECT {q}, count(*) AS n FROM src GROUP BY {q} ORDER BY n DESC, {q} LIMIT 30")
    axes.bar(range(len(rows)), [n for _, n in rows])
    axes.set_xticks(range(len(rows)), [name(json_value(v)) for v, _ in rows], rotation=45, ha="right")
    axes.set_ylabel("count(*)")
    axes.set_title(f"count(*) · {x} (top {len(rows)})")


def xy(analysis, axes, kind, x, y):
    qx, qy = quote_ident(x), quote_ident(y)
    limit = SCATTER_POINTS if kind == "scatter" else LINE_POINTS
    total = analysis.query(f"SELECT count(*) FROM src WHERE {qx} IS NOT NULL AND {qy} IS NOT NULL")[0][0]
    source = f"(SELECT {qx} AS x, {qy} AS y FROM src WHERE {qx} IS NOT NULL AND {qy} IS NOT NULL)"
    if total > limit:
        source += f" USING SAMPLE reservoir({limit} ROWS) REPEATABLE (7)"
        analysis.notes.append(f"the {kind} plot shows a random sample of {limit} of {total} points")
        sampled = f" ({limit:,} of {total:,} points, sampled)"
    else:
        sampled = ""
    points = analysis.query(f"SELECT x, y FROM {source} ORDER BY x")
    xs, ys = [p[0] for p in points], [p[1] for p in points]
    if kind == "scatter":
        axes.scatter(xs, ys, s=6, alpha=0.6)
    else:
        axes.plot(xs, ys)
        from_zero(axes, ys)
    if analysis.kind(x) == "temporal":
        import matplotlib.dates as dates

        locator = dates.AutoDateLocator(maxticks=DATE_LABELS)
        axes.xaxis.set_major_locator(locator)
        axes.xaxis.set_major_formatter(dates.ConciseDateFormatter(locator))
    else:
        readable(axes.xaxis)
    axes.set_xlabel(x)
    axes.set_ylabel(y)
    axes.set_title(f"{y} · {x}{sampled}")


def grouped_line(analysis, axes, plot, results, aggregates, numeric):
    """A line through the groups' values, in the table's order (by period when one is asked)."""
    y = group_y(analysis, plot, aggregates, numeric)
    stat = statistic(analysis, plot, y, aggregates)
    labels = group_labels(analysis, results)
    values = [r["columns"].get(y, {}).get(stat) for r in results]
    points = [float("nan") if v is None else v for v in values]
    axes.plot(range(len(values)), points, marker="o", markersize=5, markerfacecolor="C1", markeredgecolor="C1")
    from_zero(axes, points)
    label_groups(analysis, axes, labels)
    axes.set_ylabel(f"{stat}({y})")
    axes.set_title(title(analysis, stat, y))


def title(analysis, stat, y):
    """A plot of groups is named in the data's own words: "sum(销售额) · 订单日期 (month)", no English between."""
    period = analysis.request.get("period")
    return f"{stat}({y}) · {', '.join(analysis.group_by)}" + (f" ({period})" if period else "")


def name(value):
    """A value as a label: an empty one named as the table names it."""
    return MISSING_GROUP if value is None else str(value)


def group_labels(analysis, results):
    """Each group's label: its keys joined, a period's first day cut to what names it ("2024-03" for a month)."""
    cut = PERIOD_LABEL.get(analysis.request.get("period"))
    dated = {n for n in analysis.group_by if cut and analysis.kind(n) == "temporal"}
    return [
        " / ".join(
            name(value)[:cut] if key in dated and value is not None else name(value)
            for key, value in (r["group"] or {}).items()
        )
        for r in results
    ]


def label_groups(analysis, axes, labels):
    """One label per group, or every n-th when the groups are periods and more than DATE_LABELS would crowd."""
    step = 1
    if analysis.request.get("period") and len(labels) > DATE_LABELS:
        step = math.ceil(len(labels) / DATE_LABELS)
    axes.set_xticks(range(0, len(labels), step), labels[::step], rotation=45, ha="right")


def from_zero(axes, values):
    """A line of values that are all on one side of zero is drawn from zero: a 7% wiggle stays a wiggle."""
    drawn = [v for v in values if v is not None and not math.isnan(v)]
    if drawn and min(drawn) >= 0:
        axes.set_ylim(0, max(drawn) * 1.05 or 1)
    elif drawn and max(drawn) <= 0:
        axes.set_ylim(min(drawn) * 1.05 or -1, 0)


def readable(axis):
    """Numbers as people write them: thousands separated, no offset, no power of ten, as many decimals as the
    spacing of the ticks needs."""
    from matplotlib.ticker import FuncFormatter

    def label(value, _position):
        ticks = axis.get_majorticklocs()
        decimals = next((d for d in range(6) if all(abs(t * 10**d - round(t * 10**d)) < 1e-6 for t in ticks)), 6)
        text = f"{value:,.{decimals}f}"
        return text[1:] if text.startswith("-") and not text.strip("-0.,") else text  # never "-0"

    axis.set_major_formatter(FuncFormatter(label))
