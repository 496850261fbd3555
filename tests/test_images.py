"""Images: build contexts are hashed, and nothing is rebuilt when nothing changed."""

import contextlib
import uuid
from pathlib import Path

import pytest

from sandbox_server.errors import ImageError
from sandbox_server.policy.loader import load_policy, policy_errors
from sandbox_server.sandbox.engine.images import catalog, expected_hash, image_reference
from sandbox_server.sandbox.engine.runtime import DockerRuntime
from sandbox_server.sandbox.engine.wheels import fetch_wheel, locked_wheels
from sandbox_server.tools import all_tools
from tests.conftest import run_cli

TOOLS = [tool.name for tool in all_tools()]


def test_catalog_orders_parents_before_children() -> None:
    names = list(catalog())
    assert names.index("base") < names.index("python-data")
    assert catalog()["python-data"].parent == "base"


def test_context_hash_follows_content_and_foundation(tmp_path: Path) -> None:
    (tmp_path / "img").mkdir()
    (tmp_path / "img" / "Dockerfile").write_text("FROM scratch\n")
    definition = catalog(tmp_path)["img"]
    first = expected_hash(definition, "rootfs-a")
    assert expected_hash(definition, "rootfs-a") == first
    assert expected_hash(definition, "rootfs-b") != first
    (tmp_path / "img" / "extra.txt").write_text("x")
    assert expected_hash(definition, "rootfs-a") != first


def test_second_build_rebuilds_nothing(runtime: DockerRuntime) -> None:
    result = run_cli("images", "build")
    assert result.returncode == 0, result.stderr
    assert "all images current: nothing rebuilt" in result.stderr
    assert "Step " not in result.stderr


def test_the_image_a_rebuild_replaced_is_removed_unless_a_container_uses_it(
    tmp_path: Path, runtime: DockerRuntime
) -> None:
    """Each rebuild of a changed image left the one it replaced untagged (a gigabyte at a time for python-data's):
    the build removes it, and keeps, saying why, one a container still uses."""
    from sandbox_server.sandbox.engine.connection import ImageRecord
    from sandbox_server.sandbox.engine.images import drop_replaced, steps_said

    reference = f"sandbox-server-test/replaced-{uuid.uuid4().hex[:8]}:latest"
    records: list[ImageRecord] = []
    for version in ("first", "second", "third"):
        context = tmp_path / version
        context.mkdir()
        (context / "Dockerfile").write_text("FROM sandbox-server/base:latest\nCOPY version /version\n")
        (context / "version").write_text(f"{version} {reference}\n")
        replaced = runtime.image(reference)
        list(steps_said(runtime.build(str(context), reference, {}, {})))
        said: list[str] = []
        if version == "third":  # the second one is used by a container (made, never started)
            with runtime.unstarted(records[-1].image_id):
                drop_replaced(runtime, replaced, reference, "replaced", said.append)
        else:
            drop_replaced(runtime, replaced, reference, "replaced", said.append)
        record = runtime.image(reference)
        assert record is not None and (replaced is None or record.image_id != replaced.image_id)
        records.append(record)
        if version == "second":
            assert runtime.image(records[0].image_id) is None and not said, said  # the first removed
            drop_replaced(runtime, replaced, reference, "replaced", said.append)  # as one a child's removal took
            assert not said, f"said kept, of an image that is gone: {said}"
        if version == "third":
            assert runtime.image(records[1].image_id) is not None, "an image a container uses was removed"
            assert said and "the image it replaced is kept" in said[0], said
    for record in reversed(records):
        with contextlib.suppress(Exception):
            runtime.api.remove_image(record.image_id, force=True)


def test_images_list_reports_every_image_current(runtime: DockerRuntime) -> None:
    result = run_cli("images", "list")
    assert result.returncode == 0, result.stdout + result.stderr
    for name in catalog():
        line = next(line for line in result.stdout.splitlines() if line.startswith(image_reference(name)))
        assert line.split()[1:3] == ["yes", "yes"]


def test_a_pinned_wheel_whose_hash_differs_is_refused_and_removed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SANDBOX_WHEEL_CACHE", str(tmp_path))
    [(sha256, filename)] = [w for w in locked_wheels(catalog()["python-data"].context_dir) if "duckdb" in w[1]]
    assert filename.startswith("duckdb-") and filename.endswith(".whl")
    (tmp_path / filename).write_bytes(b"not the wheel that was pinned")
    with pytest.raises(ImageError, match=f"but wheels.lock pins {sha256}; the download was removed"):
        fetch_wheel(sha256, filename, lambda _: None)
    assert not (tmp_path / filename).exists()


def test_a_malformed_wheels_lock_names_its_line(tmp_path: Path) -> None:
    (tmp_path / "wheels.lock").write_text("# pinned\n\nabc  duckdb.whl\n")
    with pytest.raises(ImageError, match=r"wheels.lock:3: expected '<sha256>  <file>.whl', found 'abc  duckdb.whl'"):
        locked_wheels(tmp_path)


TEAM_WHEEL = ("024ca478df22e9340661486f85298cff5f6dcdba14f3813e8830015b9ed1948f", "tabulate-0.9.0-py3-none-any.whl")
"""A team's own package, in no image: pure Python, fetched with pip on the host as the image's own are."""


def test_a_policy_adds_its_own_pinned_packages_in_an_image_of_its_own(tmp_path: Path, runtime: DockerRuntime) -> None:
    """packages: the team's lock, relative to the policy file. serve refuses the policy until `images build
    --policy` made its image, then run_python imports the team's package; another lock makes another image."""
    sha256, filename = TEAM_WHEEL
    lock = tmp_path / "team.lock"
    lock.write_text(f"# our stack, run {uuid.uuid4()}\n{sha256}  {filename}\n")  # this run's own image
    policy = tmp_path / "team.yaml"
    policy.write_text("extends: default\ntools:\n  run_python:\n    packages: team.lock\n")
    tool = load_policy(str(policy), TOOLS).for_tool("run_python")
    assert tool.packages == ("sandbox-server/python-data:latest", str(lock))
    assert tool.image.startswith("sandbox-server/python-data-") and tool.image != "sandbox-server/python-data:latest"
    assert load_policy(str(policy), TOOLS).for_tool("analyze_csv").image == "sandbox-server/python-data:latest"
    try:
        refused = run_cli("call", "run_python", "--policy", str(policy), "--arg", "code=1")
        assert refused.returncode == 2, refused.stdout + refused.stderr
        assert f"tools.run_python.packages ({lock}) makes the image {tool.image}, which is not built: run " in (
            refused.stderr
        )
        assert f"`sandbox-server images build --policy {policy}`" in refused.stderr
        built = run_cli("images", "build", "--policy", str(policy), timeout_s=600)
        assert built.returncode == 0 and f"building {tool.image}" in built.stderr, built.stderr
        again = run_cli("images", "build", "--policy", str(policy))
        assert "current" in again.stderr and f"building {tool.image}" not in again.stderr  # built once
        code = "code=import tabulate, sys; (tabulate.__version__, tabulate.__file__.startswith('/usr/local/lib'))"
        called = run_cli("call", "run_python", "--policy", str(policy), "--arg", code)
        assert called.returncode == 0 and "('0.9.0', True)" in called.stdout, called.stdout + called.stderr
    finally:
        if runtime.image(tool.image) is not None:
            runtime.api.remove_image(tool.image, force=True)


def test_a_policys_lock_that_is_missing_or_malformed_is_refused_naming_the_field(tmp_path: Path) -> None:
    policy = tmp_path / "team.yaml"
    policy.write_text("extends: default\ntools:\n  run_python:\n    packages: team.lock\n")
    [missing] = policy_errors(policy, TOOLS)
    assert (
        missing
        == f"{policy}: tools.run_python.packages: cannot read the lock {tmp_path}/team.lock: No such file or directory"
    )
    (tmp_path / "team.lock").write_text("tabulate==0.9.0\n")
    [malformed] = policy_errors(policy, TOOLS)
    assert f"tools.run_python.packages: {tmp_path}/team.lock:1: expected '<sha256>  <file>.whl'" in malformed
