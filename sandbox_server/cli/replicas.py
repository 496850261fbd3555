"""`sandbox-server replicas list|drain --state URL`: the replicas sharing a database, and taking one out of service.

`drain` is the operator's way to do what SIGTERM does to a replica, from anywhere the database is reachable: the
replica sees the request at its next heartbeat (within 2 s), answers new work 503 for another replica to take,
lets what runs there finish within its grace period (serve --grace-s), and exits."""

from __future__ import annotations

import argparse
import json
import os
from typing import Any

__all__ = ["add_replicas_commands"]


def add_replicas_commands(commands: Any) -> None:
    """The `replicas` subcommand and its actions."""
    replicas = commands.add_parser("replicas", help="the replicas sharing a database: list them, drain one")
    actions = replicas.add_subparsers(dest="replicas_command", required=True, metavar="ACTION")
    listing = actions.add_parser(
        "list", help="each replica as a JSON line: its name and process, last word, whether it drains"
    )
    listing.add_argument("--state", metavar="URL", help="the shared state (postgresql://…; SANDBOX_STATE_URL)")
    listing.set_defaults(handler=_list)
    drain = actions.add_parser("drain", help="take a replica out of service: it finishes what runs there, then exits")
    drain.add_argument("replica", help="the replica's name (serve --name) or process, as `replicas list` shows them")
    drain.add_argument("--state", metavar="URL", help="the shared state (postgresql://…; SANDBOX_STATE_URL)")
    drain.set_defaults(handler=_drain)


def _database(args: argparse.Namespace) -> Any:
    from sandbox_server.errors import UsageError
    from sandbox_server.state.database import Database

    url = args.state or os.environ.get("SANDBOX_STATE_URL")
    if not url:
        raise UsageError("replicas: name the shared state with --state URL (or SANDBOX_STATE_URL)")
    database = Database(url, "replicas-command", max_connections=1)
    database.open(replica=False)
    return database


def _list(args: argparse.Namespace) -> int:
    database = _database(args)
    try:
        for replica in database.replicas():
            print(json.dumps(replica))
    finally:
        database.close()
    return 0


def _drain(args: argparse.Namespace) -> int:
    import sys

    database = _database(args)
    try:
        found = database.ask_to_drain(args.replica)
    finally:
        database.close()
    if not found:
        print(f"sandbox-server: no replica {args.replica!r} said it was alive lately (see `replicas list`)",
              file=sys.stderr)  # fmt: skip
        return 1
    print(f"asked {args.replica} to drain: it takes no new work from its next heartbeat, and exits once what runs "
          "there has finished (or its grace period has passed)", file=sys.stderr)  # fmt: skip
    return 0
