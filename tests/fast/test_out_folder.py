"""A kept workspace's output folder read by the host: what comes back is what the archive's reader takes from a tar
of the same folder, and nothing the program left there leads the host out of it. Pure logic on a folder of the
test's own; `tests/test_workspaces.py` reads one through the real server."""

from __future__ import annotations

import io
import os
import tarfile
from pathlib import Path

from sandbox_server.sandbox.archive import read_outputs
from sandbox_server.sandbox.host_files import MAX_DEPTH
from sandbox_server.sandbox.out_folder import read_folder


def _read(folder: Path, max_files: int = 20, max_bytes: int = 10_000) -> tuple[dict[str, bytes], set[str]]:
    files, notes = read_folder(os.open(folder, os.O_RDONLY | os.O_DIRECTORY), max_files, max_bytes)
    return {item.path: item.content for item in files}, set(notes)


def _read_as_tar(folder: Path, max_files: int = 20, max_bytes: int = 10_000) -> tuple[dict[str, bytes], set[str]]:
    archive = io.BytesIO()
    with tarfile.open(fileobj=archive, mode="w", format=tarfile.PAX_FORMAT) as tar:
        tar.add(folder, arcname=".")
    files, notes = read_outputs(archive.getvalue(), max_files, max_bytes)
    return {item.path: item.content for item in files}, set(notes)


def _left_by_a_program(folder: Path, secret: Path) -> None:
    (folder / "sub" / "deeper").mkdir(parents=True)
    (folder / "empty").mkdir()
    (folder / "count.txt").write_bytes(b"3\n")
    (folder / "sub" / "deeper" / "figure-1.png").write_bytes(b"\x89PNG" + bytes(range(256)))
    os.symlink(secret, folder / "x")  # a file the host may read, named by a link in the sandbox's folder
    os.symlink(secret.parent, folder / "sub" / "up")
    os.mkfifo(folder / "pipe")  # read by a host that opened it blocking, it would wait for ever
    (folder / os.fsdecode(b"caf\xe9.txt")).write_bytes(b"latin-1 named")


def test_the_host_reads_what_a_tar_of_the_folder_would_return_and_follows_no_link(tmp_path: Path) -> None:
    secret = tmp_path / "secret"
    secret.write_text("the host's")
    folder = tmp_path / "out"
    folder.mkdir()
    _left_by_a_program(folder, secret)
    files, notes = _read(folder)
    assert files == {
        "count.txt": b"3\n",
        "sub/deeper/figure-1.png": b"\x89PNG" + bytes(range(256)),
        "caf\\xe9.txt": b"latin-1 named",
    }
    assert notes == {
        "x: skipped, links are never followed",
        "sub/up: skipped, links are never followed",
        "pipe: skipped, not a regular file",
    }
    assert (files, notes) == _read_as_tar(folder)


def test_a_second_name_of_a_file_is_skipped_as_a_tar_s_hard_link_is(tmp_path: Path) -> None:
    folder = tmp_path / "out"
    (folder / "sub").mkdir(parents=True)
    (folder / "count.txt").write_bytes(b"3\n")
    os.link(folder / "count.txt", folder / "sub" / "again")
    files, notes = _read(folder)
    assert list(files.values()) == [b"3\n"] and len(notes) == 1
    (taken,), (noted,) = files, notes  # whichever the folder lists first is the file, as in the launcher's tar
    assert noted == f"{({'count.txt', 'sub/again'} - {taken}).pop()}: skipped, links are never followed"


def test_the_caps_leave_out_what_a_tar_s_reader_leaves_out(tmp_path: Path) -> None:
    folder = tmp_path / "out"
    folder.mkdir()
    for index in range(5):
        (folder / f"f{index}").write_bytes(b"x" * 10)
    files, notes = _read(folder, max_files=3)
    assert len(files) == 3 and len(notes) == 2
    assert all(note.endswith("skipped, more than 3 files") for note in notes)
    files, notes = _read(folder, max_bytes=25)
    assert len(files) == 2 and len(notes) == 3
    assert all(note.endswith("skipped, returned files are capped at 25 bytes") for note in notes)
    (folder / "big").write_bytes(b"y" * 100)
    files, _ = _read(folder, max_bytes=50)
    assert "big" not in files and sum(len(content) for content in files.values()) <= 50


def test_folders_deeper_than_the_walk_goes_are_skipped_with_a_note(tmp_path: Path) -> None:
    folder = tmp_path / "out"
    deep = folder.joinpath(*["d"] * (MAX_DEPTH + 3))
    deep.mkdir(parents=True)
    (deep / "leaf").write_text("far down")
    (folder / "d" / "near").write_text("near")
    open_before = len(os.listdir("/proc/self/fd"))
    files, notes = _read(folder)
    assert files == {"d/near": b"near"}
    assert notes == {"/".join(["d"] * (MAX_DEPTH + 1)) + f": skipped, more than {MAX_DEPTH} folders deep"}
    assert len(os.listdir("/proc/self/fd")) == open_before, "the walk left descriptors open"
