"""The attach stream of one call: stdout, stderr, the output archive and the launcher's trailer.

A worker thread reads the multiplexed stream into capped buffers; the launcher's
boundary splits stdout from the tar of /workspace/out, and its trailer carries the exit
code and the cgroup's counters. Everything here comes from inside the sandbox, where the
program can forge it: numbers are read strictly and files as hostile data.
"""

from __future__ import annotations

import contextlib
import re
import socket
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import BinaryIO

from sandbox_server.sandbox.archive import OUTPUT_LEAF, read_outputs
from sandbox_server.sandbox.meter import Usage
from sandbox_server.sandbox.spec import ExecutionResult, OutputFile, SandboxSpec
from sandbox_server.sandbox.streams import STDERR, CappedBuffer, FrameDemuxer, LoopStream, StdoutSplitter, Stream

__all__ = [
    "FLOOD_FACTOR",
    "FLOOD_MIN_BYTES",
    "Drain",
    "Ending",
    "archive_limit",
    "close_socket",
    "exit_from_trailer",
    "joined",
    "launcher_timed_out",
    "persist_grace_s",
    "pids_limited",
    "result_of",
]

FLOOD_FACTOR = 16
FLOOD_MIN_BYTES = 64 * 1024 * 1024
"""A program that writes more than FLOOD_FACTOR times its output cap (and at least
FLOOD_MIN_BYTES) is killed as a flood: draining it longer only burns the host's CPU."""
UNSETTLED_NOTE = (
    "the sandbox's processes were still running after the end of its output (a program that wrote the "
    "launcher's trailer itself?); they were stopped with the sandbox before this answer"
)


def archive_limit(spec: SandboxSpec) -> int:
    """The most bytes the launcher's archive may take: the returned files, or a whole persistent workspace."""
    limits = spec.limits
    returned = limits.returned_file_bytes + 1024 * 1024
    if spec.saved_workspace is None:
        return returned
    return max(
        returned, limits.workspace_mb * 1024 * 1024 + limits.workspace_inodes * 1536
    )  # contents plus a header per entry


def persist_grace_s(spec: SandboxSpec) -> float:
    """How long past the deadline the host waits for a persistent workspace to be written out."""
    return 5.0 + spec.limits.workspace_mb / 100


def launcher_timed_out(trailer: dict[str, str] | None) -> bool:
    """Whether the launcher stopped the program at its deadline (persistent workspaces only)."""
    return _counter(trailer, "timed_out") == 1


class Drain:
    """Reads one attach stream, in a worker thread (the async side reads its state) or on the event loop."""

    def __init__(
        self,
        spec: SandboxSpec,
        boundary: bytes,
        sink: BinaryIO | None = None,
        watch: Callable[[CappedBuffer, CappedBuffer], None] | None = None,
    ) -> None:
        cap = spec.limits.output_bytes
        self.stdout = CappedBuffer(cap)
        self.stderr = CappedBuffer(cap)
        self.splitter = StdoutSplitter(boundary, self.stdout, archive_limit(spec), sink)
        self.stderr_end = StdoutSplitter(boundary, self.stderr, 0)
        """Finds the launcher's mark after the program's stderr (it may arrive after stdout's trailer)."""
        self.flood_limit = max(cap * FLOOD_FACTOR, FLOOD_MIN_BYTES)
        self.flooded = False
        self.finished = False
        if watch is not None:  # the call reads its output while it runs
            watch(self.stdout, self.stderr)

    def run(self, raw: Stream) -> None:
        """Read until the stream ends or the output turns into a flood."""
        demuxer = FrameDemuxer()
        try:
            while not self._fed(demuxer, raw.recv(65536)):
                pass
        except OSError:
            pass  # the container was removed under us: what we have is what there is
        finally:
            self._finish()

    async def run_on_loop(self, raw: LoopStream) -> None:
        """`run`, on the event loop (a stream it can await)."""
        demuxer = FrameDemuxer()
        try:
            while not self._fed(demuxer, await raw.arecv(65536)):
                pass
        except OSError:
            pass
        finally:
            self._finish()

    def _fed(self, demuxer: FrameDemuxer, chunk: bytes) -> bool:
        """Take one chunk of the stream; whether reading is over: the stream ended, the output turned into a flood,
        or the launcher is done (no need to wait for the container to stop)."""
        if not chunk:
            return True
        for stream, payload in demuxer.feed(chunk):
            if stream == STDERR:
                self.stderr_end.feed(payload)
            else:
                self.splitter.feed(payload)
        if self.stdout.total + self.stderr.total > self.flood_limit:
            self.flooded = True
            return True
        return self.splitter.trailer is not None and self.stderr_end.found

    def _finish(self) -> None:
        self.splitter.finish()
        self.stderr_end.finish()
        self.finished = True


_COUNTER = re.compile(r"[0-9]{1,10}")


def _counter(trailer: dict[str, str] | None, name: str) -> int | None:
    """A small non-negative number from the trailer, or None.

    The trailer comes from inside the sandbox, where the program could forge it (it shares
    the launcher's user): only up to ten ASCII digits are taken as a number.
    """
    value = (trailer or {}).get(name, "")
    return int(value) if _COUNTER.fullmatch(value) else None


def exit_from_trailer(trailer: dict[str, str] | None) -> tuple[int, bool] | None:
    """Exit code and OOM flag from the launcher's trailer; None when the engine must be asked.

    Where the launcher cannot read its cgroup's memory events (gVisor shows none), a program
    that exited 0 was not killed for memory: only a failed one costs the engine's round trip
    (hundreds of milliseconds under gVisor)."""
    code, oom = _counter(trailer, "exit"), _counter(trailer, "oom_kill")
    if code is None or code > 255:
        return None
    if oom is None:
        return (0, False) if code == 0 else None
    return code, oom > 0


def pids_limited(trailer: dict[str, str] | None) -> bool:
    """Whether the launcher saw the process limit refuse a fork."""
    return (_counter(trailer, "pids_max") or 0) > 0


def close_socket(raw: Stream) -> None:
    """Shut down and close a socket; never raises."""
    with contextlib.suppress(OSError):
        raw.shutdown(socket.SHUT_RDWR)
    with contextlib.suppress(OSError):
        raw.close()


def joined(buffer: CappedBuffer) -> bytes:
    """The whole stream when it fit the cap; otherwise head and tail with a marker where the middle was dropped."""
    if not buffer.truncated_bytes:
        return buffer.head() + buffer.tail()  # past half the cap, what fit is kept in both parts
    marker = f"\n[… {buffer.truncated_bytes} bytes truncated …]\n".encode()
    return buffer.head() + marker + buffer.tail()


@dataclass(slots=True)
class Ending:
    """How a call's sandbox ended, as the host saw it (the rest of its result is in the stream)."""

    exit_code: int | None = None
    """None: it was stopped (out of time, or flooding its output) before it exited."""
    oom_killed: bool = False
    timed_out: bool = False
    """The host's deadline passed (the launcher's own deadline is read from its trailer)."""
    removed: bool = False
    """Removed before the answer (the others are removed after it)."""
    unsettled: bool = False
    """Its processes still ran after its trailer."""
    usage: Usage = field(default_factory=Usage)
    outputs: tuple[tuple[OutputFile, ...], tuple[str, ...]] | None = None
    """Its output folder's files and notes, read by the host (None: they are in the launcher's archive)."""


NEAR_LIMIT_BYTES = 4 * 1024 * 1024
"""How close to its limit a sandbox's peak memory is taken to have reached it: the kernel reclaims as usage nears
the limit, and a charge that meets it may not be counted (a cgroup v1's failcnt stays 0 when reclaim came first)."""


def at_memory_limit(usage: Usage, memory_mb: int) -> bool:
    """Whether a sandbox's memory reached its limit during the call, by the kernel's counters."""
    peak = usage.peak_memory_bytes
    return usage.memory_limit_hits > 0 or (peak is not None and peak >= memory_mb * 1024 * 1024 - NEAR_LIMIT_BYTES)


def result_of(
    spec: SandboxSpec, drain: Drain, ending: Ending, container: tuple[str, str], duration_ms: int
) -> ExecutionResult:
    """A call's result from what its stream said and how its sandbox ended; `container` is its id and address."""
    persist = spec.saved_workspace is not None
    archive = drain.splitter.sink
    files, notes = ending.outputs or read_outputs(
        archive,
        spec.limits.returned_files,
        spec.limits.returned_file_bytes,
        complete=not drain.splitter.archive_overflow,
        under=OUTPUT_LEAF if persist else "",
    )
    if ending.unsettled:
        notes = (*notes, UNSETTLED_NOTE)
    written = persist and drain.splitter.trailer is not None and not drain.splitter.archive_overflow
    if persist and not written:
        archive.close()
    timed_out = ending.timed_out or launcher_timed_out(drain.splitter.trailer)
    killed = not (timed_out or ending.oom_killed or drain.flooded) and not drain.splitter.found
    return ExecutionResult(
        exit_code=ending.exit_code,
        stdout=joined(drain.stdout),
        stderr=joined(drain.stderr),
        duration_ms=duration_ms,
        timed_out=timed_out,
        oom_killed=ending.oom_killed,
        pids_limited=pids_limited(drain.splitter.trailer),
        killed=killed,
        flooded=drain.flooded,
        stdout_truncated_bytes=drain.stdout.truncated_bytes,
        stderr_truncated_bytes=drain.stderr.truncated_bytes,
        whole_output=tuple(
            (name, whole)
            for name, buffer in (("stdout", drain.stdout), ("stderr", drain.stderr))
            if (whole := buffer.whole()) is not None
        ),
        files=files,
        skipped_files=notes,
        container_id=container[0],
        address=container[1],
        cpu_s=ending.usage.cpu_s,
        peak_memory_bytes=ending.usage.peak_memory_bytes,
        at_memory_limit=at_memory_limit(ending.usage, spec.limits.memory_mb),
        workspace=archive if written else None,
    )
