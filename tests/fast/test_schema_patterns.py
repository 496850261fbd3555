"""Every `pattern` of the tools' and the policies' schemas read as ECMA-262 reads it: a value that matches, with a
newline after it, is refused (Python's `$` matched before a trailing newline: a service named `web2\\n` passed)."""

from __future__ import annotations

import re
from collections.abc import Iterator
from re import _parser as parser  # type: ignore[attr-defined]
from typing import Any

import pytest

from sandbox_server.ops.policy_tests import CASES_SCHEMA
from sandbox_server.policy.documents import schema
from sandbox_server.policy.ecma import SchemaValidator, python_pattern
from sandbox_server.tools import all_tools


def _patterns(node: Any) -> Iterator[str]:
    if isinstance(node, dict):
        for key, value in node.items():
            if key == "pattern" and isinstance(value, str):
                yield value
            else:
                yield from _patterns(value)
    elif isinstance(node, list):
        for value in node:
            yield from _patterns(value)


def _sample(parsed: Any) -> str:
    """One string the parsed pattern matches: the first choice of each branch, the fewest of each repeat."""
    out = []
    for op, value in parsed:
        name = str(op)
        if name == "LITERAL":
            out.append(chr(value))
        elif name == "IN":
            out.append(_sample_class(value))
        elif name in ("MAX_REPEAT", "MIN_REPEAT"):
            low, _, item = value
            out.append(_sample(item) * max(low, 0))
        elif name == "SUBPATTERN":
            out.append(_sample(value[-1]))
        elif name == "BRANCH":
            out.append(_sample(value[1][-1]))  # the last branch: the first ones here start with a lookahead's word
        elif name == "ANY":
            out.append("a")
    return "".join(out)


def _sample_class(items: Any) -> str:
    if str(items[0][0]) == "NEGATE":
        return "a"
    op, value = items[0]
    if str(op) == "RANGE":
        return chr(value[0])
    if str(op) == "CATEGORY":
        return "a"
    return chr(value)


ALL = sorted({*_patterns([tool.input_schema for tool in all_tools()]), *_patterns(schema()), *_patterns(CASES_SCHEMA)})


def test_the_patterns_are_all_found() -> None:
    assert len(ALL) >= 10 and "^[a-z0-9][a-z0-9_-]*$" in ALL  # the services' names among them


@pytest.mark.parametrize("pattern", ALL)
def test_a_value_with_a_trailing_newline_is_refused_by_every_pattern(pattern: str) -> None:
    sample = _sample(parser.parse(pattern))
    validator = SchemaValidator({"type": "string", "pattern": pattern})
    assert validator.is_valid(sample), (pattern, sample)
    if pattern.endswith("$"):
        assert re.search(pattern, sample + "\n"), "Python's own `$` lets it through"
        body_takes_it = re.fullmatch(pattern[:-1], sample + "\n") is not None  # as ECMA-262: only what the body takes
        assert validator.is_valid(sample + "\n") == body_takes_it, (pattern, sample)
    assert "$" not in python_pattern(pattern).replace("\\$", "")


def test_a_service_named_with_a_trailing_newline_is_refused_by_the_tools_schema() -> None:
    tool = next(tool for tool in all_tools() if tool.name == "execute_command")
    validator = SchemaValidator(tool.input_schema)
    good: dict[str, Any] = {"command": "true", "service": {"name": "web2", "port": 8000}}
    assert validator.is_valid(good)
    errors = list(validator.iter_errors({**good, "service": {"name": "web2\n", "port": 8000}}))
    assert [list(error.absolute_path) for error in errors] == [["service", "name"]], errors
