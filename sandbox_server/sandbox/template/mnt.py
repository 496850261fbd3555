"""The sandbox's filesystem, made as its OCI config says (the config runc would be given): the image's root
read-only, each of its mounts in order, /proc of its own pid namespace with the engine's masked and read-only
paths, then pivoted into, the host's tree detached behind it."""

from __future__ import annotations

import os
import stat
from collections.abc import Mapping, Sequence
from typing import Any

from . import kernel

DEVICES = (("null", 1, 3), ("zero", 1, 5), ("full", 1, 7), ("random", 1, 8), ("urandom", 1, 9), ("tty", 5, 0))
"""The device nodes every sandbox has in its /dev, as runc makes them (character devices, mode 0666)."""
LINKS = (("/proc/self/fd", "fd"), ("/proc/self/fd/0", "stdin"), ("/proc/self/fd/1", "stdout"),
         ("/proc/self/fd/2", "stderr"), ("pts/ptmx", "ptmx"), ("/proc/kcore", "core"))  # fmt: skip


def split_options(options: Sequence[str]) -> tuple[int, int, str]:
    """A mount's OCI options as mount(2)'s flags, its propagation, and the filesystem's own data."""
    flags = propagation = 0
    data = []
    for option in options:
        if option in kernel.MOUNT_FLAGS:
            flags |= kernel.MOUNT_FLAGS[option]
        elif option in kernel.PROPAGATION:
            propagation |= kernel.PROPAGATION[option]
        elif option not in ("rw", "dev", "suid", "exec", "atime"):
            data.append(option)
    return flags, propagation, ",".join(data)


def _point(target: str, directory: bool) -> None:
    """The mount point, made when the image has none (as runc makes them)."""
    if os.path.lexists(target):
        return
    os.makedirs(os.path.dirname(target), exist_ok=True)
    if directory:
        os.mkdir(target, 0o755)
    else:
        os.close(os.open(target, os.O_CREAT | os.O_WRONLY, 0o644))


def _inside(root: str, destination: str) -> str:
    """`destination` under `root`, its links followed as they lead: never out of `root`."""
    target = os.path.realpath(os.path.join(root, destination.lstrip("/")))
    if target != root and not target.startswith(root.rstrip("/") + "/"):
        raise OSError(f"mount point {destination} leads out of the sandbox's root")
    return target


def root(config: Mapping[str, Any], new_root: str) -> None:
    """The image's root bound at `new_root` (a host folder of this sandbox's, in its own mount namespace), and
    every mount of the config but /proc under it; read-only once pivoted (`pivot`)."""
    kernel.mount(None, "/", None, kernel.MS_REC | kernel.MS_SLAVE)
    kernel.mount(config["root"]["path"], new_root, None, kernel.MS_BIND | kernel.MS_REC)
    for entry in config["mounts"]:
        if entry["destination"] == "/proc":
            continue
        _one(entry, new_root)
    _devices(new_root)


def _one(entry: Mapping[str, Any], new_root: str) -> None:
    kind, source = entry.get("type", "bind"), entry.get("source", "none")
    flags, propagation, data = split_options(entry.get("options", []))
    bind = bool(flags & kernel.MS_BIND)
    directory = not bind or stat.S_ISDIR(os.stat(source).st_mode)
    target = _inside(new_root, entry["destination"])
    _point(target, directory)
    if kind == "cgroup":
        _cgroups(target, flags)
        return
    if bind:
        kernel.mount(source, target, None, flags & (kernel.MS_BIND | kernel.MS_REC))
        if flags & ~(kernel.MS_BIND | kernel.MS_REC):  # bind's own flags take a remount
            kernel.mount(None, target, None, kernel.MS_REMOUNT | kernel.MS_BIND | (flags & ~kernel.MS_REC))
    else:
        kernel.mount(source, target, kind, flags, data or None)
    if propagation:
        kernel.mount(None, target, None, propagation)


def _cgroups(target: str, flags: int) -> None:
    """cgroup v1's hierarchies, as the sandbox's cgroup namespace shows them (its own cgroup their root), under a
    tmpfs: read-only, as runc mounts them."""
    kernel.mount("tmpfs", target, "tmpfs", kernel.MS_NOSUID | kernel.MS_NODEV | kernel.MS_NOEXEC, "mode=755")
    with open("/proc/self/mountinfo") as table:
        hierarchies = []
        for line in table:
            fields = line.split(" - ", 1)
            if len(fields) == 2 and fields[1].startswith("cgroup "):
                options = fields[1].split()[2].split(",")
                wanted = [o for o in options if o not in ("rw", "ro", "relatime")]
                if wanted:
                    hierarchies.append(",".join(wanted))
    for hierarchy in hierarchies:
        name = hierarchy.removeprefix("name=")
        os.mkdir(os.path.join(target, name), 0o755)
        kernel.mount("cgroup", os.path.join(target, name), "cgroup", flags | kernel.MS_RDONLY, hierarchy)
    kernel.mount(None, target, None, kernel.MS_REMOUNT | kernel.MS_RDONLY | kernel.MS_NOSUID | kernel.MS_NODEV
                 | kernel.MS_NOEXEC, "mode=755")  # fmt: skip


def _devices(new_root: str) -> None:
    dev = os.path.join(new_root, "dev")
    for name, major, minor in DEVICES:
        node = os.path.join(dev, name)
        os.mknod(node, 0o666 | stat.S_IFCHR, os.makedev(major, minor))
        os.chmod(node, 0o666)
    for source, name in LINKS:
        os.symlink(source, os.path.join(dev, name))


def proc(config: Mapping[str, Any]) -> None:
    """/proc of the sandbox's own pid namespace (mounted by its first process there), then the masked paths (an
    empty read-only tmpfs on a folder, /dev/null on a file) and the read-only ones: after the pivot."""
    entry = next(m for m in config["mounts"] if m["destination"] == "/proc")
    flags, _, _ = split_options(entry.get("options", []))
    kernel.mount("proc", "/proc", "proc", flags)
    linux = config["linux"]
    for name, value in (linux.get("sysctl") or {}).items():
        with open("/proc/sys/" + name.replace(".", "/"), "w") as setting:
            setting.write(value)
    for path in linux.get("maskedPaths", []):
        if not os.path.lexists(path):
            continue
        if os.path.isdir(path):
            kernel.mount("tmpfs", path, "tmpfs", kernel.MS_RDONLY, "size=0")
        else:
            kernel.mount("/dev/null", path, None, kernel.MS_BIND)
    for path in linux.get("readonlyPaths", []):
        if os.path.lexists(path):
            kernel.mount(path, path, None, kernel.MS_BIND | kernel.MS_REC)
            kernel.mount(None, path, None, kernel.MS_REMOUNT | kernel.MS_BIND | kernel.MS_RDONLY)


def pivot(new_root: str, read_only: bool) -> None:
    """Into the sandbox's root: the host's tree (and the template's) detached, out of reach for good."""
    os.chdir(new_root)
    kernel.pivot_root(".", ".")
    kernel.umount(".", kernel.MNT_DETACH)
    os.chdir("/")
    if read_only:
        kernel.mount(None, "/", None, kernel.MS_REMOUNT | kernel.MS_BIND | kernel.MS_RDONLY)
