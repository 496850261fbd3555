"""Calls' sandboxes made by runc itself (serve --sandboxes runc), through the real server and the official client:
the same sandbox as the engine's, its limits and outcomes told apart, its workspace, its meters, and nothing left
behind by a server killed mid-burst."""

from __future__ import annotations

import difflib
import json
import os
import re
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import anyio
import docker
import psutil
import pytest

from sandbox_server.sandbox.engine.runtime import DockerRuntime
from sandbox_server.sandbox.engine.services import remove_network
from sandbox_server.sandbox.runc import host_ids
from sandbox_server.sandbox.runc.runtime import unpack_for_runc
from sandbox_server.sandbox.runc.state import CGROUP_PARENT, STATE, is_gvisor, listed
from sandbox_server.sandbox.runc.veth import host_end
from tests.mcp_harness import answer, audit_records, command_of, connect, http_server_process, stdio_parameters

pytestmark = pytest.mark.anyio

PROBE = r"""
grep -E '^(Uid|Gid|Groups|CapInh|CapPrm|CapEff|CapBnd|CapAmb|NoNewPrivs|Seccomp):' /proc/self/status
echo "uid_map=$(cat /proc/self/uid_map | tr -s ' ') gid_map=$(cat /proc/self/gid_map | tr -s ' ')"
echo "host=$(hostname) links=$(ls /sys/class/net | tr '\n' ' ')"
touch /etc/x 2>/dev/null && echo "root=writable" || echo "root=read-only"
echo ok > /workspace/w && echo "workspace=$(cat /workspace/w)"
printf '#!/bin/sh\necho ran\n' > /tmp/s && chmod +x /tmp/s && (/tmp/s 2>/dev/null || echo "tmp=noexec")
echo "memory=$(cat /sys/fs/cgroup/memory/memory.limit_in_bytes) pids=$(cat /sys/fs/cgroup/pids/pids.max)"
echo "cpu=$(cat /sys/fs/cgroup/cpu/cpu.cfs_quota_us)/$(cat /sys/fs/cgroup/cpu/cpu.cfs_period_us)"
echo "nofile=$(ulimit -n) fsize=$(ulimit -f) core=$(ulimit -c)"
echo "pid1=$(cat /proc/1/comm) kcore=$(head -c 1 /proc/kcore 2>/dev/null | wc -c)"
echo "sysrq=$(echo x 2>/dev/null > /proc/sysrq-trigger && echo written || echo refused)"
df -k /tmp /workspace /dev/shm | awk 'NR > 1 {print "size", $6, $2}'
grep -E ' /(tmp|workspace|dev/shm) ' /proc/mounts | awk '{print "mount", $2, $4}' | sed 's/,size=[^,]*//; s/,nr_inodes=[^,]*//' | sort
cat /etc/hosts
env | sort
python3 -c "import ctypes;r=ctypes.CDLL(None,use_errno=True).syscall(425,8,ctypes.create_string_buffer(120));print('io_uring', r, ctypes.get_errno())"
"""


def _policy(tmp_path: Path, body: str = "") -> str:
    policy = tmp_path / "policy.yaml"
    policy.write_text("extends: default\nworkspace: {persist: false}\n" + body)
    return str(policy)


def _sandboxes_of(pid: int) -> set[str]:
    """The sandboxes runc runs for the server process `pid`, or whose bundle is left."""
    found: set[str] = set()
    for place in (STATE / "runc", STATE / "bundles"):
        if place.is_dir():
            found |= {p.name for p in place.iterdir() if _made_by(p.name, pid)}
    return found


def _cgroups_of(pid: int) -> set[str]:
    memory = Path("/sys/fs/cgroup/memory") / CGROUP_PARENT
    return {p.name for p in memory.iterdir() if _made_by(p.name, pid)} if memory.is_dir() else set()


def _held_by(pid: int) -> set[str]:
    """The sandboxes of the server `pid` holding a host id range."""
    return {name for name in host_ids.held_by(STATE).values() if _made_by(name, pid)}


def _views_of(pid: int) -> list[str]:
    """What is mounted in the bundles of the server `pid`'s sandboxes (their views, their namespaces)."""
    bundles = f"{STATE}/bundles/"
    return [t for t in _mounted_under(bundles) if _made_by(t.removeprefix(bundles).split("/")[0], pid)]


def _mounted_under(folder: str) -> list[str]:
    """Where something is mounted below `folder` (a path ending in /), in this process's mount table."""
    with open("/proc/self/mountinfo", encoding="utf-8") as table:
        return [target for line in table if (target := line.split()[4]).startswith(folder)]


def _first_host_id(said: str) -> int:
    """The host id a sandbox's id 0 is, read from its uid map (and its gid map the same)."""
    uid_map = re.search(r"uid_map= ?0 (\d+) 65536 gid_map= ?0 (\d+) 65536", said)
    assert uid_map is not None and uid_map[1] == uid_map[2], said
    return int(uid_map[1])


def as_the_engine_sees(said: str) -> str:
    """The probe's lines of a sandbox with host ids of its own as the engine's would read: its range's first id
    taken from the ids the kernel shows in host ids (the uid map, the options of the tmpfs mounts it made, which
    name root's only when it is not the host's)."""
    first = _first_host_id(said)
    assert first >= host_ids.BASE and (first - host_ids.BASE) % host_ids.SPAN == 0, said
    seen_inside = re.sub(r"(uid|gid)=(\d+)", lambda m: f"{m[1]}={int(m[2]) - first}", said)
    return seen_inside.replace(f"= 0 {first} 65536", "= 0 0 4294967295").replace(",uid=0,gid=0", "")


def _made_by(name: str, pid: int) -> bool:
    return name.startswith("sbx-") and name.split("-")[2:3] == [str(pid)]


async def test_the_same_probe_reads_the_same_sandbox_from_runc_and_from_a_template_as_from_the_engine(
    tmp_path: Path, runtime: DockerRuntime
) -> None:
    said: dict[str, dict[str, Any]] = {}
    for path in ("engine", "runc", "template"):
        audit = tmp_path / f"{path}.jsonl"
        serve = ("--policy", _policy(tmp_path), "--sandboxes", path, "--audit-log", str(audit))
        async with connect(stdio_parameters(*serve)) as session:
            said[path] = await answer(session, "execute_command", {"command": PROBE})
        said[path]["container"] = audit_records(audit)[-1]["container_id"]
    engine = said["engine"]
    assert " 0 0 4294967295 " in f" {engine['stdout']} "
    for path in ("runc", "template"):  # runc starting it, and forked from its image's template
        made = said[path]
        assert not made["is_error"] and made["exit_code"] == 0, (path, made["text"])
        assert made["container"].startswith("sbx-") and not engine["container"].startswith("sbx-")
        # the sandbox has host ids of its own: its ids 0-65535 are a range of the server's, which the kernel shows
        # in the uid map and, in the host's ids, in the options of the tmpfs mounts it made (which name root's only
        # when it is not the host's); the rest is the same
        seen_inside = as_the_engine_sees(made["stdout"])
        differ = list(difflib.unified_diff(engine["stdout"].splitlines(), seen_inside.splitlines(), lineterm=""))
        assert not differ, (path, "\n".join(differ))  # every line: user, capabilities, seccomp, mounts, limits, env
        facts = made["stdout"]
        for expected in (
            "NoNewPrivs:\t1", "Seccomp:\t2", "CapBnd:\t0000000000000000", "host=sandbox links=lo ", "root=read-only",
            "workspace=ok", "tmp=noexec", "pid1=docker-init kcore=0", "sysrq=refused", "io_uring -1 1",
        ):  # fmt: skip
            assert expected in facts, (path, expected, facts)


async def test_time_memory_and_exit_codes_are_told_apart_and_metered_on_runc(
    tmp_path: Path, runtime: DockerRuntime
) -> None:
    # 6 s: under a loaded host (the suite's workers side by side) the hog's climb to its cap took more than 2 s
    short = "tools:\n  execute_command:\n    limits: {timeout_s: 6, memory_mb: 96}\n"
    audit = tmp_path / "audit.jsonl"
    serve = ("--policy", _policy(tmp_path, short), "--sandboxes", "runc", "--audit-log", str(audit))
    hog = "python3 -c \"b = bytearray(); [b.extend(b'x' * 2**20) for _ in range(400)]\""
    burn = 'python3 -c "import time; t = time.process_time()\nwhile time.process_time() - t < 0.3: pass"; echo burnt'
    async with connect(stdio_parameters(*serve)) as session:
        exits = await answer(session, "execute_command", {"command": "echo out; echo err >&2; exit 3"})
        slow = await answer(session, "execute_command", {"command": "echo started; sleep 30"})
        hungry = await answer(session, "execute_command", {"command": hog})
        burnt = await answer(session, "execute_command", {"command": burn})
        files = await answer(session, "execute_command", {"command": "mkdir -p out && echo kept > out/a.txt"})
    assert (exits["exit_code"], exits["stdout"], exits["stderr"], exits["is_error"]) == (3, "out\n", "err\n", True)
    assert slow["timed_out"] and slow["stdout"] == "started\n" and "timed out" in slow["text"], slow["text"]
    assert hungry["oom_killed"] and not hungry["timed_out"] and "memory" in hungry["text"], hungry["text"]
    assert not burnt["is_error"] and burnt["stdout"] == "burnt\n", burnt["text"]
    assert burnt["usage"]["cpu_s"] >= 0.25 and burnt["usage"]["peak_memory_bytes"] > 1024 * 1024, burnt["usage"]
    assert [f["path"] for f in files["files"]] == ["a.txt"], files["text"]
    records = audit_records(audit)
    assert len(records) == 5 and all(r["container_id"].startswith("sbx-") for r in records), records
    assert "memory" not in slow["text"], slow["text"]  # a timeout at rest says nothing of memory
    # A call past its timeout whose memory met its limit says so: here the page cache of a file it wrote, which the
    # kernel reclaims at the limit (no process killed), and a timeout.
    kept = tmp_path / "kept.yaml"
    kept.write_text(Path(_policy(tmp_path, short)).read_text().replace("persist: false", "persist: true"))
    async with connect(stdio_parameters("--policy", str(kept), "--sandboxes", "runc")) as session:
        write = "for i in 1 2 3 4; do dd if=/dev/zero of=big$i bs=1M count=50 status=none; done"
        cached = {"command": f"{write} && sleep 30"}
        pressed = await answer(session, "execute_command", cached)
    assert pressed["timed_out"] and not pressed["oom_killed"], pressed["text"]
    assert "its memory having reached its limit of 96 MiB (policy field limits.memory_mb" in pressed["text"], pressed


async def test_a_mounted_workspace_and_a_warm_interpreter_work_on_runc(tmp_path: Path, runtime: DockerRuntime) -> None:
    policy = tmp_path / "policy.yaml"
    policy.write_text("extends: default\n")
    serve = ("--policy", str(policy), "--sandboxes", "runc", "--workspaces", "mounted")
    plot = "import matplotlib.pyplot as plt, pandas as pd\nplt.plot([1, 3, 2])\nsum(pd.Series([1, 2, 3]))"
    async with connect(stdio_parameters(*serve, env={"SANDBOX_STATE_DIR": str(tmp_path / "state")})) as session:
        wrote = await answer(session, "execute_command", {"command": "echo kept > notes.txt"})
        read = await answer(session, "execute_command", {"command": "cat notes.txt"})
        cell = await answer(session, "run_python", {"code": plot})
    assert not wrote["is_error"] and read["stdout"] == "kept\n", read["text"]
    assert not cell["is_error"] and cell["stdout"].strip() == "6", cell["text"]
    assert [f["path"] for f in cell["files"]] == ["figure-1.png"], cell["text"]


async def test_a_server_killed_mid_burst_leaves_no_runc_sandbox_cgroup_bundle_or_network_port(
    tmp_path: Path, runtime: DockerRuntime, internal_network: str
) -> None:
    # On an allow list (whose host is never asked for), so that each sandbox is plugged into its proxy's network.
    allow = {"allow": ["web.test"], "egress_network": internal_network, "hosts": {"web.test": "192.0.2.1"}}
    policy = _policy(tmp_path, f"tools: {{execute_command: {{network: {json.dumps(allow)}}}}}\n")
    ports: set[str] = set()

    def plugged(running: list[str]) -> None:
        ports.update(host_end(name) for name in running)
        assert ports & _host_links(), "the sandboxes' ports on the network are where the test looks for them"
        assert _held_by(pid) and _views_of(pid), "their id ranges and views are where the test looks for them"

    with http_server_process("--policy", policy, "--sandboxes", "runc") as server:
        pid = server.process.pid
        await _killed_mid_calls(
            server, ("execute_command", {"command": "sleep 60"}), 6,
            lambda: [p for p in _sandboxes_of(pid) if _running(p)], 6, 30, plugged,
        )  # fmt: skip
    assert _sandboxes_of(pid) == set() and _cgroups_of(pid) == set()
    assert not ports & _host_links()
    assert _held_by(pid) == set() and _views_of(pid) == []  # no id range held, nothing mounted
    assert not [p for p in psutil.process_iter(["cmdline"]) if any(_made_by(a, pid) for a in p.info["cmdline"] or ())]


async def _killed_mid_calls(
    server: Any,
    call: tuple[str, dict[str, Any]],
    calls: int,
    running: Callable[[], list[str]],
    count: int,
    within_s: float,
    look: Callable[[list[str]], None] = lambda running: None,
) -> None:
    """Make `calls` calls side by side, each in a session of its own; once `running()` lists `count` sandboxes
    (the calls' and the pool's; within `within_s`), `look` at them, kill the server with SIGKILL, and wait for its reaper to end."""
    import httpx2
    from mcp.client.streamable_http import streamable_http_client
    from mcp.shared.exceptions import MCPError

    server.wait_for_line("warm pool ready")
    pid = server.process.pid
    reaper = next(child for child in psutil.Process(pid).children() if "reap-after" in command_of(child))
    started = anyio.Event()

    async def one(index: int) -> None:
        async with httpx2.AsyncClient(timeout=httpx2.Timeout(30, read=60)) as http:
            async with connect(streamable_http_client(server.url, http_client=http)) as session:
                if index == 0:
                    started.set()
                await session.call_tool(*call)

    try:
        async with anyio.create_task_group() as group:
            for index in range(calls):
                group.start_soon(one, index)
            await started.wait()
            with anyio.fail_after(within_s):
                while len(found := running()) < count:
                    await anyio.sleep(0.05)
            assert _cgroups_of(pid), "the sandboxes' cgroups are where the test looks for them"
            look(found)
            server.process.send_signal(signal.SIGKILL)
            server.process.wait()
    except* (httpx2.HTTPError, anyio.BrokenResourceError, anyio.ClosedResourceError, MCPError):
        pass  # the calls end with their server
    # The reaper the server started deletes what it left, then ends.
    await anyio.to_thread.run_sync(lambda: reaper.wait(timeout=60))


def _host_links() -> set[str]:
    return set(os.listdir("/sys/class/net"))


@pytest.fixture
def internal_network() -> Iterator[str]:
    """An internal network of the test's own for an allow list's proxy to go out by (nothing on it answers)."""
    api = docker.from_env().api
    name = f"sandbox-test-runc-{os.getpid()}"
    api.create_network(name, internal=True)
    try:
        yield name
    finally:
        remove_network(api, name)
        api.close()


def _running(name: str) -> bool:
    done = subprocess.run(
        ["runc", "--root", str(STATE / "runc"), "state", name], capture_output=True, text=True, check=False
    )
    return done.returncode == 0 and json.loads(done.stdout).get("status") == "running"


def test_servers_starting_together_each_find_their_sandboxes_can_have_host_ids_of_their_own(tmp_path: Path) -> None:
    """Each server probes, as it starts, whether the kernel gives a sandbox a user namespace and idmapped mounts, in
    one folder of the host's state that the probe removes as it ends: servers starting at once (a test run's
    workers, replicas) took turns removing it under each other, and one would say no."""
    state, source = tmp_path / "state", tmp_path / "source"
    source.mkdir()
    probe = (
        "from pathlib import Path\nfrom sandbox_server.sandbox.runc import host_ids\n"
        f"print({{host_ids.unavailable(Path({str(state)!r}), Path({str(source)!r})) for _ in range(15)}})"
    )
    servers = [subprocess.Popen([sys.executable, "-c", probe], stdout=subprocess.PIPE, text=True) for _ in range(4)]
    said = [server.communicate(timeout=120)[0].strip() for server in servers]
    assert said == ["{None}"] * 4, said
    assert not (state / "ids-probe").exists() and not host_ids.held_by(state)


def test_images_are_unpacked_for_runc_ahead_and_those_no_longer_tagged_are_removed(
    tmp_path: Path, runtime: DockerRuntime
) -> None:
    """What `setup` and `images build` do after building: the first sandbox of a new image does not wait for it."""
    stale = tmp_path / "0123456789abcdef01234567"  # an image rebuilt since: its id is no tagged image's
    (stale / "rootfs").mkdir(parents=True)
    (tmp_path / f".{stale.name}.lock").touch()
    said: list[str] = []
    unpack_for_runc(runtime, ["sandbox-server/base:latest"], said.append, tmp_path)
    image_id = str(runtime.api.inspect_image("sandbox-server/base:latest")["Id"]).removeprefix("sha256:")[:24]
    assert (tmp_path / image_id / "rootfs" / "usr/local/bin/sandbox-launch").is_file()
    assert not stale.exists() and not (tmp_path / f".{stale.name}.lock").exists()
    assert said == [
        f"[sandbox-server/base:latest] unpacked for runc's sandboxes in {tmp_path}",
        "removed 1 unpacked image(s) the engine no longer has tagged",
    ]
    said.clear()
    unpack_for_runc(runtime, ["sandbox-server/base:latest"], said.append, tmp_path)
    assert said == []  # unpacked once, kept while tagged


GVISOR_PROBE = r"""
import os, resource, socket
for line in open("/proc/self/status"):
    if line.split(":")[0] in ("Uid", "Gid", "Groups", "CapInh", "CapPrm", "CapEff", "CapBnd", "CapAmb", "NoNewPrivs"):
        print(line.rstrip())
print("host", socket.gethostname(), "links", sorted(os.listdir("/sys/class/net")))
for path in ("/etc/x", "/workspace/w", "/tmp/t"):
    try:
        open(path, "w").close()
        print(path, "writable")
    except OSError as exc:
        print(path, "refused", exc.errno)
for name in ("NOFILE", "FSIZE", "CORE", "NPROC"):
    print(name, resource.getrlimit(getattr(resource, "RLIMIT_" + name)))
for line in sorted(open("/proc/mounts")):
    where, kind, options = line.split()[1:4]
    if where in ("/", "/tmp", "/workspace", "/dev/shm", "/proc", "/sys"):
        print("mount", where, kind, ",".join(o for o in options.split(",") if not o.startswith(("size=", "nr_inodes="))))
print("pid1", open("/proc/1/cmdline").read().split("\0")[0])
print(sorted(k for k in os.environ))
"""


async def test_the_same_probe_reads_the_same_gvisor_sandbox_from_runsc_as_from_the_engine(
    tmp_path: Path, runtime: DockerRuntime
) -> None:
    said: dict[str, dict[str, Any]] = {}
    hog = "b = []\nwhile True:\n    b.append(bytearray(2**24))"
    for path in ("engine", "runc"):
        audit = tmp_path / f"{path}.jsonl"
        serve = ("--policy", "strict", "--sandboxes", path, "--audit-log", str(audit))
        async with connect(stdio_parameters(*serve)) as session:
            said[path] = await answer(session, "run_python", {"code": GVISOR_PROBE})
            if path == "runc":  # and its outcomes told apart: memory, time, an exit code
                hungry = await answer(session, "run_python", {"code": hog})
                slow = await answer(session, "run_python", {"code": "while True:\n    pass", "timeout_s": 3})
                exits = await answer(session, "execute_command", {"command": "ls", "args": ["/nowhere"]})
        said[path]["containers"] = [record["container_id"] for record in audit_records(audit)]
    engine, runsc = said["engine"], said["runc"]
    assert not runsc["is_error"], runsc["text"]
    assert all(name.startswith("sbx-") for name in runsc["containers"]) and len(runsc["containers"]) == 4
    assert not engine["containers"][0].startswith("sbx-")
    differ = list(difflib.unified_diff(engine["stdout"].splitlines(), runsc["stdout"].splitlines(), lineterm=""))
    assert not differ, "\n".join(differ)  # every line: user, capabilities, links, the read-only root, limits, mounts
    assert "CapEff:\t0000000000000000" in runsc["stdout"] and "/etc/x refused" in runsc["stdout"], runsc["stdout"]
    assert hungry["oom_killed"] and not hungry["timed_out"] and "out of memory" in hungry["text"], hungry["text"]
    assert slow["timed_out"] and not slow["oom_killed"] and "timed out" in slow["text"], slow["text"]
    assert exits["exit_code"] == 2 and exits["is_error"] and "/nowhere" in exits["stderr"], exits["text"]


async def test_a_server_killed_with_gvisor_sandboxes_running_leaves_none_nor_their_cgroups(
    tmp_path: Path, runtime: DockerRuntime
) -> None:
    with http_server_process("--policy", "strict", "--sandboxes", "runc") as server:
        pid = server.process.pid
        # strict's two concurrent calls take its two warm sandboxes, and the pool makes two more beside them
        sleeping = ("run_python", {"code": "import time\ntime.sleep(60)", "timeout_s": 20})
        await _killed_mid_calls(
            server, sleeping, 2, lambda: [name for name in _sandboxes_of(pid) if is_gvisor(STATE, name)], 4, 60
        )
    assert _sandboxes_of(pid) == set() and _cgroups_of(pid) == set()
    assert not [n for n in listed(STATE) if _made_by(n, pid)]  # runsc's own state of them too
    assert not [p for p in psutil.process_iter(["cmdline"]) if any(_made_by(a, pid) for a in p.info["cmdline"] or ())]


async def test_a_relative_state_folder_is_made_absolute_at_start_and_calls_run_in_it(
    tmp_path: Path, runtime: DockerRuntime
) -> None:
    """`serve --state-dir state` broke every call on runc's path (its bundles named a folder relative to another
    working folder), and the answer handed the caller host paths."""
    policy = tmp_path / "keeping.yaml"
    policy.write_text("extends: default\nworkspace: {persist: true, size_mb: 64, idle_ttl_s: 600}\n")
    parameters = stdio_parameters("--policy", str(policy), "--state-dir", "state", "--sandboxes", "runc")
    parameters.cwd = tmp_path
    async with connect(parameters) as session:
        said = await answer(session, "execute_command", {"command": "echo kept > note.txt && cat note.txt"})
        again = await answer(session, "execute_command", {"command": "cat note.txt", "workspace": said["workspace"]})
    assert not said["is_error"] and said["stdout"] == "kept\n", said["text"]
    assert again["stdout"] == "kept\n", again["text"]
    assert str(tmp_path) not in json.dumps([said, again])
    assert (tmp_path / "state").is_dir()


HOLDER = r"""
import ctypes, os, time
libc = ctypes.CDLL(None, use_errno=True)
class Attr(ctypes.Structure):
    _fields_ = [("flags", ctypes.c_long), ("maxmsg", ctypes.c_long), ("msgsize", ctypes.c_long), ("cur", ctypes.c_long), ("pad", ctypes.c_long * 4)]
instances = 0
while libc.inotify_init() >= 0:
    instances += 1
stopped = os.strerror(ctypes.get_errno())
queues = 0
while libc.mq_open(f"/held-{queues}".encode(), os.O_CREAT | os.O_RDWR, 0o600, ctypes.byref(Attr(0, 10, 8192, 0))) >= 0:
    queues += 1
print(f"inotify={instances} ({stopped}) queues={queues} ({os.strerror(ctypes.get_errno())})", flush=True)
open("/workspace/held", "w").close()
deadline = time.monotonic() + 30
while not os.path.exists("/workspace/tried") and time.monotonic() < deadline:
    time.sleep(0.01)
"""
TRIER = r"""
import ctypes, os, time
libc = ctypes.CDLL(None, use_errno=True)
class Attr(ctypes.Structure):
    _fields_ = [("flags", ctypes.c_long), ("maxmsg", ctypes.c_long), ("msgsize", ctypes.c_long), ("cur", ctypes.c_long), ("pad", ctypes.c_long * 4)]
deadline = time.monotonic() + 30
while not os.path.exists("/workspace/held") and time.monotonic() < deadline:
    time.sleep(0.01)
watch = libc.inotify_init()
watch_error = os.strerror(ctypes.get_errno())
queue = libc.mq_open(b"/mine", os.O_CREAT | os.O_RDWR, 0o600, ctypes.byref(Attr(0, 10, 8192, 0)))
print(f"inotify={'made' if watch >= 0 else watch_error} queue={'made' if queue >= 0 else os.strerror(ctypes.get_errno())}")
open("/workspace/tried", "w").close()
"""


async def test_a_sandbox_holding_every_per_user_limit_leaves_another_sandbox_its_own(
    tmp_path: Path, runtime: DockerRuntime
) -> None:
    # The kernel counts inotify instances and message queue bytes per host user: one sandbox takes all it may, and
    # another, running beside it in the same workspace, still gets its own (each is a range of host ids of its own).
    policy = _policy(tmp_path, "workspace: {persist: true}\ntools:\n  execute_command:\n    limits: {timeout_s: 60}\n")
    said: dict[str, dict[str, Any]] = {}
    async with connect(stdio_parameters("--policy", policy, "--sandboxes", "runc")) as session:

        async def run(role: str, program: str) -> None:
            said[role] = await answer(session, "execute_command", {"command": f"python3 - <<'EOF'\n{program}\nEOF"})

        async with anyio.create_task_group() as group:
            group.start_soon(run, "holder", HOLDER)
            group.start_soon(run, "trier", TRIER)
    holder, trier = said["holder"], said["trier"]
    assert not holder["is_error"] and not trier["is_error"], (holder["text"], trier["text"])
    held = re.fullmatch(r"inotify=(\d+) \((.*)\) queues=(\d+) \((.*)\)\n", holder["stdout"])
    assert held is not None, holder["stdout"]
    assert int(held[1]) == int(Path("/proc/sys/fs/inotify/max_user_instances").read_text()), held[0]
    assert held[2] == held[4] == "Too many open files" and int(held[3]) > 0, held[0]  # both limits reached
    assert trier["stdout"] == "inotify=made queue=made\n", trier["stdout"]


def test_a_cgroup_a_killed_server_made_before_its_sandboxs_bundle_is_swept_with_its_process(
    runtime: DockerRuntime,
) -> None:
    """A server killed between making a sandbox's cgroups and writing its bundle leaves cgroups no bundle names
    (seen once under a loaded burst): the next start's sweep finds them by the server's name in theirs."""
    import socket

    from sandbox_server.sandbox.runc.state import delete_left_by, sandbox_name
    from sandbox_server.sandbox.template.cgroups import HIERARCHIES, ROOT

    owner = f"{socket.gethostname()}:999999:1"  # a server that is gone
    name = sandbox_name(owner)
    folders = [ROOT / hierarchy / CGROUP_PARENT / name for hierarchy in HIERARCHIES]
    stray = subprocess.Popen(["sleep", "300"])
    try:
        for folder in folders:
            folder.mkdir(parents=True)
        (folders[0] / "cgroup.procs").write_text(str(stray.pid))
        assert delete_left_by(owner, STATE) == 0  # no bundle of its own
        assert stray.wait(timeout=10) == -signal.SIGKILL
        assert not [folder for folder in folders if folder.exists()]
    finally:
        stray.kill()
        stray.wait()
        for folder in folders:
            if folder.exists():
                folder.rmdir()
