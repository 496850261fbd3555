"""How a warm cell's end is told: the first exit code said is the one the launcher reads (the cell's own, said as
it exits, or its parent's as it reaps it), each once, and nothing else the cell writes on that pipe; and when the
host holds a sandbox's process settled (each of its threads stopped, exiting or gone). The same on the real
template: tests/test_template_sandboxes.py."""

from __future__ import annotations

import importlib.util
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from types import ModuleType, SimpleNamespace

import pytest

from sandbox_server import shipped
from sandbox_server.sandbox import wire
from sandbox_server.sandbox.warm_container import WarmContainer, settled


@pytest.fixture(scope="module")
def warm_python() -> ModuleType:
    """The image's warm interpreter module, loaded here with the host's copy of the wire it imports."""
    sys.modules.setdefault("sandbox_wire", wire)
    spec = importlib.util.spec_from_file_location("warm_python", shipped.images_dir() / "python-data/warm_python.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def done() -> Iterator[tuple[int, int]]:
    """A pipe standing for the launcher's FIFO: (what is said on it, its read end)."""
    read, write = os.pipe2(os.O_NONBLOCK)
    yield write, read
    os.close(read)
    os.close(write)


def _said(read: int) -> list[str]:
    try:
        return os.read(read, 4096).decode().splitlines()
    except BlockingIOError:
        return []


def test_the_first_exit_said_is_the_one_the_launcher_reads(warm_python: ModuleType, done: tuple[int, int]) -> None:
    told = warm_python._Told(done[0])
    assert told.heard(b"pid 12\npid 13\nex")  # (a line split between two reads)
    assert told.heard(b"it 3\n")
    told.exited(b"137")  # its parent's reap, after the cell said its own end
    assert not told.heard(b"")
    assert _said(done[1]) == ["12", "3"]


def test_what_the_cell_writes_on_its_exits_pipe_is_not_an_exit(warm_python: ModuleType, done: tuple[int, int]) -> None:
    told = warm_python._Told(done[0])
    told.started(b"7")
    told.heard(b"exit 256\nexit -1\nexit x\nexit\n" + b"y" * 10_000)
    assert told.said == b"", "a line no one says is not kept"
    told.heard(b"\nexit 9\n")
    assert _said(done[1]) == ["7", "9"]


def test_a_program_that_was_not_made_is_an_empty_line_once(warm_python: ModuleType, done: tuple[int, int]) -> None:
    told = warm_python._Told(done[0])
    assert not told.heard(b"")
    told.exited(b"125")
    assert _said(done[1]) == [""]
    ended = warm_python._Told(done[0])
    ended.exited(b"125")  # (its end said before any pid: the same)
    ended.started(b"8")
    assert _said(done[1]) == [""]


def _wait_for(check: object, within_s: float = 10.0) -> None:
    deadline = time.monotonic() + within_s
    while not check():  # type: ignore[operator]
        assert time.monotonic() < deadline, "never happened"
        time.sleep(0.01)


def _state(pid: int) -> str:
    with open(f"/proc/{pid}/stat", "rb") as stat:
        return stat.read().rsplit(b")", 1)[1].split()[0].decode()


def test_a_process_is_settled_when_each_of_its_threads_can_do_nothing_more() -> None:
    running = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    # Its first thread ended (the process's state is a zombie's), another still runs
    leader_gone = subprocess.Popen([
        sys.executable, "-c",
        "import ctypes, threading, time\n"
        "threading.Thread(target=time.sleep, args=(60,)).start()\n"
        "ctypes.CDLL(None).pthread_exit(None)",
    ])  # fmt: skip
    try:
        _wait_for(lambda: _state(leader_gone.pid) == "Z" and len(os.listdir(f"/proc/{leader_gone.pid}/task")) == 2)
        assert not settled(running.pid)
        assert not settled(leader_gone.pid)
        running.send_signal(signal.SIGSTOP)
        _wait_for(lambda: _state(running.pid) == "T")
        assert settled(running.pid)
    finally:
        for process in (running, leader_gone):
            process.kill()
            process.wait()
    assert settled(running.pid), "a process gone is settled"


@pytest.mark.anyio
async def test_a_sandbox_whose_end_a_descriptor_tells_is_settled_once_it_is_readable_and_not_before(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A warm template's sandbox that preloads nothing is settled when its first process has ended (its pidfd
    readable: the kernel has ended every other process of its pid namespace by then), awaited on the event loop,
    without a look at /proc; one whose first process runs on past SETTLE_S is not, and is removed."""
    import anyio

    from sandbox_server.sandbox.engine import runtime

    monkeypatch.setattr(runtime, "SETTLE_S", 0.3)
    looked: list[int] = []

    def look(pid: int) -> list[int]:
        looked.append(pid)
        return [pid, pid]

    monkeypatch.setattr(runtime, "sandbox_processes", look)
    spec = SimpleNamespace(runtime="runc", mounted_workspace=None, networked=False)
    for ends_at in (0.1, None):
        process = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
        pidfd = os.pidfd_open(process.pid)
        warm = WarmContainer("sbx-a", None, ("key",), 0.0, pid=process.pid, ends=pidfd)  # type: ignore[arg-type]
        try:
            async with anyio.create_task_group() as group:
                if ends_at is not None:
                    group.start_soon(_kill_after, process, ends_at)
                started = time.monotonic()
                settled_ = await runtime._settle(warm, spec, lambda *_: True)  # type: ignore[arg-type]
            took = time.monotonic() - started
        finally:
            os.close(pidfd)
            process.kill()
            process.wait()
        assert settled_ == (ends_at is not None), ends_at
        assert (took < 0.3) if ends_at is not None else (took >= 0.3), took
    assert not looked, "a sandbox whose end is told was looked at in /proc"


async def _kill_after(process: subprocess.Popen[bytes], seconds: float) -> None:
    import anyio

    await anyio.sleep(seconds)
    process.kill()
