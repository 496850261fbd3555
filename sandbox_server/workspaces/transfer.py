"""A workspace or a snapshot as one file, so work moves between machines, replicas and backups.

The file is a zstd-compressed tar (with zstd's own checksum of the frame) of exactly two members, in order:
`manifest.json` (what it holds: its format, name, origin, when it was made and exported, how many files and
bytes, and the SHA-256 of the next member) and `workspace.tar` (the workspace's files and run_python's kept
variables, as a launcher writes /workspace: relative names, folders, files, links).

Reading one back trusts nothing in it: the compressed stream may not unpack past what the workspace may hold,
the outer tar must be those two members and nothing else, the manifest is a small JSON object of the known
format, the payload must hash to what the manifest says, and the payload is then cleaned as every sandbox's
workspace archive is (`keep_workspace`: names that leave the workspace, devices and FIFOs, entries below
non-folders, duplicates and stray hard links dropped; more bytes or entries than the policy's workspace holds
refused). Nothing in it is unpickled or run on the host.
"""

from __future__ import annotations

import hashlib
import io
import json
import tarfile
import tempfile
import time
from typing import IO, Any, BinaryIO

import zstandard

from sandbox_server.sandbox.archive import WorkspaceTooLarge, keep_workspace

__all__ = ["FORMAT", "Hashing", "TransferError", "read_export", "write_export"]

FORMAT = "sandbox-server-workspace/1"
MANIFEST, PAYLOAD = "manifest.json", "workspace.tar"
MANIFEST_BYTES = 64 * 1024
TAR_OVERHEAD = 2048
"""Bytes a tar spends per entry beyond its content (a header, padding), counted against what may be unpacked."""
WINDOW_BYTES = 1 << 27
"""The largest zstd window a reader accepts (128 MiB): a frame asking for more is refused, not allocated."""
COPY_CHUNK = 1 << 20


class TransferError(ValueError):
    """An exported workspace that cannot be read back, and why."""


class Hashing(io.RawIOBase):
    """A file being written, hashed as it is (so an export reads its payload once, to compress it)."""

    def __init__(self, inner: IO[bytes]) -> None:
        self.inner, self.digest, self.size = inner, hashlib.sha256(), 0

    def writable(self) -> bool:
        return True

    def write(self, data: Any) -> int:
        self.digest.update(data)
        self.size += len(data)
        return self.inner.write(data)


def write_export(
    out: BinaryIO, manifest: dict[str, Any], payload: IO[bytes], hashed: Hashing | None = None
) -> dict[str, Any]:
    """Write an export of `payload` (a workspace's tar, seekable; `hashed`: as it was hashed while written) with
    its manifest; the manifest as written."""
    if hashed is None:
        hashed = Hashing(io.BytesIO())
        payload.seek(0)
        while chunk := payload.read(COPY_CHUNK):
            hashed.digest.update(chunk)
            hashed.size += len(chunk)
    size = hashed.size
    manifest = {
        **manifest,
        "format": FORMAT,
        "exported": _iso(time.time()),
        "bytes": size,
        "sha256": hashed.digest.hexdigest(),
    }
    encoded = json.dumps(manifest, indent=1, sort_keys=True).encode()
    # Level 1 in the library's worker threads: a workspace is often incompressible (data, images, wheels), which
    # zstd stores as it is at any level; beyond that, the export goes at about the disk's own speed.
    compressor = zstandard.ZstdCompressor(level=1, write_checksum=True, threads=-1)
    with compressor.stream_writer(out, closefd=False) as packed, tarfile.open(fileobj=packed, mode="w|") as tar:
        tar.addfile(_member(MANIFEST, len(encoded)), io.BytesIO(encoded))
        payload.seek(0)
        tar.addfile(_member(PAYLOAD, size), payload)
    return manifest


def read_export(archive: BinaryIO, max_bytes: int, max_entries: int, kept: BinaryIO) -> dict[str, Any]:
    """Read an export: its manifest, with its workspace written to `kept` cleaned as a kept archive is (entries
    under workspace/, ready to be the workspace's files); raises TransferError saying what is wrong with it."""
    limit = max_bytes + (max_entries + 4) * TAR_OVERHEAD + MANIFEST_BYTES
    reader = zstandard.ZstdDecompressor(max_window_size=WINDOW_BYTES).stream_reader(archive, closefd=False)
    try:
        with tempfile.TemporaryFile() as payload, tarfile.open(fileobj=_Capped(reader, limit), mode="r|") as tar:
            manifest = _manifest(tar.next(), tar)
            member = tar.next()
            if member is None or member.name != PAYLOAD or not member.isreg():
                raise TransferError(f"its second member is not {PAYLOAD}")
            if member.size != manifest["bytes"]:
                raise TransferError(f"{PAYLOAD} holds {member.size} bytes where the manifest says {manifest['bytes']}")
            digest = _copy(tar.extractfile(member), payload)
            if digest != manifest["sha256"]:
                raise TransferError(f"{PAYLOAD} does not match the manifest's SHA-256: it was changed or damaged")
            if tar.next() is not None:
                raise TransferError(f"it holds more than {MANIFEST} and {PAYLOAD}")
            keep_workspace(payload, kept, max_bytes, max_entries)
    except TransferError:
        raise
    except WorkspaceTooLarge as exc:
        raise TransferError(f"{exc} (policy fields workspace.size_mb and workspace.files)") from None
    except _TooLarge:
        raise TransferError(
            f"it unpacks past the {limit} bytes the policy's workspace could hold (policy fields workspace.size_mb "
            "and workspace.files)"
        ) from None
    except (tarfile.TarError, zstandard.ZstdError, EOFError, OSError) as exc:
        raise TransferError(f"it is not a readable zstd-compressed tar ({exc})") from None
    return manifest


def _manifest(member: tarfile.TarInfo | None, tar: tarfile.TarFile) -> dict[str, Any]:
    if member is None or member.name != MANIFEST or not member.isreg():
        raise TransferError(f"its first member is not {MANIFEST}")
    if member.size > MANIFEST_BYTES:
        raise TransferError(f"its {MANIFEST} is {member.size} bytes, above {MANIFEST_BYTES}")
    handle = tar.extractfile(member)
    try:
        manifest = json.loads(handle.read() if handle is not None else b"")
    except ValueError:
        raise TransferError(f"its {MANIFEST} is not JSON") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise TransferError(f"its {MANIFEST} is not of the format {FORMAT!r}")
    if not isinstance(manifest.get("bytes"), int) or not isinstance(manifest.get("sha256"), str):
        raise TransferError(f"its {MANIFEST} does not say the size and SHA-256 of {PAYLOAD}")
    return manifest


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


def _iso(seconds: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(seconds))


class _TooLarge(Exception):
    pass


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
