"""The `sandbox-server` command line."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

import anyio

from sandbox_server import __version__
from sandbox_server.errors import SandboxServerError

__all__ = ["main"]


def _say(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def _images_build(args: argparse.Namespace) -> int:
    from sandbox_server.sandbox.docker_runtime import DockerRuntime
    from sandbox_server.sandbox.images import build_images

    runtime = DockerRuntime.connect()
    outcomes = build_images(runtime, args.names or None, say=_say, force=args.force)
    rebuilt = [outcome.name for outcome in outcomes if outcome.rebuilt]
    _say(f"built: {', '.join(rebuilt)}" if rebuilt else "all images current: nothing rebuilt")
    return 0


def _images_list(args: argparse.Namespace) -> int:
    from sandbox_server.sandbox.docker_runtime import DockerRuntime
    from sandbox_server.sandbox.images import catalog, image_status

    runtime = DockerRuntime.connect()
    statuses = [image_status(runtime, definition) for definition in catalog().values()]
    if args.json:
        print(json.dumps([_status_dict(status) for status in statuses], indent=2))
    else:
        print(f"{'IMAGE':<32} {'BUILT':<6} {'CURRENT':<8} {'SIZE':>9}  HASH")
        for status in statuses:
            size = f"{status.size_bytes / 1e6:.0f} MB" if status.built else "-"
            print(
                f"{status.reference:<32} {'yes' if status.built else 'no':<6} "
                f"{'yes' if status.current else 'no':<8} {size:>9}  {status.expected_hash}"
            )
    return 0 if all(status.current for status in statuses) else 1


def _status_dict(status: object) -> dict[str, object]:
    from dataclasses import asdict

    return asdict(status)  # type: ignore[call-overload]


def _doctor(args: argparse.Namespace) -> int:
    from sandbox_server.doctor import Check, DoctorReport, run_doctor
    from sandbox_server.sandbox.docker_runtime import DockerRuntime

    try:
        runtime = DockerRuntime.connect()
    except SandboxServerError as exc:
        report = DoctorReport([Check("engine", False, str(exc), "run scripts/engine-up, or start dockerd yourself")])
    else:
        report = anyio.run(run_doctor, runtime)
    print(report.to_json() if args.json else report.to_text())
    return 0 if report.healthy else 1


def _serve(args: argparse.Namespace) -> int:
    import logging

    from sandbox_server.policy import Policy
    from sandbox_server.sandbox.docker_runtime import DockerRuntime
    from sandbox_server.server import SandboxServer, serve_http, serve_stdio
    from sandbox_server.tools import all_tools

    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="sandbox-server: %(message)s")
    runtime = DockerRuntime.lazy()
    try:
        reaped = runtime.reap_strays()
        if reaped:
            logging.getLogger("sandbox_server").info("removed %d stray sandbox container(s)", reaped)
    except SandboxServerError as exc:
        logging.getLogger("sandbox_server").warning("%s", exc)
    app = SandboxServer(all_tools(), Policy(), runtime, page_size=args.page_size)
    if args.transport == "http":
        anyio.run(serve_http, app, args.host, args.port)
    else:
        anyio.run(serve_stdio, app)
    return 0


def _parse_arguments(pairs: list[str], raw_json: str | None) -> dict[str, object]:
    arguments: dict[str, object] = json.loads(raw_json) if raw_json else {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep:
            raise SystemExit(f"sandbox-server: --arg takes KEY=VALUE, got {pair!r}")
        try:
            arguments[key] = json.loads(value) if value[:1] in ('[', '{') or key == "timeout_s" else value
        except json.JSONDecodeError:
            arguments[key] = value
    return arguments


def _call(args: argparse.Namespace) -> int:
    from sandbox_server.client import run_calls

    arguments = _parse_arguments(args.arg, args.json)
    results = anyio.run(run_calls, [(args.tool, arguments)])
    return 1 if results[0].is_error else 0


DEMO_CALLS: list[tuple[str, dict[str, object]]] = [
    ("execute_command", {"command": "uname -sm; id; echo \"network interfaces: $(ls /sys/class/net)\""}),
    (
        "execute_command",
        {
            "command": "sort -t, -k2 -n scores.csv | tee out/sorted.csv | tail -n 1",
            "files": [{"path": "scores.csv", "content": "ada,93\nlinus,71\ngrace,88\n"}],
        },
    ),
    ("execute_command", {"command": "echo", "args": ["$(id)", "; rm -rf /", "`whoami`"]}),
    ("execute_command", {"command": "touch /usr/bin/evil"}),
    ("execute_command", {"command": "sleep 30", "timeout_s": 1}),
]


def _demo(args: argparse.Namespace) -> int:
    from sandbox_server.client import run_calls

    print("A real MCP session: this command starts `sandbox-server serve` over stdio and calls it.\n", flush=True)
    results = anyio.run(run_calls, DEMO_CALLS, (), True)
    expected_errors = [False, False, False, True, True]
    if [result.is_error for result in results] != expected_errors:
        print("demo: unexpected results, see above", file=sys.stderr)
        return 1
    print("demo: every call ran in its own fresh container, and each was removed afterwards.")
    return 0


def build_parser() -> argparse.ArgumentParser:
    """The argument parser for every subcommand."""
    parser = argparse.ArgumentParser(
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
    build.set_defaults(handler=_images_build)
    listing = images_commands.add_parser("list", help="show which images are built and current")
    listing.add_argument("--json", action="store_true", help="machine-readable output")
    listing.set_defaults(handler=_images_list)

    serve = commands.add_parser("serve", help="serve MCP over stdio (default) or Streamable HTTP")
    serve.add_argument("--transport", choices=["stdio", "http"], default="stdio")
    serve.add_argument("--host", default="127.0.0.1", help="HTTP: address to bind (default loopback)")
    serve.add_argument("--port", type=int, default=8000, help="HTTP: port (default 8000)")
    serve.add_argument("--page-size", type=int, default=50, help="tools per tools/list page")
    serve.set_defaults(handler=_serve)

    call = commands.add_parser("call", help="start the server, make one tool call, print the result")
    call.add_argument("tool", help="tool name, e.g. execute_command")
    call.add_argument("--arg", action="append", default=[], metavar="KEY=VALUE", help="an argument (repeatable)")
    call.add_argument("--json", help="all arguments as one JSON object")
    call.set_defaults(handler=_call)

    demo = commands.add_parser("demo", help="a real MCP session against the server, with a few calls")
    demo.set_defaults(handler=_demo)

    doctor = commands.add_parser("doctor", help="check the engine, images and enforced limits")
    doctor.add_argument("--json", action="store_true", help="machine-readable output")
    doctor.set_defaults(handler=_doctor)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `sandbox-server` console script."""
    args = build_parser().parse_args(argv)
    try:
        return int(args.handler(args))
    except SandboxServerError as exc:
        print(f"sandbox-server: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
