"""A SandboxSpec as the engine's HostConfig: the hardened container of docs/design.md."""

from __future__ import annotations

from typing import Any

from docker.types import Mount

from sandbox_server.sandbox.engine.dialect import DOCKER, EngineDialect
from sandbox_server.sandbox.spec import SandboxSpec

__all__ = ["MASKED_PATHS", "RUNSC_PIDS_BASE", "RUNSC_PIDS_FACTOR", "host_config_kwargs", "masked_paths"]

ENGINE_MASKED_PATHS = (
    "/proc/asound", "/proc/acpi", "/proc/kcore", "/proc/keys", "/proc/latency_stats", "/proc/timer_list",
    "/proc/timer_stats", "/proc/sched_debug", "/proc/scsi", "/sys/firmware", "/sys/devices/virtual/powercap",
)  # fmt: skip
"""The engine's own masked paths, which a HostConfig that names any replaces: kept as they are."""
BLOCK_DEVICE_VIEWS = ("/sys/devices/virtual/block", "/sys/block", "/sys/class/block", "/sys/dev/block")
"""Where the kernel shows the host's block devices, loop devices' backing files (a kept workspace's image on
the host) among them."""
MASKED_PATHS = ENGINE_MASKED_PATHS + BLOCK_DEVICE_VIEWS
"""Paths a sandbox sees empty (folders) or as /dev/null (files)."""

RUNSC_PIDS_FACTOR, RUNSC_PIDS_BASE = 8, 256
"""Under gVisor the sandbox kernel's own host threads (several per guest task on the ptrace
platform) count against the pids cgroup, so the cgroup limit is pids * 8 + 256 there."""


def masked_paths(spec: SandboxSpec) -> list[str] | None:
    """The HostConfig's MaskedPaths for a spec; None to leave the engine's. gVisor's own /sys shows no host
    device; naming masked paths to it slowed its sandboxes' start enough that a strict caller's first cell
    ran past its 10 s."""
    return None if spec.runtime == "runsc" else list(MASKED_PATHS)


def host_config_kwargs(spec: SandboxSpec, slot: str | None = None, dialect: EngineDialect = DOCKER) -> dict[str, Any]:
    """The engine's HostConfig for a spec (keyword arguments of the engine client's create_host_config).

    `slot`: the host folder bound at the workspace (a kept workspace is mounted onto it per
    call, and the mount propagates in); without one the workspace is a sized tmpfs. `dialect`: the
    engine's way of saying it.
    """
    limits = spec.limits
    uid, _, gid = spec.user.partition(":")
    security_opt = ["no-new-privileges"]
    if spec.seccomp_profile is not None:
        security_opt.append(f"seccomp={spec.seccomp_profile}")
    tmpfs = {"/tmp": f"size={limits.tmp_mb}m,nr_inodes={max(1024, limits.tmp_mb * 256)},mode=1777,noexec,nosuid,nodev"}
    if slot is None:
        tmpfs[spec.workdir] = (
            f"size={limits.workspace_mb}m,nr_inodes={limits.workspace_inodes},"
            f"uid={uid},gid={gid or uid},mode=0755,nosuid,nodev"
            + (",exec" if limits.workspace_exec else ",noexec")  # the engine's tmpfs is noexec unless told
        )
    network: dict[str, Any] = {}
    if spec.networked:
        # An internal network with a proxy: no name server but loopback (names are the proxy's
        # business) and no IPv6 (its link-local addresses would reach the host's bridge).
        network = {"dns": ["127.0.0.1"], "sysctls": {"net.ipv6.conf.all.disable_ipv6": "1"}}
    return dialect.adapt(
        {
            **network,
            "read_only": True,
            "cap_drop": ["ALL"],
            "security_opt": security_opt,
            "tmpfs": tmpfs,
            "mounts": [] if slot is None else [Mount(spec.workdir, slot, type="bind", propagation="rslave")],
            "pids_limit": limits.pids if spec.runtime != "runsc" else limits.pids * RUNSC_PIDS_FACTOR + RUNSC_PIDS_BASE,
            "mem_limit": limits.memory_mb * 1024 * 1024,
            "memswap_limit": limits.memory_mb * 1024 * 1024,
            "nano_cpus": int(limits.cpus * 1e9),
            "ulimits": [
                {"name": "nofile", "soft": limits.nofile, "hard": limits.nofile},
                {"name": "fsize", "soft": limits.file_size_mb * 1024 * 1024, "hard": limits.file_size_mb * 1024 * 1024},
                {"name": "core", "soft": 0, "hard": 0},
            ],
            # Its services' network when that is its only one; an egress network is joined first, theirs besides.
            "network_mode": spec.network if spec.network != "none" else (spec.service_network or "none"),
            "ipc_mode": "private",
            "shm_size": limits.shm_mb * 1024 * 1024,
            "init": True,
            "log_config": {"type": "none", "config": {}},
            "runtime": spec.runtime,
            "binds": {
                mount.host_path: {"bind": mount.sandbox_path, "mode": "ro" if mount.read_only else "rw"}
                for mount in spec.mounts
            },
            "privileged": False,
        }
    )
