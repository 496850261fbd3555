"""The pipes of a sandbox runc runs, read as the engine's attach stream; the choice of who makes a sandbox."""

from __future__ import annotations

import json
import os
import socket
import threading
import time
from pathlib import Path

import pytest

from sandbox_server.sandbox.runc import runtime as runc_runtime
from sandbox_server.sandbox.runc import state as runc_state
from sandbox_server.sandbox.runc.oci import merged_env
from sandbox_server.sandbox.runc.pipes import PipeStream
from sandbox_server.sandbox.runc.runtime import RuncRuntime
from sandbox_server.sandbox.spec import SandboxSpec
from sandbox_server.sandbox.streams import STDERR, STDOUT, FrameDemuxer


def _frames(stream: PipeStream) -> list[tuple[int, bytes]]:
    demuxer, frames = FrameDemuxer(), []
    while chunk := stream.recv(65536):
        frames += demuxer.feed(chunk)
    return frames


def test_each_output_is_framed_apart_and_a_forged_header_is_only_payload() -> None:
    stream = PipeStream()
    assert stream.sandbox_ends is not None
    stdin, stdout, stderr = stream.sandbox_ends
    forged = b"\x02\x00\x00\x00\xff\xff\xff\xff"  # a header claiming 4 GiB of stderr, written to stdout
    os.write(stdout, forged + b"out")
    os.write(stderr, b"err")
    stream.sendall(b"request")
    stream.shutdown(socket.SHUT_WR)
    assert os.read(stdin, 100) == b"request" and os.read(stdin, 100) == b""  # its stdin ended
    stream.handed_over()  # the sandbox's ends are closed here; the test writes no more
    frames = _frames(stream)
    assert b"".join(p for s, p in frames if s == STDOUT) == forged + b"out"
    assert b"".join(p for s, p in frames if s == STDERR) == b"err"
    stream.close()


def test_a_waiting_sandbox_says_nothing_until_it_writes_or_ends() -> None:
    stream = PipeStream()
    assert stream.sandbox_ends is not None
    _, stdout, _ = stream.sandbox_ends
    assert not stream.said_anything()
    os.write(stdout, b"x")
    assert stream.said_anything()
    stream.close()
    assert stream.said_anything()


def test_closing_wakes_a_reader_waiting_in_another_thread() -> None:
    stream = PipeStream()
    failed: list[BaseException] = []

    def read() -> None:
        try:
            stream.recv(65536)
        except OSError as exc:
            failed.append(exc)

    reader = threading.Thread(target=read)
    reader.start()
    stream.close()
    reader.join(timeout=10)
    assert not reader.is_alive() and failed, "the waiting read ends with an error once the stream is closed"
    with pytest.raises(OSError):
        stream.recv(1)


@pytest.mark.anyio
async def test_the_event_loop_sends_a_request_and_reads_both_outputs_without_a_thread() -> None:
    """A call's small request and its answer go through the event loop: a request past the pipe's capacity is
    written as the sandbox reads it while the loop runs on, both outputs come framed apart, and both ended is the
    end; a close from another thread wakes a read the loop awaits."""
    import anyio

    stream = PipeStream()
    assert stream.sandbox_ends is not None
    stdin, stdout, stderr = stream.sandbox_ends
    request = os.urandom(300_000)  # (past a pipe's 64 KiB: the loop must await the sandbox's reads)
    received = bytearray()

    def sandbox() -> None:
        while chunk := os.read(stdin, 65536):
            received.extend(chunk)
        os.write(stdout, b"out")
        os.write(stderr, b"err")
        for fd in (stdout, stderr):
            os.close(fd)

    threads_before = threading.active_count()
    with anyio.fail_after(10):
        async with anyio.create_task_group() as group:
            group.start_soon(anyio.to_thread.run_sync, sandbox)
            await stream.asend(request)
            stream.shutdown(socket.SHUT_WR)
            demuxer, frames = FrameDemuxer(), []
            while chunk := await stream.arecv(65536):
                frames += demuxer.feed(chunk)
    assert bytes(received) == request
    assert b"".join(p for s, p in frames if s == STDOUT) == b"out"
    assert b"".join(p for s, p in frames if s == STDERR) == b"err"
    stream.close()
    assert threading.active_count() <= threads_before + 1  # (the test's own sandbox thread, idle in anyio's pool)

    waiting = PipeStream()

    def close_soon() -> None:
        time.sleep(0.1)  # (while the loop awaits the read)
        waiting.close()

    with anyio.fail_after(10):
        async with anyio.create_task_group() as group:
            group.start_soon(anyio.to_thread.run_sync, close_soon)
            with pytest.raises(OSError):
                await waiting.arecv(65536)
    with pytest.raises(OSError):
        await waiting.arecv(1)


def test_the_environment_is_the_images_with_the_policys_over_it() -> None:
    image = ["PATH=/usr/bin:/bin", "LANG=C.UTF-8", "HOME=/workspace"]
    assert merged_env(image, [("LANG", "fr_FR.UTF-8"), ("X", "a=b")]) == [
        "PATH=/usr/bin:/bin", "LANG=fr_FR.UTF-8", "HOME=/workspace", "X=a=b", "HOSTNAME=sandbox",
    ]  # fmt: skip
    assert merged_env([], [])[0].startswith("PATH=/usr/local/sbin:")


@pytest.mark.parametrize(
    ("spec", "by_runc"),
    [
        (SandboxSpec(image="i", argv=("true",)), True),
        (SandboxSpec(image="i", argv=("true",), runtime="runsc"), True),  # by runsc itself
        (SandboxSpec(image="i", argv=("true",), runtime="runsc", network="egress-net"), False),
        (SandboxSpec(image="i", argv=("true",), network="egress-net"), True),  # if the network leaves it addresses
        (SandboxSpec(image="i", argv=("true",), service_network="services"), True),  # beside services
        (SandboxSpec(image="i", argv=("true",), network="egress-net", service_network="services"), True),
        (SandboxSpec(image="i", argv=("true",), runtime="runsc", service_network="services"), False),
    ],
)
def test_runc_makes_the_sandboxes_of_runc_policies_and_runsc_those_of_gvisor_without_a_network(
    spec: SandboxSpec, by_runc: bool, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    runc, engine = RuncRuntime(None, "auto", state=tmp_path), RuncRuntime(None, "engine", state=tmp_path)
    runc._chosen = ""  # this host lets runc make sandboxes (asked of the engine otherwise)
    monkeypatch.setattr(runc_runtime, "runsc_path", lambda: "/usr/bin/runsc")
    assert runc.takes(spec) is by_runc
    assert engine.takes(spec) is False and engine.runc_refused() == "as asked"
    monkeypatch.setattr(runc_runtime, "runsc_path", lambda: None)  # gVisor's stay the engine's without runsc
    assert runc.takes(spec) is (by_runc and spec.runtime == "runc")


def test_runc_is_not_used_where_the_server_is_not_root(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    assert runc_runtime.runc_usable() == "the server does not run as root"


def test_a_sandboxs_name_says_which_server_made_it() -> None:
    owner = f"{socket.gethostname()}:4242:1795848710"
    names = {runc_state.sandbox_name(owner) for _ in range(20)}
    assert all(runc_state.owner_of(name) == owner for name in names)
    assert len({name[:12] for name in names}) == 20  # ids are shown short: the short ones differ
    assert runc_state.is_runc("sbx-4242-1-a") and not runc_state.is_runc("3f2a" * 16)


def test_the_cgroup_paths_of_runcs_state_are_read_without_decoding_its_config() -> None:
    paths = {"": "/sys/fs/cgroup/unified/s/sbx-1", "memory": "/sys/fs/cgroup/memory/s/sbx-1"}
    config = {"labels": ['sandbox.owner="cgroup_paths": {}'], "env": ['X={"cgroup_paths": 1}'], "n": [1] * 9}
    for separators in ((",", ":"), (", ", ": ")):  # as runc writes it, and spaced
        state = json.dumps(
            {"id": "sbx-1", "config": config, "cgroup_paths": paths, "rootless": False}, separators=separators
        )
        assert runc_state.cgroup_paths(state) == json.loads(state)["cgroup_paths"] == paths
    for broken in ('{"id": "sbx-1"}', '{"cgroup_paths": [1]}', '{"cgroup_paths": {"memory": '):
        with pytest.raises(ValueError):
            runc_state.cgroup_paths(broken)


def test_a_stopped_sandbox_is_deleted_without_runc_unless_a_cgroup_still_holds_a_process(tmp_path: Path) -> None:
    """runc deletes a stopped sandbox by removing its cgroups, then its state; a cgroup that cannot be removed (a
    process still in it) leaves everything to runc's forced delete."""
    empty, held = tmp_path / "memory" / "sbx", tmp_path / "pids" / "sbx"
    empty.mkdir(parents=True)
    held.mkdir(parents=True)
    (held / "cgroup.procs").write_text("1234\n")  # a folder that rmdir refuses, as the kernel refuses a busy cgroup
    state = tmp_path / "runc" / "sbx"
    state.mkdir(parents=True)
    (state / "state.json").write_text(json.dumps({"cgroup_paths": {"memory": str(empty), "pids": str(held)}}))
    assert runc_state._delete_stopped(state) is False
    assert state.exists(), "runc's forced delete needs its state"
    (held / "cgroup.procs").unlink()
    assert runc_state._delete_stopped(state) is True
    assert not empty.exists() and not held.exists() and not state.exists()
    assert runc_state._delete_stopped(state) is True  # deleted already: nothing to do
