"""`sandbox-server policy replay` and `policy test`: a policy change judged against the calls a trail recorded,
and a policy checked against the cases written beside it."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

__all__ = ["add_policy_evidence_commands"]


def add_policy_evidence_commands(policy_commands: Any, tool_names: Any) -> None:
    """The `policy replay` and `policy test` actions, on the `policy` command's."""
    replay = policy_commands.add_parser(
        "replay", help="what a changed policy would have done to the calls an audit trail recorded (nothing runs)"
    )
    replay.add_argument("trail", metavar="AUDIT.jsonl", help="the audit trail; its rotated files (.1 …) are read too")
    replay.add_argument("--policy", required=True, help="the changed policy (name or file)")
    replay.add_argument(
        "--from-policy", metavar="NAME",
        help="judge the calls recorded under this policy (default: the changed policy's name; '*': every call)",
    )  # fmt: skip
    replay.add_argument("--since", metavar="WHEN", help="from this time on: an ISO date or time, or 90m, 24h, 7d")
    replay.add_argument("--show", type=int, default=50, metavar="N", help="calls listed of each change (default 50)")
    replay.add_argument("--json", action="store_true", help="machine-readable output")
    replay.set_defaults(handler=lambda args: policy_replay(args, tool_names))
    test = policy_commands.add_parser(
        "test", help="check policies against their test cases (NAME.tests.yaml beside each); exit 1 on a failure"
    )
    test.add_argument("policies", nargs="*", metavar="NAME|PATH", help="policies (default: every shipped policy)")
    test.add_argument("--cases", metavar="FILE", help="the cases file (default: beside the policy)")
    test.add_argument("--json", action="store_true", help="machine-readable output")
    test.set_defaults(handler=lambda args: policy_test(args, tool_names))


def policy_replay(args: argparse.Namespace, tool_names: Any) -> int:
    """Exit 0 when the change changes none of the calls judged, 1 when it changes some (as diff does)."""
    from sandbox_server.ops.replay import KINDS, replay_trail
    from sandbox_server.ops.usage import parse_since
    from sandbox_server.policy.loader import load_policy

    policy = load_policy(args.policy, tool_names())
    since = parse_since(args.since) if args.since else None
    trail = Path(args.trail)
    if not trail.exists():
        print(f"sandbox-server: no audit trail at {trail}", file=sys.stderr)
        return 2
    from sandbox_server.cli.audit import trail_caution

    caution = trail_caution(trail)
    if caution is not None:
        print(f"sandbox-server: {caution}", file=sys.stderr)
    found = replay_trail(trail, policy, args.from_policy, since, max(0, args.show))
    changed = sum(found.counts.values())
    if args.json:
        print(json.dumps(found.as_json(), indent=2))
        return 1 if changed else 0
    span = f", {found.first_time} to {found.last_time}" if found.first_time else ""
    under = "every policy" if found.from_policy == "*" else f"policy '{found.from_policy}'"
    print(f"replayed {found.judged} call(s) recorded under {under}{span} against policy '{found.policy}' "
          f"({args.policy})\n")  # fmt: skip
    width = max(len(said) for said in KINDS.values())
    print(f"{'change':<{width}}  calls")
    for kind, said in KINDS.items():
        print(f"{said:<{width}}  {found.counts[kind]}")
    print(f"{'unchanged':<{width}}  {found.unchanged}")
    for kind, said in KINDS.items():
        if found.counts[kind]:
            more = found.counts[kind] - len(found.changes.get(kind, []))
            print(f"\n{said} ({found.counts[kind]}" + (f", {more} not listed" if more > 0 else "") + ")")
            for change in found.changes.get(kind, []):
                print(f"  {change.time}  {change.caller or '-'}  {change.tool}  {change.where}: {change.said}")
    if found.unjudged:
        print("\nnot judged:")
        for note, calls in found.unjudged.most_common():
            print(f"  {calls} call(s): {note}")
    if found.other_policies:
        others = ", ".join(f"{name}: {n}" for name, n in found.other_policies.most_common())
        print(f"\nnot replayed: calls under other policies ({others}); --from-policy NAME judges them")
    if found.unreadable:
        print(f"\n{found.unreadable} line(s) of the trail could not be read")
    return 1 if changed else 0


def policy_test(args: argparse.Namespace, tool_names: Any) -> int:
    """Exit 0 when every case of every policy passes, 1 otherwise (each failure shown as expected and got)."""
    from sandbox_server.ops.policy_tests import load_cases, run_cases
    from sandbox_server.policy.loader import load_policy
    from sandbox_server.policy.references import cases_path, policy_path, shipped_policies

    references = args.policies or shipped_policies()
    if args.cases and len(references) != 1:
        print("sandbox-server: --cases names the cases of one policy: give that policy alone", file=sys.stderr)
        return 2
    failed = 0
    report: list[dict[str, Any]] = []
    for reference in references:
        policy = load_policy(reference, tool_names())
        cases_file = Path(args.cases) if args.cases else cases_path(policy_path(reference))
        results = run_cases(policy, load_cases(cases_file))
        bad = [result for result in results if not result.passed]
        failed += len(bad)
        report.append({
            "policy": policy.name, "cases": str(cases_file), "passed": len(results) - len(bad),
            "failed": [{"case": r.name, "expected": r.expected, "got": r.got.said(), "reason": r.got.reason}
                       for r in bad],
        })  # fmt: skip
        if args.json:
            continue
        print(f"policy '{policy.name}': {len(results) - len(bad)} of {len(results)} case(s) pass ({cases_file})")
        for result in bad:
            print(f"  FAIL {result.name}\n    - expected: {result.expected}\n    + got:      {result.got.said()}"
                  + (f": {result.got.reason}" if result.got.reason else ""))  # fmt: skip
    if args.json:
        print(json.dumps(report, indent=2))
    return 1 if failed else 0
