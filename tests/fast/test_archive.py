"""Pure logic of archives in and out: names, links and caps."""

import io
import os
import shlex
import subprocess
import tarfile
from pathlib import Path

import pytest

from sandbox_server.sandbox.archive import (
    WorkspaceTooLarge,
    build_request,
    keep_workspace,
    kept_entries,
    read_outputs,
    safe_relative_path,
)
from sandbox_server.sandbox.spec import InputFile


@pytest.mark.parametrize(
    ("given", "expected"),
    [
        ("a.txt", "a.txt"),
        ("./dir//b.csv", "dir/b.csv"),
        ("../etc/passwd", None),
        ("dir/../../x", None),
        ("/etc/passwd", None),
        ("", None),
        ("a\x00b", None),
    ],
)
def test_safe_relative_path(given: str, expected: str | None) -> None:
    assert safe_relative_path(given) == expected


def test_request_holds_stdin_argv_env_boundary_and_files_under_the_workspace() -> None:
    argv = ("echo", "it's", "$(id)", "a b", "")
    request = build_request(
        (InputFile("data/in.csv", b"a,b\n"),), b"typed input", argv, "b0undary", (("X_Y", "1 'two'"),), "a b/c"
    )
    form, _, body = request.partition(b"\n")
    assert form == b"tar"
    with tarfile.open(fileobj=io.BytesIO(body)) as tar:
        names = tar.getnames()

        def read(name: str) -> bytes:
            member = tar.extractfile(name)
            assert member is not None
            return member.read()

        assert read("tmp/.sandbox/stdin") == b"typed input"
        assert read("workspace/data/in.csv") == b"a,b\n"
        export, words, workdir, boundary = read("tmp/.sandbox/request").decode().splitlines()
        assert workdir == "workdir='a b/c'"
        assert export == "export X_Y='1 '\"'\"'two'\"'\"''"
        assert words.startswith("set -- ") and shlex.split(words[len("set -- ") :]) == list(argv)
        assert boundary == "boundary=b0undary"
    assert "workspace/data" in names and "workspace/out" in names


READ_SCRIPT = (
    'read -r form lines size; r=; while [ "$lines" -gt 0 ] && IFS= read -r l; do r="$r$l\n"; lines=$((lines-1)); '
    'done; eval "$r"; printf "%s|" "$@" "$X" "$boundary"; [ "$size" -eq 0 ] || head -c "$size"'
)
"""What the launcher does with a request of the script form, its stdin copied to stdout."""


def test_a_plain_call_is_sent_as_the_request_script_alone() -> None:
    argv = ("printf", "%s\\n", "two\nlines", "it's")
    request = build_request((), b"", argv, "b0undary", (("X", "a\nb"),))
    form, _, script = request.decode().partition("\n")
    assert form == f"script {script.count(chr(10))} 0" and script.endswith("boundary=b0undary\n")
    done = subprocess.run(["sh", "-c", READ_SCRIPT], input=request, capture_output=True, check=True)
    assert done.stdout.decode() == "printf|%s\\n|two\nlines|it's|a\nb|b0undary|"


def test_a_call_with_a_stdin_and_no_files_sends_its_bytes_after_the_script() -> None:
    stdin = b"line one\n\x00binary\xff\nno newline at the end"
    request = build_request((), stdin, ("cat",), "b0undary", (("X", "x"),))
    form, _, rest = request.partition(b"\n")
    assert form.startswith(b"script ") and form.endswith(b" %d" % len(stdin))
    done = subprocess.run(["sh", "-c", READ_SCRIPT], input=request, capture_output=True, check=True)
    assert done.stdout == b"cat|x|b0undary|" + stdin


def test_request_refuses_paths_outside_the_workspace_and_bad_env_names() -> None:
    with pytest.raises(ValueError, match="not a relative path"):
        build_request((InputFile("../escape", b""),), b"", ("true",), "b")
    with pytest.raises(ValueError, match="not valid shell names"):
        build_request((), b"", ("true",), "b", (("A;rm", "x"),))
    with pytest.raises(ValueError, match="working folder"):
        build_request((), b"", ("true",), "b", (), "../up")


def _archive(*members: tuple[str, bytes, bytes]) -> bytes:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as tar:
        for name, kind, content in members:
            info = tarfile.TarInfo(name)
            info.type = kind
            if kind == tarfile.REGTYPE:
                info.size = len(content)
                tar.addfile(info, io.BytesIO(content))
            else:
                info.linkname = content.decode()
                tar.addfile(info)
    return buffer.getvalue()


def test_outputs_keep_regular_files_and_note_everything_else() -> None:
    archive = _archive(
        ("./result.txt", tarfile.REGTYPE, b"42"),
        ("./shadow", tarfile.SYMTYPE, b"/etc/shadow"),
        ("./hard", tarfile.LNKTYPE, b"result.txt"),
        ("../escape", tarfile.REGTYPE, b"x"),
        ("./fifo", tarfile.FIFOTYPE, b""),
    )
    files, notes = read_outputs(archive, max_files=10, max_bytes=1000)
    assert [(f.path, f.content) for f in files] == [("result.txt", b"42")]
    assert len(notes) == 4
    assert any("links are never followed" in note for note in notes)
    assert any("leaves the output folder" in note for note in notes)


def test_outputs_respect_count_and_byte_caps() -> None:
    archive = _archive(*((f"f{i}", tarfile.REGTYPE, b"x" * 10) for i in range(5)))
    files, notes = read_outputs(archive, max_files=3, max_bytes=25)
    assert [f.path for f in files] == ["f0", "f1"]
    assert len(notes) == 3


def test_truncated_archive_keeps_what_was_complete() -> None:
    archive = _archive(("a", tarfile.REGTYPE, b"1" * 600), ("b", tarfile.REGTYPE, b"2" * 600))
    files, notes = read_outputs(archive[:1600], max_files=10, max_bytes=10_000, complete=False)
    assert [f.path for f in files] == ["a"]
    assert "cut short" in notes[-1]


def test_a_forged_workspace_archive_keeps_only_what_the_next_call_can_restore() -> None:
    forged = io.BytesIO()
    with tarfile.open(fileobj=forged, mode="w") as tar:
        for name, kind, extra in [
            ("./", tarfile.DIRTYPE, ""),
            ("./data", tarfile.DIRTYPE, ""),
            ("./data/kept.txt", tarfile.REGTYPE, ""),
            ("./link", tarfile.SYMTYPE, "/etc"),
            ("./link/passwd", tarfile.REGTYPE, ""),  # through a link: would stop the next restore
            ("./data/kept.txt", tarfile.REGTYPE, ""),  # a second entry of one name
            ("./hard", tarfile.LNKTYPE, "./data/kept.txt"),
            ("./hard-out", tarfile.LNKTYPE, "/etc/shadow"),
            ("./hard-missing", tarfile.LNKTYPE, "./nowhere"),
            ("./fifo", tarfile.FIFOTYPE, ""),
            ("./dev", tarfile.CHRTYPE, ""),
            ("../escape", tarfile.REGTYPE, ""),
            ("./out/returned.txt", tarfile.REGTYPE, ""),
        ]:
            info = tarfile.TarInfo(name)
            info.type, info.linkname = kind, extra
            info.size = 2 if kind == tarfile.REGTYPE else 0
            tar.addfile(info, io.BytesIO(b"ok") if kind == tarfile.REGTYPE else None)
    kept = io.BytesIO()
    keep_workspace(forged, kept, max_bytes=1000, max_entries=100)
    names = [(name, member.type) for name, member, _ in kept_entries(kept)]
    assert names == [
        ("data", tarfile.DIRTYPE),
        ("data/kept.txt", tarfile.REGTYPE),
        ("link", tarfile.SYMTYPE),
        ("hard", tarfile.LNKTYPE),
    ]
    with pytest.raises(WorkspaceTooLarge):
        keep_workspace(forged, io.BytesIO(), max_bytes=1, max_entries=100)
    request = io.BytesIO()
    build_request((InputFile("in.txt", b"1"),), b"typed", ("true",), "b0undary", into=request)  # (a tar: a file)
    form, _, body = request.getvalue().partition(b"\n")
    assert form == b"tar"
    with tarfile.open(fileobj=io.BytesIO(kept.getvalue() + body)) as both:
        assert "workspace/data/kept.txt" in both.getnames() and "tmp/.sandbox/request" in both.getnames()


def test_a_file_is_opened_below_its_folder_never_above_it(tmp_path: Path) -> None:
    from sandbox_server.sandbox.host_files import open_regular

    (tmp_path / "inside").mkdir()
    (tmp_path / "inside" / "kept.txt").write_text("mine")
    (tmp_path / "secret.txt").write_text("someone else's")
    folder = tmp_path / "inside"

    def opened(path: str) -> bytes | None:
        handle = open_regular(os.open(folder, os.O_RDONLY | os.O_DIRECTORY), path)
        if handle is None:
            return None
        with os.fdopen(handle, "rb") as found:
            return found.read()

    assert opened("kept.txt") == b"mine"
    assert [opened(p) for p in ("../secret.txt", "./../secret.txt", "x/../../secret.txt", "", "/kept.txt")] == [
        None
    ] * 5


def test_a_walk_of_a_workspace_leaves_the_calls_folders_out_unopened(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from sandbox_server.sandbox import host_files as files
    from sandbox_server.workspaces.mounted import NOT_ITS_FILES

    for path in ("a.txt", "sub/b.txt", "out/x", ".sandbox/calls/slot-1/y", ".sandbox/cell-state.pickle"):
        (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / path).write_text(path)
    opened: list[str] = []
    real_open_below = files.open_below

    def open_below(folder: int, name: str, *, directory: bool) -> int:
        opened.append(name)
        return real_open_below(folder, name, directory=directory)

    monkeypatch.setattr(files, "open_below", open_below)
    walked = dict(files.file_states(os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY), skip=NOT_ITS_FILES))
    assert sorted(walked) == [".sandbox/cell-state.pickle", "a.txt", "sub/b.txt"]
    assert walked["a.txt"][0] == len("a.txt")
    assert sorted(opened) == [".sandbox", "sub"]  # a call's own output folder is never opened, however many


def test_a_kept_members_content_is_read_straight_from_the_file_as_tarfile_reads_it(tmp_path: Path) -> None:
    from sandbox_server.sandbox.archive import kept_entries, member_content

    path = tmp_path / "kept.tar"
    contents = {"workspace/a.bin": bytes(range(256)) * 5000, "workspace/empty": b"", "workspace/b.txt": b"beta"}
    with tarfile.open(path, "w") as tar:
        for name, data in contents.items():
            member = tarfile.TarInfo(name)
            member.size = len(data)
            tar.addfile(member, io.BytesIO(data))
    with open(path, "rb") as kept:
        read = {}
        for name, member, tar in kept_entries(kept):
            content = member_content(tar, member)
            assert content is not None
            parts = [content.read(100_000) for _ in range(20)]  # in parts, past its end
            read["workspace/" + name] = b"".join(parts)
    assert read == contents
