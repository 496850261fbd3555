"""Battery case 33: 200 concurrent calls over Streamable HTTP against the default policy.

Never more containers than the policy allows (`rate.concurrent_calls` running calls plus
the warm pools' sizes), the rest answered at once with "busy", nothing leaked, the
server's memory bounded. Live containers are counted from the engine's own create and
destroy events for this server's containers, so a short-lived excess cannot slip
between two samples.
"""

from __future__ import annotations

import os
import select
import struct
import threading
import time
from pathlib import Path

import anyio
import docker
import psutil
import pytest

from sandbox_server.policy.loader import load_policy
from sandbox_server.sandbox.engine.removal import OWNER_LABEL
from sandbox_server.sandbox.engine.runtime import DockerRuntime
from sandbox_server.sandbox.runc.state import IN_CREATE, IN_DELETE, STATE, inotify_watch, is_runc, owner_of
from sandbox_server.sandbox.spec import SANDBOX_LABEL
from tests.conftest import containers_of, interpreters_warm
from tests.mcp_harness import connect, http_server_process, text_of

pytestmark = [pytest.mark.anyio, pytest.mark.alone]

CALLS = 200
TOOL_NAMES = ("analyze_csv", "execute_command", "files", "run_python")


class LiveContainers:
    """The most sandboxes of one server alive at once: the engine's from its event stream, runc's from inotify on
    runc's bundles (a bundle is made with its sandbox and removed with it)."""

    def __init__(self, pid: int) -> None:
        self._api = docker.from_env().api
        self._owner = f":{pid}:"
        self.live = len(containers_of(pid))
        self.most = self.live
        self._lock = threading.Lock()
        self._events = self._api.events(
            decode=True, filters={"type": "container", "label": SANDBOX_LABEL, "event": ["create", "destroy"]}
        )
        (STATE / "bundles").mkdir(parents=True, exist_ok=True)
        self._watch = inotify_watch(STATE / "bundles", IN_CREATE | IN_DELETE)
        self._stop, self._stopping = os.pipe()
        self._readers = [threading.Thread(target=read, daemon=True) for read in (self._read, self._read_bundles)]
        for reader in self._readers:
            reader.start()

    def _count(self, more: int) -> None:
        with self._lock:
            self.live += more
            self.most = max(self.most, self.live)

    def _read(self) -> None:
        for event in self._events:
            if self._owner in event.get("Actor", {}).get("Attributes", {}).get(OWNER_LABEL, ""):
                self._count(1 if event["Action"] == "create" else -1)

    def _read_bundles(self) -> None:
        while self._stop not in select.select([self._watch, self._stop], [], [])[0]:
            events = os.read(self._watch, 65536)
            at = 0
            while at < len(events):
                _, mask, _, size = struct.unpack_from("iIII", events, at)
                name = events[at + 16 : at + 16 + size].rstrip(b"\0").decode()
                at += 16 + size
                if is_runc(name) and self._owner in owner_of(name):
                    self._count(1 if mask & IN_CREATE else -1)

    def close(self) -> None:
        self._events.close()
        self._api.close()
        os.write(self._stopping, b".")
        self._readers[1].join()
        for fd in (self._watch, self._stop, self._stopping):
            os.close(fd)


async def test_33_a_flood_of_calls_is_bounded_answered_busy_and_leaves_nothing(
    tmp_path: Path, runtime: DockerRuntime
) -> None:
    policy = load_policy("default", TOOL_NAMES)
    tools = [policy.for_tool(name) for name in TOOL_NAMES]
    # Each pool may have grown under the flood, to its ceiling.
    ceiling: dict[tuple[object, ...], int] = {}
    for tool in tools:  # tools of equal container settings share a pool: the deeper one's
        key = tool.container_spec().container_key()
        ceiling[key] = max(ceiling.get(key, 0), tool.pool_most if tool.enabled else 0)
    allowed = policy.rate.concurrent_calls + sum(ceiling.values())
    no_queue = (
        tmp_path / "no-queue.yaml"
    )  # the calls past the cap are refused at once (queued ones: tests/fast/test_guards.py)
    no_queue.write_text("extends: default\nname: default\nrate: {queue_wait_s: 0}\n")
    with http_server_process("--policy", str(no_queue)) as server:
        server.wait_for_line("warm pool ready: 2 container(s) of sandbox-server/python-data")
        await interpreters_warm(server.process.pid)  # their imports are not part of what this case measures
        process = psutil.Process(server.process.pid)
        rss_before = process.memory_info().rss
        watch = LiveContainers(server.process.pid)
        answers: list[tuple[float, bool, str]] = []
        try:
            async with connect(server.url) as session:

                async def call(index: int) -> None:
                    started = time.monotonic()
                    result = await session.call_tool("execute_command", {"command": f"sleep 4; echo {index}"})
                    answers.append((time.monotonic() - started, result.is_error, text_of(result)))

                async with anyio.create_task_group() as group:
                    for index in range(CALLS):
                        group.start_soon(call, index)
            rss_after = process.memory_info().rss
        finally:
            watch.close()
        ran = [text for _, is_error, text in answers if not is_error]
        busy = [(elapsed, text) for elapsed, is_error, text in answers if is_error]
        assert len(answers) == CALLS
        assert 1 <= len(ran) <= policy.rate.concurrent_calls, ran
        assert all(text.startswith("busy:") for _, text in busy), {text for _, text in busy}
        assert "policy 'default'" in busy[0][1] and "rate.concurrent_calls" in busy[0][1], busy[0][1]
        # Not queued: every busy answer came before the first admitted call (4 s of sleep) ended and freed a slot.
        first_done = min(elapsed for elapsed, is_error, _ in answers if not is_error)
        assert max(elapsed for elapsed, _ in busy) < first_done, "busy must be answered at once, not queued"
        assert watch.most <= allowed, f"{watch.most} containers alive at once; the policy allows {allowed}"
        assert rss_after - rss_before < 100 * 2**20, (rss_before, rss_after)
        with anyio.fail_after(15):
            while len(containers_of(server.process.pid)) > sum(ceiling.values()):
                await anyio.sleep(0.1)  # the finished calls' containers are being removed
