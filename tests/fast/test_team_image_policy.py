"""A tool's `build`: the context's path, the image it names by its content, and what is refused, naming the field."""

from __future__ import annotations

from pathlib import Path

from sandbox_server.policy.loader import load_policy, policy_errors
from sandbox_server.sandbox.engine.team_images import TeamImage
from sandbox_server.tools import all_tools

TOOLS = [tool.name for tool in all_tools()]


def test_a_build_context_beside_the_policy_names_an_image_by_its_content(tmp_path: Path) -> None:
    (tmp_path / "Team Tools").mkdir()
    (tmp_path / "Team Tools" / "Dockerfile").write_text("FROM sandbox-server/shell:latest\n")
    policy = tmp_path / "team.yaml"
    policy.write_text("extends: default\ntools:\n  execute_command:\n    build: Team Tools\n")
    tool = load_policy(str(policy), TOOLS).for_tool("execute_command")
    assert tool.build == str(tmp_path / "Team Tools") and tool.packages is None
    assert tool.image.startswith("sandbox-server/team-tools-") and tool.image.endswith(":latest")
    assert load_policy(str(policy), TOOLS).for_tool("run_python").image == "sandbox-server/python-data:latest"
    (tmp_path / "Team Tools" / "teamctl").write_text("#!/bin/sh\n")
    changed = load_policy(str(policy), TOOLS).for_tool("execute_command").image
    assert changed != tool.image and changed.startswith("sandbox-server/team-tools-")
    needs = TeamImage(changed, tmp_path, ("execute_command", "run_python")).needs
    assert needs[:2] == ("sh", "tar") and needs[-2:] == ("python3", "/usr/local/lib/sandbox/run_cell.py")


def test_a_context_without_a_dockerfile_or_beside_packages_is_refused_naming_the_field(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    policy = tmp_path / "team.yaml"
    policy.write_text("extends: default\ntools:\n  execute_command:\n    build: empty\n")
    assert policy_errors(policy, TOOLS) == [
        f"{policy}: tools.execute_command.build: {tmp_path}/empty holds no Dockerfile"
    ]
    (tmp_path / "empty" / "Dockerfile").write_text("FROM sandbox-server/shell:latest\n")
    (tmp_path / "team.lock").write_text("")
    policy.write_text("extends: default\ntools:\n  run_python:\n    build: empty\n    packages: team.lock\n")
    [both] = policy_errors(policy, TOOLS)
    assert both.endswith("tools.run_python.build: a tool with its own build context adds its packages in its "
                         "Dockerfile: drop packages")  # fmt: skip
