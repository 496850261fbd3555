"""The contract between the host and the launchers inside the sandbox images, written once.

This file is the host's module `sandbox_server.sandbox.wire` and, copied into the build
context of every image whose Dockerfile names it, the launchers' module `sandbox_wire`.
It uses nothing but the language itself, so it imports the same on both sides; a test
compares what the image holds with what the host uses, and the shell launcher's paths
with the ones here.
"""

from __future__ import annotations

WORKSPACE = "/workspace"
"""The call's writable folder; input files land here and relative paths start here."""
OUTPUT_DIR = "/workspace/out"
"""What a program leaves here comes back with the result."""
REQUEST_DIR = "/tmp/.sandbox"
"""Where the request tar puts the program's stdin and the request script the launcher sources."""
LAUNCHER = "/usr/local/bin/sandbox-launch"
"""Every sandbox's command: it reads the request from stdin."""
LAUNCHERS_DIR = "/usr/local/lib/sandbox"
"""The Python launchers of the python-data image."""
RUN_CELL = f"{LAUNCHERS_DIR}/run_cell.py"
ANALYZE_CSV = f"{LAUNCHERS_DIR}/analyze_csv.py"

PRELOAD_ENV = "SANDBOX_PRELOAD"
"""In a warm container's environment: the modules its warm interpreter imports before any request."""
WARM_DIR = "/tmp/.sandbox-warm"
"""The warm interpreter's folder: the program handed over to it (argv, env, cwd), and its preload errors."""
WARM_JOB = f"{WARM_DIR}/job"
"""The FIFO on which the launcher hands the program over."""
WARM_ERRORS = f"{WARM_DIR}/errors"
"""What importing the preloaded modules said (nothing may reach the attach stream before the request)."""
WARM_PYTHON = f"{LAUNCHERS_DIR}/warm_python.py"
WARM_DONE = f"{WARM_DIR}/done"
"""In a sandbox forked from a warm template: the FIFO on which its first process, the warm interpreter, tells the
launcher the program's pid (its process group), then the program's exit code."""
WARM_STDIN = f"{WARM_DIR}/stdin-bytes"
"""In a sandbox forked from a warm template: how many bytes of the program's stdin follow the request on the
launcher's stdin, when the program is handed over (it reads them there itself: no `head` is started for them)."""
WARM_FORKS_ENV = "SANDBOX_WARM_FORKS"
"""In the launcher's environment: "1" when its parent, the sandbox's first process, is a warm interpreter that forks
the program handed over on WARM_JOB (the launcher starts no interpreter of its own)."""
LINGER_ENV = "SANDBOX_LINGER"
"""In a container's environment: "1" has the launcher stop itself after its trailer, so the container
ends when the host removes it (in a pause between calls), not at once."""

IMAGE_BYTES_ENV = "SANDBOX_IMAGE_BYTES"
"""run_python: the most bytes one figure's PNG may take (it is drawn smaller to fit)."""
FIGURE_NAME = "figure-{index}.png"
"""run_python: each open matplotlib figure, numbered from 1, under OUTPUT_DIR."""
KEEP_VARIABLES_ENV = "SANDBOX_KEEP_VARIABLES"
"""run_python in a kept workspace: "1" restores the previous cell's variables and keeps this one's."""
CELL_STATE_DIR = ".sandbox/cell-state"
"""run_python: the kept variables, relative to WORKSPACE, one file each and an index (pickled and unpickled only in
sandboxes)."""
CELL_STATE_FILE = ".sandbox/cell-state.pickle"
"""run_python: every kept variable in one file, as earlier versions kept them (read once, then kept the new way)."""
CELL_STATE_REPORT = "cell-state.json"
"""run_python: under OUTPUT_DIR, which variables were kept and which not ({"kept": [...], "not_kept": [...]}), and
what each kept one is ({"about": {name: "DataFrame 3 x 2"}})."""
CELL_VALUE = "cell-value.json"
"""run_python: under OUTPUT_DIR, the cell's value when it is a pandas DataFrame or Series, its first rows as a table
({"type", "shape", "table": {"columns", "index", "data"}, "repr": what stdout ends with}), for the cell's view."""
CELL_VALUE_ROWS = 200

ANALYSIS_ANSWER = "analysis.json"
"""analyze_csv: the launcher's answer under OUTPUT_DIR (the other files there are returned as they are)."""
ANALYSIS_TABLE = "result.csv"
ANALYSIS_PLOT = "plot.png"
MISSING_GROUP = "(missing)"
"""analyze_csv: how a group whose key is empty is named where people read it (the table's cell, the plot's label)."""
ANALYSIS_REFUSED_EXIT = 2
"""analyze_csv: the exit code when the answer is a refusal ({"error": ..., "field": ...})."""
ANALYSIS_REQUEST_KEYS = (
    "path", "roots", "operations", "columns", "group_by", "max_groups", "encoding", "decimal", "thousands", "sheet", "period", "plot", "image_bytes",
    "max_bytes", "max_line_bytes", "policy", "delimiter", "header", "header_row", "drop_totals", "skip_bad_rows",
)  # fmt: skip
"""analyze_csv: the keys of the JSON request the host sends on stdin, all of them always present."""
