"""A run_python cell's top-level variables, kept in a kept workspace for the next cell, like a notebook.

Only ever pickled and unpickled here, inside a sandbox: a poisoned state file runs its
code in the next sandbox, never on the host. Modules are kept by name and imported again;
what cannot be pickled is named, not kept.
"""

import json
import os
import pickle
import sys
import types

from sandbox_wire import CELL_STATE_FILE, CELL_STATE_REPORT, OUTPUT_DIR, WORKSPACE


def _path():
    return os.path.join(WORKSPACE, CELL_STATE_FILE)


def restore(namespace):
    """Put the previous cell's kept variables into `namespace`; a note on stderr when that fails."""
    try:
        with open(_path(), "rb") as handle:
            state = pickle.load(handle)
    except FileNotFoundError:
        return
    except Exception as exc:  # a damaged state must not stop the cell: it starts without it
        print(f"sandbox: the previous cell's variables could not be restored: {exc!r}", file=sys.stderr)
        return
    for name, module in state.get("modules", {}).items():
        try:
            namespace[name] = __import__(module, fromlist=["_"])
        except ImportError:
            pass
    namespace.update(state.get("values", {}))


def save(namespace):
    """Keep what can be kept of the cell's top-level names, and report what was and was not."""
    modules, values, kept, not_kept = {}, {}, [], []
    for name, value in namespace.items():
        if name.startswith("_") or name == "__builtins__":
            continue
        if isinstance(value, types.ModuleType):
            modules[name] = value.__name__
            continue
        try:
            pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)
        except Exception:
            not_kept.append(f"{name} ({type(value).__name__})")
            continue
        values[name] = value
        kept.append(name)
    path = _path()
    os.makedirs(os.path.dirname(path), exist_ok=True)
    try:
        with open(path + ".new", "wb") as handle:
            pickle.dump({"modules": modules, "values": values}, handle, protocol=pickle.HIGHEST_PROTOCOL)
        os.replace(path + ".new", path)
    except OSError as exc:  # the workspace is full: keep the previous state rather than half a new one
        not_kept = [f"all ({exc.strerror})"]
        kept = []
        try:
            os.remove(path + ".new")
        except OSError:
            pass
    os.makedirs(OUTPUT_DIR, exist_ok=True)
    with open(os.path.join(OUTPUT_DIR, CELL_STATE_REPORT), "w", encoding="utf-8") as handle:
        json.dump({"kept": kept, "not_kept": not_kept}, handle)
