"""A policy's test cases: what it must allow, refuse (naming the field) or put to a person (`policy test`).

The cases are a YAML file beside the policy (`strict.yaml`'s in `strict.tests.yaml`), each a call (a tool and its
arguments, whole) or a host a tool's sandbox reaches, and what the policy must say of it. They are judged as a call
is before it runs (calls.judge), so a loosened policy fails its cases without a sandbox started.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from sandbox_server.calls.arguments import argument_path
from sandbox_server.calls.judge import Judge, Verdict
from sandbox_server.errors import ConfigError
from sandbox_server.policy import Policy
from sandbox_server.policy.ecma import SchemaValidator
from sandbox_server.policy.yaml_files import load_yaml
from sandbox_server.tools import all_tools

__all__ = ["CASES_SCHEMA", "CaseResult", "load_cases", "run_cases"]

CASES_SCHEMA: dict[str, Any] = {
    "type": "object",
    "required": ["cases"],
    "additionalProperties": False,
    "properties": {
        "cases": {
            "type": "array",
            "minItems": 1,
            "items": {
                "type": "object",
                "required": ["tool", "expect"],
                "additionalProperties": False,
                "properties": {
                    "name": {"type": "string"},
                    "caller": {"type": "string", "description": "who makes the call, as the report shows it"},
                    "tool": {"type": "string"},
                    "arguments": {"type": "object"},
                    "task": {"type": "boolean", "description": "the call runs as a task (its time cap is max_task_s)"},
                    "host": {"type": "string", "description": "a host the tool's sandbox reaches, not a call"},
                    "port": {"type": "integer", "minimum": 1, "maximum": 65535},
                    "expect": {"enum": ["allowed", "refused", "approval"]},
                    "field": {"type": "string", "description": "the policy field that must decide"},
                },
                "not": {"required": ["host", "arguments"]},
            },
        }
    },
}
"""The shape of a cases file."""


@dataclass(frozen=True, slots=True)
class CaseResult:
    """One case: what it expects, what the policy said, and whether they agree."""

    name: str
    expected: str
    got: Verdict

    @property
    def passed(self) -> bool:
        decision, _, field = self.expected.partition(" ")
        return self.got.decision == decision and (not field or field.strip("()") == self.got.field)


def load_cases(path: Path) -> list[dict[str, Any]]:
    """A cases file read and checked: each error names the case and the field."""
    try:
        document = load_yaml(path)
    except FileNotFoundError:
        raise ConfigError(f"no test cases at {path}: write what the policy must allow and refuse there") from None
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read: {exc.strerror or exc}") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: not YAML: {exc}") from None
    errors = sorted(SchemaValidator(CASES_SCHEMA).iter_errors(document), key=lambda e: list(map(str, e.path)))
    if errors:
        said = [f"{argument_path(error)}: {error.message[:200]}" for error in errors[:10]]
        raise ConfigError(f"{path}: cases refused:\n  " + "\n  ".join(said))
    return list(document["cases"])


def run_cases(policy: Policy, cases: Sequence[Mapping[str, Any]]) -> list[CaseResult]:
    """Each case judged under the policy."""
    judge = Judge(policy, all_tools())
    results = []
    for index, case in enumerate(cases):
        tool = case["tool"]
        if "host" in case:
            got = judge.host(tool, case["host"], int(case.get("port", 443)))
            what = f"{tool} reaches {case['host']}:{case.get('port', 443)}"
        else:
            got = judge.call(tool, case.get("arguments", {}), bool(case.get("task")))
            what = f"{tool} {_shown(case.get('arguments', {}))}"
        by = f" by {case['caller']}" if case.get("caller") else ""
        expected = case["expect"] + (f" ({case['field']})" if case.get("field") else "")
        results.append(CaseResult(case.get("name") or f"case {index + 1}: {what}{by}", expected, got))
    return results


def _shown(arguments: Mapping[str, Any]) -> str:
    text = json.dumps(arguments, ensure_ascii=False)
    return text if len(text) <= 80 else text[:77] + "…"
