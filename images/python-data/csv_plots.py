"""The plots of analyze_csv: histogram, bar, line and scatter, drawn with matplotlib.

Each function takes the running analysis (`analysis`: its query method, columns and
notes), so the statistics module stays about reading and computing.
"""

import os
import warnings

from csv_values import LINE_POINTS, SCATTER_POINTS, Refusal, json_value, quote_ident
from sandbox_wire import ANALYSIS_PLOT, OUTPUT_DIR


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
    axes.set_xlabel(column)
    axes.set_ylabel("rows")
    axes.set_title(f"Distribution of {column} ({count} values)")


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
        labels = [" / ".join(str(v) for v in (r["group"] or {}).values()) for r in results]
        values = [r["columns"].get(y, {}).get(stat) or 0 for r in results]
        axes.bar(range(len(values)), values)
        axes.set_xticks(range(len(values)), labels, rotation=45, ha="right")
        axes.set_ylabel(f"{stat} of {y}")
        axes.set_title(f"{stat} of {y} by {', '.join(analysis.group_by)}")
        return
    x = plot.get("x")
    if not x:
        raise Refusal("a bar plot needs group_by, or plot.x to count the rows of each value", "plot.x")
    q = quote_ident(x)
    rows = analysis.query(f"SELECT {q}, count(*) AS n FROM src GROUP BY {q} ORDER BY n DESC, {q} LIMIT 30")
    axes.bar(range(len(rows)), [n for _, n in rows])
    axes.set_xticks(range(len(rows)), [str(json_value(v)) for v, _ in rows], rotation=45, ha="right")
    axes.set_ylabel("rows")
    axes.set_title(f"Rows per {x} (most frequent {len(rows)})")


def xy(analysis, axes, kind, x, y):
    qx, qy = quote_ident(x), quote_ident(y)
    limit = SCATTER_POINTS if kind == "scatter" else LINE_POINTS
    total = analysis.query(f"SELECT count(*) FROM src WHERE {qx} IS NOT NULL AND {qy} IS NOT NULL")[0][0]
    source = f"(SELECT {qx} AS x, {qy} AS y FROM src WHERE {qx} IS NOT NULL AND {qy} IS NOT NULL)"
    if total > limit:
        source += f" USING SAMPLE reservoir({limit} ROWS) REPEATABLE (7)"
        analysis.notes.append(f"the {kind} plot shows a random sample of {limit} of {total} points")
        sampled = f" (a random sample of {limit} of {total} points)"
    else:
        sampled = ""
    points = analysis.query(f"SELECT x, y FROM {source} ORDER BY x")
    xs, ys = [p[0] for p in points], [p[1] for p in points]
    if kind == "scatter":
        axes.scatter(xs, ys, s=6, alpha=0.6)
    else:
        axes.plot(xs, ys)
    axes.set_xlabel(x)
    axes.set_ylabel(y)
    axes.set_title(f"{y} by {x}{sampled}")


def grouped_line(analysis, axes, plot, results, aggregates, numeric):
    """A line through the groups' values, in the table's order (by period when one is asked)."""
    y = group_y(analysis, plot, aggregates, numeric)
    stat = statistic(analysis, plot, y, aggregates)
    labels = [" / ".join(str(v) for v in (r["group"] or {}).values()) for r in results]
    values = [r["columns"].get(y, {}).get(stat) for r in results]
    points = [float("nan") if v is None else v for v in values]
    axes.plot(range(len(values)), points, marker="o", markersize=5, markerfacecolor="C1", markeredgecolor="C1")
    step = max(1, len(labels) // 24)  # at most about 24 labels, so they stay readable
    axes.set_xticks(range(0, len(labels), step), labels[::step], rotation=45, ha="right")
    axes.set_ylabel(f"{stat} of {y}")
    period = analysis.request.get("period")
    by = ", ".join(analysis.group_by) + (f" ({period})" if period else "")
    axes.set_title(f"{stat} of {y} by {by}")
