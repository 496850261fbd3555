"""The options of `sandbox-server serve` (kept apart from the wiring that reads them, in serve)."""

from __future__ import annotations

import argparse
import os
import re

__all__ = ["add_serve_arguments", "tool_prefix"]


def _absolute(path: str) -> str:
    """A folder or file named on the command line, made absolute once, at start: the server and what it starts
    (runc's bundles, the reaper) read it from other working folders."""
    return os.path.abspath(os.path.expanduser(path))


def _pool_sandboxes(text: str) -> int:
    try:
        count = int(text)
    except ValueError:
        count = -1
    if count < 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a count of sandboxes (0 or more)")
    return count


def add_serve_arguments(serve: argparse.ArgumentParser) -> None:
    """The options of `sandbox-server serve`."""
    serve.add_argument(
        "--transport", choices=["stdio", "http"], default="stdio", help="stdio (one client, default) or http (/mcp)"
    )
    serve.add_argument("--host", default="127.0.0.1", help="HTTP: address to bind (default loopback)")
    serve.add_argument("--port", type=int, default=8000, help="HTTP: port (default 8000)")
    serve.add_argument("--page-size", type=int, default=50, help="tools per tools/list page")
    serve.add_argument("--policy", default="default", help="a shipped policy name or a policy file (default: default)")
    serve.add_argument(
        "--audit-log", type=_absolute, help="append one JSON line per call to this file (overrides audit.path)"
    )
    serve.add_argument("--no-watch", action="store_true", help="do not reload the policy when its file changes")
    serve.add_argument(
        "--state-dir",
        type=_absolute,
        help="where kept workspaces live (default: SANDBOX_STATE_DIR, /var/lib/sandbox-server as root, "
        "else ~/.local/state/sandbox-server)",
    )
    serve.add_argument(
        "--tool-prefix",
        type=tool_prefix,
        help="put this before every tool name (e.g. sbx_ gives sbx_execute_command); overrides the policy's tool_prefix",
    )
    serve.add_argument(
        "--tokens",
        metavar="FILE",
        help="HTTP: only callers with a token in this file (`sandbox-server token add`), each under its policy; "
        "read again when it changes",
    )
    serve.add_argument(
        "--issuer",
        metavar="URL",
        help="HTTP: accept JWT access tokens of this OAuth authorization server (signature by its JWKS, "
        "issuer, audience = the resource URL, expiry)",
    )
    serve.add_argument("--jwks-url", metavar="URL", help="with --issuer: its key set (default: from its metadata)")
    serve.add_argument(
        "--scope-policy",
        metavar="SCOPE=POLICY",
        action="append",
        default=[],
        help="with --issuer: a token with this scope runs under this policy (repeatable; the first that matches)",
    )
    serve.add_argument(
        "--claim-policy",
        metavar="CLAIM:VALUE=POLICY",
        action="append",
        default=[],
        help="with --issuer: a token whose claim has this value (or lists it) runs under this policy (repeatable; "
        "scope rules first, then these; a token matching none runs under --policy)",
    )
    serve.add_argument(
        "--required-scope",
        metavar="SCOPE",
        action="append",
        default=[],
        help="with --issuer: tokens without this scope get 403 insufficient_scope (repeatable)",
    )
    serve.add_argument(
        "--public-url",
        metavar="URL",
        help="HTTP with --tokens or --issuer: the URL clients use for /mcp: the resource URL of the protected-resource "
        "metadata and the audience tokens must name (default http://HOST:PORT/mcp)",
    )
    serve.add_argument(
        "--preview-port", type=int, metavar="PORT",
        help="stdio: open services' previews on 127.0.0.1:PORT (default: a free port; over HTTP they are served "
        "beside /mcp)",
    )  # fmt: skip
    serve.add_argument(
        "--frame-ancestor", action="append", default=[], metavar="ORIGIN",
        help="an origin whose pages may show services' previews in a frame (an MCP Apps host's, say "
        "https://app.example or http://127.0.0.1:*; repeatable); without one only the server's own pages may",
    )  # fmt: skip
    serve.add_argument(
        "--no-preview", action="store_true",
        help="stdio: open no port for services' previews (their answers then carry no link, and say so)",
    )  # fmt: skip
    serve.add_argument(
        "--metrics-token-file", metavar="PATH",
        help="HTTP: serve /metrics (Prometheus) to a bearer of the token in this file, a token of its own (at least "
        "16 characters); without it there is no /metrics",
    )  # fmt: skip
    serve.add_argument(
        "--otlp-endpoint", metavar="URL",
        help="export OpenTelemetry spans of each call over OTLP/HTTP to this collector (http://host:4318; default: "
        "OTEL_EXPORTER_OTLP_ENDPOINT when set, else none); needs sandbox-server[telemetry]",
    )  # fmt: skip
    serve.add_argument(
        "--grace-s", type=float, default=30.0, metavar="SECONDS",
        help="HTTP: on SIGTERM (or `replicas drain`) take no new work and let running calls and tasks finish for up "
        "to this long before stopping (default 30; a second signal stops at once)",
    )  # fmt: skip
    add_replica_arguments(serve)
    add_sandbox_arguments(serve)


def add_sandbox_arguments(serve: argparse.ArgumentParser) -> None:
    """The options of `sandbox-server serve` that say how calls' sandboxes and workspaces are made and kept."""
    serve.add_argument(
        "--no-pool", action="store_true", help="no warm containers: every call creates its container (pool size 0)"
    )
    serve.add_argument(
        "--pool-sandboxes",
        type=_pool_sandboxes,
        default=os.environ.get("SANDBOX_POOL_SANDBOXES") or None,
        metavar="N",
        help="keep at most N sandboxes waiting in all warm pools together, where the server policy's "
        "host.pool_sandboxes allows more (a small machine, a test run: each waiting sandbox is CPU spent ahead); "
        "default: SANDBOX_POOL_SANDBOXES, else the policy's",
    )
    serve.add_argument(
        "--workspaces",
        choices=["auto", "mounted", "archived"],
        default="auto",
        help="how kept workspaces are kept: mounted (a sized filesystem per workspace; root on the engine's "
        "host; with --state, each on its home replica), archived (a tar carried in and out of each call; works "
        "anywhere), or auto (mounted when it can)",
    )
    serve.add_argument(
        "--sandboxes",
        choices=["auto", "runc", "template", "engine"],
        default=os.environ.get("SANDBOX_SANDBOXES", "auto"),
        help="who makes calls' sandboxes: template (each forked from a template of its image, runc's bundle applied; "
        "an image without python3 by runc; root on the engine's host), runc (runc itself, for calls without a network, "
        "on an allow list or beside services, and runsc for gVisor's), engine (the engine, every call), or auto "
        "(template where the host lets it, else the engine); default: "
        "SANDBOX_SANDBOXES, else auto",
    )


def add_replica_arguments(serve: argparse.ArgumentParser) -> None:
    """The options of `sandbox-server serve` that make it one replica of several (docs/scale-out.md)."""
    serve.add_argument(
        "--state", metavar="URL",
        help="replicas: keep what every replica needs (workspaces, tasks, approvals, rate counts) in this "
        "PostgreSQL database (postgresql://user@host/db; SANDBOX_STATE_URL); default: local files, one process",
    )  # fmt: skip
    serve.add_argument(
        "--name",
        help="replicas: this replica's name in `replicas list` and `replicas drain`, the same across its restarts "
        "(default: the host's name); a replica that is alive keeps its name, and another given it is refused",
    )
    serve.add_argument(
        "--advertise", metavar="URL",
        help="replicas: the address its peers reach this replica at, to forward what lives here (a workspace "
        "mounted here, its services); default: http://<--host>:<--port>",
    )  # fmt: skip


def tool_prefix(value: str) -> str:
    """A --tool-prefix value, as the policy schema allows it."""
    from sandbox_server.policy.documents import schema

    if not re.fullmatch(schema()["properties"]["tool_prefix"]["pattern"], value):
        raise argparse.ArgumentTypeError("a tool prefix is at most 32 letters, digits, '_', '-' or '.'")
    return value
