"""Where a forked sandbox's mounts land under its root: as `os.path.realpath` puts them (links followed as they
lead, never out of the root), each part looked at once when no part is a link."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from sandbox_server.sandbox.template import mnt


def _image(root: Path) -> None:
    (root / "usr" / "lib").mkdir(parents=True)
    (root / "etc").mkdir()
    (root / "etc" / "hosts").write_text("")
    (root / "lib").symlink_to("usr/lib")  # as Debian's merged /usr
    (root / "escape").symlink_to("/")  # a link an image may hold, leading to the host's root
    (root / "up").symlink_to("../../..")


@pytest.mark.parametrize(
    "destination",
    ["/proc", "/proc/sys/kernel", "/tmp", "/etc/hosts", "/etc/hosts/under/a/file", "/lib/x", "/lib", "/./dev//shm",
     "/usr/../etc", "/escape/etc", "/up/x", "/", ""],
)  # fmt: skip
def test_a_mount_point_is_where_realpath_puts_it_or_refused_out_of_the_root(tmp_path: Path, destination: str) -> None:
    root = tmp_path / "root"
    root.mkdir()
    _image(root)
    expected = os.path.realpath(os.path.join(str(root), destination.lstrip("/")))
    if expected == str(root) or expected.startswith(f"{root}/"):
        assert mnt._inside(str(root), destination) == expected
    else:
        with pytest.raises(OSError, match="leads out of the sandbox's root"):
            mnt._inside(str(root), destination)


def test_parts_below_the_root_are_looked_at_once_when_none_is_a_link(tmp_path: Path) -> None:
    root = tmp_path / "root"
    root.mkdir()
    _image(root)
    assert mnt._under(str(root), "/proc/sys/kernel") == f"{root}/proc/sys/kernel"
    assert mnt._under(str(root), "/lib/x") is None  # a link: realpath decides
    assert mnt._under(str(root), "/usr/../etc") is None
    assert mnt._under(f"{root}/lib", "/x") is None  # a root that is not a real path
