"""Run one notebook-style cell inside the sandbox (the run_python tool's launcher).

The code arrives on stdin. It runs as __main__ with the working folder /workspace;
when its last statement is an expression, its value is printed as a notebook
would. Every matplotlib figure the cell drew or changed (shown or not) is saved
to the output folder as figure-N.png, downscaled to fit the byte budget the host
sends (names and paths from sandbox_wire, the contract shared with the host); a figure
kept in a variable from an earlier cell comes back only when it draws differently now. In a
kept workspace the previous cell's variables that this cell names are restored first,
and what it loaded or set kept after it (cell_state).
"""

import _ast  # the parser's node types without `ast`'s helpers: a cell's start pays only for what it uses
import os
import sys

from sandbox_figures import seed_font_cache
from sandbox_wire import CELL_VALUE, CELL_VALUE_ROWS, FIGURE_NAME, IMAGE_BYTES_ENV, KEEP_VARIABLES_ENV, OUTPUT_DIR

IMAGE_BYTES = int(os.environ.pop(IMAGE_BYTES_ENV, "2000000"))
KEEP_VARIABLES = os.environ.pop(KEEP_VARIABLES_ENV, "") == "1"
DIGEST = "_sandbox_png_sha256"
"""The attribute a figure keeps the digest of its last returned PNG in (pickled with it)."""


def _open_figures() -> list:
    """The open matplotlib figures (none when the cell has not loaded pyplot)."""
    if "matplotlib.pyplot" not in sys.modules:
        return []
    import matplotlib.pyplot as plt

    return [plt.figure(number) for number in plt.get_fignums()]


def _kept_figures(namespace: dict) -> list:
    """The figures the restored variables hold (a figure, its axes, an array of axes), and any pyplot knows."""
    found = _open_figures()
    if "matplotlib.figure" not in sys.modules:
        return found
    from matplotlib.figure import Figure

    for value in list(namespace.values()):
        items = value.flat if type(value).__name__ == "ndarray" and value.dtype == object else (value,)
        for item in items:
            figure = item if isinstance(item, Figure) else getattr(item, "figure", None)
            if isinstance(figure, Figure) and all(figure is not other for other in found):
                found.append(figure)
    return found


def _set_aside(figures: list) -> None:
    """Kept figures taken out of pyplot's list: a cell starts with no current figure, as a notebook's does, so
    `plt.bar` draws a new one; each stays whole in its variable."""
    if figures:
        import matplotlib.pyplot as plt

        for figure in figures:
            plt.close(figure)


def _save_figures(kept: list, value: object) -> None:
    """Save the figures the cell drew, and the kept figures it changed or gave as its value. A kept figure carries
    the digest of the PNG last returned for it: drawn the same again, it is not returned again."""
    drawn = _open_figures()
    figures = drawn + [figure for figure in kept if all(figure is not other for other in drawn)]
    if not figures:
        return
    import hashlib

    from sandbox_figures import save_png

    os.makedirs(OUTPUT_DIR, exist_ok=True)
    index = 0
    for figure in figures:
        path = os.path.join(OUTPUT_DIR, FIGURE_NAME.format(index=index + 1))
        save_png(figure, path, IMAGE_BYTES)
        with open(path, "rb") as png:
            digest = hashlib.sha256(png.read()).hexdigest()
        unchanged = any(figure is other for other in kept) and getattr(figure, DIGEST, None) == digest
        if unchanged and figure is not value:
            os.remove(path)  # kept, not changed, not asked for: the model has it already
            continue
        setattr(figure, DIGEST, digest)  # kept with the figure, for the next cell to compare
        index += 1


def _table_of(value, shown: str) -> None:
    """A pandas DataFrame or Series, the cell's value, as a table for its view: its first rows (the printed repr is
    what a model reads; a value that cannot be written so is left to it)."""
    if type(value).__module__.split(".")[0] != "pandas" or getattr(value, "ndim", 0) not in (1, 2):
        return
    import json

    try:
        frame = value.to_frame() if value.ndim == 1 else value
        rows = frame.head(CELL_VALUE_ROWS).to_json(orient="split", date_format="iso", default_handler=str)
        table = {"type": type(value).__name__, "shape": list(value.shape), "table": json.loads(rows), "repr": shown}
        os.makedirs(OUTPUT_DIR, exist_ok=True)
        with open(os.path.join(OUTPUT_DIR, CELL_VALUE), "w", encoding="utf-8") as handle:
            json.dump(table, handle)
    except (ValueError, TypeError, OverflowError, OSError):
        return


def main() -> int:
    seed_font_cache()  # before the cell can import matplotlib
    source = sys.stdin.read()
    sys.stdin = open(os.devnull)
    try:
        tree = compile(source, "<cell>", "exec", _ast.PyCF_ONLY_AST)  # what ast.parse does
    except SyntaxError:
        import traceback

        traceback.print_exc(limit=0)
        return 1
    namespace = {"__name__": "__main__"}
    state = None
    if KEEP_VARIABLES:
        import cell_state

        state = cell_state.State()
    kept: list = []
    if state is not None:
        state.restore(namespace, tree)
        kept = _kept_figures(namespace)  # figures of kept variables, returned by the cell that drew them
        _set_aside(kept)
    last = tree.body.pop() if tree.body and isinstance(tree.body[-1], _ast.Expr) else None
    value = None
    try:
        exec(compile(tree, "<cell>", "exec"), namespace)
        if last is not None:
            value = eval(compile(_ast.Expression(last.value), "<cell>", "eval"), namespace)
            if value is not None:
                shown = repr(value)
                print(shown)
                _table_of(value, shown)
    except SystemExit as exc:
        _finish(namespace, state, kept, value)
        return exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except BaseException:
        import traceback

        exc_type, exc, tb = sys.exc_info()
        traceback.print_exception(exc_type, exc, tb.tb_next if tb else None)
        _finish(namespace, state, kept, value)
        return 1
    _finish(namespace, state, kept, value)
    return 0


def _finish(namespace: dict, state, kept: list, value: object) -> None:
    """Figures out, and (in a kept workspace) the variables kept, as a notebook keeps them after an error too."""
    _save_figures(kept, value)
    if state is not None:
        state.save(namespace)


if __name__ == "__main__":
    sys.exit(main())
