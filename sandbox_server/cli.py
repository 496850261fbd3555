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
