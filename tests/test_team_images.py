"""A team's own image: a build context beside its policy, built into a sandbox image, served, pooled and audited;
refused, saying why, when it runs as root, a step fails, or it lacks what its tools' calls run."""

from __future__ import annotations

import json
import re
import time
import uuid
from pathlib import Path

import anyio
import docker
import pytest

from sandbox_server.sandbox.engine.removal import OWNER_LABEL
from sandbox_server.sandbox.engine.runtime import DockerRuntime
from sandbox_server.sandbox.runc.bundles import prune_unpacked
from sandbox_server.sandbox.runc.state import IMAGES, STATE, listed, owner_of
from sandbox_server.sandbox.spec import SANDBOX_LABEL
from tests.conftest import run_cli
from tests.mcp_harness import _made_by, audit_records, connect, stdio_parameters, text_of

pytestmark = pytest.mark.anyio

TEAM_TOOL = """\
FROM sandbox-server/shell:latest
USER root
RUN printf '#!/bin/sh\\necho "teamctl {marker}: $*"\\n' > /usr/local/bin/teamctl && chmod 755 /usr/local/bin/teamctl
USER 1000:1000
"""


def _policy(folder: Path, name: str, body: str) -> Path:
    policy = folder / f"{name}.yaml"
    policy.write_text(f"extends: default\nname: {name}\n{body}")
    return policy


def _context(folder: Path, name: str, dockerfile: str) -> tuple[Path, str]:
    """A team's build context `name` under `folder` with this Dockerfile, the policy whose execute_command builds it,
    and the image it makes."""
    (folder / name).mkdir()
    (folder / name / "Dockerfile").write_text(dockerfile)
    policy = _policy(folder, name, f"tools:\n  execute_command:\n    build: {name}\n")
    return policy, _team_image(policy)


def _team_image(policy: Path) -> str:
    listed_images = run_cli("images", "list", "--json", "--policy", str(policy))
    [row] = [row for row in json.loads(listed_images.stdout) if row["policy"] is not None]
    return str(row["reference"])


def _waiting(api: docker.APIClient, server: str, image: str) -> int:
    """The sandboxes of `image` that the server whose command line holds `server` keeps started for calls."""
    count = sum(
        _made_by(item["Labels"].get(OWNER_LABEL, ""), server)
        for item in api.containers(filters={"label": SANDBOX_LABEL, "ancestor": image})
    )
    unpacked = str(api.inspect_image(image)["Id"]).removeprefix("sha256:")[:24]
    for name in listed(STATE):
        bundle = STATE / "bundles" / name
        try:
            count += (
                _made_by(owner_of(name), server)
                and (bundle / "pid").exists()
                and unpacked in (bundle / "config.json").read_text()
            )
        except OSError:  # removed meanwhile
            continue
    return count


def _remove(runtime: DockerRuntime, *references: str) -> None:
    for reference in references:
        if runtime.image(reference) is not None:
            runtime.api.remove_image(reference, force=True)
    prune_unpacked(runtime.api, IMAGES, STATE / "bundles")


async def test_a_teams_image_with_a_tool_of_its_own_is_built_served_pooled_and_audited(
    tmp_path: Path, runtime: DockerRuntime
) -> None:
    marker = uuid.uuid4().hex[:8]  # this run's own image
    (tmp_path / "team-tools").mkdir()
    (tmp_path / "team-tools" / "Dockerfile").write_text(TEAM_TOOL.format(marker=marker))
    policy = _policy(tmp_path, "team", "tools:\n  execute_command:\n    build: team-tools\n")
    image = _team_image(policy)
    assert image.startswith("sandbox-server/team-tools-"), image
    try:
        refused = run_cli("call", "execute_command", "--policy", str(policy), "--arg", "command=teamctl")
        assert refused.returncode == 2, refused.stdout + refused.stderr
        assert f"tools.execute_command.build ({tmp_path}/team-tools) makes the image {image}, which is not built" in (
            refused.stderr
        )
        assert f"run `sandbox-server images build --policy {policy}`" in refused.stderr
        unbuilt = run_cli("doctor", "--posture", "--policy", str(policy), timeout_s=300)
        assert unbuilt.returncode == 1, unbuilt.stdout + unbuilt.stderr  # the team's image named, and how to build it
        assert f"image {image}" in unbuilt.stdout and "not built (tools.execute_command.build:" in unbuilt.stdout
        assert f"images build --policy {policy}" in unbuilt.stdout and "posture team/" not in unbuilt.stdout
        built = run_cli("images", "build", "--policy", str(policy), timeout_s=600)
        assert built.returncode == 0, built.stderr
        steps = [line for line in built.stderr.splitlines() if line.startswith("[team-tools-")]
        assert any(re.search(r"\] Step 3/\d+ : RUN printf", line) for line in steps), built.stderr  # one line per step
        assert "the sandbox user, the launcher and /workspace added" in built.stderr
        again = run_cli("images", "build", "--policy", str(policy))
        assert "current" in again.stderr and "Step " not in again.stderr  # built once
        listing = run_cli("images", "list", "--policy", str(policy))
        [line] = [line for line in listing.stdout.splitlines() if line.startswith(image)]
        assert line.split()[1:3] == ["yes", "yes"] and line.split()[-2:] == ["sandbox-server/shell:latest", "team"]
        posture = run_cli("doctor", "--posture", "--policy", str(policy), timeout_s=300)
        assert f"image {image}: built and current (tools.execute_command.build:" in posture.stdout, posture.stdout
        assert posture.returncode == 0 and "posture team/execute_command: limits.pids" in posture.stdout, (
            posture.stdout + posture.stderr
        )

        audit = tmp_path / "audit.jsonl"
        async with connect(stdio_parameters("--policy", str(policy), "--audit-log", str(audit))) as session:
            with anyio.fail_after(60):
                while _waiting(runtime.api, str(audit), image) < 1:  # its warm pool, as ours have
                    await anyio.sleep(0.1)
            result = await session.call_tool("execute_command", {"command": "teamctl hello; id -u; echo $HOME"})
            python = await session.call_tool("run_python", {"code": "1 + 1"})  # the other tools keep their images
        assert not result.is_error and result.structured_content is not None, text_of(result)
        assert result.structured_content["stdout"] == f"teamctl {marker}: hello\n1000\n/workspace\n"
        assert python.structured_content is not None and python.structured_content["stdout"] == "2\n"
        records = audit_records(audit)
        assert [(r["tool"], r["image"], r["policy"]) for r in records] == [
            ("execute_command", image, "team"),
            ("run_python", "sandbox-server/python-data:latest", "team"),
        ]

        (tmp_path / "team-tools" / "notes.txt").write_text("changed\n")  # another context: another image
        changed = run_cli("call", "execute_command", "--policy", str(policy), "--arg", "command=teamctl")
        assert changed.returncode == 2 and "which is not built" in changed.stderr and image not in changed.stderr
    finally:
        _remove(runtime, image)


def test_a_root_image_a_failing_step_and_a_missing_launcher_program_are_refused_saying_why(
    tmp_path: Path, runtime: DockerRuntime
) -> None:
    for name, dockerfile in {
        "rooted": "FROM sandbox-server/shell:latest\nUSER root\nRUN true\n",
        "failing": f"FROM sandbox-server/shell:latest\nUSER root\nRUN echo {uuid.uuid4().hex}; exit 3\nUSER 1000\n",
        "no-cells": f"FROM sandbox-server/shell:latest\nRUN echo {uuid.uuid4().hex}\n",
    }.items():
        (tmp_path / name).mkdir()
        (tmp_path / name / "Dockerfile").write_text(dockerfile)
    rooted = _policy(tmp_path, "rooted", "tools:\n  execute_command:\n    build: rooted\n")
    failing = _policy(tmp_path, "failing", "tools:\n  execute_command:\n    build: failing\n")
    no_cells = _policy(tmp_path, "no-cells", "tools:\n  run_python:\n    build: no-cells\n")
    images = [_team_image(policy) for policy in (rooted, failing, no_cells)]
    try:
        said = run_cli("images", "build", "--policy", str(rooted))
        assert said.returncode == 1, said.stderr
        assert f"{tmp_path}/rooted/Dockerfile leaves its image running as root: sandboxes run as the non-root " in (
            said.stderr
        )
        assert "end it with `USER 1000:1000`" in said.stderr
        said = run_cli("images", "build", "--policy", str(failing), timeout_s=300)
        assert said.returncode == 1
        assert re.search(rf"building {re.escape(images[1])} failed at step 3/\d+ \(RUN echo ", said.stderr), said.stderr
        assert "returned a non-zero code: 3" in said.stderr
        said = run_cli("images", "build", "--policy", str(no_cells), timeout_s=300)
        assert said.returncode == 1
        assert f"{images[2]} lacks what its tools' calls run (run_python): /usr/local/lib/sandbox/run_cell.py" in (
            said.stderr
        )
        assert all(runtime.image(image) is None for image in images)  # nothing refused is left tagged
    finally:
        _remove(runtime, *images)


async def test_an_image_from_any_base_the_engine_has_is_made_a_sandbox_image(
    tmp_path: Path, runtime: DockerRuntime
) -> None:
    """FROM a plain Debian root filesystem (the one the base image is built upon): the build adds the user 1000,
    the launcher and /workspace, and a call runs in it as it runs in ours."""
    rootfs = next(ref for ref in ("debian:bookworm-slim", "sandbox-server/rootfs:bookworm") if runtime.image(ref))
    (tmp_path / "plain").mkdir()
    (tmp_path / "plain" / "Dockerfile").write_text(f"FROM {rootfs}\nRUN echo {uuid.uuid4().hex} > /etc/team\n")
    policy = _policy(tmp_path, "plain", "tools:\n  execute_command:\n    build: plain\n")
    image = _team_image(policy)
    try:
        built = run_cli("images", "build", "--policy", str(policy), timeout_s=300)
        assert built.returncode == 0, built.stderr
        async with connect(stdio_parameters("--policy", str(policy))) as session:
            result = await session.call_tool(
                "execute_command", {"command": "wc -c < /etc/team; id; pwd; touch mine && ls -l mine | cut -c1-10"}
            )
        assert result.structured_content is not None, text_of(result)
        assert result.structured_content["stdout"] == (
            "33\nuid=1000(sandbox) gid=1000(sandbox) groups=1000(sandbox)\n/workspace\n-rw-r--r--\n"
        ), text_of(result)
    finally:
        _remove(runtime, image)


HIJACKING = """\
FROM sandbox-server/shell:latest
USER root
RUN printf '#!/bin/sh\\necho hijacked "$@"; exit 3\\n' > /usr/local/bin/hijack && chmod 755 /usr/local/bin/hijack
ENTRYPOINT ["/usr/local/bin/hijack"]
CMD ["--as-command"]
USER 1000:1000
"""


@pytest.mark.parametrize("path", ["engine", "runc"])
async def test_a_teams_entrypoint_never_runs_in_place_of_the_launcher_or_a_service(
    path: str, tmp_path: Path, runtime: DockerRuntime
) -> None:
    """A team's ENTRYPOINT (and its CMD) stayed in the image: the engine ran it in place of the launcher (answered
    "killed from outside") and services failed on both paths. A call and a service now run as on ours."""
    policy, image = _context(tmp_path, "hijacking", HIJACKING)
    try:
        built = run_cli("images", "build", "--policy", str(policy), timeout_s=600)
        assert built.returncode == 0, built.stderr
        serve = ("--policy", str(policy), "--sandboxes", path, "--state-dir", str(tmp_path / "state"))
        async with connect(stdio_parameters(*serve)) as session:
            result = await session.call_tool("execute_command", {"command": "echo ran; hijack x || true"})
            assert not result.is_error and result.structured_content is not None, text_of(result)
            assert result.structured_content["stdout"] == "ran\nhijacked x\n", text_of(result)
            started = await session.call_tool(
                "execute_command",
                {"command": "exec python3 -m http.server 8000", "service": {"name": "web", "port": 8000}},
            )
            assert not started.is_error, text_of(started)
            workspace = (started.structured_content or {})["workspace"]
            reached = await session.call_tool(
                "execute_command",
                {"command": "python3 -c \"import urllib.request as u; print(u.urlopen('http://web:8000/').status)\"",
                 "workspace": workspace},
            )  # fmt: skip
            assert not reached.is_error and (reached.structured_content or {})["stdout"] == "200\n", text_of(reached)
    finally:
        _remove(runtime, image)


def test_an_image_whose_environment_would_run_first_in_the_launcher_is_refused(
    tmp_path: Path, runtime: DockerRuntime
) -> None:
    policy, image = _context(
        tmp_path,
        "preloading",
        f"FROM sandbox-server/shell:latest\nENV LD_PRELOAD=/workspace/evil.so BASH_ENV=/tmp/x NOTE={uuid.uuid4().hex}\n",
    )
    try:
        said = run_cli("images", "build", "--policy", str(policy), timeout_s=300)
        assert said.returncode == 1, said.stderr
        assert f"{image} sets BASH_ENV, LD_PRELOAD in its environment, which would run code of the image's" in (
            said.stderr
        )
        assert runtime.image(image) is None
    finally:
        _remove(runtime, image)


HARMFUL = """\
FROM sandbox-server/shell:latest
USER root
RUN mknod /opt/disk b 8 0 && mknod /opt/mem c 1 1 && cp /bin/true /opt/suid && chmod 6755 /opt/suid \\
    && truncate -s 64M /opt/sparse && mkfifo /opt/fifo
USER 1000:1000
"""


async def test_a_teams_image_unpacked_for_runc_holds_no_device_node_setuid_bit_or_written_out_hole(
    tmp_path: Path, runtime: DockerRuntime
) -> None:
    """Unpacked team images recreated device nodes (the host's root disk, /dev/mem) and setuid files on the host,
    and a 1 GiB sparse file took 1 GiB of its disk (64 MiB here, past the 16 MiB from which holes are dug again: the
    engine writes a sparse file's holes out in the layer and the export, so a larger one takes longer for the same
    proof)."""
    policy, image = _context(tmp_path, "harmful", HARMFUL + f"# {uuid.uuid4().hex}\n")
    try:
        built = run_cli("images", "build", "--policy", str(policy), timeout_s=600)
        assert built.returncode == 0, built.stderr
        serve = ("--policy", str(policy), "--sandboxes", "runc", "--no-pool", "--state-dir", str(tmp_path / "s"))
        async with connect(stdio_parameters(*serve)) as session:
            result = await session.call_tool("execute_command", {"command": "ls /opt; stat -c %a /opt/suid"})
        assert result.structured_content is not None and not result.is_error, text_of(result)
        assert result.structured_content["stdout"] == "sparse\nsuid\n755\n", text_of(result)
        unpacked = IMAGES / str(runtime.api.inspect_image(image)["Id"]).removeprefix("sha256:")[:24] / "rootfs"
        names = {path.name: path.lstat() for path in (unpacked / "opt").iterdir()}
        assert sorted(names) == ["sparse", "suid"], sorted(names)  # no node, no FIFO
        assert not names["suid"].st_mode & 0o6000
        assert names["sparse"].st_size == 1 << 26 and names["sparse"].st_blocks * 512 < 1 << 20  # its hole kept
    finally:
        _remove(runtime, image)


def test_a_build_past_its_time_cap_is_stopped_and_a_context_past_its_size_cap_refused(
    tmp_path: Path, runtime: DockerRuntime
) -> None:
    endless, image = _context(
        tmp_path, "endless", f"FROM sandbox-server/shell:latest\nRUN echo {uuid.uuid4().hex} && sleep 600\n"
    )
    try:
        started = time.monotonic()
        said = run_cli("images", "build", "--policy", str(endless), "--max-s", "8", timeout_s=120)
        assert said.returncode == 1 and time.monotonic() - started < 60, said.stderr
        assert "took longer than its cap of 8 s (images build --max-s) and was stopped at Step 2/2" in said.stderr
        assert runtime.image(image) is None
    finally:
        _remove(runtime, image)
    (tmp_path / "huge").mkdir()
    (tmp_path / "huge" / "Dockerfile").write_text("FROM sandbox-server/shell:latest\n")
    with open(tmp_path / "huge" / "data.bin", "wb") as handle:
        handle.truncate(3 * 1024**3)  # sparse: it costs nothing here, and was read whole at every policy load
    huge = _policy(tmp_path, "huge", "tools:\n  execute_command:\n    build: huge\n")
    said = run_cli("images", "build", "--policy", str(huge), timeout_s=120)
    assert said.returncode != 0 and "above the cap of 2147483648 (its largest file: data.bin" in said.stderr, (
        said.stderr
    )
