"""A run_python cell's top-level variables, kept in a kept workspace for the next cell, like a notebook.

Variables are kept in files under CELL_STATE_DIR, listed in an index: each in a file of its own, except those
that share a mutable object (a figure and its axes, two names for one list), which are kept together so that
they still share it. A cell loads only the files of the kept variables its code names (every one when it
reaches for names by a string: eval, exec, globals, vars, locals, dir), and writes again only what it loaded or
set: a cell that names none of 160 MB of kept data pays nothing for it, and a variable that cannot be kept (not
picklable, larger than one file may be) is named and costs no other variable. Modules are kept by name and
imported again when named. Only ever pickled and unpickled here, inside a sandbox: a poisoned state file runs
its code in the next sandbox, never on the host.
"""

import ast
import errno
import json
import os
import pickle
import sys
import types

from sandbox_wire import CELL_STATE_DIR, CELL_STATE_FILE, CELL_STATE_REPORT, OUTPUT_DIR, WORKSPACE

DYNAMIC = frozenset({"eval", "exec", "globals", "vars", "locals", "dir"})
"""Names through which a cell may reach any variable by a string: such a cell loads every kept variable."""
INDEX = "index.json"
_WHY = {
    errno.EFBIG: "larger than one file may be: policy field limits.file_size_mb",
    errno.ENOSPC: "the workspace is full: policy field workspace.size_mb",
    errno.EDQUOT: "the workspace is full: policy field workspace.size_mb",
}


def names_in(tree):
    """Every name a cell's code reads, deletes or declares global, at any depth."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Name) and not isinstance(node.ctx, ast.Store):
            found.add(node.id)
        elif isinstance(node, ast.AugAssign) and isinstance(node.target, ast.Name):  # `x += 1` reads x
            found.add(node.target.id)
        elif isinstance(node, (ast.Global, ast.Nonlocal)):
            found.update(node.names)
    return found


class State:
    """The kept variables as the previous cell left them, and which of them this cell loaded."""

    def __init__(self):
        self.folder = os.path.join(WORKSPACE, CELL_STATE_DIR)
        self.values = {}
        """Kept variable -> its file, in the order they were first kept."""
        self.modules = {}
        """Kept name -> the module it names."""
        self.next = 1
        self.loaded = set()
        """The kept names this cell was given (so it may have changed, rebound or deleted them)."""
        self.about = {}
        """Kept variable -> a line saying what it is (read by the host to compare workspaces: data, never code)."""
        self.digests = {}
        """Kept variable -> the SHA-256 of its file's content: a variable a cell loaded and left as it was keeps
        its file, and `compare` calls it unchanged."""
        self.earlier = None
        """An earlier version's single file of every variable, when that is what the workspace holds."""

    def restore(self, namespace, tree):
        """Put the kept variables and modules the cell names into `namespace`."""
        self._read()
        wanted = names_in(tree)
        every = bool(wanted & DYNAMIC)
        for name, module in self.modules.items():
            if every or name in wanted:
                self.loaded.add(name)
                try:
                    namespace[name] = __import__(module, fromlist=["_"])
                except ImportError:
                    pass
        if self.earlier is not None:  # all of it, kept the new way from now on
            namespace.update(self.earlier)
            self.loaded.update(self.earlier)
            return
        files = {file for name, file in self.values.items() if every or name in wanted}
        for file in sorted(files):
            members = [name for name, its in self.values.items() if its == file]
            self.loaded.update(members)  # loaded together, kept again together
            try:
                with open(os.path.join(self.folder, file), "rb") as handle:
                    kept = pickle.load(handle)
                namespace.update((name, kept[name]) for name in members if name in kept)
            except Exception as exc:  # a damaged file must not stop the cell: it starts without its variables
                print(f"sandbox: {', '.join(members)} could not be restored: {exc!r}", file=sys.stderr)

    def _read(self):
        try:
            with open(os.path.join(self.folder, INDEX), encoding="utf-8") as handle:
                index = json.load(handle)
            self.values, self.modules, self.next = dict(index["values"]), dict(index["modules"]), int(index["next"])
            self.about = dict(index.get("about", {}))
            self.digests = dict(index.get("digests", {}))
            return
        except FileNotFoundError:
            pass
        except Exception as exc:  # a damaged index must not stop the cell: it starts without its variables
            print(f"sandbox: the previous cell's variables could not be restored: {exc!r}", file=sys.stderr)
            return
        try:
            with open(os.path.join(WORKSPACE, CELL_STATE_FILE), "rb") as handle:
                state = pickle.load(handle)
            self.modules, self.earlier = dict(state.get("modules", {})), dict(state.get("values", {}))
        except FileNotFoundError:
            pass
        except Exception as exc:
            print(f"sandbox: the previous cell's variables could not be restored: {exc!r}", file=sys.stderr)

    def save(self, namespace):
        """Keep what can be kept of the cell's top-level names, and report what was and was not."""
        os.makedirs(self.folder, exist_ok=True)
        values = {n: f for n, f in self.values.items() if n not in self.loaded and n not in namespace}
        modules = {n: m for n, m in self.modules.items() if n not in self.loaded and n not in namespace}
        not_kept, written, shared = [], {}, {}
        digests = {n: d for n, d in self.digests.items() if n in values}
        for name, value in namespace.items():
            if name.startswith("_") or name == "__builtins__":
                continue
            if isinstance(value, types.ModuleType):
                modules[name] = value.__name__
                continue
            file = f"v{self._number()}.pickle"
            problem, mutable, digest = _write(os.path.join(self.folder, file), {name: value})
            if problem is not None:
                not_kept.append(f"{name} ({problem})")
                continue
            earlier = self.values.get(name)
            alone = earlier is not None and [n for n, f in self.values.items() if f == earlier] == [name]
            if alone and self.digests.get(name) == digest:  # loaded, and the same again: its file stays
                _remove(os.path.join(self.folder, file))
                file = earlier
            written[name], digests[name] = file, digest
            for identity in mutable:
                shared.setdefault(identity, []).append(name)
        for group in _entangled(written, shared):  # kept together, so that they still share what they share
            file = f"v{self._number()}.pickle"
            problem, _, digest = _write(os.path.join(self.folder, file), {name: namespace[name] for name in group})
            for name in group:
                if written[name] != self.values.get(name):  # (a file kept as it was is still the old group's)
                    _remove(os.path.join(self.folder, written[name]))
                if problem is None:
                    written[name], digests[name] = file, digest
                else:
                    del written[name]
                    digests.pop(name, None)
                    not_kept.append(f"{name} ({problem})")
        values.update(written)
        referenced = set(values.values())
        for file in set(self.values.values()) - referenced:  # no kept variable is in it any more
            _remove(os.path.join(self.folder, file))
        order = [n for n in self.values if n in values] + [n for n in values if n not in self.values]
        about = {n: a for n, a in self.about.items() if n in values and n not in written}
        about.update((n, _about(namespace[n])) for n in written)
        index = {"values": {n: values[n] for n in order}, "modules": modules, "next": self.next, "about": about,
                 "digests": {n: digests[n] for n in order if n in digests}}  # fmt: skip
        problem = _write_json(os.path.join(self.folder, INDEX), index)
        if problem is not None:  # the workspace is full: the previous index stays, and says what it says
            order, not_kept = [], [f"all ({problem})"]
        elif self.earlier is not None:
            _remove(os.path.join(WORKSPACE, CELL_STATE_FILE))
        os.makedirs(OUTPUT_DIR, exist_ok=True)
        with open(os.path.join(OUTPUT_DIR, CELL_STATE_REPORT), "w", encoding="utf-8") as handle:
            json.dump({"kept": order, "not_kept": not_kept, "about": {n: about.get(n, "") for n in order}}, handle)

    def _number(self):
        number, self.next = self.next, self.next + 1
        return number


IMMUTABLE = (
    str,
    bytes,
    int,
    float,
    complex,
    bool,
    type(None),
    tuple,
    frozenset,
    type,
    types.FunctionType,
    types.BuiltinFunctionType,
)
"""Objects whose identity two variables may share without it mattering (or that pickle by their name)."""


class _Hashing:
    """A file that hashes what is written to it (a kept variable's digest: what `compare` calls changed)."""

    def __init__(self, handle):
        import hashlib

        self.handle, self.sha256 = handle, hashlib.sha256()

    def write(self, data):
        self.sha256.update(data)
        return self.handle.write(data)


def _write(path, values):
    """Pickle `values` into a file, whole or not at all: (why it could not be, or None; the ids of the mutable
    objects it holds, which variables kept apart must not share; the SHA-256 of what was written)."""
    temporary = path + ".new"
    try:
        with open(temporary, "wb") as handle:
            hashing = _Hashing(handle)
            pickler = pickle.Pickler(hashing, protocol=pickle.HIGHEST_PROTOCOL)
            pickler.dump(values)
            memo = pickler.memo.copy()
        os.replace(temporary, path)
    except OSError as exc:
        _remove(temporary)
        return _WHY.get(exc.errno) or exc.strerror or type(exc).__name__, (), None
    except Exception as exc:  # not picklable (a stream, a lock, a generator, a function of this cell)
        _remove(temporary)
        return _why_not(next(iter(values.values())), exc), (), None
    mutable = [identity for identity, (_, obj) in memo.items() if not isinstance(obj, IMMUTABLE) and obj is not values]
    return None, mutable, hashing.sha256.hexdigest()


def _why_not(value, error):
    """Why a value could not be kept, in a line: its type, the part pickle stopped at, and what to do."""
    import re

    kind = type(value).__name__
    part = _local_function_in(value)
    if part is not None:
        return (
            f"{kind}: not picklable, {part}; give it a function made with def at a cell's top level, or make it "
            "again in the next cell"
        )
    said = re.sub(r" at 0x[0-9a-f]+", "", str(error).splitlines()[0] if str(error) else type(error).__name__)
    return f"{kind}: not picklable ({said[:120]}); make it again in the next cell"


def _local_function_in(value):
    """Where a matplotlib figure (or one of its axes) holds a lambda or a function made inside another, which
    pickle cannot save: its tick formatters and locators (FuncFormatter(lambda …)); None elsewhere."""
    figure = value if hasattr(value, "get_axes") else getattr(value, "figure", None)
    for axes in getattr(figure, "axes", None) or []:
        for name, axis in (("x", getattr(axes, "xaxis", None)), ("y", getattr(axes, "yaxis", None))):
            if axis is None:
                continue
            for what, part in (
                ("tick formatter", axis.get_major_formatter()),
                ("minor tick formatter", axis.get_minor_formatter()),
                ("tick locator", axis.get_major_locator()),
            ):
                function = getattr(part, "func", None)
                qualified = getattr(function, "__qualname__", "")
                if function is not None and ("<lambda>" in qualified or "<locals>" in qualified):
                    made = "a lambda" if "<lambda>" in qualified else f"a function made inside another ({qualified})"
                    return f"{made} in its {name} axis' {what}"
    return None


def _about(value, width=80):
    """What a kept variable is, in a line: its type, and its shape, length or (for a scalar or a short text) its
    value. Cheap: no repr of anything large."""
    kind = type(value).__name__
    shape = getattr(value, "shape", None)
    if isinstance(shape, tuple) and all(isinstance(n, int) for n in shape):
        return f"{kind} {' x '.join(map(str, shape)) or 'scalar'}"
    if isinstance(value, (bool, int, float, complex, type(None))) or (
        isinstance(value, (str, bytes)) and len(value) <= width
    ):
        shown = repr(value)
        return f"{kind} {shown if len(shown) <= width else shown[: width - 1] + '…'}"
    try:
        return f"{kind} of {len(value)}"
    except Exception:
        return kind


def _entangled(written, shared):
    """Groups of the variables just written that share a mutable object (each group of two or more)."""
    parent = {name: name for name in written}

    def root(name):
        while parent[name] != name:
            parent[name] = parent[parent[name]]
            name = parent[name]
        return name

    for names in shared.values():
        for other in names[1:]:
            parent[root(other)] = root(names[0])
    groups = {}
    for name in written:
        groups.setdefault(root(name), []).append(name)
    return [group for group in groups.values() if len(group) > 1]


def _write_json(path, value):
    temporary = path + ".new"
    try:
        with open(temporary, "w", encoding="utf-8") as handle:
            json.dump(value, handle)
        os.replace(temporary, path)
        return None
    except OSError as exc:
        _remove(temporary)
        return _WHY.get(exc.errno) or exc.strerror or type(exc).__name__


def _remove(path):
    try:
        os.remove(path)
    except OSError:
        pass
