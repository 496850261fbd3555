"""Which engine answers, and the hardened container said its way (pure logic; the engine tests prove it runs)."""

from __future__ import annotations

import os
import resource
import socket
import stat
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from sandbox_server.sandbox.engine.connection import engine_pid
from sandbox_server.sandbox.engine.dialect import DOCKER, dialect_of, process_limit
from sandbox_server.sandbox.engine.host_config import host_config_kwargs
from sandbox_server.sandbox.spec import ResourceLimits, SandboxSpec

PODMAN_VERSION = {
    "Components": [
        {"Name": "Podman Engine", "Version": "4.3.1"},
        {"Name": "OCI Runtime (runc)", "Version": "runc version 1.1.5"},
    ],
    "Version": "4.3.1",
    "ApiVersion": "1.41",
}
DOCKER_VERSION = {"Components": [{"Name": "Engine", "Version": "20.10.24"}], "Version": "20.10.24"}
SPEC = SandboxSpec(image="x", argv=("true",), limits=ResourceLimits(workspace_mb=64, tmp_mb=16))


def test_docker_is_told_the_hardened_container_unchanged() -> None:
    dialect = dialect_of(DOCKER_VERSION)
    assert (dialect.name, dialect.version, dialect.podman) == ("Docker", "20.10.24", False)
    assert dialect.differences() == ()
    assert (dialect.chooses_runtime, dialect.bridge_networks, dialect.seccomp_by_path) == (True, True, False)
    assert host_config_kwargs(SPEC, dialect=dialect) == host_config_kwargs(SPEC, dialect=DOCKER)
    tmpfs = host_config_kwargs(SPEC)["tmpfs"]
    assert "nr_inodes=" in tmpfs["/tmp"] and "uid=1000,gid=1000" in tmpfs["/workspace"]


def test_podman_is_told_the_owner_its_way_and_the_inode_cap_is_named_as_missing() -> None:
    dialect = dialect_of(PODMAN_VERSION)
    assert (dialect.name, dialect.version, dialect.podman) == ("Podman", "4.3.1", True)
    settings = host_config_kwargs(SPEC, dialect=dialect)
    workspace = settings["tmpfs"]["/workspace"].split(",")
    docker = host_config_kwargs(SPEC)["tmpfs"]["/workspace"].split(",")
    assert workspace == [option for option in docker if not option.startswith(("uid=", "gid=", "nr_inodes="))] + ["U"]
    assert "size=64m" in workspace
    assert "nr_inodes" not in settings["tmpfs"]["/tmp"] and "size=16m" in settings["tmpfs"]["/tmp"]
    runtime, networks, inodes = dialect.differences()
    assert "ignores a container's runtime" in runtime and "runsc" in runtime and "refused" in runtime
    assert networks == dialect.networks_missing() and "services are refused" in networks
    assert "nr_inodes" in inodes and "limits.workspace_inodes" in inodes and "size caps are" in inodes
    assert (dialect.chooses_runtime, dialect.bridge_networks, dialect.seccomp_by_path) == (False, False, True)


def test_podman_is_told_a_process_limit_it_can_grant() -> None:
    settings = host_config_kwargs(SPEC, dialect=dialect_of(PODMAN_VERSION, os.getpid()))
    [nproc] = [limit for limit in settings["ulimits"] if limit["name"] == "nproc"]
    hard = resource.getrlimit(resource.RLIMIT_NPROC)[1]
    assert nproc["soft"] == nproc["hard"] == (-1 if hard == resource.RLIM_INFINITY else hard)
    assert "nproc" not in [limit["name"] for limit in host_config_kwargs(SPEC)["ulimits"]]


def test_podman_reads_the_seccomp_profile_from_a_private_file() -> None:
    profile = '{"defaultAction": "SCMP_ACT_ERRNO"}'
    spec = replace(SPEC, seccomp_profile=profile)
    [option] = [
        o for o in host_config_kwargs(spec, dialect=dialect_of(PODMAN_VERSION))["security_opt"] if "seccomp" in o
    ]
    path = Path(option.removeprefix("seccomp="))
    assert path.read_text() == profile and stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    assert f"seccomp={profile}" in host_config_kwargs(spec)["security_opt"]


def test_a_lower_limit_of_the_engine_process_is_the_one_given() -> None:
    hard = resource.getrlimit(resource.RLIMIT_NPROC)[1]
    lower = 4321 if hard == resource.RLIM_INFINITY or hard > 4321 else hard - 1
    lowered = f"import resource, sys; resource.setrlimit(resource.RLIMIT_NPROC, ({lower}, {lower})); print('ready', flush=True); sys.stdin.read()"
    with subprocess.Popen([sys.executable, "-c", lowered], stdin=subprocess.PIPE, stdout=subprocess.PIPE) as engine:
        assert engine.stdout is not None and engine.stdout.readline() == b"ready\n"
        assert process_limit(engine.pid) == lower
        assert host_config_kwargs(SPEC, dialect=dialect_of(PODMAN_VERSION, engine.pid))["ulimits"][-1]["hard"] == lower
        engine.communicate(b"")


def test_the_engine_process_is_the_peer_of_its_unix_socket(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "engine.sock"
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as server:
        server.bind(str(path))
        server.listen(1)
        monkeypatch.setenv("DOCKER_HOST", f"unix://{path}")
        assert engine_pid() == os.getpid()
    monkeypatch.setenv("DOCKER_HOST", f"unix://{tmp_path}/none.sock")
    assert engine_pid() is None
    monkeypatch.setenv("DOCKER_HOST", "tcp://127.0.0.1:2375")
    assert engine_pid() is None
