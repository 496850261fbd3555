"""Ways out of a policy error: the closest valid name for a misspelled one, or where a misplaced key belongs."""

from __future__ import annotations

import difflib
from collections.abc import Iterable, Mapping
from typing import Any

from jsonschema.exceptions import ValidationError

__all__ = ["closest", "in_words", "unexpected_key_hint"]

_DEPTH = 3
"""How deep the schema is searched for where a key belongs (top level, a section, a section's section)."""


def closest(name: str, known: Iterable[str]) -> str | None:
    """The known name a misspelled one most likely meant, or None when none is close."""
    found = difflib.get_close_matches(name, list(known), n=1, cutoff=0.6)
    return found[0] if found else None


def _resolved(node: Mapping[str, Any], root: Mapping[str, Any]) -> dict[str, Any]:
    """A schema node with its `$ref` followed (its own keys over the referenced ones, properties merged)."""
    merged: dict[str, Any] = {}
    properties: dict[str, Any] = {}
    seen = 0
    while True:
        properties = {**node.get("properties", {}), **properties}
        merged = {**node, **merged}
        reference = node.get("$ref")
        if not isinstance(reference, str) or not reference.startswith("#/$defs/") or seen > 8:
            break
        node, seen = root["$defs"][reference.removeprefix("#/$defs/")], seen + 1
    merged.pop("$ref", None)
    merged["properties"] = properties
    return merged


def _places(root: Mapping[str, Any]) -> dict[str, list[str]]:
    """Every key of the schema and where it may be written: `mounts` -> ["defaults", "tools.<tool>"]."""
    found: dict[str, list[str]] = {}

    def walk(node: Mapping[str, Any], where: str, depth: int) -> None:
        node = _resolved(node, root)
        for key, child in node["properties"].items():
            found.setdefault(key, []).append(where or "the top level")
            if depth < _DEPTH and isinstance(child, Mapping):
                walk(child, f"{where}.{key}" if where else key, depth + 1)
        extra = node.get("additionalProperties")
        if isinstance(extra, Mapping) and depth < _DEPTH:  # a mapping of named entries (tools.<tool>)
            walk(extra, f"{where}.<{where.rsplit('.', 1)[-1].rstrip('s')}>", depth + 1)

    walk(root, "", 0)
    return found


def unexpected_key_hint(error: ValidationError, root: Mapping[str, Any]) -> str:
    """For a key the schema does not allow where it is written: the closest allowed name there, or the places it
    is allowed; empty for any other error."""
    if error.validator not in ("additionalProperties", "unevaluatedProperties") or not isinstance(
        error.instance, Mapping
    ):
        return ""
    where = error.schema if isinstance(error.schema, Mapping) else {}
    allowed = set(_resolved(where, root)["properties"])
    places = _places(root)
    hints = []
    for key in (str(k) for k in error.instance if k not in allowed):
        if key in places:
            hints.append(f"'{key}' belongs under {' or '.join(places[key])}")
        elif (near := closest(key, allowed)) is not None:
            hints.append(f"did you mean '{near}' instead of '{key}'?")
        elif (near := closest(key, places)) is not None:
            hints.append(f"did you mean '{near}' (which belongs under {' or '.join(places[near])}) instead of '{key}'?")
    if not hints and allowed and where.get("required"):  # an object of set fields (a mount): name them
        hints.append(f"the fields here: {_fields(_resolved(where, root))}")
    return "; ".join(hints)


def _fields(where: Mapping[str, Any]) -> str:
    """The fields an object of the schema takes: "host, sandbox, mode (optional)"."""
    required = set(where.get("required", []))
    return ", ".join(name if name in required else f"{name} (optional)" for name in where.get("properties", {}))


def in_words(error: ValidationError) -> str:
    """What a pattern asks for, in the words the schema gives it (`x-in-words`) rather than as a regular
    expression, and the fields of an object a required one is missing from; the validator's message otherwise."""
    where = error.schema if isinstance(error.schema, Mapping) else {}
    if error.validator == "pattern" and isinstance(where.get("x-in-words"), str):
        return f"{error.instance!r} is not allowed here: it must be {where['x-in-words']}"
    if error.validator == "required" and where.get("properties"):
        return f"{error.message} (the fields here: {_fields(where)})"
    return error.message
