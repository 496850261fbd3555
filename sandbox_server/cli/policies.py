"""`sandbox-server policy check|explain|diff|schema` (and the evidence commands, `test` and `replay`): a policy
read, told in full, compared and tried before a server runs it."""

from __future__ import annotations

import argparse
import functools
import json
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from sandbox_server.cli.policy_evidence import add_policy_evidence_commands
from sandbox_server.policy.references import CASES_SUFFIX

if TYPE_CHECKING:
    from sandbox_server.policy import Policy
    from sandbox_server.policy.loader import HostFacts

__all__ = ["add_policy_commands"]


def add_policy_commands(commands: Any, tool_names: Callable[[], list[str]], facts: Callable[[], HostFacts]) -> None:
    """The `policy` subcommand and its actions; `facts`: what this host's engine has, asked when a command needs it."""
    policy = commands.add_parser(
        "policy", help="check, explain, compare, test policies; replay a trail under one; print their schema"
    )
    policy_commands = policy.add_subparsers(dest="policy_command", required=True, metavar="ACTION")
    check = policy_commands.add_parser("check", help="validate policy files; exit 1 with every error")
    check.add_argument("files", nargs="+", metavar="FILE", help="policy files (or shipped names)")
    check.set_defaults(handler=functools.partial(_policy_check, tool_names=tool_names, facts=facts))
    explain = policy_commands.add_parser("explain", help="the fully resolved policy and its container settings")
    explain.add_argument("policy", metavar="NAME|PATH", help="a shipped policy name or a policy file")
    explain.set_defaults(handler=functools.partial(_policy_explain, tool_names=tool_names, facts=facts))
    diff = policy_commands.add_parser(
        "diff", help="what differs in effect between two policies, by the files' own names; exit 1 when any does"
    )
    diff.add_argument("first", metavar="A", help="a shipped policy name or a policy file")
    diff.add_argument("second", metavar="B", help="the policy to compare it with")
    diff.set_defaults(handler=functools.partial(_policy_diff, tool_names=tool_names))
    schema_command = policy_commands.add_parser("schema", help="print the policy JSON Schema")
    schema_command.set_defaults(handler=_policy_schema)
    add_policy_evidence_commands(policy_commands, tool_names)


def _cases_checked(path: Path) -> bool:
    """A policy's test cases, known by their name: checked as cases, not as a policy (as `opa check` knows a
    `_test.rego`); whether they are well formed."""
    from sandbox_server.errors import ConfigError
    from sandbox_server.ops.policy_tests import load_cases

    policy = path.with_name(path.name.removesuffix(CASES_SUFFIX) + ".yaml")
    try:
        cases = load_cases(path)
    except ConfigError as error:
        print(f"{path}: test cases: {str(error).removeprefix(f'{path}: ')}")
        return False
    print(f"{path}: test cases of {policy.name}: {len(cases)} case(s), well formed (run them: policy test {policy})")
    return True


def _policy_check(args: argparse.Namespace, tool_names: Callable[[], list[str]], facts: Callable[[], HostFacts]) -> int:
    from sandbox_server.policy.loader import load_policy, policy_errors, policy_path

    facts_here = facts()
    failed = False
    for reference in args.files:
        path = policy_path(reference) if not Path(reference).exists() else Path(reference)
        if path.name.endswith(CASES_SUFFIX):  # `policies/*.yaml` names the cases beside each policy too
            failed = not _cases_checked(path) or failed
            continue
        errors = policy_errors(path, tool_names(), facts_here)
        if errors:
            failed = True
            print(f"{path}: {len(errors)} error(s)")
            for error in errors:
                print(f"  {error}")
        else:
            print(f"{path}: ok")
            for note in load_policy(str(path), tool_names(), facts_here).notes:
                print(f"  note: {note}")
    return 1 if failed else 0


def _policy_explain(
    args: argparse.Namespace, tool_names: Callable[[], list[str]], facts: Callable[[], HostFacts]
) -> int:
    from sandbox_server.policy.explain import explain_policy
    from sandbox_server.policy.loader import load_policy

    names = tool_names()
    policy = load_policy(args.policy, names, facts())
    print(json.dumps(explain_policy(policy, _offered(policy), _managing()), indent=2, default=str))
    return 0


def _policy_diff(args: argparse.Namespace, tool_names: Callable[[], list[str]]) -> int:
    from sandbox_server.policy.explain import diff_policies, explain_policy
    from sandbox_server.policy.loader import load_policy

    names = tool_names()
    loaded = [load_policy(ref, names) for ref in (args.first, args.second)]
    first, second = (json.loads(json.dumps(explain_policy(p, _offered(p), _managing()), default=str)) for p in loaded)
    lines = diff_policies(first, second)
    print("\n".join(lines) if lines else "no differences in effect")
    return 1 if lines else 0  # as diff(1) and `policy replay`: 1 when they differ


def _policy_schema(args: argparse.Namespace) -> int:
    from sandbox_server.policy.documents import schema

    print(json.dumps(schema(), indent=2, ensure_ascii=False))
    return 0


def _offered(policy: Policy) -> list[str]:
    """The tools a policy offers: enabled, and (a tool that runs no sandbox) of use under it."""
    from sandbox_server.tools import all_tools, offers

    return [tool.name for tool in all_tools() if offers(policy, tool)]


def _managing() -> tuple[str, ...]:
    """The tools that run no sandbox of their own."""
    from sandbox_server.tools import all_tools

    return tuple(tool.name for tool in all_tools() if not tool.sandbox)
