"""`sandbox-server token add|list|revoke`: the static bearer tokens of HTTP callers, in a tokens file or in the
replicas' shared state."""

from __future__ import annotations

import argparse
import functools
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from sandbox_server.access.shared import SharedTokens

__all__ = ["add_token_commands"]


def add_token_commands(commands: Any, tool_names: Callable[[], list[str]], say: Callable[[str], None]) -> None:
    """The `token` subcommand and its actions."""
    token = commands.add_parser("token", help="static bearer tokens for HTTP callers: add, list, revoke")
    token_commands = token.add_subparsers(dest="token_command", required=True, metavar="ACTION")
    add = token_commands.add_parser("add", help="a new caller: prints its token once (the last line of stdout)")
    add.add_argument("name", help="the caller's name, as the audit log shows it")
    add.add_argument("--policy", help="the policy its calls run under, whatever the server's (default: default)")
    _where_callers(add, "the tokens file (made when missing)")
    add.set_defaults(handler=functools.partial(_token_add, tool_names=tool_names, say=say))
    listed = token_commands.add_parser("list", help="the callers of a tokens file and their policies")
    _where_callers(listed, "the tokens file")
    listed.set_defaults(handler=_token_list)
    revoke = token_commands.add_parser("revoke", help="remove a caller; a server reading the file refuses it at once")
    revoke.add_argument("name", help="the caller's name, as `token list` shows it")
    _where_callers(revoke, "the tokens file")
    revoke.set_defaults(handler=functools.partial(_token_revoke, say=say))


def _where_callers(parser: argparse.ArgumentParser, file_help: str) -> None:
    where = parser.add_mutually_exclusive_group(required=True)
    where.add_argument("--tokens", metavar="FILE", help=file_help)
    where.add_argument("--state", metavar="URL", help="the replicas' shared state (postgresql://…) instead of a file")


def _token_add(args: argparse.Namespace, tool_names: Callable[[], list[str]], say: Callable[[str], None]) -> int:
    from sandbox_server.access.tokens import add_caller
    from sandbox_server.policy.loader import load_policy, policy_problem
    from sandbox_server.policy.references import stored_reference

    names, shared = tool_names(), _shared_tokens(args)
    problem = policy_problem(lambda reference: load_policy(reference, names))
    if args.policy is None:
        say("no --policy: this caller's calls run under policy 'default', whatever policy the server is given")
    policy = stored_reference(args.policy or "default")  # a file by its absolute path, found from anywhere
    adding = shared.add if shared is not None else functools.partial(add_caller, Path(args.tokens))
    token = adding(args.name, policy, problem)
    where = "the shared state" if shared is not None else args.tokens
    say(f"added caller {args.name!r} (policy {policy}) to {where}; its token, shown this once:")
    print(token)
    return 0


def _token_list(args: argparse.Namespace) -> int:
    from sandbox_server.access.tokens import read_callers

    shared = _shared_tokens(args)
    for caller in shared.callers() if shared is not None else read_callers(Path(args.tokens)):
        print(f"{caller.name}\tpolicy {caller.policy}\tadded {caller.created}")
    return 0


def _token_revoke(args: argparse.Namespace, say: Callable[[str], None]) -> int:
    from sandbox_server.access.tokens import revoke_caller

    shared = _shared_tokens(args)
    if shared is not None:
        shared.revoke(args.name)
        say(f"revoked {args.name!r}: every replica refuses its token within a second")
        return 0
    revoke_caller(Path(args.tokens), args.name)
    say(f"revoked {args.name!r}: servers reading {args.tokens} refuse its token from their next request")
    return 0


def _shared_tokens(args: argparse.Namespace) -> SharedTokens | None:
    """The replicas' callers (token … --state URL), or None for a tokens file."""
    if not args.state:
        return None
    from sandbox_server.access.shared import SharedTokens
    from sandbox_server.state.database import Database

    database = Database(args.state, "token-command", max_connections=1)
    database.open(replica=False)
    return SharedTokens(database)
