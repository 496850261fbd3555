"""Exports an attacker writes by hand (for the fast tier and the tests through the real server): each is a whole
export of the current format (a manifest, entries under workspace/, a checksum, one zstd frame with its
checksum) but for the one thing it forges, so that what refuses it is that thing and nothing before it."""

from __future__ import annotations

import io
import json
import tarfile
from collections.abc import Iterable, Iterator
from typing import BinaryIO

import zstandard

from sandbox_server.workspaces.transfer import FORMAT

BLOCK = tarfile.BLOCKSIZE


def _header(member: tarfile.TarInfo) -> bytes:
    return member.tobuf(tarfile.PAX_FORMAT, tarfile.ENCODING, "surrogateescape")


def _padded(data: bytes) -> bytes:
    return data + bytes(-len(data) % BLOCK)


def file_member(name: str, data: bytes, **pax: str) -> bytes:
    member = tarfile.TarInfo(name)
    member.size, member.mode, member.pax_headers = len(data), 0o644, dict(pax)
    return _header(member) + _padded(data)


def link_member(name: str, target: str, kind: bytes = tarfile.SYMTYPE) -> bytes:
    member = tarfile.TarInfo(name)
    member.type, member.linkname = kind, target
    return _header(member)


def folder_member(name: str) -> bytes:
    member = tarfile.TarInfo(name)
    member.type, member.mode = tarfile.DIRTYPE, 0o755
    return _header(member)


def _octal(value: int, width: int) -> bytes:
    return f"{value:0{width - 1}o}".encode() + b"\0"


def gnu_sparse_member(name: str, declared: int) -> bytes:
    """A GNU sparse member (type S) whose one region is its last byte: one block on disk, `declared` bytes to
    whoever expands it."""
    block = bytearray(tarfile.TarInfo(name).tobuf(tarfile.GNU_FORMAT))
    block[156:157] = tarfile.GNUTYPE_SPARSE
    block[124:136] = _octal(1, 12)  # what is stored: the one byte
    block[386:398], block[398:410] = _octal(declared - 1, 12), _octal(1, 12)  # the map's one region
    block[483:495] = _octal(declared, 12)  # its real size
    block[148:156] = b" " * 8
    block[148:156] = f"{sum(block):06o}".encode() + b"\0 "
    return bytes(block) + _padded(b"x")


def pax_sparse_member(name: str, declared: int, minor: str = "0") -> bytes:
    """A member whose PAX header says it is GNU sparse (format 1.0 reads its map from the content; 0.1 from the
    header)."""
    if minor == "0":
        pax = {"GNU.sparse.major": "1", "GNU.sparse.minor": "0", "GNU.sparse.name": name}
        return file_member(name, b"1\n0\n1\n", **pax, **{"GNU.sparse.realsize": str(declared)})
    return file_member(name, b"x", **{"GNU.sparse.map": f"{declared - 1},1", "GNU.sparse.size": str(declared)})


def pax_comment_blocks(name: str, comment_bytes: int) -> Iterator[bytes]:
    """A file whose PAX header carries a comment of `comment_bytes`, written in parts (never held whole)."""
    record_tail = b"\n"
    keyword = b" comment="
    body = comment_bytes
    digits = len(str(body + len(keyword) + 1))
    while len(str(body + len(keyword) + 1 + digits)) != digits:
        digits += 1
    length = body + len(keyword) + 1 + digits
    header = tarfile.TarInfo("././@PaxHeader")
    header.type, header.size = tarfile.XHDTYPE, length
    yield header.tobuf(tarfile.USTAR_FORMAT)
    yield str(length).encode() + keyword
    left, part = body, b"a" * (1 << 20)
    while left:
        yield part[: min(left, len(part))]
        left -= min(left, len(part))
    yield record_tail + bytes(-length % BLOCK)
    plain = tarfile.TarInfo(name)
    plain.size = 2
    yield plain.tobuf(tarfile.USTAR_FORMAT) + _padded(b"ok")


def export_of(
    entries: Iterable[bytes], manifest: dict[str, object] | None = None, out: BinaryIO | None = None
) -> bytes:
    """An export holding these raw entries (headers and content, names under workspace/) between its manifest and
    its checksum, compressed as it goes; written to `out` when given (then b"")."""
    target = out if out is not None else io.BytesIO()
    head = json.dumps(manifest if manifest is not None else {"format": FORMAT, "id": "ws-forged"}).encode()
    with zstandard.ZstdCompressor(level=3, write_checksum=True).stream_writer(target, closefd=False) as packed:
        packed.write(file_member("manifest.json", head))
        for part in entries:
            packed.write(part)
        packed.write(file_member("checksum.json", json.dumps({"files": 0, "bytes": 0}).encode()))
        packed.write(bytes(2 * BLOCK))
    return target.getvalue() if isinstance(target, io.BytesIO) else b""
