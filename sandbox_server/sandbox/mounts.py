"""The host's mounts for kept workspaces: a sized ext4 image per workspace, bound into a warm container.

A warm container is created before its call, so it cannot be created with the workspace it
will work in. It is created instead with an empty *slot* (a host folder of its own) bound at
/workspace with slave propagation; when its call comes, the host binds the workspace's
mounted filesystem onto the slot, the kernel propagates that mount into the container, and
after the call the host detaches it again. The filesystem's size and inode count are the
kernel's limits on what a workspace can hold.

Needs root on the engine's own host (mount(2), loop devices); the archive keeping of
sandbox_server.workspaces.contents works everywhere else.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import os
import shutil
import struct
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path

from sandbox_server.sandbox.runc import views

__all__ = [
    "MountError",
    "bind",
    "bind_outputs",
    "clear_calls",
    "detach",
    "detach_under",
    "drop_outputs",
    "give_back",
    "image_bytes",
    "make_image",
    "make_shared",
    "share_in_place",
    "mount_image",
    "set_executable",
    "mounted",
    "open_folders",
    "open_folder",
    "unavailable",
]

MS_NOSUID, MS_NODEV, MS_NOEXEC = 0x2, 0x4, 0x8
MS_BIND, MS_REC, MS_PRIVATE, MS_SHARED = 0x1000, 0x4000, 0x40000, 0x100000
FITRIM = 0xC0185879
MNT_DETACH, UMOUNT_NOFOLLOW = 0x2, 0x8
CALLS = (".sandbox", "calls")
"""Where in a workspace each call's own output folder lies while it runs (a tools' folder, never listed)."""
OUTPUT_NAME = "out"
JOURNAL_MB = 4
INODE_BYTES = 256

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_void_p]
_libc.umount2.argtypes = [ctypes.c_char_p, ctypes.c_int]


class MountError(OSError):
    """A mount the host could not make."""


def _mount(source: str | None, target: str, flags: int, kind: str | None = None, data: str | None = None) -> None:
    encoded = source.encode() if source is not None else None
    options = ctypes.c_char_p(data.encode()) if data is not None else None
    if _libc.mount(encoded, target.encode(), kind.encode() if kind else None, flags, options) != 0:
        code = ctypes.get_errno()
        raise MountError(code, f"mount {source or ''} on {target}: {os.strerror(code)}")


def bind(source: str, target: str, namespace: Path | None = None) -> None:
    """Bind-mount a folder (and what is mounted under it) onto another, idmapped for the user namespace held on
    `namespace` when one is given (a sandbox with host ids of its own: sandbox.host_ids)."""
    if namespace is None:
        _mount(source, target, MS_BIND | MS_REC)
    else:
        views.view(source, Path(target), namespace)


def bind_outputs(slot: str, owner: str, source: str | None = None, namespace: Path | None = None) -> None:
    """Give the call in this slot an output folder of its own, so that calls in one workspace run side by side.

    `.sandbox/calls/<the slot's name>` of the workspace bound on the slot at its `out`: the mount
    propagates into this slot's container alone (each slot's bind of a workspace is a peer group of
    its own, as the workspace's own mount is private). Every folder is opened without following a
    link a program left, and mounted by its descriptor, so nothing outside the workspace is touched.
    """
    uid, _, gid = owner.partition(":")
    ids = (int(uid), int(gid or uid))
    try:
        _bind_outputs(slot, ids, source if namespace is not None else None, namespace)
    except OSError as exc:
        if exc.errno not in (errno.ENOSPC, errno.EDQUOT):
            raise
        # A workspace full to its last file has no room for a folder: the call writes to the shared `out`,
        # emptied first, as a call in a workspace of its own would find it.
        _remove_below(slot, (), OUTPUT_NAME)


def _bind_outputs(slot: str, ids: tuple[int, int], source: str | None, namespace: Path | None) -> None:
    opened = [open_folder(source or slot)]
    try:
        for name in CALLS:
            opened.append(_own_folder(opened[-1], name, ids))
        outputs = _own_folder(opened[-1], os.path.basename(slot), ids)
        opened.append(outputs)
        opened.append(_own_folder(opened[0], OUTPUT_NAME, ids))
        if namespace is None:
            _mount(f"/proc/self/fd/{outputs}", f"/proc/self/fd/{opened[-1]}", MS_BIND)
            return
        opened.append(_open_path(open_folder(slot), (OUTPUT_NAME,)))  # the same folder, in the slot's mount
        views.view_on(f"/proc/self/fd/{outputs}", opened[-1], namespace)
    finally:
        for handle in opened:
            os.close(handle)


def drop_outputs(slot: str) -> None:
    """Remove the output folder `bind_outputs` gave the slot's call (its files went back with the answer); never
    raises."""
    _remove_below(slot, CALLS, os.path.basename(slot))


def clear_calls(folder: Path) -> None:
    """Remove every call's output folder from a workspace no call runs in (what a killed process left)."""
    _remove_below(str(folder), CALLS[:-1], CALLS[-1])


def _remove_below(top: str, folders: tuple[str, ...], name: str) -> None:
    """Remove the folder `name` and all it holds under `folders` of `top`, by open folders, never
    through a link; never raises."""
    with contextlib.suppress(OSError):
        parent = _open_path(open_folder(top), folders)
        try:
            shutil.rmtree(name, dir_fd=parent)
        finally:
            os.close(parent)


def open_folders(top: str, names: tuple[str, ...]) -> int:
    """The folder `names` below the folder `top`, open, reached without following any link."""
    return _open_path(open_folder(top), names)


def _open_path(top: int, names: tuple[str, ...]) -> int:
    """Open folders one below the other from an open one (which it closes), following no link."""
    try:
        for name in names:
            inner = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=top)
            os.close(top)
            top = inner
    except BaseException:
        os.close(top)
        raise
    return top


def _own_folder(parent: int, name: str, ids: tuple[int, int]) -> int:
    """A real folder `name` under an open one, made for the sandbox's user when missing; whatever else a program
    left under that name (a link, a file) is removed first."""
    for _ in range(2):
        with contextlib.suppress(FileExistsError):
            os.mkdir(name, 0o755, dir_fd=parent)
            os.chown(name, *ids, dir_fd=parent, follow_symlinks=False)
        try:
            return os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=parent)
        except OSError as exc:
            if exc.errno not in (errno.ENOTDIR, errno.ELOOP):
                raise
            os.unlink(name, dir_fd=parent)
    raise MountError(errno.EEXIST, f"{name}: kept being replaced while it was made")


def detach(target: str) -> None:
    """Detach whatever is mounted on a folder (lazily: still-open files keep it alive); never raises."""
    while _libc.umount2(target.encode(), MNT_DETACH | UMOUNT_NOFOLLOW) == 0:
        pass  # a folder may carry more than one mount, one on top of the other


def mounted(folder: Path) -> list[str]:
    """The mount points at or under a folder, deepest first (from this process's mount table)."""
    prefix = str(folder.resolve())
    found = []
    with open("/proc/self/mountinfo", encoding="utf-8", errors="replace") as table:
        for line in table:
            target = line.split(" ", 5)[4].encode().decode("unicode_escape")
            if target == prefix or target.startswith(prefix + "/"):
                found.append(target)
    return sorted(set(found), key=len, reverse=True)


def detach_under(folder: Path) -> None:
    """Detach every mount at or under a folder; never raises."""
    if folder.exists():
        for target in mounted(folder):
            detach(target)


def make_shared(folder: Path) -> None:
    """Make a folder a small tmpfs of its own whose sub-mounts propagate into the containers bound to it.

    A tmpfs rather than the folder bound to itself: a container's mount table shows where a bind
    mount's folder lies in its filesystem, and a slot on the host's own disk would show the state
    folder's path; on a tmpfs of its own it shows only the slot's name."""
    folder.mkdir(parents=True, exist_ok=True, mode=0o700)
    if str(folder.resolve()) not in mounted(folder):
        _mount("sandbox-slots", str(folder), MS_NOSUID | MS_NODEV | MS_NOEXEC, "tmpfs", "size=1m,mode=0700")
    _mount(None, str(folder), MS_SHARED)


def share_in_place(folder: Path, tmpfs_mb: int = 0) -> None:
    """Make a folder a mount of its own, shared: what is mounted under it later also appears in the mount
    namespaces copied from the host's before (a warm template's: sandbox.template.warm). With `tmpfs_mb`, an empty
    folder becomes a tmpfs of that size (what is made and removed there per sandbox costs no disk's inodes, and is
    gone with a reboot wherever /run is on a disk); one holding anything is bound on itself, hiding nothing."""
    folder.mkdir(parents=True, exist_ok=True)
    if str(folder.resolve()) not in mounted(folder):
        if tmpfs_mb and not any(folder.iterdir()):
            _mount("sandbox-bundles", str(folder), MS_NOSUID | MS_NODEV, "tmpfs", f"size={tmpfs_mb}m,mode=0755")
        else:
            _mount(str(folder), str(folder), MS_BIND)
    _mount(None, str(folder), MS_SHARED)


def image_bytes(size_mb: int, inodes: int) -> int:
    """The image file of a workspace of `size_mb` usable MiB and `inodes` files (ext4's own needs on top)."""
    usable = size_mb * 1024 * 1024
    return usable + usable // 48 + inodes * INODE_BYTES + (JOURNAL_MB + 1) * 1024 * 1024


def used_bytes(target: Path) -> int:
    """What the files of a mounted workspace take of its filesystem: the blocks in use (ext4 counts its own
    tables and journal apart, and blocks a program wrote but the kernel has not yet put on the image)."""
    found = os.statvfs(target)
    return (found.f_blocks - found.f_bfree) * found.f_frsize


def make_image(path: Path, size_mb: int, inodes: int, owner: str) -> None:
    """A new sparse ext4 image whose root folder belongs to the sandbox's user ("uid:gid").

    ext4 rounds the inode count down to fill whole tables and keeps eleven for itself, so a
    workspace holds slightly fewer files than `inodes`, never more.
    """
    uid, _, gid = owner.partition(":")
    with open(path, "wb") as image:
        image.truncate(image_bytes(size_mb, inodes))
    _run(
        "mkfs.ext4", "-q", "-F", "-m", "0", "-N", str(inodes), "-J", f"size={JOURNAL_MB}",
        "-E", f"root_owner={uid}:{gid or uid},nodiscard", "-L", "workspace", str(path),
    )  # fmt: skip


def mount_image(image: Path, target: Path, executable: bool) -> None:
    """Mount a workspace image (never devices or set-uid; programs run from it only when `executable`) and drop
    lost+found."""
    target.mkdir(parents=True, exist_ok=True, mode=0o700)
    options = "loop,noatime,nodev,nosuid" + ("" if executable else ",noexec")
    _run("mount", "-t", "ext4", "-o", options, str(image), str(target))
    _mount(None, str(target), MS_PRIVATE)  # what is bound onto one slot's copy never reaches another's
    with contextlib.suppress(OSError):
        os.rmdir(target / "lost+found")


FIFREEZE, FITHAW = 0xC0045877, 0xC0045878
"""ioctl(2) requests that hold a filesystem's writes and flush it (a consistent copy of its image), then let go."""


_FREEZING: dict[int, threading.Lock] = {}
"""Per filesystem (its device), the one freeze at a time it may have: a second FIFREEZE fails (EBUSY), and the
first thaw would let go of the second's hold."""
_FREEZING_LOCK = threading.Lock()


@contextlib.contextmanager
def frozen(target: Path) -> Iterator[None]:
    """A mounted workspace with its writes held and everything written on its image, for as long as this lasts;
    copies of one workspace side by side take their turns."""
    folder = os.open(target, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        with _FREEZING_LOCK:
            turn = _FREEZING.setdefault(os.fstat(folder).st_dev, threading.Lock())
        with turn:
            fcntl.ioctl(folder, FIFREEZE, 0)
            try:
                yield
            finally:
                fcntl.ioctl(folder, FITHAW, 0)
    finally:
        os.close(folder)


def copy_sparse(source: Path, target: Path) -> int:
    """Copy an image file's data, leaving its holes holes (a workspace's image is mostly holes): the bytes
    copied. The target is made new (never an existing file)."""
    copied = 0
    with open(source, "rb") as reading, open(target, "xb") as writing:
        size = os.fstat(reading.fileno()).st_size
        writing.truncate(size)
        offset = 0
        while offset < size:
            try:
                start = os.lseek(reading.fileno(), offset, os.SEEK_DATA)
            except OSError:  # ENXIO: only a hole is left
                break
            end = os.lseek(reading.fileno(), start, os.SEEK_HOLE)
            position = start
            while position < end:
                done = os.copy_file_range(reading.fileno(), writing.fileno(), end - position, position, position)
                if done == 0:
                    break
                position += done
            copied += end - start
            offset = end
    return copied


def set_executable(target: Path, executable: bool) -> None:
    """Allow or forbid running programs from a mounted workspace (a policy reloaded with another workspace.exec)."""
    _run("mount", "-o", "remount," + ("exec" if executable else "noexec"), str(target))


def open_folder(folder: str | Path) -> int:
    """A descriptor of a folder itself, never of what a link there points to."""
    return os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)


def give_back(folder: str) -> None:
    """Write a mounted workspace out and return its free blocks to the host (holes in its image); never raises."""
    try:
        handle = open_folder(folder)
    except OSError:
        return
    try:
        _libc.syncfs(handle)  # commits what the call deleted, so that its blocks are free to trim
        with contextlib.suppress(OSError):
            fcntl.ioctl(handle, FITRIM, bytearray(struct.pack("QQQ", 0, 2**64 - 1, 0)))
    finally:
        os.close(handle)


def _run(*argv: str) -> None:
    done = subprocess.run(argv, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise MountError(errno.EIO, f"{argv[0]} failed: {done.stderr.strip() or done.returncode}")


def unavailable(local_engine: bool) -> str | None:
    """Why this host cannot keep workspaces as mounted images; None when it can."""
    if not local_engine:
        return "the engine is not on this host"
    if os.geteuid() != 0:
        return "the server does not run as root"
    missing = [tool for tool in ("mkfs.ext4", "mount") if shutil.which(tool) is None]
    if missing:
        return f"{' and '.join(missing)} not found"
    if not os.path.exists("/dev/loop-control"):
        return "this host has no loop devices"
    return None
