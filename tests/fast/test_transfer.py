"""An exported workspace read back: a whole export round-trips; a damaged or hostile one is refused saying why, or
cleaned as any workspace archive is."""

from __future__ import annotations

import hashlib
import io
import json
import os
import tarfile
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import zstandard

from sandbox_server.sandbox.archive import kept_entries
from sandbox_server.workspaces.exports import EXPORT_PREFIX, KEEP_S, MIME, Exports
from sandbox_server.workspaces.transfer import (
    FIRST_FORMAT,
    FORMAT,
    SECOND_FORMAT,
    Add,
    Bounds,
    ExportStopped,
    TransferError,
    read_export,
    write_export,
)
from tests import hostile_exports as hostile

MIB = 1 << 20


def _tar(entries: list[tuple[tarfile.TarInfo, bytes | None]]) -> bytes:
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for member, data in entries:
            if data is not None:
                member.size = len(data)
            tar.addfile(member, io.BytesIO(data) if data is not None else None)
    return out.getvalue()


def _file(name: str, data: bytes) -> tuple[tarfile.TarInfo, bytes]:
    return tarfile.TarInfo(name), data


def _entries_of(payload: bytes) -> Callable[[Add], None]:
    """What a workspace's contents give an export: each entry of a tar, with its content."""

    def fill(add: Add) -> None:
        with tarfile.open(fileobj=io.BytesIO(payload)) as tar:
            for member in tar:
                add(member, tar.extractfile(member) if member.isreg() else None)

    return fill


def _export(payload: bytes) -> bytes:
    out = io.BytesIO()
    write_export(out, {"id": "ws-x", "name": "n"}, _entries_of(payload))
    return out.getvalue()


def _members(archive: bytes) -> list[tuple[tarfile.TarInfo, bytes]]:
    unpacked = zstandard.ZstdDecompressor().stream_reader(io.BytesIO(archive)).read()
    with tarfile.open(fileobj=io.BytesIO(unpacked)) as tar:
        return [(m, tar.extractfile(m).read() if m.isreg() else b"") for m in tar]  # type: ignore[union-attr]


def _read(archive: bytes, max_bytes: int = 16 * MIB, entries: int = 1000) -> tuple[dict[str, object], dict[str, bytes]]:
    kept = io.BytesIO()
    manifest = read_export(io.BytesIO(archive), max_bytes, entries, kept)
    found = {}
    for name, member, tar in kept_entries(kept):
        handle = tar.extractfile(member) if member.isreg() else None
        found[name] = handle.read() if handle is not None else b""
    return manifest, found


def _packed(members: list[tuple[tarfile.TarInfo, bytes]], checksum: bool = True) -> bytes:
    out = io.BytesIO()
    with zstandard.ZstdCompressor(write_checksum=checksum).stream_writer(out, closefd=False) as packed:
        packed.write(_tar(members))  # type: ignore[arg-type]
    return out.getvalue()


def test_an_export_round_trips_its_files_with_a_manifest_that_says_what_it_holds() -> None:
    payload = _tar([_file("a.txt", b"alpha"), _file("d/b.bin", bytes(range(256)) * 10)])
    archive = _export(payload)
    manifest, found = _read(archive)
    assert manifest["format"] == FORMAT and manifest["name"] == "n"
    assert (manifest["files"], manifest["bytes"]) == (2, 5 + 2560)
    assert found == {"a.txt": b"alpha", "d/b.bin": bytes(range(256)) * 10}
    names = [member.name for member, _ in _members(archive)]  # written in one pass: the checksum comes last
    assert names == ["manifest.json", "workspace/a.txt", "workspace/d/b.bin", "checksum.json"]


def test_an_export_of_the_first_format_is_still_read() -> None:
    payload = _tar([_file("a.txt", b"alpha")])
    manifest = {"format": FIRST_FORMAT, "bytes": len(payload), "sha256": hashlib.sha256(payload).hexdigest()}
    first = _packed([_file("manifest.json", json.dumps(manifest).encode()), _file("workspace.tar", payload)])
    read, found = _read(first)
    assert read["format"] == FIRST_FORMAT and found == {"a.txt": b"alpha"}


@pytest.mark.parametrize(
    ("archive", "said"),
    [
        (b"not zstd at all" * 100, "not zstd-compressed, as an export is"),
        (_packed([_file("workspace.tar", b"x")]), "first member is not manifest.json"),
        (_packed([_file("manifest.json", b"[1, 2]")]), "not a JSON object"),
        (_packed([_file("manifest.json", b"{}")]), "not of the format"),
        (_packed([_file("manifest.json", json.dumps({"format": FIRST_FORMAT}).encode())]), "does not say the size"),
        (_packed([_file("manifest.json", json.dumps({"format": FORMAT}).encode())]), "cut short"),
        (_packed([_file("manifest.json", json.dumps({"format": FORMAT}).encode())], checksum=False), "no checksum"),
        (
            _packed([_file("manifest.json", json.dumps({"format": FORMAT}).encode()), _file("../x", b"x")]),
            "neither under workspace/ nor checksum.json",
        ),
    ],
)
def test_what_is_not_an_export_is_refused_saying_why(archive: bytes, said: str) -> None:
    with pytest.raises(TransferError, match=said):
        _read(archive)


def test_a_damaged_export_fails_zstds_checksum_and_a_member_past_it_is_refused() -> None:
    data = bytes(range(256)) * 4096 + bytes(hashlib.sha256(str(i).encode()).digest()[0] for i in range(65536))
    archive = bytearray(_export(_tar([_file("a.bin", data)])))
    assert _read(bytes(archive))[1] == {"a.bin": data}
    archive[len(archive) // 2] ^= 0x01  # one bit of the stored content, which still decompresses
    with pytest.raises(TransferError, match="does not match its zstd checksum: it was changed or damaged"):
        _read(bytes(archive))
    members = _members(_export(_tar([_file("a.txt", b"alpha")])))
    with pytest.raises(TransferError, match="holds more than"):
        _read(_packed([*members, _file("extra", b"x")]))


def test_the_earlier_formats_sha256_are_still_checked() -> None:
    payload = _tar([_file("a.txt", b"alpha")])
    manifest = {"format": FIRST_FORMAT, "bytes": len(payload), "sha256": "0" * 64}
    changed = _packed([_file("manifest.json", json.dumps(manifest).encode()), _file("workspace.tar", payload)])
    with pytest.raises(TransferError, match="does not match the manifest's SHA-256"):
        _read(changed)
    entry = tarfile.TarInfo("workspace/a.txt")
    entry.size = 5
    said = f"0\0a.txt\0\0{entry.size}\0{entry.mode & 0o7777:o}\0".encode()
    head = _file("manifest.json", json.dumps({"format": SECOND_FORMAT}).encode())

    def second(content: bytes, digest: str) -> bytes:
        trailer = _file("checksum.json", json.dumps({"files": 1, "bytes": 5, "sha256": digest}).encode())
        return _packed([head, (entry, content), trailer])

    right = hashlib.sha256(said + b"alpha").hexdigest()
    assert _read(second(b"alpha", right))[1] == {"a.txt": b"alpha"}
    with pytest.raises(TransferError, match="does not match its checksum.json's SHA-256"):
        _read(second(b"omega", right))


def test_a_small_file_that_unpacks_past_the_workspace_is_refused_before_it_is_unpacked() -> None:
    bomb = _export(_tar([_file("zeros", bytes(64 * MIB))]))
    assert len(bomb) < MIB
    with pytest.raises(TransferError, match="more than the workspace can"):  # by what it declares, before a byte
        _read(bomb, max_bytes=8 * MIB)
    payload = _tar([_file("zeros", bytes(64 * MIB))])  # the first format's one tar, where the stream's cap holds
    manifest = {"format": FIRST_FORMAT, "bytes": len(payload), "sha256": hashlib.sha256(payload).hexdigest()}
    first = _packed([_file("manifest.json", json.dumps(manifest).encode()), _file("workspace.tar", payload)])
    with pytest.raises(TransferError, match="unpacks past"):
        _read(first, max_bytes=8 * MIB)
    with pytest.raises(TransferError, match="more than the workspace can .* workspace.size_mb"):
        _read(_export(_tar([_file("big", bytes(range(256)) * 40_000)])), max_bytes=8 * MIB)


def test_names_that_leave_the_workspace_devices_and_stray_links_are_dropped_as_in_any_workspace_archive() -> None:
    device = tarfile.TarInfo("dev")
    device.type = tarfile.CHRTYPE
    up, absolute = _file("../up.txt", b"out"), _file("/etc/cron.d/x", b"out")
    stray = tarfile.TarInfo("hard")
    stray.type, stray.linkname = tarfile.LNKTYPE, "/etc/shadow"
    link = tarfile.TarInfo("shadow")
    link.type, link.linkname = tarfile.SYMTYPE, "/etc/shadow"
    _, found = _read(_export(_tar([up, absolute, (device, None), (stray, None), (link, None), _file("ok", b"ok")])))
    assert set(found) == {"shadow", "ok"}, found  # a link stays a link, made only in a sandbox (or by the data filter)
    assert found["ok"] == b"ok" and found["shadow"] == b""


@pytest.mark.parametrize(
    ("member", "said"),
    [
        (hostile.gnu_sparse_member("workspace/s", 4 << 40), "'workspace/s' is sparse, which is refused"),
        (hostile.pax_sparse_member("workspace/s", 4 << 30), "'workspace/s' is sparse, which is refused"),
        (hostile.pax_sparse_member("workspace/s", 4 << 30, minor="1"), "'workspace/s' is sparse, which is refused"),
    ],
)
def test_a_sparse_member_is_refused_before_a_byte_of_what_it_declares_is_written(member: bytes, said: str) -> None:
    archive = hostile.export_of([member])
    assert len(archive) < 1024
    with pytest.raises(TransferError, match=said):
        _read(archive)


def test_an_extended_header_past_64_kib_is_refused_before_it_is_read_and_none_reaches_the_workspace() -> None:
    big = hostile.export_of(hostile.pax_comment_blocks("workspace/c.txt", 8 * MIB))
    assert len(big) < 64 * 1024
    with pytest.raises(TransferError, match="an extended header of 8388[0-9]+ bytes, above 65536"):
        _read(big)
    long_name = "workspace/" + "/".join(["deep"] * 30) + "/leaf.txt"  # 159 bytes: carried by a PAX path
    small = hostile.file_member("workspace/c.txt", b"ok", comment="x" * 1000, path="workspace/c.txt")
    _, found = _read(hostile.export_of([small, hostile.file_member(long_name, b"far")]))
    assert found == {"c.txt": b"ok", long_name.removeprefix("workspace/"): b"far"}, found
    kept = io.BytesIO()
    read_export(io.BytesIO(hostile.export_of([small])), MIB, 10, kept)
    assert b"comment" not in kept.getvalue() and b"x" * 100 not in kept.getvalue()
    chained = [hostile.file_member("workspace/x", b"", comment="c")[:1024]] * 6 + [
        hostile.file_member("workspace/y", b"")
    ]
    with pytest.raises(TransferError, match="more than 4 extended headers before one member"):
        _read(hostile.export_of(chained))


def test_entries_are_counted_as_they_are_read_and_a_refusal_comes_at_the_first_one_past_the_cap() -> None:
    many = hostile.export_of(hostile.folder_member(f"workspace/d{index}") for index in range(3_000))
    with pytest.raises(TransferError, match="more than the workspace can .*1000 entries"):
        _read(many, entries=1000)


def test_a_deeply_nested_manifest_and_an_export_of_nothing_are_answered_not_raised() -> None:
    nested = hostile.export_of([], manifest=None)
    deep = _packed([_file("manifest.json", b"[" * 30_000 + b"]" * 30_000)])
    with pytest.raises(TransferError, match="manifest.json is not JSON"):
        _read(deep)
    manifest, found = _read(nested)  # nothing in it: an empty workspace
    assert found == {} and manifest["format"] == FORMAT


def test_an_export_stops_past_its_bytes_of_content_and_at_its_deadline() -> None:
    payload = _tar([_file("a.bin", bytes(2 * MIB)), _file("b.bin", bytes(2 * MIB))])
    with pytest.raises(ExportStopped, match="claim more than the 3145728 bytes") as past:
        write_export(io.BytesIO(), {"id": "ws-x"}, _entries_of(payload), Bounds(3 * MIB))
    assert past.value.field == "workspace.size_mb"
    with pytest.raises(ExportStopped, match="longer than one call may") as late:
        write_export(io.BytesIO(), {"id": "ws-x"}, _entries_of(payload), Bounds(8 * MIB, time.monotonic() - 1))
    assert late.value.field == "limits.max_timeout_s"
    assert write_export(io.BytesIO(), {"id": "ws-x"}, _entries_of(payload), Bounds(4 * MIB))["bytes"] == 4 * MIB


def test_exports_are_counted_per_caller_until_dropped_or_past_their_hour_and_one_past_it_is_not_served(
    tmp_path: Path,
) -> None:
    exports = Exports(tmp_path / "exports")
    mine, path = exports.begin("ada", 1000)
    theirs, other = exports.begin("bob", 500)
    assert (exports.held_by("ada"), exports.held_by("bob"), exports.total()) == (1000, 500, 1500)
    path.write_bytes(b"x" * 10)
    other.write_bytes(b"y" * 20)
    exports.finish(mine, 10)
    assert exports.read(mine, "ada", 0, 4) == (MIME, 10, b"xxxx") and exports.read(mine, "bob", 0, 4) is None
    assert Exports(tmp_path / "exports").held_by("ada") == 10  # a restarted server counts what is still there
    exports.drop(theirs)
    assert not other.exists() and exports.total() == 10
    old = time.time() - KEEP_S - 1
    os.utime(tmp_path / "exports" / f"{mine.removeprefix(EXPORT_PREFIX)}.json", (old, old))
    assert exports.read(mine, "ada", 0, 4) is None and not path.exists() and exports.total() == 0
