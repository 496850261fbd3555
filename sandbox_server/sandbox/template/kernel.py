"""The kernel's calls the template's child makes, through the C library (the standard library has no unshare,
mount, pivot_root, capset or seccomp of its own): each raises OSError with the call's name when it fails.

Like every module of the child's way in, it needs the standard library alone: it runs in the image's own
interpreter, where nothing of this package is installed."""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import os

LIBC = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)

CLONE_NEWNS, CLONE_NEWCGROUP, CLONE_NEWUTS, CLONE_NEWIPC = 0x00020000, 0x02000000, 0x04000000, 0x08000000
CLONE_NEWUSER, CLONE_NEWPID, CLONE_NEWNET = 0x10000000, 0x20000000, 0x40000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 0x1, 0x2, 0x4, 0x8
MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE, MS_SLAVE = 0x20, 0x1000, 0x4000, 0x40000, 0x80000
MS_NOATIME, MS_NODIRATIME, MS_RELATIME, MS_STRICTATIME = 0x400, 0x800, 0x200000, 0x1000000
MNT_DETACH = 2
STATVFS_FLAGS = {os.ST_RDONLY: MS_RDONLY, os.ST_NOSUID: MS_NOSUID, os.ST_NODEV: MS_NODEV, os.ST_NOEXEC: MS_NOEXEC,
                 os.ST_NOATIME: MS_NOATIME, os.ST_NODIRATIME: MS_NODIRATIME, os.ST_RELATIME: MS_RELATIME}  # fmt: skip
"""A mount's flags as statvfs says them, as mount(2) takes them."""
PR_CAPBSET_READ, PR_CAPBSET_DROP, PR_SET_NO_NEW_PRIVS, PR_SET_SECCOMP = 23, 24, 38, 22
PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL = 47, 4
SECCOMP_MODE_FILTER = 2
MADV_COLLAPSE = 25
HUGE_PAGE = 2 << 20
SYS_PIVOT_ROOT = 155  # x86_64
SYS_CAPSET = 126

MOUNT_FLAGS = {
    "ro": MS_RDONLY, "nosuid": MS_NOSUID, "nodev": MS_NODEV, "noexec": MS_NOEXEC, "noatime": MS_NOATIME,
    "nodiratime": MS_NODIRATIME, "relatime": MS_RELATIME, "strictatime": MS_STRICTATIME, "bind": MS_BIND,
    "rbind": MS_BIND | MS_REC,
}  # fmt: skip
"""The OCI runtime spec's mount options that are flags (the others are the filesystem's data, or propagation)."""
PROPAGATION = {"rslave": MS_SLAVE | MS_REC, "slave": MS_SLAVE, "rprivate": MS_PRIVATE | MS_REC, "private": MS_PRIVATE}


def _checked(name: str, result: int) -> int:
    if result < 0:
        error = ctypes.get_errno()
        raise OSError(error, f"{name}: {os.strerror(error)}")
    return result


def fork() -> int:
    """fork(2), with every object the child was born with out of its collector's sight (`gc.freeze`): a full
    collection in the child would write to each one's header, copying every page of its parent's heap that holds
    one (a tenth of the CPU the template's children spent in a profile of a burst of shell calls). What the child
    makes after is collected as ever."""
    pid = os.fork()
    if pid == 0:
        gc.freeze()
    return pid


def collapse_heap(maps: int) -> int:
    """The process's own anonymous memory, 2 MiB at a time where at least half of it is in use, made huge pages
    (madvise MADV_COLLAPSE, Linux 6.1; `maps`: its /proc/<pid>/maps, open). A fork copies one entry of the page
    tables for each, not 512, and an exit drops one: a warm template's heap copied and torn down per call costs a
    fraction of what it did. A child that writes to one splits that entry alone and copies the 4 KiB it wrote, as
    before. Where the kernel will not (no huge pages free, THP set to never), nothing changes. How many MiB it made
    huge; never raises."""
    made = 0
    LIBC.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    LIBC.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]
    resident = ctypes.create_string_buffer(HUGE_PAGE // 4096)
    try:
        with os.fdopen(maps, "r", encoding="ascii", errors="replace") as listing:
            ranges = [line.split() for line in listing]
    except OSError:
        return 0
    for fields in ranges:  # (start-end, permissions, offset, device, inode[, path])
        if fields[1][:2] != "rw" or fields[1][3] != "p" or (len(fields) > 5 and fields[5] != "[heap]"):
            continue
        start, end = (int(bound, 16) for bound in fields[0].split("-"))
        for place in range((start + HUGE_PAGE - 1) & -HUGE_PAGE, end & -HUGE_PAGE, HUGE_PAGE):
            if LIBC.mincore(place, HUGE_PAGE, resident) != 0:
                continue
            if sum(byte & 1 for byte in resident.raw) * 2 < len(resident.raw):
                continue  # (mostly not in use: made whole, it would take memory nobody asked for)
            if LIBC.madvise(place, HUGE_PAGE, MADV_COLLAPSE) == 0:
                made += 2
    return made


def unshare(flags: int) -> None:
    _checked("unshare", LIBC.unshare(ctypes.c_int(flags)))


def setns(fd: int, kind: int) -> None:
    _checked("setns", LIBC.setns(ctypes.c_int(fd), ctypes.c_int(kind)))


def mount(source: str | None, target: str, kind: str | None, flags: int, data: str | None = None) -> None:
    def text(value: str | None) -> bytes | None:
        return value.encode() if value is not None else None

    result = LIBC.mount(text(source), text(target), text(kind), ctypes.c_ulong(flags), text(data))
    if result < 0:
        error = ctypes.get_errno()
        raise OSError(error, f"mount {kind or 'bind'} on {target}: {os.strerror(error)}")


def remount(target: str, flags: int) -> None:
    """A bind mount's flags changed: `flags` added to those it has (in a user namespace the flags it was made with
    are locked, and a remount without them is refused)."""
    found = os.statvfs(target).f_flag
    held = sum(flag for given, flag in STATVFS_FLAGS.items() if found & given)
    mount(None, target, None, MS_REMOUNT | MS_BIND | held | flags)


def umount(target: str, flags: int = MNT_DETACH) -> None:
    _checked(f"umount {target}", LIBC.umount2(target.encode(), ctypes.c_int(flags)))


def pivot_root(new_root: str, put_old: str) -> None:
    _checked("pivot_root", LIBC.syscall(ctypes.c_long(SYS_PIVOT_ROOT), new_root.encode(), put_old.encode()))


def prctl(option: int, arg2: int | ctypes.c_void_p = 0, arg3: int = 0) -> int:
    return _checked(f"prctl {option}", LIBC.prctl(ctypes.c_int(option), arg2, ctypes.c_ulong(arg3), 0, 0))


def sethostname(name: str) -> None:
    _checked("sethostname", LIBC.sethostname(name.encode(), ctypes.c_size_t(len(name))))


class _CapHeader(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]


class _CapData(ctypes.Structure):
    _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32), ("inheritable", ctypes.c_uint32)]


def capset_none() -> None:
    """Every capability set of this thread emptied (effective, permitted, inheritable)."""
    header = _CapHeader(0x20080522, 0)  # _LINUX_CAPABILITY_VERSION_3
    data = (_CapData * 2)()
    _checked("capset", LIBC.syscall(ctypes.c_long(SYS_CAPSET), ctypes.byref(header), ctypes.byref(data)))


class _SockFilter(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint16), ("jt", ctypes.c_uint8), ("jf", ctypes.c_uint8), ("k", ctypes.c_uint32)]


class _SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_uint16), ("filter", ctypes.POINTER(_SockFilter))]


def load_seccomp(program: bytes) -> None:
    """Load a compiled seccomp filter (its BPF instructions, 8 bytes each) on this thread (no_new_privs set)."""
    count = len(program) // 8
    instructions = (_SockFilter * count).from_buffer_copy(program)
    prog = _SockFprog(count, ctypes.cast(instructions, ctypes.POINTER(_SockFilter)))
    _checked("seccomp", LIBC.prctl(ctypes.c_int(PR_SET_SECCOMP), ctypes.c_ulong(SECCOMP_MODE_FILTER),
                                   ctypes.byref(prog), 0, 0))  # fmt: skip
