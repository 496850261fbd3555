"""`sandbox-server audit verify`: the audit trail's chain checked from the command line."""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from sandbox_server.errors import SandboxServerError, UsageError

if TYPE_CHECKING:
    from sandbox_server.access.audit_seal import VerificationKey
    from sandbox_server.access.audit_verify import Verdict

__all__ = ["add_audit_commands", "trail_caution", "verification_key"]


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
    verify.add_argument(
        "--key", metavar="KEY|FILE",
        help="the trail's verification key (as the first sealing server wrote it), or a file holding it: every seal "
        "is checked (default: the file beside the trail, if it is still there)",
    )  # fmt: skip
    verify.add_argument("--json", action="store_true", help="machine-readable output")
    verify.set_defaults(handler=lambda args: audit_verify(args, tool_names))


def audit_verify(args: argparse.Namespace, tool_names: Any) -> int:
    """Exit 0 when the chain and its seals hold, 1 where they break (each break named: file, line, why)."""
    from sandbox_server.access.audit_verify import verify_trail
    from sandbox_server.policy.loader import load_policy
    from sandbox_server.state.folder import default_state_dir

    path = Path(args.path) if args.path else None
    if path is None:
        kept = load_policy(args.policy, tool_names()).audit.path
        path = Path(kept) if kept else default_state_dir() / "audit.jsonl"
    key, where = verification_key(path, args.key)
    verdict = verify_trail(path, key)
    if args.json:
        print(json.dumps({"trail": str(path), "verification_key": where, **verdict.as_json()}, indent=2))
        return 0 if verdict.holds else 1
    if not verdict.files:
        print(f"no audit trail at {path}")
        return 1
    for broken in verdict.breaks:
        print(f"broken at {broken.said()}")
    if verdict.breaks_not_listed:
        print(f"… and {verdict.breaks_not_listed} more break(s) not listed")
    notes = []
    if verdict.unchained:
        notes.append(f"its first {verdict.unchained} line(s) predate the chain, vouched for by its first link")
    if verdict.starts_after_rotated:
        notes.append("its oldest kept file starts after lines rotation removed (and said so)")
    notes.append(sealing_said(verdict, where))
    span = f", {verdict.first_time} to {verdict.last_time}" if verdict.first_time else ""
    state = "the chain holds" if verdict.holds else f"the chain is broken in {len(verdict.breaks)} place(s)"
    print(f"{state}: {verdict.lines} line(s) in {', '.join(verdict.files)}{span}" + "".join(f"; {n}" for n in notes))
    return 0 if verdict.holds else 1


def trail_caution(trail: Path) -> str | None:
    """A warning for what reads a trail to count or judge it (usage, policy replay): None when its chain and seals
    hold to its last line, else what does not, in a line."""
    from sandbox_server.access.audit_verify import verify_trail

    try:
        key, _ = verification_key(trail, None)
    except SandboxServerError:
        key = None
    verdict = verify_trail(trail, key)
    if not verdict.files:
        return None
    if not verdict.holds:
        first = verdict.breaks[0].said() if verdict.breaks else "?"
        return (
            f"warning: the audit trail at {trail} does not hold (broken at {first}; `sandbox-server audit verify` "
            "names every break): what follows counts lines that may have been changed, added or removed"
        )
    if key is not None and verdict.unvouched:
        return f"warning: the last {verdict.unvouched} line(s) of the audit trail at {trail} are not yet sealed"
    if key is None and verdict.seals:
        return f"note: the seals of the audit trail at {trail} were not checked (no verification key beside it)"
    return None


def verification_key(trail: Path, given: str | None) -> tuple[VerificationKey | None, str | None]:
    """The key to check seals with: given (itself, or a file holding it), else the file beside the trail; and where
    it came from. UsageError for a key that does not read as one."""
    from sandbox_server.access.audit_seal import VerificationKey, verification_key_path

    if given is None:
        beside = verification_key_path(trail)
        if not beside.is_file():
            return None, None
        given, where = beside.read_text(), f"{beside} (beside the trail)"
    elif os.path.isfile(given):
        given, where = Path(given).read_text(), given
    else:
        where = "--key"
    try:
        return VerificationKey.parse(given), where
    except ValueError as exc:
        raise UsageError(f"--key: {exc}") from None


def sealing_said(verdict: Verdict, where: str | None) -> str:
    """What the seals vouch for, in a sentence."""
    if not verdict.seals_checked:
        found = f"{verdict.seals} seal(s) found, " if verdict.seals else "no seal found, "
        return found + "not checked: no verification key (--key)"
    through = verdict.sealed_through
    sealed = f"sealed through {through[0]} line {through[1]}" if through else "no seal holds"
    after = f", {verdict.unvouched} line(s) after it not yet vouched for by a seal" if through else ""
    beside = " (a key kept beside the trail proves nothing against whoever holds this machine)"
    return f"{sealed}{after}, checked with the key from {where}" + (beside if "beside the trail" in str(where) else "")
