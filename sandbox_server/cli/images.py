"""`sandbox-server images build` and `images list`: the shipped images, and those a policy's tools build."""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from sandbox_server.policy import Policy
    from sandbox_server.sandbox.engine.team_images import TeamImage

__all__ = ["images_build", "images_list"]


def team_images(policy: Policy, tool_names: list[str]) -> list[TeamImage]:
    """The team images a policy's tools run in, each once with the tools that use it."""
    from sandbox_server.sandbox.engine.team_images import TeamImage

    contexts: dict[tuple[str, str], list[str]] = {}
    for name in tool_names:
        tool = policy.for_tool(name)
        if tool.build is not None and tool.enabled:
            contexts.setdefault((tool.image, tool.build), []).append(name)
    return [TeamImage(image, Path(build), tuple(tools)) for (image, build), tools in contexts.items()]


def images_build(
    args: argparse.Namespace,
    tool_names: Callable[[], list[str]],
    host_facts: Callable[[], Any],
    say: Callable[[str], None],
) -> int:
    """Build what changed; with --policy, also the images its tools build or add their own packages to."""
    from sandbox_server.sandbox.engine.images import build_images
    from sandbox_server.sandbox.engine.runtime import DockerRuntime

    runtime = DockerRuntime.connect()
    outcomes = build_images(runtime, args.names or None, say=say, force=args.force)
    if args.policy:
        from sandbox_server.policy.loader import load_policy
        from sandbox_server.sandbox.engine.images import build_with_packages
        from sandbox_server.sandbox.engine.team_images import build_team_image

        policy = load_policy(args.policy, tool_names(), host_facts())
        tools = map(policy.for_tool, tool_names())
        wanted = {tool.image: (*tool.packages, tool.user) for tool in tools if tool.packages is not None}
        for image, (base, lock, user) in wanted.items():
            outcomes.append(build_with_packages(runtime, image, base, Path(lock), user, say, args.force))
        for team in team_images(policy, tool_names()):
            outcomes.append(build_team_image(runtime, team, say, args.force, args.max_s))
    rebuilt = [outcome.name for outcome in outcomes if outcome.rebuilt]
    say(f"built: {', '.join(rebuilt)}" if rebuilt else "all images current: nothing rebuilt")
    from sandbox_server.ops.bootstrap import policy_images
    from sandbox_server.sandbox.runc.runtime import unpack_for_runc

    unpack_for_runc(runtime, policy_images(args.policy or "default", host_facts()), say)
    return 0


def images_list(args: argparse.Namespace, tool_names: Callable[[], list[str]], host_facts: Callable[[], Any]) -> int:
    """Which images are built and current, their size, base and policy (exit 1 when one is not current)."""
    from sandbox_server.sandbox.engine.images import catalog, image_reference, image_status
    from sandbox_server.sandbox.engine.runtime import DockerRuntime
    from sandbox_server.sandbox.engine.team_images import dockerfile_base, team_image_status

    runtime = DockerRuntime.connect()
    rows: list[dict[str, Any]] = []
    for definition in catalog().values():
        status = image_status(runtime, definition)
        base = image_reference(definition.parent) if definition.parent else "debian bookworm"
        rows.append({**asdict(status), "base": base, "policy": None})
    if args.policy:
        from sandbox_server.policy.loader import load_policy

        policy = load_policy(args.policy, tool_names(), host_facts())
        for team in team_images(policy, tool_names()):
            built, current, size_bytes = team_image_status(runtime, team)
            rows.append({
                "name": team.reference.split("/", 1)[1].rsplit(":", 1)[0], "reference": team.reference,
                "built": built, "current": current, "size_bytes": size_bytes, "base": dockerfile_base(team.context),
                "policy": policy.name, "context": str(team.context), "tools": list(team.tools),
            })  # fmt: skip
    if args.json:
        print(json.dumps(rows, indent=2))
    else:
        print(f"{'IMAGE':<48} {'BUILT':<6} {'CURRENT':<8} {'SIZE':>8}  {'BASE':<32} POLICY")
        for row in rows:
            size = f"{row['size_bytes'] / 1e6:.0f} MB" if row["built"] else "-"
            print(
                f"{row['reference']:<48} {'yes' if row['built'] else 'no':<6} {'yes' if row['current'] else 'no':<8} "
                f"{size:>8}  {row['base']:<32} {row['policy'] or '-'}"
            )
    return 0 if all(row["current"] for row in rows) else 1
