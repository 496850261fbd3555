"""Images: build contexts are hashed, and nothing is rebuilt when nothing changed."""

from pathlib import Path

import pytest

from sandbox_server.errors import ImageError
from sandbox_server.sandbox.docker_runtime import DockerRuntime
from sandbox_server.sandbox.images import catalog, expected_hash, fetch_wheel, image_reference, locked_wheels
from tests.conftest import run_cli


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
