"""JSON Schema validation with the `pattern` of ECMA-262, as the specification says a pattern is read.

jsonschema reads a `pattern` with Python's `re.search`, where `$` also matches before a trailing newline: a service
named `web2\\n` passed `^[a-z0-9][a-z0-9_-]*$`. Here each unescaped `$` outside a character class becomes `\\Z`, so
the schemas the server publishes (which clients read as ECMA-262) mean the same on both sides."""

from __future__ import annotations

import functools
import re
from collections.abc import Iterator, Mapping
from typing import Any

from jsonschema import Draft202012Validator
from jsonschema.exceptions import ValidationError
from jsonschema.protocols import Validator
from jsonschema.validators import extend

__all__ = ["SchemaValidator", "python_pattern"]


def python_pattern(pattern: str) -> str:
    """The pattern as Python's `re` must read it to mean what ECMA-262 does: `$` only at the very end."""
    out, escaped, in_class = [], False, False
    for char in pattern:
        if escaped:
            escaped = False
        elif char == "\\":
            escaped = True
        elif in_class:
            in_class = char != "]"
        elif char == "[":
            in_class = True
        elif char == "$":
            char = r"\Z"
        out.append(char)
    return "".join(out)


@functools.lru_cache(maxsize=256)
def _compiled(pattern: str) -> re.Pattern[str]:
    return re.compile(python_pattern(pattern))


def _pattern(validator: Any, pattern: str, instance: Any, schema: Mapping[str, Any]) -> Iterator[ValidationError]:
    if validator.is_type(instance, "string") and not _compiled(pattern).search(instance):
        yield ValidationError(f"{instance!r} does not match {pattern!r}")


SchemaValidator: type[Validator] = extend(Draft202012Validator, {"pattern": _pattern})  # type: ignore[no-untyped-call]
"""Draft 2020-12, with ECMA-262's `pattern` (jsonschema's `extend` is untyped)."""
