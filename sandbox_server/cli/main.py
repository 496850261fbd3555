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
from sandbox_server.cli.policies import add_policy_commands
from sandbox_server.cli.replicas import add_replicas_commands
from sandbox_server.cli.tokens import add_token_commands
from sandbox_server.cli.workspace_files import add_workspace_commands
from sandbox_server.errors import SandboxServerError, UsageError
from sandbox_server.protocol.http_limits import add_limit_arguments

if TYPE_CHECKING:
    from sandbox_server.ops.doctor import Check, WarmPlan
    from sandbox_server.policy import Policy
    from sandbox_server.policy.loader import HostFacts
    from sandbox_server.sandbox.engine.runtime import DockerRuntime

__all__ = ["main"]


def _say(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def _doctor(args: argparse.Namespace) -> int:
    from sandbox_server.ops.doctor import Check, DoctorReport, run_doctor
    from sandbox_server.sandbox.engine.runtime import DockerRuntime

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
                report.checks.extend(_team_image_checks(runtime, policy, args.policy))
                if report.healthy:  # (a team's image not built: there is nothing to start, the check says how)
                    report.checks.extend(anyio.run(run_posture, runtime, policy, _tool_names(sandboxed=True)))
        runtime.close()
    print(report.to_json() if args.json else report.to_text())
    return 0 if report.healthy else 1


def _team_image_checks(runtime: DockerRuntime, policy: Policy, reference: str) -> list[Check]:
    """The images a policy's own tools run in (a team's build, a tool's packages), each built and current or what
    to run; the posture check then starts its sandboxes in them."""
    from sandbox_server.cli.images import team_images
    from sandbox_server.ops.doctor import Check, image_state
    from sandbox_server.sandbox.engine.team_images import team_image_status

    checks = []
    for team in team_images(policy, _tool_names()):
        built, current, _ = team_image_status(runtime, team)
        checks.append(Check(
            f"image {team.reference}", built and current,
            f"{image_state(built, current)} (tools.{'/'.join(team.tools)}.build: {team.context}); the posture below is checked in it",
            f"run `sandbox-server images build --policy {reference}`",
        ))  # fmt: skip
    for image in sorted({policy.for_tool(n).image for n in _tool_names() if policy.for_tool(n).packages}):
        present = runtime.image(image) is not None
        checks.append(Check(f"image {image}", present, "built (a tool's packages)" if present else "not built",
                            f"run `sandbox-server images build --policy {reference}`"))  # fmt: skip
    return checks


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
    from sandbox_server.network.firewall import sweep_firewall
    from sandbox_server.sandbox.engine.removal import reap_after

    reaped = reap_after(args.pid, args.owner)
    sweep_firewall()  # the rules of the bridges its egress networks had, gone with them
    if args.workspaces:  # its mounted workspaces, free for another server (a replica taking them over) to mount
        from sandbox_server.workspaces.mounted import let_go_of_run

        let_go_of_run(Path(args.workspaces), args.owner)
    return reaped


def _serve(args: argparse.Namespace) -> int:
    from sandbox_server.cli.serve import serve_command

    return serve_command(args)


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
    from sandbox_server.cli.audit import trail_caution

    for path in paths:
        caution = trail_caution(Path(path))
        if caution is not None:
            print(f"sandbox-server: {caution}", file=sys.stderr)
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


def _runtime_facts() -> HostFacts:
    from sandbox_server.ops.bootstrap import host_facts
    from sandbox_server.sandbox.engine.runtime import DockerRuntime

    return host_facts(DockerRuntime.lazy())


class _Parser(argparse.ArgumentParser):
    """Options only by their whole names: a prefix (`--state` of `--state-dir`) is an error, not a guess. Every
    subcommand's parser is of this class too."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs["allow_abbrev"] = False
        super().__init__(*args, **kwargs)


def _add_call_command(commands: Any) -> None:
    """`call`: one tool call through a real session, its result printed, saved, or opened in its view."""
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
        help="an argument (repeatable); VALUE is JSON where the tool's argument is not text (true, 20, [...], {...}), "
        "else a string",
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
    call.add_argument(
        "--view",
        metavar="FILE",
        help="write the result as its view shows it (MCP Apps: a table, a notebook cell) into FILE, one HTML page "
        "to open in a browser on this machine",
    )
    call.add_argument("--tool-prefix", type=tool_prefix, help="serve tools with this name prefix")
    call.add_argument(
        "--task",
        action="store_true",
        help="run it as an MCP task (up to the policy's limits.max_task_s, that long unless timeout_s says less), "
        "printing its progress on stderr until it ends; Ctrl-C cancels it",
    )
    call.set_defaults(handler=_call)


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
    build.add_argument(
        "--max-s", type=float, default=1800.0, metavar="SECONDS",
        help="the longest a team's image may take to build, every step together (default 1800): past it the "
        "build is stopped and refused",
    )  # fmt: skip
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

    add_token_commands(commands, _tool_names, _say)
    add_replicas_commands(commands)

    # Started by `serve` itself, never by people: outlives a server killed with SIGKILL and removes its containers.
    reaper = commands.add_parser("reap-after")
    reaper.add_argument("--pid", type=int, required=True, help="the server process to outlive")
    reaper.add_argument("--owner", required=True, help="the owner label of that server's containers")
    reaper.add_argument("--workspaces", help="the workspaces' folder of that server's state folder")
    reaper.set_defaults(handler=_reap_after)

    _add_call_command(commands)

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

    add_policy_commands(commands, _tool_names, _runtime_facts)

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
