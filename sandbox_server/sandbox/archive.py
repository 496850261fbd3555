"""Pure tar handling for files moving in and out of a sandbox.

In: one tar built in memory holding a saved workspace's entries and the input files
under `workspace/` and the
request under `tmp/.sandbox/`: stdin, and a script of shell-quoted values (extra
environment, argv, the output boundary), so a container started before its call
knows nothing of it. Out: the launcher's tar of the output folder,
read member by member, never extracted: only regular files with safe relative
names, within the count and byte caps, are returned; every other entry gets a note.
"""

from __future__ import annotations

import io
import os
import re
import shlex
import shutil
import tarfile
import time
from collections.abc import Iterator
from typing import IO, Any, BinaryIO, cast

from sandbox_server.sandbox import wire
from sandbox_server.sandbox.spec import InputFile, OutputFile

__all__ = [
    "LINK_SKIPPED",
    "NOT_REGULAR_SKIPPED",
    "BoundedTar",
    "UnsafeMember",
    "WorkspaceTooLarge",
    "build_request",
    "keep_workspace",
    "kept_entries",
    "member_content",
    "printable",
    "read_outputs",
    "safe_relative_path",
    "skipped_for_caps",
    "valid_text",
]

REQUEST_DIR = wire.REQUEST_DIR.lstrip("/")
WORKSPACE_DIR = wire.WORKSPACE.lstrip("/")
OUTPUT_DIR = wire.OUTPUT_DIR.lstrip("/")
OUTPUT_LEAF = OUTPUT_DIR.removeprefix(WORKSPACE_DIR + "/")
"""The output folder relative to the workspace ("out")."""


EXTENDED_BYTES = 64 * 1024
"""The largest extended header (a PAX record set, a GNU long name or link) a reader takes: a path is 4 KiB at most,
and tarfile holds a header's whole content in memory."""
EXTENDED_RUN = 4
"""Extended headers that may precede one member (a PAX header, a GNU long name and long link: three at most)."""
_EXTENDED = (tarfile.XHDTYPE, tarfile.SOLARIS_XHDTYPE, tarfile.GNUTYPE_LONGNAME, tarfile.GNUTYPE_LONGLINK)


class UnsafeMember(tarfile.TarError):
    """A tar member refused before its header's content is read: a sparse member (reading it writes out the size
    it declares, whatever it holds), an extended header above EXTENDED_BYTES or in a run of more than
    EXTENDED_RUN, a global header."""


class _BoundedInfo(tarfile.TarInfo):
    """A member header checked before tarfile reads what it announces."""

    def _proc_member(self, tar: Any) -> Any:
        if self.type == tarfile.GNUTYPE_SPARSE:
            raise _sparse(self.name)
        if self.type == tarfile.XGLTYPE:
            raise UnsafeMember("it holds a global extended header, which is refused")
        if self.type in _EXTENDED:
            if self.size > EXTENDED_BYTES:
                raise UnsafeMember(f"it holds an extended header of {self.size} bytes, above {EXTENDED_BYTES}")
            tar.extended_run += 1
            if tar.extended_run > EXTENDED_RUN:
                raise UnsafeMember(f"it holds more than {EXTENDED_RUN} extended headers before one member")
        return super()._proc_member(tar)  # type: ignore[misc]  # (tarfile's own, untyped)

    def _sparse_refused(self, member: tarfile.TarInfo, *_: Any) -> Any:
        raise _sparse(member.name)

    _proc_gnusparse_00 = _proc_gnusparse_01 = _proc_gnusparse_10 = _sparse_refused


def _sparse(name: str) -> UnsafeMember:
    return UnsafeMember(
        f"its member {printable(name[:100])!r} is sparse, which is refused: reading it would write out the whole "
        "size it declares"
    )


class BoundedTar(tarfile.TarFile):
    """tarfile's reader for archives made elsewhere: what a header announces is bounded before it is read (no
    sparse member, no extended header above EXTENDED_BYTES or global one; UnsafeMember says which)."""

    tarinfo = _BoundedInfo
    extended_run = 0

    def next(self) -> tarfile.TarInfo | None:
        self.extended_run = 0
        return super().next()


def safe_relative_path(path: str) -> str | None:
    """Normalise a relative path inside a folder; None when it is absolute, escapes or is empty."""
    if not path or "\x00" in path or path.startswith("/"):
        return None
    parts = [part for part in path.split("/") if part not in ("", ".")]
    if not parts or any(part == ".." for part in parts):
        return None
    return "/".join(parts)


def _add(
    tar: tarfile.TarFile, name: str, content: bytes, mode: int, kind: bytes = tarfile.REGTYPE, mtime: float = 0
) -> None:
    info = tarfile.TarInfo(name)
    info.type = kind
    info.mode = mode
    info.size = len(content) if kind == tarfile.REGTYPE else 0
    info.mtime = mtime
    tar.addfile(info, io.BytesIO(content) if kind == tarfile.REGTYPE else None)


_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def build_request(
    files: tuple[InputFile, ...],
    stdin: bytes,
    argv: tuple[str, ...],
    boundary: str,
    env: tuple[tuple[str, str], ...] = (),
    workdir: str = "",
    saved: str | None = None,
    deadline_s: float | None = None,
    into: BinaryIO | None = None,
    outputs_by_host: bool = False,
) -> bytes:
    """What the launcher reads on stdin: a first line naming the form, then the request.

    `tar`: a tar it unpacks (input files relative to the workspace, stdin, the request script
    with argv, env, working folder and boundary). `script N M`: the request script's N lines,
    read with the shell's own `read`, then the M bytes of the program's stdin, for a call with
    no files and no saved workspace: every program the launcher starts costs CPU (tens of
    milliseconds under gVisor), and this form starts none but the call's own, and `head` for
    a stdin (where a tar took `tar` and `rm`). `outputs_by_host`: the host reads the output folder itself
    (sandbox.out_folder), and the launcher sends no tar of it.
    """
    if not argv:
        raise ValueError("a request needs a program to run")
    if workdir and safe_relative_path(workdir) != workdir:
        raise ValueError(f"working folder {workdir!r} is not a normalised relative path inside the workspace")
    bad = [name for name, _ in env if not _ENV_NAME.fullmatch(name)]
    if bad:
        raise ValueError(f"environment variable name(s) {bad!r} are not valid shell names")
    script = "".join(f"export {name}={shlex.quote(value)}\n" for name, value in env)
    script += "set -- " + " ".join(shlex.quote(word) for word in argv) + "\n"
    script += f"workdir={shlex.quote(workdir)}\n"
    script += f"boundary={shlex.quote(boundary)}\n"
    if saved is not None:
        script += "persist=1\n"
    if deadline_s is not None:
        script += f"deadline={deadline_s:.3f}\n"
    if outputs_by_host:
        script += "out_by_host=1\n"
    buffer = into if into is not None else io.BytesIO()
    if not files and not saved:
        buffer.write(f"script {script.count(chr(10))} {len(stdin)}\n{script}".encode())
        buffer.write(stdin)
        return buffer.getvalue() if isinstance(buffer, io.BytesIO) else b""
    buffer.write(b"tar\n")
    if saved:  # a kept workspace's entries open the request; the tar continues after them
        with open(saved, "rb") as kept:
            shutil.copyfileobj(kept, buffer, 1 << 20)
    with tarfile.open(fileobj=buffer, mode="w", format=tarfile.PAX_FORMAT) as tar:
        _add(tar, REQUEST_DIR, b"", 0o700, tarfile.DIRTYPE)
        _add(tar, f"{REQUEST_DIR}/stdin", stdin, 0o600)
        _add(tar, f"{REQUEST_DIR}/request", script.encode(), 0o600)
        _add(tar, OUTPUT_DIR, b"", 0o755, tarfile.DIRTYPE)
        made: set[str] = set()
        now = time.time()  # what an input file is dated when the client gives no time: the call's
        for item in files:
            relative = safe_relative_path(item.path)
            if relative is None:
                raise ValueError(f"input file path {item.path!r} is not a relative path inside the workspace")
            for depth in range(1, relative.count("/") + 1):
                folder = "/".join(relative.split("/")[:depth])
                if folder not in made:
                    made.add(folder)
                    _add(tar, f"{WORKSPACE_DIR}/{folder}", b"", 0o755, tarfile.DIRTYPE, now)
            mtime = item.mtime if item.mtime is not None else now
            _add(tar, f"{WORKSPACE_DIR}/{relative}", item.content, item.mode & 0o755, mtime=mtime)
    return buffer.getvalue() if isinstance(buffer, io.BytesIO) else b""


class WorkspaceTooLarge(ValueError):
    """A workspace archive holds more than the workspace can: it could not be restored."""


def keep_workspace(source: BinaryIO, target: BinaryIO, max_bytes: int, max_entries: int) -> None:
    """A launcher's tar of /workspace, as the entries the next call's request starts with.

    The archive came out of a sandbox and is read as data, never extracted here: entries
    whose names leave the workspace, the output folder of the call (returned, not kept),
    FIFOs and devices are dropped; symbolic and hard links stay entries, to be made inside
    the next sandbox only. The entries are written under workspace/ and without the
    archive's end marker, so that the next request's tar continues right after them.

    The program can forge this archive, so nothing in it may stop the next call from
    restoring it: an entry below a name that is not a folder (a link-then-file trick), a
    second entry of one name, and a hard link to anything but a file already kept are
    dropped; more bytes or entries than the workspace holds raise WorkspaceTooLarge.
    Raises tarfile.TarError (or EOFError) when the archive is unreadable.
    """
    source.seek(0)
    kept = tarfile.open(fileobj=target, mode="w", format=tarfile.PAX_FORMAT)
    kinds: dict[str, str] = {}
    total = 0
    with BoundedTar.open(fileobj=source, mode="r|") as tar:
        for member in tar:
            name = safe_relative_path(member.name)
            if name is None or name == OUTPUT_LEAF or name.startswith(OUTPUT_LEAF + "/") or name in kinds:
                continue
            if not (member.isreg() or member.isdir() or member.issym() or member.islnk()):
                continue
            parents = name.split("/")[:-1]
            if any(kinds.get("/".join(parents[: depth + 1]), "dir") != "dir" for depth in range(len(parents))):
                continue
            if member.islnk():
                target_name = safe_relative_path(member.linkname)
                if target_name is None or kinds.get(target_name) != "file":
                    continue  # a hard link must name a file of the workspace kept before it
                member.linkname = f"{WORKSPACE_DIR}/{target_name}"
            kinds[name] = "dir" if member.isdir() else "file" if member.isreg() or member.islnk() else "link"
            total += member.size if member.isreg() else 0
            if total > max_bytes or len(kinds) > max_entries:
                raise WorkspaceTooLarge(
                    f"it holds more than the workspace can ({max_bytes} bytes, {max_entries} entries)"
                )
            content = tar.extractfile(member) if member.isreg() else None
            member.name = f"{WORKSPACE_DIR}/{name}"
            member.uid = member.gid = 0
            member.uname = member.gname = ""
            member.pax_headers = {}  # a path or linkpath kept there would override the names set above
            kept.addfile(member, content)
    # Not kept.close(): its end marker would end the next request's tar right after these entries.


def kept_entries(kept: BinaryIO) -> Iterator[tuple[str, tarfile.TarInfo, tarfile.TarFile]]:
    """The entries of a kept workspace with their paths in the workspace (for listing and reading)."""
    kept.seek(0)
    try:
        with tarfile.open(fileobj=kept, mode="r:") as tar:
            for member in tar:
                name = safe_relative_path(member.name.removeprefix(WORKSPACE_DIR + "/"))
                if name is not None:
                    yield name, member, tar
    except (tarfile.TarError, EOFError):
        return


class _Slice:
    """A regular member's content read straight from an uncompressed tar file (one copy, where tarfile's reader
    copies each part twice)."""

    def __init__(self, fd: int, offset: int, size: int) -> None:
        self.fd, self.offset, self.left = fd, offset, size

    def read(self, size: int = -1) -> bytes:
        data = os.pread(self.fd, self.left if size < 0 else min(size, self.left), self.offset)
        self.offset += len(data)
        self.left -= len(data)
        return data


def member_content(tar: tarfile.TarFile, member: tarfile.TarInfo) -> IO[bytes] | None:
    """A regular member's content, of a tar opened on a file (`kept_entries`); None for any other member."""
    if not member.isreg():
        return None
    fileno = getattr(tar.fileobj, "fileno", None)
    if member.issparse() or fileno is None:
        return tar.extractfile(member)
    return cast(IO[bytes], _Slice(fileno(), member.offset_data, member.size))


def printable(name: str) -> str:
    """A name as a note shows it: ASCII, every other character escaped."""
    return name.encode("unicode_escape", "backslashreplace").decode("ascii")


def valid_text(name: str) -> str:
    """A name as valid Unicode: bytes that are not UTF-8 (surrogate escapes from tarfile) become `\\xNN`."""
    return name.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")


LINK_SKIPPED = "links are never followed"
NOT_REGULAR_SKIPPED = "not a regular file"


def skipped_for_caps(shown: str, size: int, taken: int, used: int, max_files: int, max_bytes: int) -> str | None:
    """The note for a regular file of `size` bytes that the caps leave out, after `taken` files of `used` bytes
    (None: it is returned)."""
    if taken >= max_files:
        return f"{shown}: skipped, more than {max_files} files"
    if used + size > max_bytes:
        return f"{shown}: skipped, returned files are capped at {max_bytes} bytes"
    return None


def read_outputs(
    archive: bytes | BinaryIO, max_files: int, max_bytes: int, complete: bool = True, under: str = ""
) -> tuple[tuple[OutputFile, ...], tuple[str, ...]]:
    """Regular files from the output archive within the caps, and a note for everything skipped.

    With `under` (the archive is the whole workspace), only entries below that folder count,
    named relative to it.
    """
    files: list[OutputFile] = []
    notes: list[str] = []
    if isinstance(archive, bytes):
        if not archive:
            return (), ()
        archive = io.BytesIO(archive)
    if archive.seek(0, io.SEEK_END) == 0:
        return (), ()
    archive.seek(0)
    used = 0
    try:
        with BoundedTar.open(fileobj=archive, mode="r|") as tar:
            for member in tar:
                name = safe_relative_path(member.name)
                if under and name is not None:  # a whole workspace: only its output folder comes back
                    if not name.startswith(under + "/"):
                        continue
                    name = name.removeprefix(under + "/")
                shown = printable(name or member.name)
                if member.isdir():
                    continue
                if name is None:
                    notes.append(f"{shown}: skipped, name leaves the output folder")
                elif member.issym() or member.islnk():
                    notes.append(f"{shown}: skipped, {LINK_SKIPPED}")
                elif not member.isreg():
                    notes.append(f"{shown}: skipped, {NOT_REGULAR_SKIPPED}")
                elif capped := skipped_for_caps(shown, member.size, len(files), used, max_files, max_bytes):
                    notes.append(capped)
                else:
                    handle = tar.extractfile(member)
                    content = handle.read() if handle else b""
                    used += len(content)
                    files.append(OutputFile(valid_text(name), content, member.size, float(member.mtime)))
    except (tarfile.TarError, EOFError) as exc:
        if complete:
            notes.append(f"output archive unreadable after {len(files)} files: {exc}")
    if not complete:
        notes.append(f"output files cut short after {len(files)} files: the archive exceeded its cap")
    return tuple(files), tuple(notes)
