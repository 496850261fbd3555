"""Pure logic of the output streams: caps, frames, and the stdout/archive boundary."""

import struct

import pytest

from sandbox_server.sandbox.engine.attach import exit_from_trailer, joined, pids_limited
from sandbox_server.sandbox.streams import CappedBuffer, FrameDemuxer, StdoutSplitter


def test_capped_buffer_keeps_everything_under_the_cap() -> None:
    buffer = CappedBuffer(100)
    buffer.feed(b"hello ")
    buffer.feed(b"world")
    assert buffer.head() == b"hello world"
    assert buffer.truncated_bytes == 0
    assert buffer.tail() == b""


def test_capped_buffer_keeps_head_and_tail_and_counts_the_middle() -> None:
    buffer = CappedBuffer(10)
    for index in range(100):
        buffer.feed(bytes([65 + index % 26]))
    assert buffer.head() == b"ABCDE"
    assert buffer.tail() == bytes(65 + i % 26 for i in range(95, 100))
    assert buffer.total == 100
    assert buffer.truncated_bytes == 90


@pytest.mark.parametrize("size", [49, 50, 51, 77, 99, 100])
def test_a_stream_up_to_its_cap_comes_back_whole(size: int) -> None:
    """Past half the cap the buffer keeps what fits in its head and tail parts: all of it comes back, unmarked."""
    buffer = CappedBuffer(100)
    data = bytes(65 + index % 26 for index in range(size))
    for index in range(0, size, 7):
        buffer.feed(data[index : index + 7])
    assert buffer.truncated_bytes == 0
    assert joined(buffer) == data


def test_a_stream_past_its_cap_comes_back_as_head_marker_and_tail() -> None:
    buffer = CappedBuffer(100)
    buffer.feed(bytes(range(101)))
    marker = "\n[… 1 bytes truncated …]\n".encode()
    assert joined(buffer) == bytes(range(50)) + marker + bytes(range(51, 101))


def _frame(stream: int, payload: bytes) -> bytes:
    return struct.pack(">BxxxL", stream, len(payload)) + payload


def test_demuxer_reassembles_frames_split_anywhere() -> None:
    wire = _frame(1, b"out") + _frame(2, b"err") + _frame(1, b"more")
    for cut in range(len(wire) + 1):
        demuxer = FrameDemuxer()
        frames = demuxer.feed(wire[:cut]) + demuxer.feed(wire[cut:])
        assert frames == [(1, b"out"), (2, b"err"), (1, b"more")]


def test_splitter_finds_a_boundary_split_across_chunks() -> None:
    data = b"program output" + b"BOUNDARY42" + b"archive bytes"
    for cut in range(len(data) + 1):
        program = CappedBuffer(1000)
        splitter = StdoutSplitter(b"BOUNDARY42", program, 1000)
        splitter.feed(data[:cut])
        splitter.feed(data[cut:])
        splitter.finish()
        assert program.head() == b"program output"
        assert bytes(splitter.archive) == b"archive bytes"
        assert splitter.found


def test_splitter_without_boundary_gives_everything_to_the_program() -> None:
    program = CappedBuffer(1000)
    splitter = StdoutSplitter(b"BOUNDARY42", program, 1000)
    splitter.feed(b"ends with BOUNDA")
    splitter.finish()
    assert program.head() == b"ends with BOUNDA"
    assert not splitter.found


def test_splitter_caps_the_archive() -> None:
    splitter = StdoutSplitter(b"B", CappedBuffer(10), 4)
    splitter.feed(b"xB123456")
    assert bytes(splitter.archive) == b"1234"
    assert splitter.archive_overflow


@pytest.mark.parametrize("chunk", [1, 7, 4096])
def test_the_trailer_ends_the_archive_whatever_the_chunking(chunk: int) -> None:
    boundary = b"0123456789abcdef"
    stream = b"program says hi" + boundary + b"TARBYTES" * 100 + boundary + b" exit=3 oom_kill=1\n"
    program = CappedBuffer(1000)
    splitter = StdoutSplitter(boundary, program, 10_000)
    for start in range(0, len(stream), chunk):
        assert splitter.trailer is None
        splitter.feed(stream[start : start + chunk])
    assert splitter.trailer == {"exit": "3", "oom_kill": "1"}
    assert bytes(splitter.archive) == b"TARBYTES" * 100
    assert program.head() == b"program says hi"


@pytest.mark.parametrize("chunk", [1, 5, 7, 64, 4096])
@pytest.mark.parametrize("cap", [0, 10, 799, 800, 810])
def test_the_trailer_ends_an_archive_up_to_and_past_its_cap_whatever_the_chunking(chunk: int, cap: int) -> None:
    # The launcher writes its trailer after the whole archive, and then waits for the host: were the trailer not
    # looked for past the cap, the call would wait for its timeout (a full output folder once did).
    boundary = b"0123456789abcdef"
    stream = b"out" + boundary + b"TARBYTES" * 100 + boundary + b" exit=1 oom_kill=0\n"
    splitter = StdoutSplitter(boundary, CappedBuffer(1000), cap)
    for start in range(0, len(stream), chunk):
        assert splitter.trailer is None
        splitter.feed(stream[start : start + chunk])
    assert splitter.trailer == {"exit": "1", "oom_kill": "0"}
    assert splitter.archive_overflow is (cap < 800)  # the trailer is never counted against the cap
    assert bytes(splitter.archive) == (b"TARBYTES" * 100)[:cap]


def test_without_a_whole_trailer_line_the_engine_is_asked() -> None:
    splitter = StdoutSplitter(b"B" * 16, CappedBuffer(100), 10_000)
    splitter.feed(b"B" * 16 + b"tar" + b"B" * 16 + b" exit=0 oom")
    assert splitter.trailer is None and bytes(splitter.archive).startswith(b"tar")


@pytest.mark.parametrize(
    ("line", "known", "pids"),
    [
        (b"exit=3 oom_kill=0 pids_max=0", (3, False), False),
        (b"exit=137 oom_kill=2 pids_max=5", (137, True), True),
        (b"exit=0 oom_kill=- pids_max=-", (0, False), False),  # cgroup unreadable (gVisor), but it exited 0
        (b"exit=1 oom_kill=- pids_max=-", None, False),  # cgroup unreadable and it failed: ask the engine
        (b"exit=" + b"9" * 5000 + b" oom_kill=0 pids_max=" + b"9" * 5000, None, False),  # forged
        (b"exit=256 oom_kill=0", None, False),
        (b"exit=-1 oom_kill=0 pids_max=+1", None, False),
        (b"exit=\xd9\xa3 oom_kill=0", None, False),  # a non-ASCII digit
    ],
)
def test_trailer_values_are_small_ascii_numbers_or_ignored(line: bytes, known: object, pids: bool) -> None:
    splitter = StdoutSplitter(b"--b--", CappedBuffer(100), 100_000)
    splitter.feed(b"--b--" + b"--b--" + line + b"\n")
    assert exit_from_trailer(splitter.trailer) == known
    assert pids_limited(splitter.trailer) is pids


@pytest.mark.parametrize(
    ("chunks", "expected"),
    [
        ([b"one\ntwo\n"], "two"),
        ([b"one\ntw", b"o and a half"], "two and a half"),  # a line still being written
        ([b"step 1/3\rstep 2/3\rstep 3/3\n\n  \n"], "step 3/3"),  # a progress bar: its latest state
        ([b"\x1b[31mred\x07\n"], "[31mred"),  # control characters are not shown
        ([b"x" * 300 + b"\n"], "…" + "x" * 159),
        ([b"a\n" * 10_000, b"end of a flood\n"], "end of a flood"),  # past the buffer's cap
        ([], ""),
    ],
)
def test_the_last_line_of_a_stream_is_what_a_person_would_read(chunks: list[bytes], expected: str) -> None:
    buffer = CappedBuffer(100)
    for chunk in chunks:
        buffer.feed(chunk)
    assert buffer.last_line() == expected


def test_a_stream_past_its_cap_is_also_kept_whole_up_to_its_own_bound() -> None:
    from sandbox_server.sandbox.streams import WHOLE_BYTES

    buffer = CappedBuffer(100)
    data = bytes(range(256)) * 4
    for start in range(0, len(data), 7):
        buffer.feed(data[start : start + 7])
    assert buffer.truncated_bytes == len(data) - 100 and buffer.whole() == data
    small = CappedBuffer(100)
    small.feed(b"x" * 100)
    assert small.whole() is None  # it fit: the answer holds it all
    flood = CappedBuffer(10)
    flood.feed(b"y" * (WHOLE_BYTES + 5))
    assert flood.whole() == b"y" * WHOLE_BYTES
