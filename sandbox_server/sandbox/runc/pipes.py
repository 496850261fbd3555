"""A sandbox's stdin, stdout and stderr as three pipes, spoken to as the engine's attach socket is.

A sandbox runc runs itself gets the far ends of three pipes as its standard streams. The call's side reads them
as one stream of frames in the engine's format (an 8-byte header: stream id, size), so the drain, the
boundary, the archive and the trailer are read exactly as on the engine's path. Nothing inside the sandbox can
write a frame header of its own: its two outputs are separate pipes and each chunk is framed here, and its stdin
is a pipe it can only read.

`close` may come from the call's thread while a worker thread waits in `recv` (or the event loop in `arecv`): it
wakes that wait through a pipe of its own, and the read ends are closed by whichever side is last, so a file number
is never closed under a wait and then reused by something else. A call's small request and its answer go through
`asend` and `arecv`, on the event loop: no trip to a thread, and no thread blocked in a read, per call.
"""

from __future__ import annotations

import contextlib
import errno
import os
import select
import socket
import threading
from typing import BinaryIO

import anyio

from sandbox_server.sandbox.polling import readable
from sandbox_server.sandbox.streams import STDERR, STDOUT, frame

__all__ = ["PipeStream"]

CHUNK = 65536


class PipeStream:
    """Our ends of a sandbox's three pipes; `sandbox_ends` are handed to the process that runs it."""

    def __init__(self) -> None:
        stdin_read, self._stdin = os.pipe()
        stdout_read, stdout_write = os.pipe()
        stderr_read, stderr_write = os.pipe()
        self._wake_read, self._wake = os.pipe()
        self._reads: dict[int, int] = {STDOUT: stdout_read, STDERR: stderr_read}
        self.sandbox_ends: tuple[int, int, int] | None = (stdin_read, stdout_write, stderr_write)
        self._lock = threading.Lock()
        self._poller: select.epoll | None = None
        """Our read ends and the wake pipe, as one descriptor the event loop awaits (made at the first `arecv`)."""
        self._reading = False
        self._closed = False
        self._stdin_closed = False

    @property
    def closed(self) -> bool:
        """Whether `close` was called (from any thread)."""
        return self._closed

    def handed_over(self) -> None:
        """The sandbox's process holds its ends now: close ours of them, so its exit is seen as the end."""
        ends, self.sandbox_ends = self.sandbox_ends, None
        for fd in ends or ():
            with contextlib.suppress(OSError):
                os.close(fd)

    def fileno(self) -> int:
        """The stdout pipe's read end (what a wait for "has the sandbox said anything" selects on)."""
        return self._reads.get(STDOUT, self._wake_read)

    def said_anything(self) -> bool:
        """Whether either output has something to read, or has ended (a waiting sandbox says nothing)."""
        with self._lock:
            if self._closed:
                return True
            said = readable(self._reads.values(), 0)
        return bool(said)

    def sendall(self, data: bytes | memoryview) -> None:
        """Write all of `data` to the sandbox's stdin (OSError once it stopped reading)."""
        view = memoryview(data)
        while view:
            view = view[os.write(self._stdin, view) :]

    def sendfile(self, source: BinaryIO) -> None:
        """Write a file, from where it stands, to the sandbox's stdin."""
        while chunk := source.read(CHUNK):
            self.sendall(chunk)

    def shutdown(self, how: int) -> None:
        """SHUT_WR ends the sandbox's stdin; SHUT_RDWR closes everything."""
        if how == socket.SHUT_WR:
            self._close_stdin()
        else:
            self.close()

    async def asend(self, data: bytes) -> None:
        """`sendall` on the event loop: what the stdin pipe does not take at once is written as the sandbox reads."""
        os.set_blocking(self._stdin, False)
        view = memoryview(data)
        while view:
            try:
                view = view[os.write(self._stdin, view) :]
            except BlockingIOError:
                await anyio.wait_writable(self._stdin)

    def recv(self, size: int) -> bytes:
        """The next chunk of either output as one frame; b"" once both have ended; OSError once closed."""
        self._start_reading()
        try:
            while self._reads:
                chunk = self._read_ready(size, None)
                if chunk:
                    return chunk
            return b""
        finally:
            self._stop_reading()

    async def arecv(self, size: int) -> bytes:
        """`recv` on the event loop: the outputs awaited as one descriptor, read once one has something."""
        self._start_reading()
        try:
            while self._reads:
                chunk = self._read_ready(size, 0)
                if chunk:
                    return chunk
                if self._reads:
                    await anyio.wait_readable(self._awaited())
            return b""
        finally:
            self._stop_reading()

    def _start_reading(self) -> None:
        with self._lock:
            if self._closed:
                raise OSError(errno.EBADF, "the sandbox's streams are closed")
            self._reading = True

    def _stop_reading(self) -> None:
        with self._lock:
            self._reading = False
            if self.closed:
                self._close_reads()

    def _read_ready(self, size: int, timeout_s: float | None) -> bytes:
        """A frame of an output that has something within `timeout_s` (None: until one has); b"" when none had
        (or one ended: it is dropped); OSError once closed."""
        ready = readable([*self._reads.values(), self._wake_read], timeout_s)
        if self._wake_read in ready or self.closed:
            raise OSError(errno.EBADF, "the sandbox's streams were closed")
        for stream, fd in list(self._reads.items()):
            if fd not in ready:
                continue
            data = os.read(fd, size)
            if data:
                return frame(stream, data)
            del self._reads[stream]  # this output ended
            os.close(fd)
        return b""

    def _awaited(self) -> int:
        """One descriptor readable when an output or the wake pipe is (an epoll of them; ended outputs leave it as
        they are closed)."""
        if self._poller is None:
            self._poller = select.epoll()
            for fd in (*self._reads.values(), self._wake_read):
                self._poller.register(fd, select.EPOLLIN)
        return self._poller.fileno()

    def close(self) -> None:
        """Close our ends (a wait in `recv` wakes and raises); never raises."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            with contextlib.suppress(OSError):
                os.write(self._wake, b"x")
            if not self._reading:
                self._close_reads()
        self._close_stdin()
        self.handed_over()

    def _close_stdin(self) -> None:
        with self._lock:
            if self._stdin_closed:
                return
            self._stdin_closed = True
        with contextlib.suppress(OSError):
            os.close(self._stdin)

    def _close_reads(self) -> None:
        """Close the read ends, their epoll and the wake pipe (under the lock, with no `recv` running)."""
        if self._poller is not None:
            self._poller.close()
        for fd in (*self._reads.values(), self._wake_read, self._wake):
            with contextlib.suppress(OSError):
                os.close(fd)
        self._reads.clear()
        self._wake_read = self._wake = -1
