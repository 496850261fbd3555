"""The shipped seccomp profile `no-io-uring`: the engine's default protections, and no io_uring.

The engine's default profile still allows io_uring (`io_uring_setup` and friends), whose
kernel code has been a steady source of privilege escalations and which bypasses
syscall-level filtering of the operations it submits. The shipped profile is an allow
list: every system call this host's libseccomp knows for x86-64 and arm64, except the
denied ones below (answered EPERM), with `clone` refused when it asks for a new
namespace and `clone3` answered ENOSYS so that C libraries fall back to `clone`, whose
flags can be checked, `socket` refused for AF_VSOCK and `personality` held to the engine's
personas. Only the host's own ABI is listed: a 32-bit or x32 call kills its program. A system
call newer than the host's libseccomp is refused.

Regenerate with `python -m sandbox_server.sandbox.seccomp` (the test suite checks the shipped
file is current for the listed calls).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import json
import sys
from pathlib import Path
from typing import Any

from sandbox_server.shipped import seccomp_dir

__all__ = ["DENIED", "PROFILE_NAME", "profile_path", "build_profile", "known_syscalls"]

PROFILE_NAME = "no-io-uring"


def profile_path() -> Path:
    """Where the shipped profile lives."""
    return seccomp_dir() / f"{PROFILE_NAME}.json"


DENIED: dict[str, str] = {
    # io_uring: the reason this profile exists.
    "io_uring_setup": "io_uring", "io_uring_enter": "io_uring", "io_uring_register": "io_uring",
    # Namespaces and mounts: a sandbox never needs to make its own.
    "unshare": "namespaces", "setns": "namespaces", "mount": "mounts", "umount2": "mounts",
    "mount_setattr": "mounts", "move_mount": "mounts", "open_tree": "mounts", "fsopen": "mounts",
    "fsconfig": "mounts", "fsmount": "mounts", "fspick": "mounts", "pivot_root": "mounts",
    # The kernel itself: modules, kexec, reboot, swap, clocks, accounting, quotas.
    "init_module": "kernel modules", "finit_module": "kernel modules", "delete_module": "kernel modules",
    "create_module": "kernel modules", "query_module": "kernel modules", "get_kernel_syms": "kernel modules",
    "kexec_load": "kexec", "kexec_file_load": "kexec", "reboot": "reboot", "swapon": "swap", "swapoff": "swap",
    "settimeofday": "clock", "clock_settime": "clock", "clock_adjtime": "clock", "stime": "clock",
    "acct": "accounting", "quotactl": "quotas", "quotactl_fd": "quotas", "_sysctl": "sysctl",
    "sysfs": "obsolete", "uselib": "obsolete", "ustat": "obsolete", "nfsservctl": "obsolete",
    "vm86": "obsolete", "vm86old": "obsolete", "lookup_dcookie": "profiling",
    # Kernel attack surface with a history: keys, BPF, perf, userfaultfd, handles, raw I/O.
    "add_key": "keyring", "request_key": "keyring", "keyctl": "keyring", "bpf": "bpf",
    "perf_event_open": "perf", "userfaultfd": "userfaultfd", "open_by_handle_at": "file handles",
    "ioperm": "raw I/O ports", "iopl": "raw I/O ports", "kcmp": "process comparison", "vhangup": "terminals",
    # What the engine's default grants only with a capability a sandbox never holds (CAP_SYS_ADMIN, CAP_SYS_NICE,
    # CAP_SYS_PTRACE, CAP_SYS_CHROOT, CAP_SYSLOG): kept refused here too, where the kernel would let an
    # unprivileged caller through (fanotify_init with FAN_REPORT_FID, the NUMA calls on its own pages).
    "fanotify_init": "filesystem watching", "get_mempolicy": "NUMA placement", "set_mempolicy": "NUMA placement",
    "set_mempolicy_home_node": "NUMA placement", "mbind": "NUMA placement", "move_pages": "NUMA placement",
    "migrate_pages": "NUMA placement", "pidfd_getfd": "process comparison", "process_madvise": "process comparison",
    "chroot": "mounts", "sethostname": "names", "setdomainname": "names", "syslog": "kernel log",
    "afs_syscall": "obsolete", "getpmsg": "obsolete", "putpmsg": "obsolete", "security": "obsolete",
    "tuxcall": "obsolete", "vserver": "obsolete",
}  # fmt: skip

CLONE_NAMESPACES = 0x7E020000
"""CLONE_NEWNS | NEWCGROUP | NEWUTS | NEWIPC | NEWUSER | NEWPID | NEWNET."""

ARCHITECTURES = {"x86_64": "SCMP_ARCH_X86_64", "aarch64": "SCMP_ARCH_AARCH64"}
"""Each host's own system call ABI, alone: a call through another (i386's int 0x80, x32) is not in the filter, and
the kernel kills its program, on the engine's path as on runc's (the engine's default admits i386 and x32 calls
through the same list, `socket` among them: i386's has a number of its own)."""
EPERM, ENOSYS = 1, 38
AF_VSOCK = 40
"""Sockets to the hypervisor: a sandbox on a virtual machine could reach the host's vsock services past `network:
none` (refused by the engine's default profile since moby#44562)."""
PERSONAS = (0x0, 0x8, 0x20000, 0x20008, 0xFFFFFFFF)
"""personality(2) as the engine's default allows it: Linux (0), PER_LINUX32 (8, `linux32`'s uname), UNAME26
(0x20000) and both, and the query (0xffffffff); ADDR_NO_RANDOMIZE and every other persona are refused."""


def known_syscalls(architectures: tuple[str, ...] = ("x86_64", "aarch64")) -> list[str]:
    """Every system call name the host's libseccomp knows for these architectures."""
    library = ctypes.CDLL(ctypes.util.find_library("seccomp") or "libseccomp.so.2")
    library.seccomp_syscall_resolve_num_arch.restype = ctypes.c_void_p
    library.seccomp_arch_resolve_name.restype = ctypes.c_uint32
    names: set[str] = set()
    for architecture in architectures:
        token = library.seccomp_arch_resolve_name(architecture.encode())
        for number in range(1024):
            name = library.seccomp_syscall_resolve_num_arch(token, number)
            if name:
                names.add(ctypes.string_at(name).decode())
    return sorted(names)


def build_profile(syscalls: list[str]) -> dict[str, Any]:
    """The profile: allow every known call but the denied ones; clone without namespaces; clone3 -> ENOSYS."""
    conditional = ("clone", "clone3", "socket", "personality")
    allowed = [name for name in syscalls if name not in DENIED and name not in conditional]
    return {
        "defaultAction": "SCMP_ACT_ERRNO",
        "defaultErrnoRet": EPERM,
        "archMap": [{"architecture": native, "subArchitectures": []} for native in ARCHITECTURES.values()],
        "syscalls": [
            {"names": allowed, "action": "SCMP_ACT_ALLOW"},
            {
                "names": ["socket"],
                "action": "SCMP_ACT_ALLOW",
                "args": [{"index": 0, "value": AF_VSOCK, "valueTwo": 0, "op": "SCMP_CMP_NE"}],
                "comment": "every family but AF_VSOCK, the hypervisor's (the network namespace bounds the others)",
            },
            *(
                {
                    "names": ["personality"],
                    "action": "SCMP_ACT_ALLOW",
                    "args": [{"index": 0, "value": persona, "valueTwo": 0, "op": "SCMP_CMP_EQ"}],
                }
                for persona in PERSONAS
            ),
            {
                "names": ["clone"],
                "action": "SCMP_ACT_ALLOW",
                "args": [{"index": 0, "value": CLONE_NAMESPACES, "valueTwo": 0, "op": "SCMP_CMP_MASKED_EQ"}],
                "comment": "threads and processes, never new namespaces (x86-64 and arm64 take flags first)",
            },
            {
                "names": ["clone3"],
                "action": "SCMP_ACT_ERRNO",
                "errnoRet": ENOSYS,
                "comment": "its flags sit in memory a filter cannot read: callers fall back to clone",
            },  # fmt: skip
        ],
    }


def main() -> int:
    profile = build_profile(known_syscalls())
    path = profile_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(profile, indent=1) + "\n")
    print(f"wrote {path} ({len(profile['syscalls'][0]['names'])} calls allowed outright, {len(DENIED)} denied)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
