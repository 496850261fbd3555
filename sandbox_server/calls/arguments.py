"""A call's arguments checked before anything runs: their size against the policy's cap, their shape against
the tool's input schema, each error said so that a person (or a model) can fix it."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from jsonschema.exceptions import ValidationError
from jsonschema.protocols import Validator

from sandbox_server.errors import Refusal
from sandbox_server.policy import Policy
from sandbox_server.policy.hints import in_words

__all__ = ["argument_path", "check_arguments", "describe_error"]


def argument_path(error: ValidationError) -> str:
    """Where in the arguments a schema error is, as `files[2].path`."""
    path = ""
    for part in error.absolute_path:
        path += f"[{part}]" if isinstance(part, int) else (f".{part}" if path else str(part))
    return path or "(arguments)"


def describe_error(error: ValidationError) -> str:
    """A schema error as a person reads it, naming the field."""
    if error.validator == "required":
        return f"missing required field: {error.message.split(' ')[0]}"
    if error.validator == "additionalProperties":
        return f"unknown field: {error.message}"
    if error.validator == "pattern" and "\\u0000" in str(error.validator_value):
        return f"`{argument_path(error)}` contains a NUL byte, which no program argument can hold"
    said = in_words(error)  # a pattern in the schema's own words, when it gives them
    message = said if len(said) < 300 else said[:300] + "…"
    return f"`{argument_path(error)}`: {message}"


def check_arguments(tool_name: str, validator: Validator, arguments: Mapping[str, Any], policy: Policy) -> None:
    """Refuse arguments over the policy's size cap or not valid against the tool's input schema."""
    tool_policy = policy.for_tool(tool_name)
    size = len(json.dumps(arguments, ensure_ascii=False).encode("utf-8", "surrogatepass"))
    if size > tool_policy.max_argument_bytes:
        raise Refusal(
            f"refused: arguments are {size} bytes, above the cap of {tool_policy.max_argument_bytes} bytes "
            f"set by policy '{policy.name}' (field limits.argument_bytes)",
            "limits.argument_bytes",
        )
    errors = sorted(validator.iter_errors(arguments), key=lambda e: list(map(str, e.absolute_path)))
    if errors:
        raise Refusal(
            f"invalid arguments for {tool_name}: " + "; ".join(describe_error(e) for e in errors[:5]),
            argument_path(errors[0]),
            kind="invalid_arguments",
        )
