"""A SandboxSpec as an OCI runtime bundle's `config.json`: the hardened container of docs/design.md said to runc
directly, with what the engine's HostConfig says (sandbox.host_config) and nothing less.

The engine's path and this one must make the same sandbox: no capability in any set, no new privileges, the
policy's seccomp profile, a read-only root with a sized tmpfs at /tmp (noexec) and at the workspace (or the
workspace's slot bound there, slave propagation), the same masked and read-only paths, the sandbox's user, its
rlimits, memory equal to memory plus swap, pids and CPU in the cgroup, fresh namespaces (network too, for a call
with no network), `sandbox` as its host name, and a small init as PID 1 that reaps what the program leaves. The
root filesystem is the image's, unpacked once per image and shared read-only by every sandbox of it.
"""

from __future__ import annotations

import json
import platform
from collections.abc import Mapping, Sequence
from typing import Any

from sandbox_server.sandbox.engine.host_config import (
    ENGINE_MASKED_PATHS,
    MASKED_PATHS,
    RUNSC_PIDS_BASE,
    RUNSC_PIDS_FACTOR,
)
from sandbox_server.sandbox.spec import SandboxSpec

SPAN = 65536
"""Ids a sandbox with a user namespace of its own has: 0-65535, each a host id of its range (sandbox.host_ids)."""

__all__ = ["INIT_PATH", "INIT_SOURCE", "READONLY_PATHS", "merged_env", "oci_config", "oci_seccomp"]

INIT_PATH = "/sbin/docker-init"
"""Where the init (the engine's own tini, bound from the host read-only) is found inside a sandbox."""
INIT_SOURCE = "/usr/bin/docker-init"
"""The engine's init on the host."""
READONLY_PATHS = ("/proc/bus", "/proc/fs", "/proc/irq", "/proc/sys", "/proc/sysrq-trigger")
"""What the engine makes read-only in every container's /proc, and so does this path."""
NATIVE = {"x86_64": "SCMP_ARCH_X86_64", "aarch64": "SCMP_ARCH_AARCH64"}.get(platform.machine(), "")
"""The host's own system call ABI, as seccomp names it ("" where this module does not know it)."""
DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


def oci_seccomp(profile_json: str) -> dict[str, Any]:
    """An engine-format seccomp profile (an `archMap`, `names` per rule, `includes`/`excludes`) as the OCI
    runtime spec's `linux.seccomp`: the host's own architecture (else every one of its map), each rule whose conditions hold for a sandbox
    with no capability (a rule that `includes` capabilities never applies, one that `excludes` them always does)."""
    profile = json.loads(profile_json)
    arches: list[str] = []
    for entry in profile.get("archMap") or []:
        arches += [entry["architecture"], *entry.get("subArchitectures", [])]
    if NATIVE in arches:
        # The host's own system call ABI alone: a 32-bit or x32 call is refused outright (the engine allows them
        # through the same list), and the filter is compiled for one ABI instead of four, half of runc's CPU.
        arches = [NATIVE]
    rules = []
    for rule in profile.get("syscalls") or []:
        if (rule.get("includes") or {}).get("caps"):
            continue  # granted only to containers holding a capability: a sandbox holds none
        kept = {"names": rule["names"], "action": rule["action"]}
        if rule.get("args"):
            kept["args"] = rule["args"]
        if "errnoRet" in rule:
            kept["errnoRet"] = rule["errnoRet"]
        rules.append(kept)
    said: dict[str, Any] = {"defaultAction": profile["defaultAction"], "architectures": arches, "syscalls": rules}
    if "defaultErrnoRet" in profile:
        said["defaultErrnoRet"] = profile["defaultErrnoRet"]
    return said


def merged_env(image_env: Sequence[str], env: Sequence[tuple[str, str]]) -> list[str]:
    """A container's environment as the engine makes it: the image's, each name the spec sets replaced by its
    value, the host name, and a default PATH when neither gives one."""
    merged = dict(item.partition("=")[::2] for item in image_env)
    merged |= dict(env)
    merged.setdefault("PATH", DEFAULT_PATH)
    merged.setdefault("HOSTNAME", "sandbox")
    return [f"{name}={value}" for name, value in merged.items()]


RLIMITS = "sandbox-server.rlimits"
"""The annotation holding the rlimits of a sandbox with host ids of its own, whose config gives runc none (its first
shell sets them): a sandbox forked from a template has them set by the template's child before anything of the
image runs, so a warm interpreter's program, which the shell does not start, has them too."""


def _rlimits(nofile: int, file_size: int) -> list[dict[str, Any]]:
    return [
        {"type": "RLIMIT_NOFILE", "soft": nofile, "hard": nofile},
        {"type": "RLIMIT_FSIZE", "soft": file_size, "hard": file_size},
        {"type": "RLIMIT_CORE", "soft": 0, "hard": 0},
    ]


def _limited(nofile: int, file_size: int, argv: list[str]) -> list[str]:
    """The init and `argv` run by a shell that first sets the sandbox's rlimits on itself, soft and hard, then
    becomes the init (refused: the sandbox ends before anything else runs). runc sets them from outside with prlimit(2), which this kernel refuses for a
    process in a user namespace that another host id owns; a process may always lower its own."""
    blocks = file_size // 512  # ulimit -f counts 512-byte blocks
    script = f'ulimit -n {nofile} && ulimit -f {blocks} && ulimit -c 0 || exit 126; exec "$0" "$@"'
    return ["/bin/sh", "-c", script, INIT_PATH, "--", *argv]


def oci_config(
    spec: SandboxSpec,
    rootfs: str,
    argv: list[str],
    slot: str | None = None,
    *,
    image_env: Sequence[str] = (),
    cgroups_path: str | None = None,
    annotations: Mapping[str, str] | None = None,
    user_namespace: tuple[str, int] | None = None,
) -> dict[str, Any]:
    """The bundle's config.json for a spec: `rootfs` the image's unpacked root, `argv` the program (after the
    init), `slot` the host folder bound at the workspace (None: a sized tmpfs there), `image_env` the image's own
    environment (the spec's overrides it), `cgroups_path` where runc makes its cgroups (None:
    runc's choice), `annotations` what the bundle says of its owner, `user_namespace` the file holding the sandbox's
    user namespace and the first host id it maps ids 0-65535 onto (None: the host's ids, as the engine's)."""
    limits = spec.limits
    gvisor = spec.runtime == "runsc"
    uid_text, _, gid_text = spec.user.partition(":")
    uid, gid = int(uid_text), int(gid_text or uid_text)
    memory = limits.memory_mb * 1024 * 1024
    file_size = limits.file_size_mb * 1024 * 1024
    tmp = [f"size={limits.tmp_mb}m", f"nr_inodes={max(1024, limits.tmp_mb * 256)}", "mode=1777", "noexec", "nosuid", "nodev"]  # fmt: skip
    mounts: list[dict[str, Any]] = [
        {"destination": "/proc", "type": "proc", "source": "proc", "options": ["nosuid", "noexec", "nodev"]},
        {
            "destination": "/dev",
            "type": "tmpfs",
            "source": "tmpfs",
            "options": ["nosuid", "strictatime", "mode=755", "size=65536k"],
        },  # fmt: skip
        {
            "destination": "/dev/pts",
            "type": "devpts",
            "source": "devpts",
            "options": ["nosuid", "noexec", "newinstance", "ptmxmode=0666", "mode=0620", "gid=5"],
        },  # fmt: skip
        {
            "destination": "/dev/shm",
            "type": "tmpfs",
            "source": "shm",
            "options": ["nosuid", "noexec", "nodev", "mode=1777", f"size={limits.shm_mb * 1024 * 1024}"],
        },  # fmt: skip
        {"destination": "/dev/mqueue", "type": "mqueue", "source": "mqueue", "options": ["nosuid", "noexec", "nodev"]},
        {"destination": "/sys", "type": "sysfs", "source": "sysfs", "options": ["nosuid", "noexec", "nodev", "ro"]},
        {
            "destination": "/sys/fs/cgroup",
            "type": "cgroup",
            "source": "cgroup",
            "options": ["nosuid", "noexec", "nodev", "relatime", "ro"],
        },  # fmt: skip
        {"destination": "/tmp", "type": "tmpfs", "source": "tmpfs", "options": tmp},
        {
            "destination": INIT_PATH,
            "type": "bind",
            "source": INIT_SOURCE,
            "options": ["rbind", "ro", "nosuid", "nodev"],
        },  # fmt: skip
    ]
    if slot is None:
        workspace = [
            f"size={limits.workspace_mb}m", f"nr_inodes={limits.workspace_inodes}", f"uid={uid}", f"gid={gid}",
            "mode=0755", "nosuid", "nodev", "exec" if limits.workspace_exec else "noexec",
        ]  # fmt: skip
        mounts.append({"destination": spec.workdir, "type": "tmpfs", "source": "tmpfs", "options": workspace})
    else:
        mounts.append({"destination": spec.workdir, "type": "bind", "source": slot, "options": ["rbind", "rslave"]})
    for mount in spec.mounts:
        options = ["rbind", "ro" if mount.read_only else "rw", "nosuid", "nodev"]
        mounts.append(
            {"destination": mount.sandbox_path, "type": "bind", "source": mount.host_path, "options": options}
        )
    env = merged_env(image_env, spec.env)
    linux: dict[str, Any] = {
        "namespaces": [{"type": kind} for kind in ("pid", "ipc", "uts", "mount", "network", "cgroup")],
        "maskedPaths": list(ENGINE_MASKED_PATHS if gvisor else MASKED_PATHS),  # as the engine's path has them
        "readonlyPaths": list(READONLY_PATHS),
        "resources": {
            "devices": [{"allow": False, "access": "rwm"}],
            "memory": {"limit": memory, "swap": memory},
            "pids": {"limit": limits.pids * RUNSC_PIDS_FACTOR + RUNSC_PIDS_BASE if gvisor else limits.pids},
            "cpu": {"quota": int(limits.cpus * 100_000), "period": 100_000},
        },
        "sysctl": {f"net.ipv6.conf.{which}.disable_ipv6": "1" for which in ("all", "default")}
        if spec.networked
        else {},
    }
    if user_namespace is not None:
        held, first = user_namespace
        linux["namespaces"].insert(0, {"type": "user", "path": held})
        linux["uidMappings"] = linux["gidMappings"] = [{"containerID": 0, "hostID": first, "size": SPAN}]
    if spec.seccomp_profile is not None:
        linux["seccomp"] = oci_seccomp(spec.seccomp_profile)
    if cgroups_path is not None:
        linux["cgroupsPath"] = cgroups_path
    rlimits = _rlimits(limits.nofile, file_size)
    said = dict(annotations or {})
    if user_namespace is not None:  # (runc is not given them; a template's child sets them on itself, as the shell)
        said[RLIMITS] = json.dumps(rlimits)
    return {
        "annotations": said,
        "ociVersion": "1.0.2",
        "root": {"path": rootfs, "readonly": True},
        "hostname": "sandbox",
        "mounts": mounts,
        "process": {
            "terminal": False,
            "user": {"uid": uid, "gid": gid, "additionalGids": [gid]},
            "args": [INIT_PATH, "--", *argv] if user_namespace is None else _limited(limits.nofile, file_size, argv),
            "env": env,
            "cwd": spec.workdir,
            "capabilities": {kind: [] for kind in ("bounding", "effective", "inheritable", "permitted", "ambient")},
            "rlimits": rlimits if user_namespace is None else [],
            "noNewPrivileges": True,
        },
        "linux": linux,
    }
