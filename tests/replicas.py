"""The parts of a replicated deployment, real and started by the tests: Debian's PostgreSQL in a folder of the
test's own (initdb, pg_ctl), sandbox-server replicas sharing it, and HAProxy with the project's own configuration
(deploy/haproxy.cfg) in front of them. Everything listens on loopback."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tests.mcp_harness import ServerProcess, audit_records, free_port, stop_server

ROOT = Path(__file__).resolve().parent.parent
HAPROXY_CONFIG = ROOT / "deploy" / "haproxy.cfg"


def postgres_bin() -> Path:
    """The folder of Debian's PostgreSQL programs (the newest installed)."""
    found = sorted(Path("/usr/lib/postgresql").glob("*/bin/pg_ctl"), key=lambda path: int(path.parent.parent.name))
    if not found:
        raise AssertionError("PostgreSQL is not installed: scripts/run test installs Debian's postgresql")
    return found[-1].parent


@dataclass
class Postgres:
    """A PostgreSQL server of the test's own: its data folder, port, and the URL replicas are given."""

    folder: Path
    port: int

    @property
    def url(self) -> str:
        return f"postgresql://postgres@127.0.0.1:{self.port}/postgres"

    def _ctl(self, *args: str) -> None:
        command = [str(postgres_bin() / "pg_ctl"), "-D", str(self.folder / "data"), *args]
        done = subprocess.run(_as_postgres(command), capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, f"pg_ctl {args[0]}: {done.stdout}{done.stderr}"

    def start(self) -> None:
        options = f"-p {self.port} -k {self.folder} -c listen_addresses=127.0.0.1 -c max_connections=200"
        self._ctl("-o", options, "-l", str(self.folder / "log"), "-w", "start")

    def stop(self) -> None:
        self._ctl("-m", "fast", "-w", "stop")

    def query(self, sql: str) -> list[tuple[Any, ...]]:
        import psycopg

        with psycopg.connect(self.url, autocommit=True) as connection:
            cursor = connection.execute(sql)
            return cursor.fetchall() if cursor.description is not None else []


def _as_postgres(command: list[str]) -> list[str]:
    """PostgreSQL refuses to run as root: as root, its programs run as Debian's postgres user."""
    return ["runuser", "-u", "postgres", "--", *command] if os.geteuid() == 0 else command


@contextmanager
def postgres() -> Iterator[Postgres]:
    """A fresh PostgreSQL server in a folder of its own (one its user may reach: the tests' are root's alone),
    stopped and removed afterwards."""
    folder = Path(tempfile.mkdtemp(prefix="sandbox-server-pg-"))
    folder.chmod(0o755)
    if os.geteuid() == 0:
        shutil.chown(folder, "postgres")
    initdb = [str(postgres_bin() / "initdb"), "-D", str(folder / "data"), "--auth=trust", "-U", "postgres"]
    done = subprocess.run(_as_postgres(initdb), capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    server = Postgres(folder, free_port())
    server.start()
    try:
        yield server
    finally:
        subprocess.run(
            _as_postgres([str(postgres_bin() / "pg_ctl"), "-D", str(folder / "data"), "-m", "immediate", "stop"]),
            capture_output=True,
            timeout=60,
        )
        shutil.rmtree(folder, ignore_errors=True)


class Replica(ServerProcess):
    """One `serve --transport http --state …` child: its log, its audit file, and its port."""

    def __init__(self, url: str, process: subprocess.Popen[bytes], folder: Path, port: int) -> None:
        super().__init__(url, process)
        self.folder, self.port = folder, port

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def audit(self) -> list[dict[str, Any]]:
        path = self.folder / "audit.jsonl"
        return audit_records(path) if path.exists() else []

    def owner(self) -> str:
        """Its owner label (in its log's first lines)."""
        line = self.wait_for_line(", process ")
        return line.rsplit(", process ", 1)[1].split(")", 1)[0]

    def stop(self) -> None:
        stop_server(self.process)
        self.reader.join(timeout=10)
        if self.process.stderr is not None:
            self.process.stderr.close()


def one_caller(folder: Path, policy_text: str, name: str = "alice") -> tuple[Path, Path, str]:
    """`folder`'s policy.yaml (`policy_text`) and tokens.json holding one caller under it: both paths, and its
    token."""
    from tests.conftest import run_cli

    policy, tokens = folder / "policy.yaml", folder / "tokens.json"
    policy.write_text(policy_text)
    added = run_cli("token", "add", name, "--policy", str(policy), "--tokens", str(tokens))
    assert added.returncode == 0, added.stderr
    return policy, tokens, added.stdout.splitlines()[-1]


async def start_replicas(folder: Path, state_url: str, *serve_args: str) -> dict[str, Replica]:
    """Replicas `one` and `two` of `folder`, started one after the other off the event loop, each once healthy."""
    import functools

    import anyio.to_thread

    started: dict[str, Replica] = {}
    for name in ("one", "two"):
        started[name] = await anyio.to_thread.run_sync(
            functools.partial(start_replica, folder / name, state_url, *serve_args)
        )
    return started


def start_replica(folder: Path, state_url: str | None, *serve_args: str, port: int | None = None) -> Replica:
    """A replica (a server of its own without `state_url`), once its /healthz answers 200, named after its folder
    (unless `serve_args` name it); on `port` (a replica started again where a load balancer knows it), else a free
    one."""
    import httpx2 as httpx

    folder.mkdir(parents=True, exist_ok=True)
    port = port or free_port()
    command = [
        sys.executable, "-m", "sandbox_server", "serve", "--transport", "http", "--port", str(port),
        *(("--state", state_url) if state_url else ()), "--state-dir", str(folder / "state"), "--audit-log", str(folder / "audit.jsonl"),
        "--no-watch", *(() if "--name" in serve_args else ("--name", folder.name)), *serve_args,
    ]  # fmt: skip
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    replica = Replica(f"http://127.0.0.1:{port}/mcp", process, folder, port)
    deadline = time.monotonic() + 60
    while True:
        if process.poll() is not None:
            replica.stop()  # its log read to the end, its pipe closed
            raise AssertionError(f"replica exited: {''.join(replica.lines)}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=2).status_code == 200:
                return replica
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            replica.stop()
            raise AssertionError(f"replica not healthy within 60 s: {''.join(replica.lines)}")
        time.sleep(0.1)


@contextmanager
def haproxy(tmp: Path, *replicas: Replica) -> Iterator[str]:
    """HAProxy with deploy/haproxy.cfg in front of two replicas; yields the MCP URL it serves."""
    import httpx2 as httpx

    assert len(replicas) == 2, "deploy/haproxy.cfg names two replicas"
    port = free_port()
    env = {
        **os.environ,
        "LISTEN": f"127.0.0.1:{port}",
        "REPLICA_1": replicas[0].address,
        "REPLICA_2": replicas[1].address,
    }
    process = subprocess.Popen(
        ["haproxy", "-db", "-f", str(HAPROXY_CONFIG)], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        cwd=tmp,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 20
        while True:  # until both replicas are in service (one health check each)
            assert process.poll() is None, "haproxy exited"
            served = set()
            try:
                for _ in range(4):
                    served.add(httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=2).status_code)
            except httpx.HTTPError:
                served.add(0)
            if served == {200}:
                break
            assert time.monotonic() < deadline, f"haproxy did not serve /healthz within 20 s: {served}"
            time.sleep(0.2)
        yield f"http://127.0.0.1:{port}/mcp"
    finally:
        process.terminate()
        process.wait(timeout=10)
