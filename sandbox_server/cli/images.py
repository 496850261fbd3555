"""`sandbox-server images build` and `images list`: the shipped images, and those a policy's packages make."""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

__all__ = ["images_build", "images_list"]


def images_build(
    args: argparse.Namespace,
    tool_names: Callable[[], list[str]],
    host_facts: Callable[[], Any],
    say: Callable[[str], None],
) -> int:
    """Build what changed; with --policy, also the images its tools' own packages make, each once."""
    from sandbox_server.sandbox.docker_runtime import DockerRuntime
    from sandbox_server.sandbox.images import build_images

    runtime = DockerRuntime.connect()
    outcomes = build_images(runtime, args.names or None, say=say, force=args.force)
    if args.policy:
        from sandbox_server.policy.loader import load_policy
        from sandbox_server.sandbox.images import build_with_packages

        tools = map(load_policy(args.policy, tool_names(), host_facts()).for_tool, tool_names())
        wanted = {tool.image: (*tool.packages, tool.user) for tool in tools if tool.packages is not None}
        for image, (base, lock, user) in wanted.items():
            outcomes.append(build_with_packages(runtime, image, base, Path(lock), user, say, args.force))
    rebuilt = [outcome.name for outcome in outcomes if outcome.rebuilt]
    say(f"built: {', '.join(rebuilt)}" if rebuilt else "all images current: nothing rebuilt")
    from sandbox_server.ops.bootstrap import policy_images
    from sandbox_server.sandbox.runc_runtime import unpack_for_runc

    unpack_for_runc(runtime, policy_images(args.policy or "default", host_facts()), say)
    return 0


def images_list(args: argparse.Namespace) -> int:
    """Which images are built and current (exit 1 when one is not)."""
    from sandbox_server.sandbox.docker_runtime import DockerRuntime
    from sandbox_server.sandbox.images import catalog, image_status

    runtime = DockerRuntime.connect()
    statuses = [image_status(runtime, definition) for definition in catalog().values()]
    if args.json:
        print(json.dumps([asdict(status) for status in statuses], indent=2))
    else:
        print(f"{'IMAGE':<32} {'BUILT':<6} {'CURRENT':<8} {'SIZE':>9}  HASH")
        for status in statuses:
            size = f"{status.size_bytes / 1e6:.0f} MB" if status.built else "-"
            print(
                f"{status.reference:<32} {'yes' if status.built else 'no':<6} "
                f"{'yes' if status.current else 'no':<8} {size:>9}  {status.expected_hash}"
            )
    return 0 if all(status.current for status in statuses) else 1
