"""The `files` tool's program: run by the image's python3 in the call's sandbox, on its /workspace.

It reads one JSON request on stdin and writes one JSON answer on stdout: `{"ok": {...}}`, or
`{"refused": message, "field": name}`. It uses nothing but the standard library, and it runs as
the sandbox's user, so a link that leads out of the workspace, a name of odd bytes or a file it
may not read is met as the kernel and the sandbox's own filesystem meet it. The host reads the
answer as hostile input. Paths arrive already checked to be inside /workspace, as a relative
path ("" for /workspace itself).
"""

import json
import os
import re
import sys
from collections.abc import Iterator
from typing import Any

ROOT = "/workspace"
TOOLS_FOLDER = ".sandbox"
LINE_CHARS = 2000


class Refused(Exception):
    def __init__(self, message: str, field: str) -> None:
        super().__init__(message)
        self.field = field


def _text(path: str, field: str = "path") -> str:
    try:
        with open(path, "rb") as handle:
            data = handle.read()
    except FileNotFoundError:
        raise Refused(f"{_shown(path)} does not exist", field) from None
    except IsADirectoryError:
        raise Refused(f"{_shown(path)} is a folder: `find` lists what it holds", field) from None
    except OSError as error:
        raise Refused(f"{_shown(path)} cannot be read: {error.strerror}", field) from None
    if b"\0" in data[:8192]:
        raise Refused(f"{_shown(path)} is binary ({len(data)} bytes): not shown; read it with execute_command", field)
    return data.decode("utf-8", "surrogateescape")


def _shown(path: str) -> str:
    return os.path.relpath(path, ROOT) if path != ROOT else "/workspace"


def read(request: dict[str, Any]) -> dict[str, Any]:
    path = os.path.join(ROOT, request["path"])
    text = _text(path)
    lines = text.splitlines()
    offset = max(1, request["offset"])
    limit = request["limit"]
    budget = request["max_bytes"]
    shown: list[str] = []
    cut_lines = size = 0
    for number in range(offset, min(len(lines), offset + limit - 1) + 1):
        line = lines[number - 1]
        if len(line) > LINE_CHARS:
            line, cut_lines = line[:LINE_CHARS] + " …", cut_lines + 1
        row = f"{number:>6}\t{line}"
        size += len(row.encode("utf-8", "surrogateescape")) + 1
        if size > budget and shown:
            break
        shown.append(row)
    last = offset + len(shown) - 1
    return {
        "path": _shown(path),
        "size": os.path.getsize(path),
        "lines": len(lines),
        "offset": offset,
        "shown": len(shown),
        "content": "\n".join(shown).encode("utf-8", "surrogateescape").decode("utf-8", "replace"),
        "more": last < len(lines),
        "cut_lines": cut_lines,
    }


def _written(path: str, text: str) -> None:
    """`text` as the whole file at `path`, its folders made; a Refusal naming `path` when the kernel says no."""
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w", encoding="utf-8", errors="surrogateescape", newline="") as handle:
            handle.write(text)
    except OSError as error:
        raise Refused(f"{_shown(path)} cannot be written: {error.strerror}", "path") from None


def write(request: dict[str, Any]) -> dict[str, Any]:
    path = os.path.join(ROOT, request["path"])
    existed = os.path.lexists(path)
    _written(path, request["content"])
    return {"path": _shown(path), "size": os.path.getsize(path), "created": not existed}


def edit(request: dict[str, Any]) -> dict[str, Any]:
    path = os.path.join(ROOT, request["path"])
    text = _text(path)
    old, new = request["old"], request["new"]
    count = text.count(old)
    if count == 0:
        raise Refused(f"`old` is not in {_shown(path)}: nothing was changed (read the file for its exact text)", "old")
    if count > 1:
        starts: list[str] = []
        at = -1
        while len(starts) < 10:
            at = text.find(old, at + 1)
            if at < 0:
                break
            starts.append(str(text.count("\n", 0, at) + 1))
        raise Refused(
            f"`old` is in {_shown(path)} {count} times (lines {', '.join(starts)}): nothing was changed; "
            "give more of the text around it so that it is found once",
            "old",
        )
    changed = text.replace(old, new, 1)
    _written(path, changed)
    import difflib  # (each action imports what it alone needs: the program starts for every call)

    name = _shown(path)
    diff = difflib.unified_diff(
        text.splitlines(keepends=True), changed.splitlines(keepends=True), f"a/{name}", f"b/{name}", n=3
    )
    patch = "".join(line if line.endswith("\n") else line + "\n\\ No newline at end of file\n" for line in diff)
    return {
        "path": name,
        "size": os.path.getsize(path),
        "diff": patch.encode("utf-8", "surrogateescape").decode("utf-8", "replace"),
    }


def _walk(start: str) -> Iterator[str]:
    """Every file under start (relative to the workspace, sorted), the tools' own folder left out."""
    if os.path.isfile(start):
        yield _shown(start)
        return
    for folder, folders, files in os.walk(start):
        folders[:] = sorted(f for f in folders if not (folder == ROOT and f == TOOLS_FOLDER))
        for name in sorted(files):
            yield _shown(os.path.join(folder, name))


def find(request: dict[str, Any]) -> dict[str, Any]:
    import fnmatch

    start = os.path.join(ROOT, request["path"])
    if not os.path.exists(start):
        raise Refused(f"{_shown(start)} does not exist", "path")
    pattern = request["pattern"]
    base = request["path"].rstrip("/")
    matcher = re.compile(_glob(pattern))
    found: list[str] = []
    more = False
    for name in _walk(start):
        inside = name[len(base) + 1 :] if base and name.startswith(base + "/") else name
        if matcher.fullmatch(inside) or ("/" not in pattern and fnmatch.fnmatchcase(os.path.basename(name), pattern)):
            if len(found) == request["max_results"]:
                more = True
                break
            found.append(name)
    return {"pattern": pattern, "paths": found, "more": more}


def _glob(pattern: str) -> str:
    """A glob as a regular expression: `**/` any folders (or none), `*` and `?` within one name, `[...]` a set."""
    out: list[str] = []
    at = 0
    while at < len(pattern):
        if pattern.startswith("**/", at):
            out.append("(?:.*/)?")
            at += 3
        elif pattern.startswith("**", at):
            out.append(".*")
            at += 2
        elif pattern[at] == "*":
            out.append("[^/]*")
            at += 1
        elif pattern[at] == "?":
            out.append("[^/]")
            at += 1
        else:
            out.append(re.escape(pattern[at]))
            at += 1
    return "".join(out)


def grep(request: dict[str, Any]) -> dict[str, Any]:
    start = os.path.join(ROOT, request["path"])
    if not os.path.exists(start):
        raise Refused(f"{_shown(start)} does not exist", "path")
    try:
        pattern = re.compile(request["pattern"].encode("utf-8", "surrogateescape"))
    except re.error as error:
        raise Refused(f"`pattern` is not a regular expression: {error}", "pattern") from None
    found = _grep_program(request["pattern"], request["path"] or ".", request["max_results"])
    if found is None:  # no GNU grep with Perl's expressions in this image: read every file here
        found = _grep_here(pattern, start, request["max_results"])
    matches, more = found
    files = len({match["path"] for match in matches})
    return {"pattern": request["pattern"], "matches": matches, "in_files": files, "more": more}


def _grep_program(pattern: str, where: str, most: int) -> tuple[list[dict[str, Any]], bool] | None:
    """GNU grep's search (Perl's expressions, which Python's are close to; binary files skipped): the first `most`
    matching lines, and whether there were more; None when this image has no such grep, or it found nothing and
    failed (then Python reads the files, as `re` means the pattern)."""
    import subprocess

    command = ["grep", "-rnIZP", f"--exclude-dir={TOOLS_FOLDER}", "-e", pattern, "--", where]
    try:
        found = subprocess.Popen(  # bytes matched as bytes, as `re` on bytes does: no locale's decoding
            command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env={**os.environ, "LC_ALL": "C"}
        )
    except OSError:
        return None
    assert found.stdout is not None
    matches: list[dict[str, Any]] = []
    more = False
    for record in found.stdout:
        name, _, rest = record.partition(b"\0")
        number, _, text = rest.partition(b":")
        if not number.isdigit():
            continue
        if len(matches) == most:
            more = True
            found.kill()
            break
        path = os.path.normpath(name.decode("utf-8", "surrogateescape"))
        shown = text.rstrip(b"\n")[:LINE_CHARS].decode("utf-8", "replace")
        matches.append({"path": path.encode("utf-8", "surrogateescape").decode("utf-8", "replace"),
                        "line": int(number), "text": shown})  # fmt: skip
    if found.wait() == 2 and not matches:  # no Perl's expressions in its grep, or one it reads otherwise
        return None
    matches.sort(key=lambda match: (match["path"], match["line"]))
    return matches, more


def _grep_here(pattern: re.Pattern[bytes], start: str, most: int) -> tuple[list[dict[str, Any]], bool]:
    matches: list[dict[str, Any]] = []
    for name in _walk(start):
        try:
            with open(os.path.join(ROOT, name), "rb") as handle:
                data = handle.read()
        except OSError:
            continue
        if b"\0" in data[:8192] or not pattern.search(data):
            continue
        for number, line in enumerate(data.splitlines(), 1):
            if pattern.search(line):
                if len(matches) == most:
                    return matches, True
                matches.append({"path": name, "line": number, "text": line[:LINE_CHARS].decode("utf-8", "replace")})
    return matches, False


ACTIONS = {"read": read, "write": write, "edit": edit, "find": find, "grep": grep}


def main() -> None:
    request = json.load(sys.stdin)
    try:
        answer: dict[str, Any] = {"ok": ACTIONS[request["action"]](request)}
    except Refused as refusal:
        answer = {"refused": str(refusal), "field": refusal.field}
    sys.stdout.write(json.dumps(answer))


if __name__ == "__main__":
    main()
