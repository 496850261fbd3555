"""Pure stream handling: the engine's multiplexed attach stream, capped buffers and
the boundary that separates the program's stdout from the archive of its output files."""

from __future__ import annotations

import io
import itertools
import struct
from typing import Any, BinaryIO, Protocol, runtime_checkable

__all__ = ["STDERR", "STDOUT", "CappedBuffer", "FrameDemuxer", "StdoutSplitter", "Stream", "frame"]

_HEADER = struct.Struct(">BxxxL")
STDOUT, STDERR = 1, 2
LAST_BYTES = 512
"""The end of a stream kept for its last line (progress notifications show it)."""
LINE_CHARS = 160
"""A last line longer than this is shown cut, its end kept."""
WHOLE_BYTES = 8 * 1024 * 1024
"""A stream cut to its cap is also kept whole up to this, for the caller to read as a resource in parts (kept only
once the stream passes its cap: until then its head and tail are all of it)."""
_feeds = itertools.count(1)


class CappedBuffer:
    """Keeps the first and last bytes of a stream within `limit` bytes and counts the rest."""

    def __init__(self, limit: int) -> None:
        self.limit = max(0, limit)
        self._tail_limit = self.limit // 2
        self._head_limit = self.limit - self._tail_limit
        self._head = bytearray()
        self._tail = bytearray()
        self._last = bytearray()
        self._whole: bytearray | None = None
        self.total = 0
        self.fed = 0
        """When it was last fed, in the order of every buffer's feeds (0: never)."""

    def feed(self, data: bytes) -> None:
        """Add bytes; memory stays bounded by `limit` and, once the stream passes it, WHOLE_BYTES."""
        if self._whole is None and self.total + len(data) > self.limit:  # nothing dropped yet: head and tail are all
            self._whole = self._head + self._tail
        if self._whole is not None and self.total < WHOLE_BYTES:
            self._whole += data[: WHOLE_BYTES - self.total]
        self.total += len(data)
        if data:
            self.fed = next(_feeds)
            self._last += data[-LAST_BYTES:]
            del self._last[: max(0, len(self._last) - LAST_BYTES)]
        room = self._head_limit - len(self._head)
        if room > 0:
            self._head += data[:room]
            data = data[room:]
        if data and self._tail_limit:
            self._tail += data
            if len(self._tail) > self._tail_limit:
                del self._tail[: len(self._tail) - self._tail_limit]

    def whole(self) -> bytes | None:
        """The stream as it came, up to WHOLE_BYTES, when it was cut to the cap (None when it was not)."""
        return bytes(self._whole) if self._whole is not None and self.truncated_bytes else None

    @property
    def truncated_bytes(self) -> int:
        """How many bytes were dropped from the middle."""
        return self.total - len(self._head) - len(self._tail)

    def head(self) -> bytes:
        """The kept beginning of the stream."""
        return bytes(self._head)

    def tail(self) -> bytes:
        """The kept end of the stream: what came after the head's half of the cap (empty while the head holds all)."""
        return bytes(self._tail)

    def last_line(self) -> str:
        """The stream's latest line as a person reads it: the last one with text, after any carriage return
        (a progress bar's latest state), cut to LINE_CHARS keeping its end; "" when there is none."""
        text = self._last.decode("utf-8", "replace")
        for line in reversed(text.splitlines()):
            shown = "".join(ch for ch in line.rsplit("\r", 1)[-1] if ch.isprintable()).strip()
            if shown:
                return shown if len(shown) <= LINE_CHARS else "…" + shown[-(LINE_CHARS - 1) :]
        return ""


class Stream(Protocol):
    """What a call speaks to its sandbox through: the engine's attach socket, or a runc sandbox's pipes."""

    def recv(self, size: int, /) -> bytes: ...
    def sendall(self, data: Any, /) -> Any: ...
    def sendfile(self, file: Any, /) -> Any: ...
    def shutdown(self, how: int, /) -> None: ...
    def fileno(self) -> int: ...
    def close(self) -> None: ...


@runtime_checkable
class LoopStream(Stream, Protocol):
    """A stream the event loop itself can send to and read from, awaiting its descriptors rather than a thread's
    blocking calls (a runc sandbox's pipes)."""

    async def asend(self, data: bytes, /) -> None: ...
    async def arecv(self, size: int, /) -> bytes: ...


def frame(stream: int, payload: bytes) -> bytes:
    """One frame of the engine's attach stream: `payload` of stream `stream` (STDOUT or STDERR)."""
    return _HEADER.pack(stream, len(payload)) + payload


class FrameDemuxer:
    """Splits the engine's attach stream (8-byte headers: stream id, size) into stdout and stderr."""

    def __init__(self) -> None:
        self._pending = bytearray()

    def feed(self, data: bytes) -> list[tuple[int, bytes]]:
        """Return the complete frames in `data` (plus what was pending) as (stream, payload)."""
        self._pending += data
        frames: list[tuple[int, bytes]] = []
        offset = 0
        while len(self._pending) - offset >= _HEADER.size:
            stream, size = _HEADER.unpack_from(self._pending, offset)
            end = offset + _HEADER.size + size
            if end > len(self._pending):
                break
            frames.append((stream, bytes(self._pending[offset + _HEADER.size : end])))
            offset = end
        del self._pending[:offset]
        return frames


class StdoutSplitter:
    """Routes stdout bytes to the program's buffer until `boundary`, then to the archive sink.

    The launcher inside the sandbox writes the boundary after the program exits,
    followed by a tar of the output folder (or of the whole workspace), then the boundary
    again with a trailer line (`<boundary> exit=N oom_kill=M …`): once it has arrived, the
    call is over without waiting for the container to stop. Bytes that could be the start
    of the boundary are held back until it is clear they are not. The archive goes to
    `sink` (memory by default, a file for a whole workspace), so the host holds no more
    than the boundary's length of it in memory.
    """

    def __init__(
        self, boundary: bytes, program: CappedBuffer, archive_limit: int, sink: BinaryIO | None = None
    ) -> None:
        self.boundary = boundary
        self.program = program
        self.sink: BinaryIO = sink if sink is not None else io.BytesIO()
        self.archive_size = 0
        """Bytes of the archive written to the sink."""
        self.archive_limit = archive_limit
        self.archive_overflow = False
        self.found = False
        self.trailer: dict[str, str] | None = None
        """The launcher's last line (exit, oom_kill, …), once it has arrived whole."""
        self._held = b""
        self._archive_held = bytearray()

    @property
    def archive(self) -> bytes:
        """The archive so far, when the sink is memory (tests and small outputs)."""
        assert isinstance(self.sink, io.BytesIO)
        return self.sink.getvalue() + bytes(self._archive_held)

    def feed(self, data: bytes) -> None:
        """Route a chunk of stdout."""
        if self.found:
            self._to_archive(data)
            return
        data = self._held + data
        index = data.find(self.boundary)
        if index >= 0:
            self.program.feed(data[:index])
            self._held = b""
            self.found = True
            self._to_archive(data[index + len(self.boundary) :])
            return
        keep = self._partial_suffix(data)
        self.program.feed(data[: len(data) - keep])
        self._held = data[len(data) - keep :] if keep else b""

    def finish(self) -> None:
        """The stream ended: whatever was held back belongs to the program, or to the archive."""
        if self._held:
            self.program.feed(self._held)
            self._held = b""
        if self.trailer is None and self._archive_held:
            self._keep(bytes(self._archive_held))
            self._archive_held.clear()

    def _partial_suffix(self, data: bytes) -> int:
        for size in range(min(len(self.boundary) - 1, len(data)), 0, -1):
            if self.boundary.startswith(data[-size:]):
                return size
        return 0

    def _write(self, data: bytes) -> None:
        self.sink.write(data)
        self.archive_size += len(data)

    def _to_archive(self, data: bytes) -> None:
        """Archive bytes go to the sink up to the cap, past it nowhere; either way the trailer is looked for, as the
        launcher, having written it, waits for the host (were it not found, the call would wait for its timeout)."""
        if self.trailer is not None:
            return
        held = self._archive_held
        held += data
        start = held.find(self.boundary)
        size = start if start >= 0 else max(len(held) - len(self.boundary) + 1, 0)  # what cannot be the boundary
        self._keep(bytes(held[:size]))
        del held[:size]
        if start < 0:
            return
        end = held.find(b"\n")
        if end < 0:
            return
        line = bytes(held[len(self.boundary) : end]).decode("ascii", "replace")
        self.trailer = dict(field.partition("=")[::2] for field in line.split())
        held.clear()

    def _keep(self, data: bytes) -> None:
        room = max(self.archive_limit - self.archive_size, 0)
        if len(data) > room:
            self.archive_overflow = True
            data = data[:room]
        if data:
            self._write(data)
