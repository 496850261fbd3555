"""The sandbox said to runc directly (sandbox.oci, sandbox.bundles), the first part of the path that makes
sandboxes without the engine: the same hardening the engine applies, read from inside and from the host."""

from __future__ import annotations

import signal
import subprocess
import time
from pathlib import Path

import pytest

from sandbox_server.policy.loader import load_policy
from sandbox_server.sandbox.engine.runtime import DockerRuntime
from sandbox_server.sandbox.runc.bundles import image_root, write_bundle
from sandbox_server.sandbox.runc.state import IMAGES
from sandbox_server.sandbox.spec import ResourceLimits, SandboxSpec
from sandbox_server.tools import all_tools

PROBE = r"""
grep -E '^(Uid|Gid|CapInh|CapPrm|CapEff|CapBnd|CapAmb|NoNewPrivs|Seccomp):' /proc/self/status
echo "host=$(hostname)"
echo "links=$(ls /sys/class/net | tr '\n' ' ')"
touch /etc/x 2>/dev/null && echo "root=writable" || echo "root=read-only"
echo ok > /workspace/w && echo "workspace=$(cat /workspace/w)"
printf '#!/bin/sh\necho ran\n' > /tmp/s && chmod +x /tmp/s && (/tmp/s 2>/dev/null || echo "tmp=noexec")
echo "memory=$(cat /sys/fs/cgroup/memory/memory.limit_in_bytes)"
echo "pids=$(cat /sys/fs/cgroup/pids/pids.max)"
echo "nofile=$(ulimit -n)"
echo "pid1=$(cat /proc/1/comm)"
cat /proc/kcore 2>/dev/null | head -c 1 | wc -c | sed 's/^/kcore=/'
"""


def _spec() -> SandboxSpec:
    policy = load_policy("default", [tool.name for tool in all_tools()]).for_tool("execute_command")
    limits = ResourceLimits(memory_mb=192, pids=48, nofile=200, workspace_mb=16)
    return SandboxSpec(
        image="sandbox-server/shell:latest", argv=("sh", "-c", PROBE), limits=limits, user=policy.user,
        seccomp_profile=policy.seccomp_profile,
    )  # fmt: skip


def test_a_sandbox_made_by_runc_has_the_engines_hardening(tmp_path: Path, runtime: DockerRuntime) -> None:
    spec = _spec()
    assert spec.seccomp_profile is not None  # the default policy's own profile (no io_uring)
    rootfs = image_root(runtime.api, spec.image, IMAGES)  # the servers' own copy (a copy of its own: 40 s a run)
    assert image_root(runtime.api, spec.image, IMAGES) == rootfs  # unpacked once
    bundle = write_bundle(tmp_path / "bundle", spec, rootfs, list(spec.argv))
    name = f"sbx-test-{time.monotonic_ns()}"
    done = subprocess.run(
        ["runc", "run", "--bundle", str(bundle), name], capture_output=True, text=True, timeout=60, check=False
    )
    subprocess.run(["runc", "delete", "--force", name], capture_output=True, check=False)
    facts = dict(
        line.replace(":", "=", 1).split("=", 1) for line in done.stdout.splitlines() if "=" in line or ":" in line
    )
    facts = {key.strip(): value.strip() for key, value in facts.items()}
    assert done.returncode == 0, done.stderr
    assert facts["Uid"].split()[0] == "1000" and facts["Gid"].split()[0] == "1000", facts
    for kind in ("CapInh", "CapPrm", "CapEff", "CapBnd", "CapAmb"):
        assert int(facts[kind], 16) == 0, (kind, facts[kind])
    assert facts["NoNewPrivs"] == "1" and facts["Seccomp"] == "2", facts
    assert facts["host"] == "sandbox" and facts["links"] == "lo", facts
    assert facts["root"] == "read-only" and facts["workspace"] == "ok" and facts["tmp"] == "noexec", facts
    assert int(facts["memory"]) == 192 * 1024 * 1024 and facts["pids"] == "48" and facts["nofile"] == "200", facts
    assert facts["pid1"] in ("docker-init", "tini-static") and facts["kcore"] == "0", facts


def test_io_uring_is_refused_by_the_policys_profile_on_the_runc_path(tmp_path: Path, runtime: DockerRuntime) -> None:
    spec = _spec()
    probe = "python3 -c \"import ctypes,os;r=ctypes.CDLL(None).syscall(425,8,ctypes.create_string_buffer(120));print('io_uring', r, ctypes.get_errno())\""
    rootfs = image_root(runtime.api, "sandbox-server/python-data:latest", IMAGES)  # the servers' own copy
    bundle = write_bundle(tmp_path / "bundle", spec, rootfs, ["sh", "-c", probe])
    name = f"sbx-test-{time.monotonic_ns()}"
    done = subprocess.run(["runc", "run", "--bundle", str(bundle), name], capture_output=True, text=True, timeout=60)
    subprocess.run(["runc", "delete", "--force", name], capture_output=True, check=False)
    assert done.stdout.split()[:2] == ["io_uring", "-1"], (done.stdout, done.stderr)


THIRTY_TWO_BIT_CALL = r"""
import ctypes, mmap
code = mmap.mmap(-1, 4096, prot=mmap.PROT_READ | mmap.PROT_WRITE | mmap.PROT_EXEC)
code.write(bytes.fromhex("b814000000cd80c3"))  # mov eax, 20 (getpid in the i386 ABI); int 0x80; ret
print("i386 getpid:", ctypes.CFUNCTYPE(ctypes.c_int)(ctypes.addressof(ctypes.c_char.from_buffer(code)))(), flush=True)
"""


def test_a_32_bit_system_call_is_refused_outright_on_the_runc_path(tmp_path: Path, runtime: DockerRuntime) -> None:
    """The filter lists the host's own ABI alone: a call through the i386 ABI kills its program (SIGSYS), where the
    engine's filter lets it through the same list."""
    spec = _spec()
    rootfs = image_root(runtime.api, "sandbox-server/python-data:latest", IMAGES)  # the servers' own copy
    bundle = write_bundle(tmp_path / "bundle", spec, rootfs, ["python3", "-c", THIRTY_TWO_BIT_CALL])
    name = f"sbx-test-{time.monotonic_ns()}"
    done = subprocess.run(["runc", "run", "--bundle", str(bundle), name], capture_output=True, text=True, timeout=60)
    subprocess.run(["runc", "delete", "--force", name], capture_output=True, check=False)
    assert done.returncode == 128 + signal.SIGSYS and "i386 getpid" not in done.stdout, (done.stdout, done.stderr)


@pytest.mark.parametrize("bad", ["1000", "1000:1000"])
def test_the_sandboxs_user_is_its_policys(bad: str) -> None:
    from sandbox_server.sandbox.runc.oci import oci_config

    config = oci_config(SandboxSpec(image="x", argv=("true",), user=bad), "/r", ["true"])
    assert config["process"]["user"]["uid"] == 1000 and config["process"]["user"]["gid"] == 1000
