"""`sandbox-server audit verify`: the audit trail's chain checked from the command line."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

__all__ = ["add_audit_commands"]


def add_audit_commands(commands: Any, tool_names: Any) -> None:
    """The `audit` command and its actions, on the CLI's subcommands."""
    audit = commands.add_parser("audit", help="check the audit trail")
    actions = audit.add_subparsers(dest="audit_command", required=True, metavar="ACTION")
    verify = actions.add_parser(
        "verify", help="whether the trail's chain of hashes holds, from its oldest kept file on, and where it breaks"
    )
    verify.add_argument(
        "path", nargs="?", metavar="PATH",
        help="the trail (default: the policy's audit.path, else audit.jsonl in the state folder); its rotated files "
        "(PATH.1 …) are read too",
    )  # fmt: skip
    verify.add_argument("--policy", default="default", help="the policy whose audit.path to check (name or file)")
    verify.add_argument("--json", action="store_true", help="machine-readable output")
    verify.set_defaults(handler=lambda args: audit_verify(args, tool_names))


def audit_verify(args: argparse.Namespace, tool_names: Any) -> int:
    """Exit 0 when the chain holds, 1 where it breaks (each break named: file, line, why)."""
    from sandbox_server.access.audit_verify import verify_trail
    from sandbox_server.policy.loader import load_policy
    from sandbox_server.state.folder import default_state_dir

    path = Path(args.path) if args.path else None
    if path is None:
        kept = load_policy(args.policy, tool_names()).audit.path
        path = Path(kept) if kept else default_state_dir() / "audit.jsonl"
    verdict = verify_trail(path)
    if args.json:
        print(json.dumps({"trail": str(path), **verdict.as_json()}, indent=2))
        return 0 if verdict.holds else 1
    if not verdict.files:
        print(f"no audit trail at {path}")
        return 1
    for broken in verdict.breaks:
        print(f"broken at {broken.said()}")
    notes = []
    if verdict.unchained:
        notes.append(f"its first {verdict.unchained} line(s) predate the chain and are not checked")
    if verdict.starts_after_rotated:
        notes.append("its oldest kept file starts after lines rotated away")
    span = f", {verdict.first_time} to {verdict.last_time}" if verdict.first_time else ""
    state = "the chain holds" if verdict.holds else f"the chain is broken in {len(verdict.breaks)} place(s)"
    print(f"{state}: {verdict.lines} line(s) in {', '.join(verdict.files)}{span}" + "".join(f"; {n}" for n in notes))
    return 0 if verdict.holds else 1
