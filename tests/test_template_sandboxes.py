"""Sandboxes forked from a template (serve --sandboxes template), through the real server and the official
client: nothing of one call reaching another (during it or after it), the template out of the calls' reach, and
nothing left behind by a server killed mid-burst (tests/test_runc_sandboxes.py reads the same probe from one as
from the engine's and runc's)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import anyio
import psutil
import pytest

from sandbox_server.sandbox.engine.runtime import DockerRuntime
from sandbox_server.sandbox.runc import host_ids
from sandbox_server.sandbox.runc.state import STATE
from sandbox_server.sandbox.template import userns
from tests.mcp_harness import ServerProcess, answer, command_of, connect, http_server_process
from tests.test_runc_sandboxes import (
    _cgroups_of,
    _held_by,
    _killed_mid_calls,
    _made_by,
    _mounted_under,
    _policy,
    _sandboxes_of,
    _views_of,
)

pytestmark = pytest.mark.anyio

SECRET = "s3cr3t-of-call-a"
HOLD = f"""
export CALL_A_SECRET={SECRET}
echo {SECRET} > /tmp/secret && echo {SECRET} > /dev/shm/secret
python3 -c "
import socket, time
tcp = socket.socket(); tcp.bind(('127.0.0.1', 47111)); tcp.listen()
unix = socket.socket(socket.AF_UNIX); unix.bind('\\0{SECRET}'); unix.listen()
secret = '{SECRET}'
time.sleep(60)
" {SECRET} &
sleep 60
"""
"""Call A: its secret in an environment variable, in files of its /tmp and /dev/shm, in a variable and the argv of a
process it leaves running, and listening on a TCP port and an abstract socket of its own."""
LOOK = f"""
printf '%s%s' '{SECRET[:8]}' '{SECRET[8:]}' > /workspace/needle
echo "processes: $(ls -d /proc/[0-9]* | wc -l)"
echo "found: $(grep -lsF -f /workspace/needle /proc/[0-9]*/cmdline /proc/[0-9]*/environ /tmp/* /dev/shm/* | wc -l)"
echo "env: $(env | grep -cF -f /workspace/needle)"
python3 -c "
import socket
secret = open('/workspace/needle').read()
for family, address in ((socket.AF_INET, ('127.0.0.1', 47111)), (socket.AF_UNIX, '\\0' + secret)):
    try:
        socket.socket(family).connect(address)
        print('reached', address)
    except OSError as exc:
        print('refused', exc.errno)
"
"""
"""Call B (and C, after A): looks for A everywhere it could be (the secret it looks for is never in its own command
line: it would find itself)."""
FDS = "python3 -c \"import os; print(*(sorted(os.listdir(f'/proc/{p}/fd')) for p in (1, 'self')))\""
"""The descriptors the sandbox's first process and a program of the call hold (the listing's own is the latter's 3)."""


def _templates_of(pid: int, below: int = 1) -> list[psutil.Process]:
    """The server's template processes (each its image's own python3, started once); or those `below` levels
    below the process `pid`."""
    found = []
    level = [psutil.Process(pid)]
    for _ in range(below - 1):
        level = [child for process in level for child in _children(process)]
    for child in (child for process in level for child in _children(process)):
        with contextlib.suppress(psutil.Error):  # (one that ended meanwhile)
            if "sandbox_template" in " ".join(child.cmdline()):
                found.append(child)
    return found


def _children(process: psutil.Process) -> list[psutil.Process]:
    """Its children; none when it ended meanwhile (a sandbox's first process, as its call ends)."""
    try:
        return process.children()
    except psutil.Error:
        return []


def _ns_pids(process: psutil.Process) -> list[int]:
    """The process's pid in each pid namespace it is in, the host's first."""
    with open(f"/proc/{process.pid}/status") as status:
        return next([int(p) for p in line.split()[1:]] for line in status if line.startswith("NSpid:"))


def _status(pid: int, field: str) -> str:
    with open(f"/proc/{pid}/status") as status:
        return next(line.split(":", 1)[1].strip() for line in status if line.startswith(f"{field}:"))


def _anon_huge_kib(pid: int) -> int:
    """How much of a process's anonymous memory is in huge pages, in KiB."""
    with open(f"/proc/{pid}/smaps_rollup") as rollup:
        return next(int(line.split()[1]) for line in rollup if line.startswith("AnonHugePages:"))


def _every_process_of(templates: list[psutil.Process]) -> Iterator[psutil.Process]:
    for template in templates:
        yield template
        with contextlib.suppress(psutil.Error):
            yield from template.children(recursive=True)


async def test_nothing_of_one_call_reaches_another_and_the_template_is_out_of_reach(
    tmp_path: Path, runtime: DockerRuntime
) -> None:
    import httpx2
    from mcp.client.streamable_http import streamable_http_client

    policy = _policy(tmp_path, "defaults:\n  limits: {timeout_s: 90, max_timeout_s: 90}\n")
    with http_server_process("--policy", policy, "--sandboxes", "template") as server:
        server.wait_for_line("warm pool ready")
        async with contextlib.AsyncExitStack() as stack:
            http = await stack.enter_async_context(httpx2.AsyncClient(timeout=120))
            a, b = [await stack.enter_async_context(connect(streamable_http_client(server.url, http_client=http)))
                    for _ in range(2)]  # fmt: skip
            held: dict[str, dict[str, object]] = {}
            async with anyio.create_task_group() as group:

                async def call_a() -> None:
                    held["a"] = await answer(a, "execute_command", {"command": HOLD, "timeout_s": 8})

                group.start_soon(call_a)
                with anyio.fail_after(60):  # A's process holding the secret runs
                    while not _holding_the_secret():
                        await anyio.sleep(0.05)
                templates = _templates_of(server.process.pid)
                assert templates, "the template is where the test looks for it"
                during = await answer(b, "execute_command", {"command": LOOK})
            assert not _holding_the_secret(), "A's leftover process ended with its call"
            after = await answer(b, "execute_command", {"command": LOOK})
            for seen in (during, after):
                out = str(seen["stdout"])
                assert "found: 0" in out and "env: 0" in out, out
                assert "reached" not in out and out.count("refused") == 2, out
                assert int(out.split("processes: ")[1].split()[0]) <= 6, out  # its own few: no other call's
            # a call that kills every process it may signal reaches none of the template's, nor the server
            await answer(b, "execute_command", {"command": "kill -9 -1; sleep 1"})
            assert all(t.is_running() for t in templates)
            served = await answer(b, "execute_command", {"command": "echo served"})
            assert served["stdout"] == "served\n", served["text"]
            # nothing the template handed its child reaches the sandbox: the pipe its end is told on least of all
            # (a program that wrote there could tell the server its sandbox had ended, or fill the server's memory)
            held_fds = await answer(b, "execute_command", {"command": FDS})
            assert held_fds["stdout"] == "['0', '1', '2'] ['0', '1', '2', '3']\n", held_fds["text"]
        assert {t.pid for t in _templates_of(server.process.pid)} >= {t.pid for t in templates}


WARM_A = f"""
import os, random, sys, numpy, pandas
pandas.SECRET = '{SECRET}'
os.environ['CALL_A_SECRET'] = '{SECRET}'
open('/tmp/secret', 'w').write('{SECRET}')
secret = '{SECRET}'
print(random.random(), float(numpy.random.rand()))
sys.stdout.flush()
if os.environ.get('HOLD_S'):  # a process that shows the secret to the host: A is running
    import subprocess
    subprocess.run(['sh', '-c', 'sleep ' + os.environ['HOLD_S'], secret])
"""
"""A warm cell (forked from the python-data template): its secret in a module the template imported, in its
environment, in a file of its /tmp and in a variable; and the first numbers of the generators the template seeded."""
WARM_LOOK = """
import os, random, numpy, pandas
def status(pid):
    return {k: v.strip() for k, _, v in (l.partition(':') for l in open(f'/proc/{pid}/status'))}
def kind(fd):
    try:
        return os.readlink(f'/proc/self/fd/{fd}').split(':')[0]
    except OSError:
        return 'the listing'
mine = status('self')
needle = 's3cr3t' + '-of-call-a'
seen = [open(f'/proc/{p}/cmdline', 'rb').read().replace(b'\\0', b' ').decode() for p in os.listdir('/proc') if p.isdigit()]
found = sum(needle in text for text in seen) + sum(needle in open(f).read() for f in ('/tmp/secret',) if os.path.exists(f))
print(repr((random.random(), float(numpy.random.rand()))))
print({'module': hasattr(pandas, 'SECRET'), 'env': 'CALL_A_SECRET' in os.environ, 'found': found,
       'processes': seen, 'fds': {int(fd): kind(fd) for fd in os.listdir('/proc/self/fd')},
       'posture': [mine[k] for k in ('CapEff', 'CapBnd', 'CapAmb', 'NoNewPrivs', 'Seccomp', 'Uid')]})
"""
"""Another warm cell, during A or after it: looks for A everywhere a cell could, and says its own posture."""


async def test_warm_cells_share_the_templates_imports_and_nothing_of_each_other(
    tmp_path: Path, runtime: DockerRuntime
) -> None:
    import ast

    import httpx2
    from mcp.client.streamable_http import streamable_http_client

    policy = _policy(tmp_path, "defaults:\n  limits: {timeout_s: 90, max_timeout_s: 90}\n")
    with http_server_process("--policy", policy, "--sandboxes", "template") as server:
        async with contextlib.AsyncExitStack() as stack:
            http = await stack.enter_async_context(httpx2.AsyncClient(timeout=120))
            a, b = [await stack.enter_async_context(connect(streamable_http_client(server.url, http_client=http)))
                    for _ in range(2)]  # fmt: skip
            await anyio.to_thread.run_sync(server.wait_for_line, "warm template of")
            # (a sandbox made while it imported waits no more: it is replaced by one forked from the template)
            probe = await answer(a, "run_python", {"code": "import os\nos.path.exists('/tmp/.sandbox-warm/done')"})
            assert str(probe["stdout"]).strip() == "True", "no sandbox was forked from the warm template"
            first = await answer(a, "run_python", {"code": WARM_A})
            after = await answer(b, "run_python", {"code": WARM_LOOK})
            async with anyio.create_task_group() as group:  # B while A holds its secret
                group.start_soon(answer, a, "run_python", {"code": f"import os\nos.environ['HOLD_S'] = '5'\n{WARM_A}"})
                with anyio.fail_after(60):
                    while not _holding_the_secret():
                        await anyio.sleep(0.05)
                during = await answer(b, "run_python", {"code": WARM_LOOK})
                # each warm template (below the child that made it, waiting) is pid 1 of a pid namespace of its
                # own; its helper's children are its sandboxes' first processes, each pid 1 of a pid namespace
                # below it; its own other children are the sandboxes' programs, each in one of those namespaces
                templates = [t for root in _templates_of(server.process.pid) for t in _templates_of(root.pid, 2)]
                assert templates and all(_ns_pids(t)[1:] == [1] for t in templates), templates
                below = [child for t in templates for child in t.children()]
                helpers = [child for child in below if len(_ns_pids(child)) == 2]
                assert len(helpers) == len(templates), below
                firsts = [f for h in helpers for f in h.children()]
                assert firsts and all(len(_ns_pids(f)) == 3 and _ns_pids(f)[-1] == 1 for f in firsts), firsts
                programs = [child for child in below if child not in helpers]
                assert programs and all(len(_ns_pids(p)) == 3 and _ns_pids(p)[-1] > 1 for p in programs), programs
                sandboxes = {os.readlink(f"/proc/{f.pid}/ns/pid") for f in firsts}
                assert all(os.readlink(f"/proc/{p.pid}/ns/pid") in sandboxes for p in programs), programs
                warm = [*(parent for t in templates if (parent := t.parent()) is not None), *templates, *helpers]
                huge = [_anon_huge_kib(t.pid) for t in templates]  # the heap each call's fork copies
                assert all(kib >= 2048 for kib in huge), huge
                # no capability any process it forks could be given back by an exec, its own set emptied once
                bounding = {_status(t.pid, "CapBnd") for t in [*templates, *helpers]}
                assert bounding == {"0000000000000000"}, bounding
            assert warm, "the warm template is where the test looks for it"
            killer = await answer(b, "run_python", {"code": "import os, signal\nos.kill(-1, signal.SIGKILL)"})
            assert all(t.is_running() for t in warm), killer["text"]
            for root in _templates_of(server.process.pid):  # the server's own interpreter, nothing of an image's
                assert os.path.realpath(f"/proc/{root.pid}/exe") == os.path.realpath(sys.executable)
                assert os.readlink(f"/proc/{root.pid}/root") == "/"
            for template in warm:  # the image's interpreter, never as the host's root: ids of a range of its own
                assert min(template.uids()) >= host_ids.BASE and min(template.gids()) >= host_ids.BASE
    numbers = [str(first["stdout"]).split()]
    for seen in (after, during):
        drawn, said = str(seen["stdout"]).splitlines()
        numbers.append([str(n) for n in ast.literal_eval(drawn)])
        found = ast.literal_eval(said)
        assert not found["module"] and not found["env"] and found["found"] == 0, found
        # Its first process (a fork of the template, with its command line), the launcher, itself: nothing of
        # another call's, nor the template's (a call that kills all it can reach leaves them running, below).
        assert len(found["processes"]) <= 4, found
        # its stdio, the cell runner's /dev/null and the listing's own, as on runc's path, and the pipe on which it
        # says its exit code to its first process: none of the template's
        fds = found["fds"]
        assert sorted(fds)[:5] == [0, 1, 2, 3, 4] and (fds[3], fds[4]) == ("/dev/null", "the listing"), found
        assert len(fds) == 6 and fds[max(fds)] == "pipe", found
        assert found["posture"] == ["0000000000000000"] * 3 + ["1", "2", "1000\t1000\t1000\t1000"], found
    assert len({tuple(n) for n in numbers}) == 3, numbers  # each drew numbers of its own


FORKED_AHEAD = """import os
rss = int(open('/proc/1/statm').read().split()[1]) * os.sysconf('SC_PAGESIZE')
print(os.getpid(), os.getppid(), rss, os.path.exists('/tmp/.sandbox-warm/done'))"""
"""A cell's pid and its parent's in its sandbox, the resident bytes of the sandbox's first process, and whether the
sandbox was forked from a warm template."""
WARM_PROBE = "import os\nprint(os.path.exists('/tmp/.sandbox-warm/done'))"
"""Whether a cell's sandbox was forked from a warm template."""
STDIN_LOOK = "import os\nprint(os.readlink('/proc/self/fd/0'), os.path.getsize('/tmp/.sandbox/stdin'), len(BIG))"
"""Where a cell's code came from: its stdin, and the request's file of it."""
NOT_A_CELL = """
test -p /tmp/.sandbox-warm/done || { echo cold; exit 0; }
for i in $(seq 100); do set -- $(grep -lx sandbox-cell /proc/[0-9]*/comm); [ $# -eq 0 ] && break; sleep 0.05; done
echo "processes waiting to become a cell: $#"
"""
"""A command of a warm template's image that is no cell: how many processes of its sandbox wait to become a cell's
program (none once the one forked for it has ended)."""


POLL_S = 0.6
"""How often `_once_warm` asks again: 100 calls at most in its 60 s, under the default's 120 a minute, so that a
template slow to be made under load fails as not ready, never as its own calls rate-limited."""


async def _once_warm(
    server: ServerProcess, session: Any, tool: str, code: str, warm: Callable[[str], bool]
) -> dict[str, Any]:
    """The answer of the first call whose stdout says it ran forked from its warm template (a sandbox made while
    that template is made is forked cold; each preload list has a template of its own, made at its first call).
    One that never comes fails with what the server said of its templates and its sandboxes' making."""
    key = "code" if tool == "run_python" else "command"
    try:
        with anyio.fail_after(60):
            while True:
                said = await answer(session, tool, {key: code})
                assert not said["is_error"], said["text"]
                if warm(str(said["stdout"])):
                    return said
                await anyio.sleep(POLL_S)
    except TimeoutError:
        told = [line for line in server.lines if "template" in line]
        raise AssertionError(f"no warm sandbox within 60 s; of its templates the server said {told}, and last "
                             f"{server.lines[-20:]}") from None  # fmt: skip


async def test_a_warm_cell_runs_in_the_process_forked_for_it_before_its_call(
    tmp_path: Path, runtime: DockerRuntime
) -> None:
    """A warm sandbox's cell is forked by the template into the sandbox as the sandbox is made (the fork of the
    template's heap is off the call's path, and the only one a call makes): its parent is outside the sandbox, its
    sandbox's first process is not (the first process forked by the helper, without the template's libraries), and
    it reads its code itself where the request left it. A command of the same image that is no cell has that process
    end before it runs."""
    extra = "tools:\n  execute_command: {image: sandbox-server/python-data:latest}\n"
    with http_server_process("--policy", _policy(tmp_path, extra), "--sandboxes", "template") as server:
        async with connect(server.url) as session:
            cell = await _once_warm(
                server, session, "run_python", FORKED_AHEAD, lambda said: said.split()[3:] == ["True"]
            )
            pid, parent, first_size, warm = str(cell["stdout"]).split()
            assert int(pid) > 1 and parent == "0" and warm == "True", cell["text"]
            assert int(first_size) < 40 << 20, f"the first process holds the template's libraries: {cell['text']}"
            # Its code, past a pipe's 64 KiB, read by the cell itself where the request left it (no `head`)
            read = await answer(session, "run_python", {"code": f"BIG = '{'x' * 100_000}'\n{STDIN_LOOK}"})
            assert read["stdout"] == "/memfd:stdin (deleted) 0 100000\n", read["text"]
            command = await _once_warm(server, session, "execute_command", NOT_A_CELL, lambda said: said != "cold\n")
            assert command["stdout"] == "processes waiting to become a cell: 0\n", command["text"]
            assert command["exit_code"] == 0


async def test_a_warm_cell_of_a_template_that_preloads_nothing_is_forked_by_its_first_process(
    tmp_path: Path, runtime: DockerRuntime
) -> None:
    """A warm template that preloads nothing has little to copy: its sandboxes' first processes are its own forks,
    and each forks its cell before its launcher starts (cheaper than the template's hand-over by the steps and
    messages that saves), pid 2 of its sandbox; it reads its code where the request left it all the same."""
    policy = _policy(tmp_path, "tools:\n  run_python: {preload: []}\n")
    with http_server_process("--policy", policy, "--sandboxes", "template") as server:
        async with connect(server.url) as session:
            cell = await _once_warm(
                server, session, "run_python", FORKED_AHEAD, lambda said: said.split()[3:] == ["True"]
            )
            pid, parent, _, warm = str(cell["stdout"]).split()
            assert (pid, parent, warm) == ("2", "1", "True"), cell["text"]
            read = await answer(session, "run_python", {"code": f"BIG = '{'x' * 100_000}'\n{STDIN_LOOK}"})
            assert read["stdout"] == "/memfd:stdin (deleted) 0 100000\n", read["text"]


FORKING = """
import os, time
if os.fork():
    time.sleep(1)
    print('the parent ended last')
"""
"""A cell whose child runs the cell's end before the cell does."""
FILLING = """
import os, threading, time
made = 0
while True:
    try:
        if {threads}:
            threading.Thread(target=time.sleep, args=(60,), daemon=True).start()
        elif os.fork() == 0:
            os._exit(0)
    except (OSError, RuntimeError):
        break
    made += 1
open('/workspace/out/made.txt', 'w').write(str(made))
"""
"""A cell that fills the process limit with threads that run on, or with children it never reaps (its first
process reaps them once the cell is gone), then leaves a file for the launcher to send, which forks a `tar`."""
FORGING = """
import os, time
def pipe(fd):
    try:
        return os.readlink(f'/proc/self/fd/{fd}').startswith('pipe:')
    except OSError:
        return False
ends = max(int(fd) for fd in os.listdir('/proc/self/fd') if pipe(fd))
os.write(ends, b'exit 300\\nexit x\\n' + b'y' * 70000)
os.write(ends, b'\\nexit 5\\n')
time.sleep(30)
print('still running')
"""
"""A cell that says an end of its own on the pipe its end is said on (after lines that say none), then runs on."""


@pytest.mark.parametrize("preload", ["[pandas]", "[]"])
async def test_a_warm_cell_says_its_own_end_as_it_exits_and_none_of_its_childrens(
    tmp_path: Path, runtime: DockerRuntime, preload: str
) -> None:
    """A warm cell's process says its exit code as it exits (the launcher goes on while the kernel tears down its
    copy of the template's memory, milliseconds for a preloaded heap): the code it exits with, whether it ends or
    raises SystemExit. A child the cell forked, which runs the cell's end too, says nothing: the cell is answered
    when the cell itself ends."""
    policy = _policy(tmp_path, f"tools:\n  run_python: {{preload: {preload}}}\n")
    with http_server_process("--policy", policy, "--sandboxes", "template") as server:
        async with connect(server.url) as session:
            await _once_warm(server, session, "run_python", WARM_PROBE, lambda said: said == "True\n")
            forking = await answer(session, "run_python", {"code": FORKING})
            assert str(forking["stdout"]).count("the parent ended last") == 1, forking["text"]
            assert forking["exit_code"] == 0 and not forking["is_error"], forking["text"]
            for code, said in (("raise SystemExit(3)", 3), ("import sys\nsys.exit(256 + 7)", 7), ("print(6 * 7)", 0)):
                ended = await answer(session, "run_python", {"code": code})
                assert ended["exit_code"] == said, (code, ended["text"])
            for threads in (True, False):  # the launcher goes on only once nothing of the cell holds the limit
                filled = await answer(session, "run_python", {"code": FILLING.format(threads=threads)})
                assert "process limit reached" in str(filled["text"]) and filled["exit_code"] == 0, filled["text"]
                assert "made.txt" in str(filled), filled  # (sent by the `tar` the launcher forked)
            # an end said early is the end of the cell: its code, and the launcher kills the cell before the answer
            with anyio.fail_after(20):
                forged = await answer(session, "run_python", {"code": FORGING})
            assert forged["exit_code"] == 5 and "still running" not in str(forged["stdout"]), forged["text"]
            assert not forged.get("timed_out"), forged["text"]


WARM_FORGE = r"""
import os, re, sys, time
launcher = next(pid for pid in os.listdir("/proc") if pid.isdigit()
                and b"sandbox-launch" in open(f"/proc/{pid}/cmdline", "rb").read())
boundary = None
with open(f"/proc/{launcher}/mem", "rb", 0) as memory:  # its launcher's, a sibling: same user
    for line in open(f"/proc/{launcher}/maps"):
        span, perms = line.split()[:2]
        if perms.startswith("rw"):
            start, end = (int(edge, 16) for edge in span.split("-"))
            try:
                memory.seek(start)
                found = re.search(rb"boundary=([0-9a-f]{32})", memory.read(end - start))
            except (OSError, ValueError, OverflowError):
                continue
            if found:
                boundary = found.group(1)
                break
sys.stderr.buffer.write(boundary + b"\n")
sys.stderr.flush()
sys.stdout.buffer.write(boundary + bytes(10240) + boundary + b" exit=0 oom_kill=0 pids_max=0 timed_out=0\n")
sys.stdout.flush()
with open("/workspace/after.log", "a") as log:  # the host is told the call is over: write on
    for number in range(150):
        log.write(f"{number}\n")
        log.flush()
        time.sleep(0.02)
"""
"""A cell that reads its launcher's boundary from its memory, says the call's end with it, and writes on."""


async def test_a_warm_cell_that_forges_its_calls_end_writes_nothing_after_the_answer(tmp_path: Path) -> None:
    """A warm template that preloads nothing: the host learns its sandbox's end from its first process's, not by
    looking at its processes. A cell that says the call's end itself while it runs on is still stopped with its
    sandbox before the answer, and writes nothing in its kept workspace after it."""
    policy = tmp_path / "keeping.yaml"
    policy.write_text("extends: default\ntools:\n  run_python: {preload: []}\n")
    serving = ("--policy", str(policy), "--sandboxes", "template", "--workspaces", "mounted")
    with http_server_process(*serving, "--state-dir", str(tmp_path / "state")) as server:
        async with connect(server.url) as session:
            await _once_warm(server, session, "run_python", WARM_PROBE, lambda said: said == "True\n")
            with anyio.fail_after(20):
                forged = await answer(session, "run_python", {"code": WARM_FORGE})
            assert "they were stopped with the sandbox before this answer" in forged["text"], forged["text"]
            looked = await answer(
                session,
                "execute_command",
                {"command": "a=$(wc -l < after.log); sleep 1; b=$(wc -l < after.log); echo $a $b"},
            )
            before, after = str(looked["stdout"]).split()
            assert before == after and int(after) < 150, looked["text"]


async def test_a_template_killed_is_made_again_and_no_call_hangs(tmp_path: Path, runtime: DockerRuntime) -> None:
    with http_server_process("--policy", _policy(tmp_path), "--sandboxes", "template", "--no-pool") as server:
        async with connect(server.url) as session:
            first = await answer(session, "execute_command", {"command": "echo one"})
            [template] = _templates_of(server.process.pid)
            template.kill()
            with anyio.fail_after(10):
                while template.is_running() and template.status() != psutil.STATUS_ZOMBIE:
                    await anyio.sleep(0.02)
            with anyio.fail_after(30):  # answered, from a template made again
                again = await answer(session, "execute_command", {"command": "echo two"})
        assert first["stdout"] == "one\n" and again["stdout"] == "two\n", again["text"]
        assert [t.pid for t in _templates_of(server.process.pid)] != [template.pid]


def test_a_template_outlives_the_thread_that_started_it(runtime: DockerRuntime) -> None:
    """The server starts templates from worker threads that end when idle: a template must not end with one (a
    parent-death signal would kill it as that thread ends, and a call in flight with it)."""
    from sandbox_server.sandbox.runc.bundles import unpacked
    from sandbox_server.sandbox.runc.state import IMAGES
    from sandbox_server.sandbox.template.host import Templates

    image = "sandbox-server/shell:latest"
    rootfs = unpacked(runtime.api, image, runtime.api.inspect_image(image), IMAGES)
    templates = Templates()
    try:

        def start() -> None:  # the template started, and serving (its children's SIGCHLD ignored), as it ends
            made = templates.of(rootfs, None)
            deadline = time.monotonic() + 30
            while not _serving(made.process.pid):
                assert time.monotonic() < deadline, "the template never began to serve"
                time.sleep(0.01)  # (nothing to await: its state is read from /proc)

        starter = threading.Thread(target=start)
        starter.start()
        starter.join()
        template = templates.of(rootfs, None)  # the one that thread started
        with pytest.raises(subprocess.TimeoutExpired):  # it lives on
            template.process.wait(timeout=2)
    finally:
        templates.close()


def _serving(pid: int) -> bool:
    """Whether a template's loop has begun: it ignores SIGCHLD from then on (its children reaped as they end)."""
    with open(f"/proc/{pid}/status") as status:
        ignored = next(int(line.split()[1], 16) for line in status if line.startswith("SigIgn:"))
    return bool(ignored & (1 << (signal.SIGCHLD - 1)))


def _holding_the_secret() -> bool:
    return any(SECRET in (p.info["cmdline"] or []) for p in psutil.process_iter(["cmdline"]))


async def test_a_server_killed_mid_burst_leaves_no_template_sandbox_process_cgroup_or_bundle(
    tmp_path: Path, runtime: DockerRuntime
) -> None:
    seen: list[psutil.Process] = []

    def look(running: list[str]) -> None:
        seen.extend(_every_process_of(_templates_of(pid)))
        assert len(seen) > 1, "the template and its sandboxes are where the test looks for them"
        makers = [p for p in _children(psutil.Process(pid)) if "CLONE_NEWUSER" in " ".join(p.cmdline())]
        assert len(makers) == 1, "the maker of the sandboxes' user namespaces is where the test looks for it"
        seen.extend(makers)

    with http_server_process("--policy", _policy(tmp_path), "--sandboxes", "template") as server:
        pid = server.process.pid
        await _killed_mid_calls(
            server, ("execute_command", {"command": "sleep 60"}), 6,
            lambda: [p for p in _sandboxes_of(pid) if _running_forked(p)], 6, 30, look,
        )  # fmt: skip
    assert _sandboxes_of(pid) == set() and _cgroups_of(pid) == set()
    assert _held_by(pid) == set() and _views_of(pid) == []  # no id range held, nothing mounted
    # Each ended: once its parent has gone, the host's init reaps it (a zombie until then, awaited here).
    assert not psutil.wait_procs(seen, timeout=10)[1], "a template, a sandbox or the maker outlived its server"


@pytest.mark.alone  # (any server started meanwhile sweeps what the killed one left: none may start beside it)
async def test_what_a_server_and_its_reaper_killed_together_left_of_its_warm_template_the_next_start_sweeps(
    tmp_path: Path, runtime: DockerRuntime
) -> None:
    """A server killed with SIGKILL beside its reaper (as a supervisor killing every process of it does) leaves its
    warm template's user namespace held and the image's view mounted, each under runc's state, and a range of host
    ids taken: the next server's start sweeps them, as it sweeps such a server's sandboxes."""
    policy = _policy(tmp_path, "tools:\n  run_python: {preload: []}\n")
    with http_server_process("--policy", policy, "--sandboxes", "template", "--no-pool") as server:
        pid = server.process.pid
        async with connect(server.url) as session:
            await answer(session, "run_python", {"code": "print(1)"})  # (its warm template is made at its first)
            await anyio.to_thread.run_sync(server.wait_for_line, "warm template of")
        [held] = _namespaces_of(pid)
        reaper = next(p for p in psutil.Process(pid).children() if "reap-after" in command_of(p))
        reaper.kill()  # (it runs nothing more once sent: a SIGKILL is never handled)
        server.process.kill()
        server.process.wait()
        reaper.wait()  # (a zombie until its parent, the server, has gone)
        left = _mounted_under(f"{STATE / userns.FOLDER / held}/")
        assert len(left) == 2 and held in _held_by(pid), "a server killed with its reaper cleans nothing up"
    with http_server_process("--policy", policy, "--sandboxes", "template", "--no-pool"):  # (serving: swept)
        assert _namespaces_of(pid) == [] and _held_by(pid) == set()
        assert _mounted_under(f"{STATE / userns.FOLDER / held}/") == []


def _namespaces_of(pid: int) -> list[str]:
    """The warm templates' namespaces the server `pid` holds (a folder each, under runc's state)."""
    folder = STATE / userns.FOLDER
    return sorted(p.name for p in folder.iterdir() if _made_by(p.name, pid)) if folder.is_dir() else []


def _running_forked(name: str) -> bool:
    """Whether a forked sandbox's first process runs (its pid, in its bundle, alive)."""
    try:
        return psutil.pid_exists(int((STATE / "bundles" / name / "pid").read_text()))
    except (OSError, ValueError):
        return False


RLIMITS_CELL = """
import resource
print(resource.getrlimit(resource.RLIMIT_NOFILE), resource.getrlimit(resource.RLIMIT_FSIZE))
with open('/tmp/big', 'wb') as big:
    big.write(b'x' * (2 * 1024 * 1024))
print('written')
"""
"""A cell that says its open-files and file-size limits, then writes 2 MiB to one file (the kernel stops it)."""


async def test_a_warm_cell_has_the_policys_open_files_and_file_size_limits(
    tmp_path: Path, runtime: DockerRuntime
) -> None:
    """A warm sandbox's program is forked into it by its warm template, not started by the shell that sets a sandbox's
    rlimits on itself: the template's child sets them before anything of the image runs (it once ran with the
    server's 20,000 open files and no file-size limit)."""
    policy = _policy(tmp_path, "defaults:\n  limits: {nofile: 128, file_size_mb: 1}\n")
    with http_server_process("--policy", policy, "--sandboxes", "template") as server:
        await anyio.to_thread.run_sync(server.wait_for_line, "warm template of")
        async with connect(server.url) as session:
            probe = await answer(
                session, "run_python", {"code": "import os\nos.path.exists('/tmp/.sandbox-warm/done')"}
            )
            assert str(probe["stdout"]).strip() == "True", "not forked from the warm template"
            cell = await answer(session, "run_python", {"code": RLIMITS_CELL})
    assert str(cell["stdout"]).splitlines() == ["(128, 128) (1048576, 1048576)"], cell
    assert cell["is_error"] and "a file grew past 1 MiB (policy field limits.file_size_mb)" in str(cell["text"]), cell


async def test_a_spent_warm_template_serves_its_running_sandbox_to_its_end_and_then_ends(
    tmp_path: Path, runtime: DockerRuntime
) -> None:
    """A warm template is pid 1 of the pid namespace its sandboxes' are made below, so its end would end them: once
    spent and replaced, it ends after its last sandbox has, whose call is answered as if nothing had happened."""
    policy = _policy(tmp_path, "tools:\n  run_python: {preload: []}\n")
    with http_server_process(
        "--policy", policy, "--sandboxes", "template", "--no-pool", env={"SANDBOX_TEMPLATE_FORKS": "2"}
    ) as server:
        async with connect(server.url) as a, connect(server.url) as b:
            await answer(b, "run_python", {"code": "print(1)"})  # (its warm template is made at its first)
            await anyio.to_thread.run_sync(server.wait_for_line, "warm template of")
            seen = len(server.lines)
            held: dict[str, dict[str, object]] = {}
            async with anyio.create_task_group() as group:

                async def call_a() -> None:
                    code = f"import subprocess\nsubprocess.run(['sh', '-c', 'sleep 10', '{SECRET}'])\nprint('A ended')"
                    held["a"] = await answer(a, "run_python", {"code": code})

                group.start_soon(call_a)
                with anyio.fail_after(60):
                    while not _holding_the_secret():
                        await anyio.sleep(0.05)
                [old] = [t for root in _templates_of(server.process.pid) for t in _templates_of(root.pid, 2)]
                for _ in range(3):  # its share forked: a new one is made, and the old one retired once it is
                    quick = await answer(b, "run_python", {"code": "print(2)"})
                    assert quick["stdout"] == "2\n", quick["text"]
                await anyio.to_thread.run_sync(lambda: server.wait_for_line("warm template of", 30, seen))
                assert _holding_the_secret() and old.is_running(), "the spent template ended under its sandbox"
                now = [t for root in _templates_of(server.process.pid) for t in _templates_of(root.pid, 2)]
                assert any(t.pid != old.pid for t in now), now  # a new one serves (the old one waits for A's end)
            assert held["a"]["stdout"] == "A ended\n", held["a"]["text"]
            assert not psutil.wait_procs([old], timeout=10)[1], "the spent warm template outlived its last sandbox"


async def test_a_warm_templates_helper_killed_ends_its_template_which_is_made_again(
    tmp_path: Path, runtime: DockerRuntime
) -> None:
    """A warm template whose helper (what forks its sandboxes' first processes) has died can make no sandbox: it
    ends rather than leave calls waiting, and the next calls are served, by a warm template made again. (A template
    that preloads something has a helper: one that preloads nothing forks its sandboxes' first processes itself.)"""
    policy = _policy(tmp_path, "tools:\n  run_python: {preload: [json]}\n")
    with http_server_process("--policy", policy, "--sandboxes", "template", "--no-pool") as server:
        async with connect(server.url) as session:
            await answer(session, "run_python", {"code": "print(1)"})  # (its warm template is made at its first)
            await anyio.to_thread.run_sync(server.wait_for_line, "warm template of")
            seen = len(server.lines)
            warm = await _once_warm(server, session, "run_python", WARM_PROBE, lambda said: said == "True\n")
            assert warm["stdout"] == "True\n", warm["text"]
            [template] = [t for root in _templates_of(server.process.pid) for t in _templates_of(root.pid, 2)]
            [helper] = [child for child in template.children() if len(_ns_pids(child)) == 2]
            helper.kill()
            assert not psutil.wait_procs([template], timeout=10)[1], "a warm template outlived its helper"
            with anyio.fail_after(60):  # answered, forked cold meanwhile or from the template made again
                again = await answer(session, "run_python", {"code": "print(3)"})
            assert again["stdout"] == "3\n", again["text"]
            await anyio.to_thread.run_sync(lambda: server.wait_for_line("warm template of", 60, seen))
            warm = await _once_warm(server, session, "run_python", WARM_PROBE, lambda said: said == "True\n")
            assert warm["stdout"] == "True\n", warm["text"]
