"""The sandbox's filesystem, made as its OCI config says (the config runc would be given): the image's root
read-only, each of its mounts in order, /proc of its own pid namespace with the engine's masked and read-only
paths, then pivoted into, the host's tree detached behind it."""

from __future__ import annotations

import functools
import os
import stat
from collections.abc import Mapping, Sequence
from typing import Any

from . import kernel

DEVICES = ("null", "zero", "full", "random", "urandom", "tty")
"""The devices every sandbox has in its /dev, as runc gives them."""
REQUEST_FOLDERS = ("/tmp/.sandbox", "/workspace/out")
"""The launcher's request folder and the call's output folder (the image's launcher makes them where they lack)."""
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
    target = _under(root, destination) or os.path.realpath(os.path.join(root, destination.lstrip("/")))
    if target != root and not target.startswith(root.rstrip("/") + "/"):
        raise OSError(f"mount point {destination} leads out of the sandbox's root")
    return target


def _under(root: str, destination: str) -> str | None:
    """What `os.path.realpath` makes of `destination` under a root that is itself a real path, when no part of
    `destination` is a link or `..`: each part below the root looked at once, not every folder above it (a
    sandbox's mounts would look at the root's ten folders 30 times). None: realpath must decide."""
    parts = [part for part in destination.split("/") if part and part != "."]
    if ".." in parts or not _real(root):
        return None
    path = root
    for part in parts:
        path = os.path.join(path, part)
        try:
            if stat.S_ISLNK(os.lstat(path).st_mode):
                return None
        except OSError:
            pass  # (missing: realpath keeps the rest of the path as it is written)
    return path


@functools.cache
def _real(root: str) -> bool:
    return os.path.isabs(root) and os.path.realpath(root) == root


def root(config: Mapping[str, Any], new_root: str) -> None:
    """The image's root bound at `new_root` (a host folder of this sandbox's, in its own mount namespace), and
    every mount of the config but /proc under it; read-only once pivoted (`pivot`)."""
    kernel.mount(None, "/", None, kernel.MS_REC | kernel.MS_SLAVE)
    kernel.mount(config["root"]["path"], new_root, None, kernel.MS_BIND | kernel.MS_REC)
    for entry in config["mounts"]:
        if entry["destination"] == "/proc":
            continue
        _one(entry, new_root, config["linux"]["cgroupsPath"])
    _devices(new_root)


def _one(entry: Mapping[str, Any], new_root: str, cgroups: str) -> None:
    kind, source = entry.get("type", "bind"), entry.get("source", "none")
    flags, propagation, data = split_options(entry.get("options", []))
    bind = bool(flags & kernel.MS_BIND)
    directory = not bind or stat.S_ISDIR(os.stat(source).st_mode)
    target = _inside(new_root, entry["destination"])
    _point(target, directory)
    if kind == "cgroup":
        _cgroups(target, flags, cgroups)
        return
    if bind:
        kernel.mount(source, target, None, flags & (kernel.MS_BIND | kernel.MS_REC))
        if flags & ~(kernel.MS_BIND | kernel.MS_REC):  # bind's own flags take a remount
            kernel.remount(target, flags & ~(kernel.MS_BIND | kernel.MS_REC))
    else:
        kernel.mount(source, target, kind, flags, data or None)
    if propagation:
        kernel.mount(None, target, None, propagation)


def _cgroups(target: str, flags: int, path: str) -> None:
    """The call's own cgroup of each v1 hierarchy the host made it in, bound read-only under a tmpfs (as runc binds
    them where it may not mount cgroupfs: in a user namespace of the sandbox's own)."""
    kernel.mount("tmpfs", target, "tmpfs", kernel.MS_NOSUID | kernel.MS_NODEV | kernel.MS_NOEXEC, "mode=755")
    for hierarchy in sorted(os.listdir("/sys/fs/cgroup")):  # those the host made the call's cgroup in
        source = os.path.join("/sys/fs/cgroup", hierarchy, path.lstrip("/"))
        if os.path.isdir(source):
            os.mkdir(os.path.join(target, hierarchy), 0o755)
            kernel.mount(source, os.path.join(target, hierarchy), None, kernel.MS_BIND)
            kernel.remount(os.path.join(target, hierarchy), flags | kernel.MS_RDONLY)
    kernel.remount(target, kernel.MS_RDONLY)


def _devices(new_root: str) -> None:
    """The host's null, zero, full, random, urandom and tty bound into the sandbox's /dev (no device node is made:
    in a user namespace none may be), and the links runc makes."""
    dev = os.path.join(new_root, "dev")
    for name in DEVICES:
        node = os.path.join(dev, name)
        os.close(os.open(node, os.O_CREAT | os.O_WRONLY, 0o666))
        kernel.mount(os.path.join("/dev", name), node, None, kernel.MS_BIND)
    for source, name in LINKS:
        os.symlink(source, os.path.join(dev, name))


def proc(config: Mapping[str, Any], new_root: str) -> None:
    """/proc of the sandbox's own pid namespace (mounted by its first process there, before the pivot: in a user
    namespace the kernel mounts a new proc only where one is fully visible), then the masked paths (an empty
    read-only tmpfs on a folder, /dev/null on a file) and the read-only ones."""
    entry = next(m for m in config["mounts"] if m["destination"] == "/proc")
    flags, _, _ = split_options(entry.get("options", []))
    kernel.mount("proc", _inside(new_root, "/proc"), "proc", flags)
    linux = config["linux"]
    for name, value in (linux.get("sysctl") or {}).items():
        with open(_inside(new_root, "/proc/sys/" + name.replace(".", "/")), "w") as setting:
            setting.write(value)
    for masked in linux.get("maskedPaths", []):
        path = _inside(new_root, masked)
        if not os.path.lexists(path):
            continue
        if os.path.isdir(path):
            kernel.mount("tmpfs", path, "tmpfs", kernel.MS_RDONLY, "size=0")
        else:
            kernel.mount("/dev/null", path, None, kernel.MS_BIND)
    for read_only in linux.get("readonlyPaths", []):
        path = _inside(new_root, read_only)
        if os.path.lexists(path):
            kernel.mount(path, path, None, kernel.MS_BIND | kernel.MS_REC)
            kernel.remount(path, kernel.MS_RDONLY)


def pivot(new_root: str, read_only: bool) -> None:
    """Into the sandbox's root: the host's tree (and the template's) detached, out of reach for good."""
    os.chdir(new_root)
    kernel.pivot_root(".", ".")
    kernel.umount(".", kernel.MNT_DETACH)
    os.chdir("/")
    if read_only:
        kernel.remount("/", kernel.MS_RDONLY)


def request_folders() -> None:
    """The launcher's request and output folders, made as the sandbox's user before its call comes, so that its
    launcher starts no `mkdir`; one that cannot be made here (a kept workspace's slot, which the host binds at the
    call) is left to the launcher, as in any other sandbox."""
    for folder in REQUEST_FOLDERS:
        try:
            os.mkdir(folder)
            os.chmod(folder, 0o755)
        except OSError:
            pass
