"""A workspace or a snapshot as one file, so work moves between machines, replicas and backups.

The file is one zstd frame carrying zstd's own checksum of its content (XXH64), holding a tar of, in order:
`manifest.json` (its format, name, origin, when it was made and exported), the workspace's entries under
`workspace/` (its files and run_python's kept variables, as a launcher writes /workspace), and `checksum.json`
(how many entries and bytes). Everything is written in one pass, read from the workspace and compressed as it
goes, at about the disk's speed: the frame's checksum is computed by the compressing threads as they go, where
a SHA-256 of every byte (the second format's, `/2`) took as long as reading and compressing together. The first
two formats (`/1`: the manifest with a SHA-256, then one `workspace.tar`; `/2`: the entries' SHA-256 in
`checksum.json`) are still read, and their SHA-256 checked.

Reading one back trusts nothing in it: the frame must carry its checksum (the current format) and match it to
its last byte, the compressed stream may not unpack past what the workspace may hold, the tar must be those
members and nothing else, the manifest is a small JSON object of a known format, and the entries are then
cleaned as every sandbox's workspace archive is (`keep_workspace`: names that leave the workspace, devices and
FIFOs, entries below non-folders, duplicates and stray hard links dropped; more bytes or entries than the
policy's workspace holds refused). Nothing in it is unpickled or run on the host.
"""

from __future__ import annotations

import copy
import hashlib
import io
import json
import tarfile
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import IO, Any, BinaryIO, cast

import zstandard

from sandbox_server.sandbox.archive import BoundedTar, UnsafeMember, WorkspaceTooLarge, keep_workspace
from sandbox_server.workspaces.naming import shown_time

__all__ = [
    "FORMAT", "PLAIN", "Add", "Bounds", "ExportStopped", "NotAnExport", "TransferError", "read_export", "read_plain",
    "write_export",
]  # fmt: skip

FORMAT = "sandbox-server-workspace/3"
SECOND_FORMAT = "sandbox-server-workspace/2"
FIRST_FORMAT = "sandbox-server-workspace/1"
FRAME_HEADER_MAX = 18
"""The most bytes a zstd frame's header takes: what is read ahead to learn whether the frame has its checksum."""
MANIFEST, PAYLOAD, CHECKSUM, ENTRIES = "manifest.json", "workspace.tar", "checksum.json", "workspace/"
MANIFEST_BYTES = 64 * 1024
TAR_OVERHEAD = 2048
"""Bytes a tar spends per entry beyond its content (a header, padding), counted against what may be unpacked."""
WINDOW_BYTES = 1 << 27
"""The largest zstd window a reader accepts (128 MiB): a frame asking for more is refused, not allocated."""
COPY_CHUNK = 1 << 20

Add = Callable[[tarfile.TarInfo, IO[bytes] | None], None]
"""Adds one entry of a workspace (relative name; its content, for a regular file) to an export."""


class TransferError(ValueError):
    """An exported workspace that cannot be read back, and why."""


class NotAnExport(TransferError):
    """A file that is no export at all (not zstd, or no manifest first): it may be a plain tar of files."""


PLAIN = "plain tar"
"""The manifest's format of an import made of a plain tar (or a folder): no manifest, no checksum of its own."""
ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"


class ExportStopped(Exception):
    """An export stopped before its end, and the policy field that stopped it."""

    def __init__(self, message: str, field: str) -> None:
        super().__init__(message)
        self.message, self.field = message, field


@dataclass(frozen=True, slots=True)
class Bounds:
    """What one export may cost: bytes of content (the workspace's size: only sparse files claim more than their
    filesystem holds, and each claimed byte is read and compressed) and a deadline (time.monotonic())."""

    max_bytes: int
    deadline: float | None = None


class _Hashed(io.RawIOBase):
    """A file read through a digest."""

    def __init__(self, inner: IO[bytes], digest: Any) -> None:
        self.inner, self.digest = inner, digest

    def readable(self) -> bool:
        return True

    def read(self, size: int = -1) -> bytes:
        data = self.inner.read(size)
        self.digest.update(data)
        return data


def _entry_said(entry: tarfile.TarInfo, name: str) -> bytes:
    """What the checksum takes of an entry besides its content."""
    kind = entry.type.decode("ascii", "replace") if isinstance(entry.type, bytes) else str(entry.type)
    return f"{kind}\0{name}\0{entry.linkname}\0{entry.size}\0{entry.mode & 0o7777:o}\0".encode()


def write_export(
    out: BinaryIO, manifest: dict[str, Any], fill: Callable[[Add], None], bounds: Bounds | None = None
) -> dict[str, Any]:
    """Write an export in one pass: the manifest, then whatever `fill` adds (the workspace's entries), then the
    checksum's counts; the manifest and those counts together. Raises ExportStopped past `bounds`."""
    head = {**manifest, "format": FORMAT, "exported": shown_time(time.time()), "checksum": "zstd frame (XXH64)"}
    # Level 1 in the library's worker threads: a workspace is often incompressible (data, images, wheels), which
    # zstd stores as it is at any level; the workers checksum what they compress.
    compressor = zstandard.ZstdCompressor(level=1, write_checksum=True, threads=-1)
    with compressor.stream_writer(out, closefd=False, write_size=COPY_CHUNK) as packed:
        tar = _TarWriter(packed, bounds)
        tar.add_json(MANIFEST, head)
        fill(tar.add)
        trailer = {"files": tar.files, "bytes": tar.bytes}
        tar.add_json(CHECKSUM, trailer)
        tar.close()
    return {**head, **trailer}


class _TarWriter:
    """A tar written straight into the compressor: tarfile's own headers (`TarInfo.tobuf`), then each file's
    content in large parts. (tarfile's stream mode copies every byte through a growing buffer of its own, which
    took as long as the compressing.)"""

    def __init__(self, out: IO[bytes], bounds: Bounds | None) -> None:
        self.out, self.bounds = out, bounds
        self.files, self.bytes, self.written = 0, 0, 0

    def _within(self, more: int) -> None:
        if self.bounds is None:
            return
        if self.bytes + more > self.bounds.max_bytes:
            raise ExportStopped(
                f"its files claim more than the {self.bounds.max_bytes} bytes its workspace holds (sparse files "
                "count what they claim; policy field workspace.size_mb)",
                "workspace.size_mb",
            )
        if self.bounds.deadline is not None and time.monotonic() > self.bounds.deadline:
            raise ExportStopped(
                "it took longer than one call may (policy field limits.max_timeout_s)", "limits.max_timeout_s"
            )

    def _write(self, data: bytes) -> None:
        self.out.write(data)
        self.written += len(data)

    def add(self, entry: tarfile.TarInfo, content: IO[bytes] | None) -> None:
        self._within(entry.size if entry.isreg() else 0)
        named = copy.copy(entry)
        named.name = ENTRIES + entry.name
        self._member(named, content if entry.isreg() else None)
        self.files += 1
        self.bytes += entry.size if entry.isreg() else 0

    def add_json(self, name: str, fields: dict[str, Any]) -> None:
        encoded = json.dumps(fields, indent=1, sort_keys=True).encode()
        self._member(_member(name, len(encoded)), io.BytesIO(encoded))

    def _member(self, entry: tarfile.TarInfo, content: IO[bytes] | None) -> None:
        self._write(entry.tobuf(tarfile.PAX_FORMAT, tarfile.ENCODING, "surrogateescape"))
        if content is None or not entry.isreg():
            return
        left = entry.size
        while left:
            part = content.read(min(COPY_CHUNK, left))
            if not part:
                raise OSError(f"{entry.name} became shorter while it was exported")
            self._write(part)
            left -= len(part)
            self._within(0)
        self._write(bytes(-entry.size % tarfile.BLOCKSIZE))

    def close(self) -> None:
        """The end of the archive: two empty blocks, then zeros to a whole record, as tarfile writes it."""
        self._write(bytes(2 * tarfile.BLOCKSIZE))
        self._write(bytes(-self.written % tarfile.RECORDSIZE))


def read_export(archive: BinaryIO, max_bytes: int, max_entries: int, kept: BinaryIO) -> dict[str, Any]:
    """Read an export: its manifest (with its checksum's fields), with its workspace written to `kept` cleaned as
    a kept archive is (entries under workspace/, ready to be the workspace's files); raises TransferError saying
    what is wrong with it."""
    limit = max_bytes + (max_entries + 4) * TAR_OVERHEAD + 2 * MANIFEST_BYTES
    head = archive.read(FRAME_HEADER_MAX)
    reader = zstandard.ZstdDecompressor(max_window_size=WINDOW_BYTES).stream_reader(
        cast(IO[bytes], _Prefixed(head, archive)), closefd=False
    )
    try:
        if not head.startswith(ZSTD_MAGIC):
            raise NotAnExport("it is not zstd-compressed, as an export is")
        checked = zstandard.get_frame_parameters(head).has_checksum
        capped = _Capped(reader, limit)
        with tempfile.TemporaryFile() as payload, BoundedTar.open(fileobj=capped, mode="r|") as tar:
            first = tar.next()
            if first is None or first.name != MANIFEST:
                raise NotAnExport(f"its first member is not {MANIFEST}")
            manifest = _json_member(first, tar, MANIFEST, "first")
            if manifest.get("format") not in (FORMAT, SECOND_FORMAT, FIRST_FORMAT):
                raise TransferError(f"its {MANIFEST} is not of the format {FORMAT!r}")
            if manifest["format"] == FORMAT and not checked:
                raise TransferError("its zstd frame carries no checksum of its content, which this format has")
            if manifest["format"] == FIRST_FORMAT:
                manifest |= _first_payload(tar, manifest, payload)
            else:
                manifest |= _entries(tar, manifest, payload, max_bytes, max_entries)
            if tar.next() is not None:
                raise TransferError(f"it holds more than {MANIFEST}, its workspace and its checksum")
            while capped.read(COPY_CHUNK):  # to the frame's end, where zstd checks its checksum
                pass
            keep_workspace(payload, kept, max_bytes, max_entries)
    except TransferError:
        raise
    except WorkspaceTooLarge as exc:
        raise TransferError(f"{exc} (policy fields workspace.size_mb and workspace.files)") from None
    except UnsafeMember as exc:
        raise TransferError(str(exc)) from None
    except _TooLarge:
        raise TransferError(
            f"it unpacks past the {limit} bytes the policy's workspace could hold (policy fields workspace.size_mb "
            "and workspace.files)"
        ) from None
    except zstandard.ZstdError as exc:
        if "checksum" in str(exc).lower():
            raise TransferError("its content does not match its zstd checksum: it was changed or damaged") from None
        raise TransferError(f"it is not a readable zstd-compressed tar ({exc})") from None
    except (tarfile.TarError, EOFError, OSError) as exc:
        raise TransferError(f"it is not a readable zstd-compressed tar ({exc})") from None
    return manifest


def read_plain(archive: BinaryIO, max_bytes: int, max_entries: int, kept: BinaryIO) -> dict[str, Any]:
    """A plain tar of files (as `tar` or `git archive` make one, compressed or not) written to `kept` cleaned as
    any workspace archive is, each entry counted before a byte of it is written: its counts, as a manifest's."""
    head = archive.read(FRAME_HEADER_MAX)
    source: BinaryIO = cast(BinaryIO, _Prefixed(head, archive))
    if head.startswith(ZSTD_MAGIC):
        source = cast(BinaryIO, zstandard.ZstdDecompressor(max_window_size=WINDOW_BYTES).stream_reader(source))
    limit = max_bytes + (max_entries + 4) * TAR_OVERHEAD
    entries = declared = 0
    try:
        with tempfile.TemporaryFile() as payload:
            with (
                BoundedTar.open(fileobj=_Capped(source, limit * 2), mode="r|*") as tar,
                tarfile.open(fileobj=payload, mode="w", format=tarfile.PAX_FORMAT) as inner,
            ):
                for member in tar:
                    name = member.name.removeprefix("./").rstrip("/")
                    if not name or name == ".":
                        continue
                    entries, declared = _counted(member, entries, declared, max_bytes, max_entries)
                    inner.addfile(_plain(member, name), tar.extractfile(member) if member.isreg() else None)
            payload.flush()
            keep_workspace(payload, kept, max_bytes, max_entries)
    except WorkspaceTooLarge as exc:
        raise TransferError(f"{exc} (policy fields workspace.size_mb and workspace.files)") from None
    except UnsafeMember as exc:
        raise TransferError(str(exc)) from None
    except _TooLarge:
        raise TransferError(f"it unpacks past the {limit * 2} bytes the policy's workspace could hold") from None
    except (tarfile.TarError, zstandard.ZstdError, EOFError, OSError) as exc:
        raise TransferError(f"it is neither an export nor a readable tar ({exc})") from None
    return {"format": PLAIN, "files": entries, "bytes": declared}


def _entries(
    tar: tarfile.TarFile, manifest: dict[str, Any], payload: IO[bytes], max_bytes: int, max_entries: int
) -> dict[str, Any]:
    """The workspace's entries, written to `payload` as a tar of relative names, up to the checksum's counts (the
    second format's entries hashed too, to match its SHA-256): the checksum's fields. Each entry is counted
    before a byte of it is written (what it declares against `max_bytes`, one more against `max_entries`), and
    carries its name, kind, size, mode, time and link alone: none of the archive's own headers."""
    hashed = manifest["format"] == SECOND_FORMAT
    digest = hashlib.sha256()
    entries = declared = 0
    with tarfile.open(fileobj=payload, mode="w", format=tarfile.PAX_FORMAT) as inner:
        inner.copybufsize = COPY_CHUNK  # type: ignore[attr-defined]
        while (member := tar.next()) is not None and member.name != CHECKSUM:
            if not member.name.startswith(ENTRIES):
                raise TransferError(f"its member {member.name[:100]!r} is neither under {ENTRIES} nor {CHECKSUM}")
            entries, declared = _counted(member, entries, declared, max_bytes, max_entries)
            entry = _plain(member, member.name[len(ENTRIES) :])
            content: IO[bytes] | None = tar.extractfile(member) if member.isreg() else None
            if hashed:
                digest.update(_entry_said(entry, entry.name))
                content = cast(IO[bytes], _Hashed(content, digest)) if content is not None else None
            inner.addfile(entry, content)
    payload.flush()
    if member is None:
        raise TransferError(f"it ends before its {CHECKSUM}: it was cut short")
    trailer = _json_member(member, tar, CHECKSUM, "last")
    if hashed and trailer.get("sha256") != digest.hexdigest():
        raise TransferError(f"its workspace does not match its {CHECKSUM}'s SHA-256: it was changed or damaged")
    return {key: trailer[key] for key in ("files", "bytes", "sha256") if key in trailer}


def _counted(member: tarfile.TarInfo, entries: int, declared: int, max_bytes: int, max_entries: int) -> tuple[int, int]:
    """The entries and declared bytes with `member` counted in, before a byte of it is written; WorkspaceTooLarge
    past what the workspace holds."""
    entries += 1
    declared += member.size if member.isreg() else 0
    if declared > max_bytes or entries > max_entries:
        raise WorkspaceTooLarge(f"it holds more than the workspace can ({max_bytes} bytes, {max_entries} entries)")
    return entries, declared


def _plain(member: tarfile.TarInfo, name: str) -> tarfile.TarInfo:
    """An entry as a workspace keeps it: its name, kind, size, mode, time and link, and nothing else the archive
    said of it (a PAX `path` would override the name, a comment would be carried along)."""
    entry = tarfile.TarInfo(name)
    entry.type, entry.mode, entry.mtime, entry.linkname = member.type, member.mode, member.mtime, member.linkname
    entry.size = member.size if member.isreg() else 0
    return entry


def _first_payload(tar: tarfile.TarFile, manifest: dict[str, Any], payload: IO[bytes]) -> dict[str, Any]:
    """The first format's one `workspace.tar`, which must match the manifest's size and SHA-256."""
    if not isinstance(manifest.get("bytes"), int) or not isinstance(manifest.get("sha256"), str):
        raise TransferError(f"its {MANIFEST} does not say the size and SHA-256 of {PAYLOAD}")
    member = tar.next()
    if member is None or member.name != PAYLOAD or not member.isreg():
        raise TransferError(f"its second member is not {PAYLOAD}")
    if member.size != manifest["bytes"]:
        raise TransferError(f"{PAYLOAD} holds {member.size} bytes where the manifest says {manifest['bytes']}")
    if _copy(tar.extractfile(member), payload) != manifest["sha256"]:
        raise TransferError(f"{PAYLOAD} does not match the manifest's SHA-256: it was changed or damaged")
    return {}


def _json_member(member: tarfile.TarInfo | None, tar: tarfile.TarFile, name: str, where: str) -> dict[str, Any]:
    if member is None or member.name != name or not member.isreg():
        raise TransferError(f"its {where} member is not {name}")
    if member.size > MANIFEST_BYTES:
        raise TransferError(f"its {name} is {member.size} bytes, above {MANIFEST_BYTES}")
    handle = tar.extractfile(member)
    try:
        fields = json.loads(handle.read() if handle is not None else b"")
    except (ValueError, RecursionError):
        raise TransferError(f"its {name} is not JSON of this format (or nested too deep)") from None
    if not isinstance(fields, dict):
        raise TransferError(f"its {name} is not a JSON object")
    return fields


def _copy(source: IO[bytes] | None, target: IO[bytes]) -> str:
    digest = hashlib.sha256()
    if source is not None:
        while chunk := source.read(COPY_CHUNK):
            digest.update(chunk)
            target.write(chunk)
    target.flush()
    return digest.hexdigest()


def _member(name: str, size: int) -> tarfile.TarInfo:
    member = tarfile.TarInfo(name)
    member.size, member.mode, member.mtime = size, 0o600, int(time.time())
    return member


class _TooLarge(Exception):
    pass


class _Prefixed(io.RawIOBase):
    """A stream whose first bytes were read ahead: those, then the rest."""

    def __init__(self, head: bytes, rest: BinaryIO) -> None:
        self.head, self.rest = head, rest

    def readable(self) -> bool:
        return True

    def read(self, size: int = -1) -> bytes:
        if self.head:
            taken = self.head if size < 0 else self.head[:size]
            self.head = self.head[len(taken) :]
            return taken
        return self.rest.read(size)


class _Capped(io.RawIOBase):
    """A stream that refuses to give more than `limit` bytes (a small file that unpacks to a huge one)."""

    def __init__(self, inner: Any, limit: int) -> None:
        self.inner, self.left = inner, limit

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        data = self.inner.read(len(buffer))
        if len(data) > self.left:
            raise _TooLarge
        self.left -= len(data)
        buffer[: len(data)] = data
        return len(data)
