"""What tools/list says of a tool's arguments and results: what a model needs to call it and read its answer, in
few words. Every bound (lengths, patterns, ranges, the shape of each nested answer) stays in the tool's full
schemas, which the server checks each call's arguments against and its results are made to (a refusal names the
argument and the rule it broke), and docs/tools.md describes; the listing carries none of them, so that five tools
cost a model's context a few thousand characters rather than fifty thousand."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

__all__ = ["HINT_DEFAULTS", "concise_arguments", "concise_hints", "concise_results"]

BOUNDS = frozenset(
    {
        "pattern", "minLength", "maxLength", "minItems", "maxItems", "minimum", "maximum", "exclusiveMinimum",
        "exclusiveMaximum", "uniqueItems", "x-in-words", "additionalProperties",
    }
)  # fmt: skip
"""What the server checks and a model need not read (a call past one is refused, naming it)."""
SHAPE = ("enum", "const")
HINT_DEFAULTS = {"readOnlyHint": False, "destructiveHint": True, "idempotentHint": False, "openWorldHint": True}
"""What a client takes a tool's hint to be when it is not given (the specification's ToolAnnotations)."""


FIELDS_IN_WORDS = "x-fields-in-words"
"""On an array argument whose items are objects: their fields in a few words, which the listing gives instead of
the items' schema (the input files of three tools, listed once each)."""


def concise_arguments(schema: Mapping[str, Any], depth: int = 0) -> dict[str, Any]:
    """The arguments' schema without its bounds: names, types, choices, defaults and what is required; each
    argument's description in its first sentence, and none for the fields within an argument (their names say
    enough beside the argument's own)."""
    said: dict[str, Any] = {}
    if FIELDS_IN_WORDS in schema and isinstance(schema.get("items"), Mapping):  # its items' fields said in words
        said["description"] = f"{first_sentence(schema.get('description', ''))} Each {schema[FIELDS_IN_WORDS]}."
        schema = {k: v for k, v in schema.items() if k not in ("description", "items", FIELDS_IN_WORDS)}
    for key, value in schema.items():
        if key in BOUNDS or (key == "description" and depth > 1) or (key == "title" and depth == 0):
            continue  # (the arguments' own title says the tool's name again)
        if key == "type" and "enum" in schema:
            continue  # the choices say it
        if key == "properties" and isinstance(value, Mapping):
            said[key] = {name: concise_arguments(inner, depth + 1) for name, inner in value.items()}
        elif key == "items" and isinstance(value, Mapping):
            said[key] = concise_arguments(value, depth + 1)
        elif key in ("anyOf", "oneOf", "allOf") and isinstance(value, list):
            said[key] = [concise_arguments(inner, depth) for inner in value]
        elif key == "description" and isinstance(value, str):
            said[key] = first_sentence(value)
        else:
            said[key] = value
    return said


def first_sentence(text: str) -> str:
    """Up to the first full stop that ends a sentence (one followed by a space and a capital, or the end)."""
    for at, char in enumerate(text):
        if char in ".;" and (at + 1 == len(text) or (text[at + 1] == " " and text[at + 2 : at + 3].isupper())):
            return text[: at + 1] if char == "." else text[:at] + "."
    return text


def concise_results(schema: Mapping[str, Any]) -> dict[str, Any]:
    """The results' schema as far as a model reads it: each field of the answer (by its type or choices where it
    is a plain value); which are there in which case (an answer, an error, a service started), and what each
    object or list holds, are the full schema's, which the server's results meet."""
    said: dict[str, Any] = {"type": "object"}
    properties = schema.get("properties") or {}
    said["properties"] = {name: _scalar_shape(inner) for name, inner in properties.items()}
    if "required" in schema:
        said["required"] = schema["required"]
    return said


def _scalar_shape(field: Mapping[str, Any]) -> dict[str, Any]:
    """A result field's choices where it has a few (a model reads which values to expect); nothing else: its name
    and value say what it is (`stdout`, `exit_code`), and its type and shape are the full schema's."""
    return {key: value for key, value in field.items() if key in SHAPE}


def concise_hints(hints: Mapping[str, Any]) -> dict[str, Any]:
    """A tool's hints without those a client assumes anyway."""
    return {key: value for key, value in hints.items() if HINT_DEFAULTS.get(key, not value) != value}
