"""A call's request sent down its sandbox's stream and its answer read: by the event loop itself where the stream
can be awaited (a runc sandbox's pipes, with a small request), else by a worker thread (the engine's attach
socket, or a request large enough to be sent before the deadline starts); progress said every second meanwhile."""

from __future__ import annotations

import io
import socket
import time
from typing import BinaryIO

import anyio

from sandbox_server.sandbox.engine.attach import Drain
from sandbox_server.sandbox.runtime import ProgressCallback
from sandbox_server.sandbox.streams import LoopStream, Stream

__all__ = ["SMALL_REQUEST", "answer", "report", "send", "small"]


async def answer(raw: Stream, request: BinaryIO, small_request: bool, drain: Drain) -> None:
    """The request sent when it is small (a large one was sent already), then the answer read until its end."""
    if small_request and isinstance(raw, LoopStream):  # (a runc sandbox's pipes: no thread at all)
        await _answer_on_loop(raw, request, drain)
    else:
        await anyio.to_thread.run_sync(_answer, raw, request if small_request else None, drain, abandon_on_cancel=True)


SMALL_REQUEST = 16384
"""A request sent by the thread that reads the answer (a fresh sandbox's stdin pipe or attach socket takes this
much at once)."""


def small(request: BinaryIO) -> bool:
    return isinstance(request, io.BytesIO) and request.getbuffer().nbytes <= SMALL_REQUEST


def _answer(raw: Stream, request: BinaryIO | None, drain: Drain) -> None:
    """The request sent when it is small (`small`), then the answer read (Drain.run)."""
    if request is not None:
        send(raw, request)
    drain.run(raw)


async def _answer_on_loop(raw: LoopStream, request: BinaryIO, drain: Drain) -> None:
    """`_answer`, on the event loop."""
    try:
        request.seek(0)
        await raw.asend(request.read())
        raw.shutdown(socket.SHUT_WR)
    except OSError:
        pass  # the program exited before reading all of its input; its output says the rest
    finally:
        request.close()
    await drain.run_on_loop(raw)


def send(raw: Stream, request: BinaryIO) -> None:
    """The request down the attach stream, then its end (the launcher reads to it)."""
    try:
        if isinstance(request, io.BytesIO):
            raw.sendall(request.getbuffer())
        else:
            request.seek(0)
            raw.sendfile(request)
        raw.shutdown(socket.SHUT_WR)
    except OSError:
        pass  # the program exited before reading all of its input; its output says the rest
    finally:
        request.close()


async def report(drain: Drain, started: float, on_progress: ProgressCallback) -> None:
    """Progress every second while the call runs: its time, its output so far and its latest line."""
    while not drain.finished:
        await anyio.sleep(1.0)
        latest = max((drain.stdout, drain.stderr), key=lambda stream: stream.fed)
        last = latest.last_line() or drain.stdout.last_line() or drain.stderr.last_line()
        await on_progress(time.monotonic() - started, drain.stdout.total, drain.stderr.total, last)
