"""The user namespaces of sandboxes with host ids of their own, made by the server's maker (one small process, a
child per namespace) rather than by a helper program started per sandbox."""

from __future__ import annotations

import fcntl
import os
import struct
import subprocess
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from sandbox_server.sandbox import mounts
from sandbox_server.sandbox.runc import host_ids, userns_maker

NS_GET_OWNER_UID = 0xB704
FIRST = host_ids.first_id(host_ids.RANGES - 1)
"""A range no sandbox takes while a test runs beside this one (they are handed out from the lowest free one)."""


@pytest.fixture
def held(tmp_path: Path) -> Iterator[Path]:
    place = tmp_path / "userns"
    yield place
    mounts.detach(str(place))
    userns_maker.close()


def _owner(held: Path) -> int:
    fd = os.open(held, os.O_RDONLY | os.O_CLOEXEC)
    try:
        said = bytearray(4)
        fcntl.ioctl(fd, NS_GET_OWNER_UID, said)
        return int(struct.unpack("I", said)[0])
    finally:
        os.close(fd)


def _seen_inside(held: Path) -> str:
    """The uid and gid maps of the namespace bound on `held`, as a process that enters it reads them."""
    return subprocess.run(
        ["nsenter", f"--user={held}", "sh", "-c", "cat /proc/self/uid_map /proc/self/gid_map; id -u"],
        capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip


def _makers() -> list[psutil.Process]:
    me = psutil.Process()
    return [child for child in me.children() if "CLONE_NEWUSER" in " ".join(child.cmdline())]


def test_a_namespace_is_owned_by_its_ranges_first_id_and_maps_the_range(held: Path) -> None:
    userns_maker.make(held, FIRST)
    assert _owner(held) == FIRST  # what its sandbox holds is counted against this host id
    said = _seen_inside(held).split()
    assert said == ["0", str(FIRST), "65536", "0", str(FIRST), "65536", "0"], said  # the host's root is its root


def test_a_maker_that_died_is_started_again_and_one_stopped_leaves_nothing_running(held: Path) -> None:
    userns_maker.make(held, FIRST)
    mounts.detach(str(held))
    (maker,) = _makers()
    maker.kill()
    maker.wait(timeout=10)
    userns_maker.make(held, FIRST)  # asked of a dead maker: started again, not an error
    assert _owner(held) == FIRST
    (again,) = _makers()
    assert again.pid != maker.pid
    userns_maker.close()
    assert not again.is_running() or again.status() == psutil.STATUS_ZOMBIE
    assert _makers() == []


def test_a_namespace_the_kernel_refuses_is_an_error_that_says_why(held: Path) -> None:
    with pytest.raises(userns_maker.UsernsError, match="could not make a user namespace"):
        userns_maker.make(held, -5)  # no such id: the maker's child cannot become it
    assert not os.path.ismount(held)
    userns_maker.make(held, FIRST)  # the maker lives on
    assert _owner(held) == FIRST
