"""The `sandbox-server` command line."""

from __future__ import annotations

import argparse
import functools
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import anyio

from sandbox_server import __version__
from sandbox_server.cli.audit import add_audit_commands
from sandbox_server.cli.images import images_build, images_list
from sandbox_server.cli.options import add_serve_arguments, tool_prefix
from sandbox_server.cli.policy_evidence import add_policy_evidence_commands
from sandbox_server.cli.replicas import add_replicas_commands
from sandbox_server.cli.workspace_files import add_workspace_commands
from sandbox_server.errors import SandboxServerError, UsageError
from sandbox_server.protocol.http_limits import add_limit_arguments

if TYPE_CHECKING:
    from sandbox_server.access.shared import SharedTokens
    from sandbox_server.ops.doctor import WarmPlan
    from sandbox_server.policy import Policy
    from sandbox_server.policy.loader import HostFacts
    from sandbox_server.sandbox.docker_runtime import DockerRuntime

__all__ = ["main"]


def _say(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def _doctor(args: argparse.Namespace) -> int:
    from sandbox_server.ops.doctor import Check, DoctorReport, run_doctor
    from sandbox_server.sandbox.docker_runtime import DockerRuntime

    try:
        runtime = DockerRuntime.connect()
    except SandboxServerError as exc:
        report = DoctorReport(
            [
                Check(
                    "engine",
                    False,
                    str(exc),
                    "run `sandbox-server setup` (as root on Debian), or start dockerd yourself",
                )
            ]
        )
    else:
        report = anyio.run(run_doctor, runtime, _warm_plan(args.policy, runtime))
        if args.posture and report.healthy:
            from sandbox_server.ops.bootstrap import host_facts
            from sandbox_server.ops.posture import run_posture
            from sandbox_server.policy.loader import load_policy

            names = _tool_names()
            try:
                policy = load_policy(args.policy, names, host_facts(runtime))
            except SandboxServerError as exc:
                report.checks.append(Check(f"policy {args.policy}", False, str(exc), "fix the policy file"))
            else:
                report.checks.extend(anyio.run(run_posture, runtime, policy, _tool_names(sandboxed=True)))
        runtime.close()
    print(report.to_json() if args.json else report.to_text())
    return 0 if report.healthy else 1


def _warm_plan(reference: str, runtime: DockerRuntime) -> WarmPlan:
    """What the policy's run_python preloads and how many such containers its pools keep (nothing when the
    policy cannot be loaded: its own check says why)."""
    from sandbox_server.ops.bootstrap import host_facts
    from sandbox_server.ops.doctor import WarmPlan
    from sandbox_server.policy.loader import load_policy

    try:
        policy = load_policy(reference, _tool_names(), host_facts(runtime))
    except SandboxServerError:
        return WarmPlan()
    return WarmPlan.of(policy, _tool_names(sandboxed=True))


def _reap_after(args: argparse.Namespace) -> int:
    from sandbox_server.sandbox.removal import reap_after

    return reap_after(args.pid, args.owner)


def _serve(args: argparse.Namespace) -> int:
    from sandbox_server.cli.serve import serve_command

    return serve_command(args)


def _token_add(args: argparse.Namespace) -> int:
    from sandbox_server.access.tokens import add_caller
    from sandbox_server.policy.loader import load_policy, policy_problem
    from sandbox_server.policy.references import stored_reference

    names, shared = _tool_names(), _shared_tokens(args)
    problem = policy_problem(lambda reference: load_policy(reference, names))
    if args.policy is None:
        _say("no --policy: this caller's calls run under policy 'default', whatever policy the server is given")
    policy = stored_reference(args.policy or "default")  # a file by its absolute path, found from anywhere
    adding = shared.add if shared is not None else functools.partial(add_caller, Path(args.tokens))
    token = adding(args.name, policy, problem)
    where = "the shared state" if shared is not None else args.tokens
    _say(f"added caller {args.name!r} (policy {policy}) to {where}; its token, shown this once:")
    print(token)
    return 0


def _token_list(args: argparse.Namespace) -> int:
    from sandbox_server.access.tokens import read_callers

    shared = _shared_tokens(args)
    for caller in shared.callers() if shared is not None else read_callers(Path(args.tokens)):
        print(f"{caller.name}\tpolicy {caller.policy}\tadded {caller.created}")
    return 0


def _token_revoke(args: argparse.Namespace) -> int:
    from sandbox_server.access.tokens import revoke_caller

    shared = _shared_tokens(args)
    if shared is not None:
        shared.revoke(args.name)
        _say(f"revoked {args.name!r}: every replica refuses its token within a second")
        return 0
    revoke_caller(Path(args.tokens), args.name)
    _say(f"revoked {args.name!r}: servers reading {args.tokens} refuse its token from their next request")
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


def _call(args: argparse.Namespace) -> int:
    from sandbox_server.cli.client import call_command

    return call_command(args)


def _demo(args: argparse.Namespace) -> int:
    from sandbox_server.cli.client import demo_command

    return demo_command(args)


def _setup(args: argparse.Namespace) -> int:
    from sandbox_server.ops.bootstrap import setup_host

    setup_host(_say, force_images=args.force)
    _say("setup done: `sandbox-server serve` is ready")
    return 0


def _usage(args: argparse.Namespace) -> int:
    from sandbox_server.ops.usage import parse_since, read_records, summarize
    from sandbox_server.policy.loader import load_policy
    from sandbox_server.state.folder import default_state_dir

    kept = load_policy(args.policy, _tool_names()).audit.path
    paths = args.audit_log or [kept or default_state_dir() / "audit.jsonl"]  # where a server keeps it by default
    read = [read_records(Path(path)) for path in paths]  # replicas: each one's trail
    records = [record for theirs, _ in read for record in theirs]
    unreadable = sum(bad for _, bad in read)
    since = parse_since(args.since) if args.since else None
    totals = {name: row.shown() for name, row in summarize(records, args.by, since).items()}
    if args.json:
        print(json.dumps({"by": args.by, "since": since.isoformat() if since else None, "totals": totals}, indent=2))
    else:
        columns = ["calls", "ok", "errors", "refused", "wall_s", "cpu_s", "peak_memory_bytes",
                   "network_in_bytes", "network_out_bytes", "task_s", "service_s", "service_cpu_s"]  # fmt: skip
        rows = [[args.by, *columns]] + [[name, *(str(row[c]) for c in columns)] for name, row in totals.items()]
        widths = [max(len(str(row[i])) for row in rows) for i in range(len(rows[0]))]
        for row in rows:
            print("  ".join(str(cell).ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip())
    if unreadable:
        print(f"sandbox-server: {unreadable} line(s) of the audit trail could not be read", file=sys.stderr)
    return 0


def _tool_names(sandboxed: bool = False) -> list[str]:
    """Every tool's name (`sandboxed`: only those that run a sandbox of their own)."""
    from sandbox_server.tools import all_tools

    return [tool.name for tool in all_tools() if not sandboxed or tool.sandbox]


def _offered(policy: Policy) -> list[str]:
    """The tools a policy offers: enabled, and (a tool that runs no sandbox) of use under it."""
    from sandbox_server.tools import all_tools, offers

    return [tool.name for tool in all_tools() if offers(policy, tool)]


def _managing() -> tuple[str, ...]:
    """The tools that run no sandbox of their own."""
    from sandbox_server.tools import all_tools

    return tuple(tool.name for tool in all_tools() if not tool.sandbox)


def _runtime_facts() -> HostFacts:
    from sandbox_server.ops.bootstrap import host_facts
    from sandbox_server.sandbox.docker_runtime import DockerRuntime

    return host_facts(DockerRuntime.lazy())


def _policy_check(args: argparse.Namespace) -> int:
    from sandbox_server.policy.loader import load_policy, policy_errors, policy_path

    facts = _runtime_facts()
    failed = False
    for reference in args.files:
        path = policy_path(reference) if not Path(reference).exists() else Path(reference)
        errors = policy_errors(path, _tool_names(), facts)
        if errors:
            failed = True
            print(f"{path}: {len(errors)} error(s)")
            for error in errors:
                print(f"  {error}")
        else:
            print(f"{path}: ok")
            for note in load_policy(str(path), _tool_names(), facts).notes:
                print(f"  note: {note}")
    return 1 if failed else 0


def _policy_explain(args: argparse.Namespace) -> int:
    from sandbox_server.policy.explain import explain_policy
    from sandbox_server.policy.loader import load_policy

    names = _tool_names()
    policy = load_policy(args.policy, names, _runtime_facts())
    print(json.dumps(explain_policy(policy, _offered(policy), _managing()), indent=2, default=str))
    return 0


def _policy_diff(args: argparse.Namespace) -> int:
    from sandbox_server.policy.explain import diff_policies, explain_policy
    from sandbox_server.policy.loader import load_policy

    names = _tool_names()
    loaded = [load_policy(ref, names) for ref in (args.first, args.second)]
    first, second = (json.loads(json.dumps(explain_policy(p, _offered(p), _managing()), default=str)) for p in loaded)
    lines = diff_policies(first, second)
    print("\n".join(lines) if lines else "no differences in effect")
    return 0


def _policy_schema(args: argparse.Namespace) -> int:
    from sandbox_server.policy.documents import schema

    print(json.dumps(schema(), indent=2, ensure_ascii=False))
    return 0


class _Parser(argparse.ArgumentParser):
    """Options only by their whole names: a prefix (`--state` of `--state-dir`) is an error, not a guess. Every
    subcommand's parser is of this class too."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs["allow_abbrev"] = False
        super().__init__(*args, **kwargs)


def _where_callers(parser: argparse.ArgumentParser, file_help: str) -> None:
    where = parser.add_mutually_exclusive_group(required=True)
    where.add_argument("--tokens", metavar="FILE", help=file_help)
    where.add_argument("--state", metavar="URL", help="the replicas' shared state (postgresql://…) instead of a file")


def build_parser() -> argparse.ArgumentParser:
    """The argument parser for every subcommand."""
    parser = _Parser(
        prog="sandbox-server",
        description="An MCP tool server that runs every call in a fresh, hardened Docker container.",
    )
    parser.add_argument("--version", action="version", version=f"sandbox-server {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    images = commands.add_parser("images", help="build and list the sandbox images")
    images_commands = images.add_subparsers(dest="images_command", required=True, metavar="ACTION")
    build = images_commands.add_parser("build", help="build images whose build context changed")
    build.add_argument("names", nargs="*", metavar="NAME", help="images to build (default: all)")
    build.add_argument("--force", action="store_true", help="rebuild even when current")
    build.add_argument(
        "--policy", metavar="POLICY", help="also the images this policy's tools build or add packages to"
    )
    build.set_defaults(
        handler=functools.partial(images_build, tool_names=_tool_names, host_facts=_runtime_facts, say=_say)
    )
    listing = images_commands.add_parser("list", help="show which images are built and current")
    listing.add_argument("--json", action="store_true", help="machine-readable output")
    listing.add_argument("--policy", metavar="POLICY", help="also the images this policy's tools build (build)")
    listing.set_defaults(handler=functools.partial(images_list, tool_names=_tool_names, host_facts=_runtime_facts))

    serve = commands.add_parser("serve", help="serve MCP over stdio (default) or Streamable HTTP")
    add_serve_arguments(serve)
    add_limit_arguments(serve)
    serve.set_defaults(handler=_serve)

    token = commands.add_parser("token", help="static bearer tokens for HTTP callers: add, list, revoke")
    token_commands = token.add_subparsers(dest="token_command", required=True, metavar="ACTION")
    add = token_commands.add_parser("add", help="a new caller: prints its token once (the last line of stdout)")
    add.add_argument("name", help="the caller's name, as the audit log shows it")
    add.add_argument("--policy", help="the policy its calls run under, whatever the server's (default: default)")
    _where_callers(add, "the tokens file (made when missing)")
    add.set_defaults(handler=_token_add)
    listed = token_commands.add_parser("list", help="the callers of a tokens file and their policies")
    _where_callers(listed, "the tokens file")
    listed.set_defaults(handler=_token_list)
    revoke = token_commands.add_parser("revoke", help="remove a caller; a server reading the file refuses it at once")
    revoke.add_argument("name", help="the caller's name, as `token list` shows it")
    _where_callers(revoke, "the tokens file")
    revoke.set_defaults(handler=_token_revoke)

    add_replicas_commands(commands)

    # Started by `serve` itself, never by people: outlives a server killed with SIGKILL and removes its containers.
    reaper = commands.add_parser("reap-after")
    reaper.add_argument("--pid", type=int, required=True, help="the server process to outlive")
    reaper.add_argument("--owner", required=True, help="the owner label of that server's containers")
    reaper.set_defaults(handler=_reap_after)

    call = commands.add_parser(
        "call",
        help="start the server, make one tool call, print the result",
        epilog="exit codes: 0 the call succeeded; 1 it answered with an error (isError); 2 it could not be made "
        "(bad arguments here, an unknown tool, a server or engine that did not start)",
    )
    call.add_argument("tool", help="tool name, e.g. execute_command (an unknown one lists the tools)")
    call.add_argument(
        "arguments", nargs="?", metavar="JSON", help="all arguments as one JSON object (as --json takes them)"
    )
    call.add_argument("--policy", default="default", help="the policy the server runs with (name or file)")
    call.add_argument(
        "--arg",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="an argument (repeatable); a VALUE starting with [ or { is JSON (as is timeout_s), any other a string",
    )
    call.add_argument("--json", metavar="JSON|@FILE|-", help="all arguments as one JSON object, from a file, or stdin")
    call.add_argument(
        "--upload",
        action="append",
        default=[],
        metavar="LOCAL[:PATH]",
        help="send a local file, at PATH under /workspace (default: its name); repeatable",
    )
    call.add_argument("--save", metavar="DIR", help="write the returned files and images into DIR")
    call.add_argument("--tool-prefix", type=tool_prefix, help="serve tools with this name prefix")
    call.add_argument(
        "--task",
        action="store_true",
        help="run it as an MCP task (up to the policy's limits.max_task_s, that long unless timeout_s says less), "
        "printing its progress on stderr until it ends; Ctrl-C cancels it",
    )
    call.set_defaults(handler=_call)

    add_workspace_commands(commands)

    add_audit_commands(commands, _tool_names)
    usage = commands.add_parser("usage", help="what each caller or tool used, summed from the audit trail")
    usage.add_argument(
        "--by", choices=("caller", "tool"), default="caller", help="one row per caller (default) or tool"
    )
    usage.add_argument("--since", metavar="WHEN", help="only calls since then: 90s, 15m, 2h, 7d, or an ISO 8601 time")
    usage.add_argument(
        "--audit-log", metavar="PATH", action="append",
        help="an audit trail (default: the policy's audit.path, else audit.jsonl in the state folder); repeat it for every replica's",
    )  # fmt: skip
    usage.add_argument("--policy", default="default", help="the policy whose audit.path to read (name or file)")
    usage.add_argument("--json", action="store_true", help="machine-readable output")
    usage.set_defaults(handler=_usage)

    setup = commands.add_parser(
        "setup", help="make this host ready: start an engine if none answers (Debian, as root), build the images"
    )
    setup.add_argument("--force", action="store_true", help="rebuild every image even when current")
    setup.set_defaults(handler=_setup)

    demo = commands.add_parser("demo", help="a real MCP session against the server, with a few calls")
    demo.set_defaults(handler=_demo)

    policy = commands.add_parser(
        "policy", help="check, explain, compare, test policies; replay a trail under one; print their schema"
    )
    policy_commands = policy.add_subparsers(dest="policy_command", required=True, metavar="ACTION")
    check = policy_commands.add_parser("check", help="validate policy files; exit 1 with every error")
    check.add_argument("files", nargs="+", metavar="FILE", help="policy files (or shipped names)")
    check.set_defaults(handler=_policy_check)
    explain = policy_commands.add_parser("explain", help="the fully resolved policy and its container settings")
    explain.add_argument("policy", metavar="NAME|PATH", help="a shipped policy name or a policy file")
    explain.set_defaults(handler=_policy_explain)
    diff = policy_commands.add_parser("diff", help="what differs in effect between two policies")
    diff.add_argument("first", metavar="A", help="a shipped policy name or a policy file")
    diff.add_argument("second", metavar="B", help="the policy to compare it with")
    diff.set_defaults(handler=_policy_diff)
    schema_command = policy_commands.add_parser("schema", help="print the policy JSON Schema")
    schema_command.set_defaults(handler=_policy_schema)
    add_policy_evidence_commands(policy_commands, _tool_names)

    doctor = commands.add_parser("doctor", help="check the engine, images and enforced limits")
    doctor.add_argument("--json", action="store_true", help="machine-readable output")
    doctor.add_argument(
        "--posture",
        action="store_true",
        help="also start each sandbox of a policy and compare what the kernel applied (read from the host) with it",
    )
    doctor.add_argument(
        "--policy", default="default", help="the policy --posture checks, and whose preload is tried (name or file)"
    )
    doctor.set_defaults(handler=_doctor)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `sandbox-server` console script."""
    args = build_parser().parse_args(argv)
    try:
        return int(args.handler(args))
    except UsageError as exc:
        print(f"sandbox-server: {exc}", file=sys.stderr)
        return 2
    except SandboxServerError as exc:
        print(f"sandbox-server: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
