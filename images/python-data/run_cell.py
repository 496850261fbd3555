"""Run one notebook-style cell inside the sandbox (the run_python tool's launcher).

The code arrives on stdin. It runs as __main__ with the working folder /workspace;
when its last statement is an expression, its value is printed as a notebook
would. Every matplotlib figure still open at the end (shown or not) is saved
to the output folder as figure-N.png, downscaled to fit the byte budget the host
sends (names and paths from sandbox_wire, the contract shared with the host). In a
kept workspace the previous cell's variables are restored first and this cell's kept
after it (cell_state).
"""

import ast
import os
import sys
import traceback

import cell_state
from sandbox_figures import save_png, seed_font_cache
from sandbox_wire import FIGURE_NAME, IMAGE_BYTES_ENV, KEEP_VARIABLES_ENV, OUTPUT_DIR

IMAGE_BYTES = int(os.environ.pop(IMAGE_BYTES_ENV, "2000000"))
KEEP_VARIABLES = os.environ.pop(KEEP_VARIABLES_ENV, "") == "1"


def _save_figures() -> None:
    if "matplotlib.pyplot" not in sys.modules:
        return
    import matplotlib.pyplot as plt

    os.makedirs(OUTPUT_DIR, exist_ok=True)
    for index, number in enumerate(plt.get_fignums(), start=1):
        figure = plt.figure(number)
        save_png(figure, os.path.join(OUTPUT_DIR, FIGURE_NAME.format(index=index)), IMAGE_BYTES)


def main() -> int:
    seed_font_cache()  # before the cell can import matplotlib
    source = sys.stdin.read()
    sys.stdin = open(os.devnull)
    try:
        tree = ast.parse(source, filename="<cell>")
    except SyntaxError:
        traceback.print_exc(limit=0)
        return 1
    last = tree.body.pop() if tree.body and isinstance(tree.body[-1], ast.Expr) else None
    namespace = {"__name__": "__main__"}
    if KEEP_VARIABLES:
        cell_state.restore(namespace)
    try:
        exec(compile(tree, "<cell>", "exec"), namespace)
        if last is not None:
            value = eval(compile(ast.Expression(last.value), "<cell>", "eval"), namespace)
            if value is not None:
                print(repr(value))
    except SystemExit as exc:
        _finish(namespace)
        return exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except BaseException:
        exc_type, exc, tb = sys.exc_info()
        traceback.print_exception(exc_type, exc, tb.tb_next if tb else None)
        _finish(namespace)
        return 1
    _finish(namespace)
    return 0


def _finish(namespace: dict) -> None:
    """Figures out, and (in a kept workspace) the variables kept, as a notebook keeps them after an error too."""
    _save_figures()
    if KEEP_VARIABLES:
        cell_state.save(namespace)


if __name__ == "__main__":
    sys.exit(main())
