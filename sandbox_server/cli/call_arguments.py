"""`sandbox-server call`'s arguments: JSON given whole, `--arg KEY=VALUE` pairs read by the tool's own schema, and
local files sent with `--upload`."""

from __future__ import annotations

import base64
import json
import sys
from pathlib import Path

from sandbox_server.errors import UsageError

__all__ = ["call_arguments"]


def _text(tool: str, key: str) -> bool:
    """Whether the tool's argument `key` takes text (or the tool or argument is unknown here: the server says so)."""
    from sandbox_server.tools import all_tools

    found = next((t for t in all_tools() if t.name == tool or tool.endswith(t.name)), None)
    kind = ((found.input_schema.get("properties") or {}).get(key) or {}).get("type") if found else None
    return kind is None or kind == "string" or (isinstance(kind, list) and "string" in kind)


def _read_json(value: str) -> dict[str, object]:
    """`--json` as given: a JSON object inline, `@FILE`, or `-` for standard input."""
    if value == "-":
        text = sys.stdin.read()
    elif value.startswith("@"):
        try:
            text = Path(value[1:]).read_text(encoding="utf-8")
        except OSError as exc:
            raise UsageError(f"--json {value}: cannot read {value[1:]}: {exc.strerror}") from None
    else:
        text = value
    try:
        document = json.loads(text)
    except json.JSONDecodeError as exc:
        raise UsageError(f"--json: not valid JSON ({exc})") from None
    if not isinstance(document, dict):
        raise UsageError("--json: the arguments must be one JSON object")
    return document


def call_arguments(tool: str, pairs: list[str], raw_json: str | None, uploads: list[str]) -> dict[str, object]:
    """A call's arguments from `--json` (or the JSON after the tool), each `--arg KEY=VALUE` and each `--upload`. A
    VALUE is JSON where the tool's argument is not text (`drop_totals=true`, `max_groups=20`, a list, an object)
    or it starts with [ or {; a string otherwise (`command=123` stays the command "123")."""
    arguments = _read_json(raw_json) if raw_json else {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep:
            raise UsageError(f"--arg takes KEY=VALUE, got {pair!r}")
        try:
            arguments[key] = json.loads(value) if value[:1] in ("[", "{") or not _text(tool, key) else value
        except json.JSONDecodeError:
            arguments[key] = value
    if uploads:
        files = arguments.setdefault("files", [])
        if not isinstance(files, list):
            raise UsageError("--upload: the arguments' `files` must be a list")
        files.extend(_upload(spec) for spec in uploads)
    return arguments


def _upload(spec: str) -> dict[str, str]:
    """`LOCAL[:PATH]` as one entry of `files`: the local file's bytes at PATH (default: its name) under /workspace."""
    local, _, remote = spec.partition(":")
    path = Path(local)
    try:
        content = path.read_bytes()
    except OSError as exc:
        raise UsageError(f"--upload {spec}: cannot read {local}: {exc.strerror}") from None
    return {"path": remote or path.name, "content": base64.b64encode(content).decode(), "encoding": "base64"}
