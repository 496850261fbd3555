"""Shared fixtures. Tests that need the engine fail (never skip) when it is missing."""

from __future__ import annotations

import ipaddress
import json
import os
import secrets
import signal
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import anyio
import docker
import docker.errors
import pytest
from mcp import Client

from sandbox_server.sandbox import mounts, wire
from sandbox_server.sandbox.engine.images import catalog, image_status
from sandbox_server.sandbox.engine.removal import LABELS_VARIABLE, OWNER_LABEL, owner_alive
from sandbox_server.sandbox.engine.runtime import DockerRuntime
from sandbox_server.sandbox.runc.runtime import RuncRuntime
from sandbox_server.sandbox.runc.state import STATE, is_runc, listed, owner_of
from sandbox_server.sandbox.runc.veth import NETWORK_ANNOTATION, Layout, mac_of
from sandbox_server.sandbox.spec import SANDBOX_LABEL
from sandbox_server.sandbox.template.launch import MARK as FORKED
from sandbox_server.sandbox.warm_container import sandbox_processes
from sandbox_server.state.folder import default_state_dir
from tests.mcp_harness import connect, stdio_parameters

ROOT = Path(__file__).resolve().parent.parent
"""The checkout the tests run from."""
ENGINE = os.environ.get("SANDBOX_TEST_ENGINE", "docker")
"""The engine this pass of the suite runs on: docker, or podman (the second pass, with DOCKER_HOST at its socket)."""
collect_ignore = [] if ENGINE == "podman" else ["podman"]


def sandbox_inits(running_only: bool = True) -> dict[str, int]:
    """Our sandboxes and the host pid of each one's init (0: not running), the engine's and those runc runs
    itself, read from the engine and from runc's bundles."""
    api = docker.from_env().api
    firsts = {}
    try:
        for item in api.containers(all=not running_only, filters={"label": SANDBOX_LABEL}):
            try:
                firsts[item["Id"]] = int(api.inspect_container(item["Id"])["State"].get("Pid") or 0)
            except docker.errors.APIError:
                continue  # gone meanwhile
    finally:
        api.close()
    for name in listed(STATE):
        first = _init_of(name)
        if first or not running_only:
            firsts[name] = first
    return firsts


def command_lines(first: int) -> list[str]:
    """The command line of every process of the sandbox whose init is `first`, read from the host's /proc."""
    said = []
    for pid in sandbox_processes(first) if first > 0 else ():
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as cmdline:
                said.append(cmdline.read().replace(b"\0", b" ").decode(errors="replace"))
        except OSError:
            continue  # ended meanwhile
    return said


def a_sleep_of_its_own(seconds: int) -> str:
    """A `sleep` of about `seconds` whose command line no other test's shares, so `containers_running` finds this
    one alone while other workers run theirs on the same engine."""
    return f"sleep {seconds}.{secrets.randbelow(10**6):06d}"


def containers_running(command: str) -> list[str]:
    """Our containers with a process whose command line contains `command` (warm ones run only the launcher),
    read from the host's /proc (Podman's `top` streams without end)."""
    return [
        container
        for container, first in sandbox_inits().items()
        if any(command in said for said in command_lines(first))
    ]


def runc_sandboxes_on(network: str, running_only: bool) -> set[str]:
    """The sandboxes runc runs on an engine network (their bundles say which); only the started ones if
    `running_only` (runc writes a pid file then)."""
    found = set()
    for name in listed(STATE):
        bundle = STATE / "bundles" / name
        try:
            annotations = json.loads((bundle / "config.json").read_text()).get("annotations") or {}
        except (OSError, ValueError):
            continue  # being made or deleted
        on_it = network in annotations.get(NETWORK_ANNOTATION, "").split(",")
        if on_it and (not running_only or (bundle / "pid").exists()):
            found.add(name)
    return found


def assert_engine_routes_and_mac(probe: dict[str, Any], layout: Layout | None, address: ipaddress.IPv4Address) -> None:
    """A network probe's `route` and `mac` lines (its answer, `probe`) are those the engine derives for `eth0` at
    `address` on the network of `layout`: a default route through its gateway, the subnet's own, 02:42 and the
    address."""
    assert layout is not None and layout.gateway is not None, "the network leaves the server no addresses"
    hexed = [
        a.packed[::-1].hex().upper() for a in (layout.gateway, layout.subnet.network_address, layout.subnet.netmask)
    ]
    routes = [f"route eth0 00000000 {hexed[0]} 00000000", f"route eth0 {hexed[1]} 00000000 {hexed[2]}"]
    lines = probe["stdout"].splitlines()
    assert [line for line in lines if line.startswith("route ")] == routes, probe["text"]
    assert f"mac {mac_of(address)}" in lines, probe["text"]


def egress_address_of(container_id: str) -> str:
    """A running sandbox's address on its allow list's network: the engine's word, or read in the namespace of a
    sandbox runc runs."""
    if is_runc(container_id):
        shown = subprocess.run(
            ["nsenter", f"--net=/proc/{_init_of(container_id)}/ns/net", "ip", "-4", "-o", "address", "show", "eth0"],
            capture_output=True, text=True, check=True, timeout=30,
        ).stdout.split()  # fmt: skip
        return shown[shown.index("inet") + 1].split("/")[0]
    api = docker.from_env().api
    try:
        networks = api.inspect_container(container_id)["NetworkSettings"]["Networks"]
    finally:
        api.close()
    (address,) = [n["IPAddress"] for name, n in networks.items() if name.startswith("sandbox-egress-")]
    return str(address)


def kill_from_outside(container_id: str) -> None:
    """SIGKILL a sandbox's init as someone on the host would: through the engine, or through runc for the
    sandboxes runc runs itself."""
    if _forked(container_id):  # forked from a template: its first process, by the pid its bundle says
        os.kill(int((STATE / "bundles" / container_id / "pid").read_text()), signal.SIGKILL)
        return
    if is_runc(container_id):
        subprocess.run(["runc", "--root", str(STATE / "runc"), "kill", container_id, "KILL"], check=True, timeout=30)
        return
    api = docker.from_env().api
    api.kill(container_id)
    api.close()


def _forked(container_id: str) -> bool:
    return is_runc(container_id) and (STATE / "bundles" / container_id / FORKED).exists()


def exec_in(container_id: str, argv: list[str], user: str = "1000") -> str:
    """What `argv` says (stdout and stderr) run inside a sandbox as `user`: through the engine, or through runc
    for the sandboxes runc runs itself."""
    if _forked(container_id):  # into its namespaces (its user namespace's ids), as the user asked for
        pid = (STATE / "bundles" / container_id / "pid").read_text().strip()
        command = ["nsenter", "-t", pid, "-a", "-S", user, "-G", user, "--", *argv]
        done = subprocess.run(command, capture_output=True, timeout=30, check=False)
        return (done.stdout + done.stderr).decode(errors="replace")
    if is_runc(container_id):
        command = ["runc", "--root", str(STATE / "runc"), "exec", "--user", f"{user}:{user}", container_id, *argv]
        done = subprocess.run(command, capture_output=True, timeout=30, check=False)
        return (done.stdout + done.stderr).decode(errors="replace")
    api = docker.from_env().api
    try:
        return str(api.exec_start(api.exec_create(container_id, argv, user=user)).decode(errors="replace"))
    finally:
        api.close()


def containers_owned_by(owner: str, running: bool = False) -> list[str]:
    """The sandboxes of the server whose owner label is `owner`, the engine's and runc's; the running ones alone
    if `running` (runc's: those whose init runs)."""
    api = docker.from_env().api
    try:
        items = api.containers(all=not running, filters={"label": f"{OWNER_LABEL}={owner}"})
    finally:
        api.close()
    found = [item["Id"] for item in items]
    for name in sorted(listed(STATE)):
        if owner_of(name) == owner and (not running or command_lines(_init_of(name))):
            found.append(name)
    return found


def _init_of(name: str) -> int:
    try:
        return int((STATE / "bundles" / name / "pid").read_text())
    except (OSError, ValueError):
        return 0


def containers_of(pid: int, running: bool = False) -> list[str]:
    """Our containers made by the server process `pid` (its owner label); only the started ones if `running`
    (a warm container is created, then started, then waits in its pool)."""
    api = docker.from_env().api
    items = api.containers(all=not running, filters={"label": SANDBOX_LABEL})
    api.close()
    found = [item["Id"] for item in items if f":{pid}:" in (item.get("Labels") or {}).get(OWNER_LABEL, "")]
    for name in sorted(listed(STATE)):  # and those runc runs for it (started: its init's pid is written)
        if f":{pid}:" in owner_of(name) and (not running or _init_of(name)):
            found.append(name)
    return found


def images_of(store: Path) -> Path:
    """Where a store's mounted workspaces' images are: its pool (an XFS filesystem with reflinks, mounted while
    its server runs) where the host has one, else the store's folder."""
    pool = store / "pool"
    return pool if pool.is_dir() and str(pool.resolve()) in mounts.mounted(pool) else store


def left_by_exited_servers() -> list[str]:
    """This test process's containers (its worker's label) whose server process has exited (warm ones of servers
    still running are theirs), once the reapers of servers that ended have done their work (side by side, another
    worker's server that ended a moment ago may be having its containers removed still)."""
    _reapers_finished()
    api = docker.from_env().api
    try:
        items = api.containers(all=True, filters={"label": [SANDBOX_LABEL, os.environ[LABELS_VARIABLE]]})
    finally:
        api.close()
    return [item["Id"] for item in items if not owner_alive((item.get("Labels") or {}).get(OWNER_LABEL, ""))]


def networks_left_by_exited_servers() -> list[str]:
    """This test process's networks (egress, services, the posture check's: its worker's label) whose server has
    exited, once the reapers of servers that ended have done their work (side by side, the other workers' servers
    have networks of their own meanwhile)."""
    _reapers_finished()
    api = docker.from_env().api
    try:
        items = api.networks(filters={"label": [SANDBOX_LABEL, os.environ[LABELS_VARIABLE]]})
    finally:
        api.close()
    return [n["Name"] for n in items if not owner_alive((n.get("Labels") or {}).get(OWNER_LABEL, ""))]


def run_cli(
    *args: str,
    env: dict[str, str] | None = None,
    timeout_s: float = 120,
    cwd: Path | None = None,
    stdin: str | None = None,
) -> subprocess.CompletedProcess[str]:
    """Run the real `sandbox-server` command line in a child process."""
    return subprocess.run(
        [sys.executable, "-m", "sandbox_server", *args],
        capture_output=True,
        text=True,
        timeout=timeout_s,
        env={**os.environ, **(env or {})},
        cwd=cwd,
        input=stdin,
        check=False,
    )


@pytest.fixture(scope="session")
def runtime() -> Iterator[RuncRuntime]:
    """A connection to the real engine, with every image built and current."""
    try:  # the sandboxes a test makes itself are made as SANDBOX_SANDBOXES says, as its servers' are
        connected = RuncRuntime(DockerRuntime._client(60), os.environ.get("SANDBOX_SANDBOXES", "auto"))
    except Exception as exc:  # the suite must fail loudly, not skip, without an engine
        pytest.fail(f"the Docker engine is required for this test: {exc}", pytrace=False)
    if connected.dialect.name.lower() != ENGINE:
        pytest.fail(f"SANDBOX_TEST_ENGINE is {ENGINE}, but {connected.dialect.name} answers", pytrace=False)
    stale = [s.reference for s in (image_status(connected, d) for d in catalog().values()) if not s.current]
    if stale:
        pytest.fail(f"images not built or stale: {stale}; run `sandbox-server images build`", pytrace=False)
    if connected.templates is not None and connected.runc_refused() is None:
        # The bundles' folder made as a server makes it before its first bundle (a tmpfs on a machine that never
        # ran one): a test that watches it for new sandboxes watches the folder they are made in.
        connected.warm_namespaces.share_bundles()
    yield connected
    connected.close()


def _reapers_finished(timeout_s: float = 60) -> None:
    """Wait for the reapers of servers that have ended (a server its client killed after the grace period leaves
    its containers to its reaper, which may still be removing them when the suite ends)."""
    import psutil

    reapers = []
    for process in psutil.process_iter(["cmdline"]):
        said = process.info["cmdline"] or []
        if "reap-after" in said and not psutil.pid_exists(int(said[said.index("--pid") + 1])):
            reapers.append(process)
    psutil.wait_procs(reapers, timeout=timeout_s)


def _left_behind() -> list[str]:
    """Our sandboxes still there once every server of the run has ended (the engine's and runc's)."""
    _reapers_finished()
    try:
        return RuncRuntime.connect().sandbox_containers()
    except Exception:
        return []  # the engine fixture already failed the tests that needed it


WORKER = os.environ.get("PYTEST_XDIST_WORKER")
"""The worker this process is when the suite runs side by side (pytest-xdist), else None."""


WORKER_LABEL = "sandbox-server-tests.worker"
"""On every container the servers of a test process make (SANDBOX_CONTAINER_LABELS, which the servers it starts
inherit): the worker's name side by side, `main` otherwise."""


POOL_SANDBOXES_VARIABLE = "SANDBOX_POOL_SANDBOXES"
TESTS_POOL_SANDBOXES = 16
"""The most sandboxes a test's server keeps waiting (serve --pool-sandboxes): the default policy fills its shell
pool to 100 after a first call, some 5 s of CPU a server, which the suite's hundreds of servers spent beside the
other workers' tests on two cores. Pools still fill, grow and refill within it; tests of deeper pools start their
servers with FULL_POOLS."""
FULL_POOLS = {POOL_SANDBOXES_VARIABLE: ""}
"""The environment of a server whose pools keep what its policy says."""


def pytest_configure(config: pytest.Config) -> None:
    """A worker's servers keep their state in a folder of the worker's own (its audit trail, workspaces and
    images pool), as servers on separate hosts would, label their containers with the worker's name, and keep at
    most TESTS_POOL_SANDBOXES waiting unless the environment says otherwise."""
    if WORKER:  # beside the folder a server would use (as root XDG_STATE_HOME is not read: SANDBOX_STATE_DIR is)
        folder = default_state_dir()
        os.environ["SANDBOX_STATE_DIR"] = str(folder.with_name(f"{folder.name}-tests-{WORKER}"))
    os.environ[LABELS_VARIABLE] = f"{WORKER_LABEL}={WORKER or 'main'}"
    os.environ.setdefault(POOL_SANDBOXES_VARIABLE, str(TESTS_POOL_SANDBOXES))


LONG_FILES = ("test_team_images.py", "test_wheel.py", "test_services.py", "test_replicas.py", "test_homes.py")
"""Files of minutes (images built, a wheel installed, services and replicas started) that come late in the
alphabet: side by side, where a worker takes a whole file at a time in the order collected, a pass that ended on
one of them kept two of three workers idle for its last minutes. They are collected first."""


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The long files first (LONG_FILES, in that order), every other test in its usual order after them."""
    first = {name: index for index, name in enumerate(LONG_FILES)}
    items.sort(key=lambda item: first.get(item.path.name, len(first)))


@pytest.fixture(scope="session", autouse=True)
def no_container_left_behind() -> Iterator[None]:
    """After a test process's last test, no container its servers made remains (each worker checks its own, by
    its label, while the others run); once the whole suite has ended, none of ours at all (side by side, the
    controller checks that once every worker has ended)."""
    yield
    leftover = _left_by_this_process()
    assert not leftover, f"sandbox containers this test process's servers left behind: {leftover}"
    if not WORKER:
        leftover = _left_behind()
        assert not leftover, f"sandbox containers left behind: {leftover}"


def _left_by_this_process() -> list[str]:
    """The containers carrying this test process's worker label (the engine's and those runc runs itself), once
    the reapers of servers that ended are done."""
    _reapers_finished()
    mine = os.environ[LABELS_VARIABLE]
    api = docker.from_env().api
    try:
        found = [item["Id"] for item in api.containers(all=True, filters={"label": mine})]
    finally:
        api.close()
    key, _, value = mine.partition("=")
    return found + [name for name in sorted(listed(STATE)) if labels_of(name).get(key) == value]


def labels_of(container_id: str) -> dict[str, str]:
    """A sandbox's labels: the engine's, or the annotations of the bundle runc runs it from ({} when it is gone)."""
    if not is_runc(container_id):
        api = docker.from_env().api
        try:
            return dict(api.inspect_container(container_id)["Config"].get("Labels") or {})
        except docker.errors.NotFound:
            return {}
        finally:
            api.close()
    try:
        return dict(json.loads((STATE / "bundles" / container_id / "config.json").read_text()).get("annotations") or {})
    except (OSError, ValueError):
        return {}  # being deleted


@pytest.fixture(autouse=True)
def no_mount_left_in_the_tests_folder(request: pytest.FixtureRequest) -> Iterator[None]:
    """A test whose servers leave a mount in its own folder fails, naming it; the mount is let go of, so the
    folder can still be removed (pytest's removal of old runs' folders would otherwise fail on it, later)."""
    folder = request.getfixturevalue("tmp_path") if "tmp_path" in request.fixturenames else None
    yield
    if folder is not None:
        _no_mount_under(folder)


@pytest.fixture(scope="session", autouse=True)
def no_mount_left_in_the_runs_folder(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """As `no_mount_left_in_the_tests_folder`, for the folders of a module's or a session's fixtures."""
    yield
    _no_mount_under(tmp_path_factory.getbasetemp())


def _no_mount_under(folder: Path) -> None:
    left = mounts.mounted(folder)
    for target in left:
        mounts.detach(target)
    assert not left, f"left mounted on the host: {left}"


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """The controller of a side-by-side run: the leftover check of `no_container_left_behind`, once for all."""
    config = session.config
    if WORKER or not config.getoption("numprocesses", default=None):
        return
    if all(str(arg).startswith("tests/fast") for arg in config.args):
        return  # the fast tier asks no engine
    leftover = _left_behind()
    if leftover:
        config.get_terminal_writer().line(f"sandbox containers left behind: {leftover}", red=True)
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


@pytest.fixture(scope="session")
def anyio_backend() -> str:
    """Async tests and fixtures run on asyncio (session-wide, so module-scoped async fixtures may use it; the event
    loop itself lives only while a test or an async fixture holds it, as anyio's plugin leases it)."""
    return "asyncio"


@pytest.fixture(scope="module")
async def module_session(runtime: DockerRuntime) -> AsyncIterator[Client]:
    """One stdio session on the default policy for a whole module."""
    async with connect(stdio_parameters()) as session:
        yield session


async def interpreters_warm(pid: int) -> None:
    """Wait until every warm interpreter in the server `pid`'s containers has finished importing (CPU-heavy)."""
    with anyio.fail_after(60):
        while True:
            pending = 0
            inits = sandbox_inits()
            for container in containers_of(pid, running=True):
                root = f"/proc/{inits.get(container, 0)}/root"
                try:
                    if not os.path.isdir(root + wire.WARM_DIR):
                        continue  # no warm interpreter in this one (a shell image)
                    with open(root + wire.WARM_ERRORS, encoding="utf-8") as said:
                        pending += "preloaded in" not in said.read()
                except OSError:
                    pending += 1
            if not pending:
                return
            await anyio.sleep(0.1)
