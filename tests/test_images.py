"""Images: build contexts are hashed, and nothing is rebuilt when nothing changed."""

from pathlib import Path

from sandbox_server.sandbox.docker_runtime import DockerRuntime
from sandbox_server.sandbox.images import _expected_hash, catalog, image_reference
from tests.conftest import run_cli


def test_catalog_orders_parents_before_children() -> None:
    names = list(catalog())
    assert names.index("base") < names.index("python-data")
    assert catalog()["python-data"].parent == "base"


def test_context_hash_follows_content_and_foundation(tmp_path: Path) -> None:
    (tmp_path / "img").mkdir()
    (tmp_path / "img" / "Dockerfile").write_text("FROM scratch\n")
    definition = catalog(tmp_path)["img"]
    first = _expected_hash(definition, "rootfs-a")
    assert _expected_hash(definition, "rootfs-a") == first
    assert _expected_hash(definition, "rootfs-b") != first
    (tmp_path / "img" / "extra.txt").write_text("x")
    assert _expected_hash(definition, "rootfs-a") != first


def test_second_build_rebuilds_nothing(runtime: DockerRuntime) -> None:
    result = run_cli("images", "build")
    assert result.returncode == 0, result.stderr
    assert "all images current: nothing rebuilt" in result.stderr
    assert "Step " not in result.stderr


def test_images_list_reports_every_image_current(runtime: DockerRuntime) -> None:
    result = run_cli("images", "list")
    assert result.returncode == 0, result.stdout + result.stderr
    for name in catalog():
        line = next(line for line in result.stdout.splitlines() if line.startswith(image_reference(name)))
        assert line.split()[1:3] == ["yes", "yes"]
