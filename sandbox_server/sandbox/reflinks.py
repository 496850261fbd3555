"""Copy-on-write copies of workspace images (reflinks), so a fork or a snapshot costs neither time nor disk in
proportion to what the workspace holds.

A clone (the FICLONE ioctl) makes a new file that shares every block of its source until one of the two writes
there; XFS (made with reflinks, the default of its tools since 5.1) and btrfs have them, ext4 does not. Where the
state folder's own filesystem clones, images live there. Elsewhere (ext4, the common case) images live in a
*pool*: an XFS filesystem with reflinks in a sparse file of the state folder (`pool.xfs`, 1 TiB of address
space, which costs the disk only what is written in it, about 65 MiB of log to begin with), mounted with
`discard` at `pool/`, so what is deleted in it goes back to the host's disk. The pool is made the first time,
mounted by the server that holds the state folder, found mounted again after a killed one, and detached when
the server stops. Without mkfs.xfs or XFS in the kernel there is no pool, and images are copied (their data,
not their holes).
"""

from __future__ import annotations

import fcntl
import os
import secrets
import shutil
import subprocess
import time
from pathlib import Path

from sandbox_server.sandbox import mounts

__all__ = ["FICLONE", "POOL_FILE", "POOL_FOLDER", "clone", "clones_in", "let_go_of_pool", "pool", "without_pool"]

FICLONE = 0x40049409
"""ioctl(2): make the file a clone of another's whole contents (a reflink: shared blocks, copied on write)."""
POOL_FILE, POOL_FOLDER = "pool.xfs", "pool"
POOL_BYTES = 1 << 40
"""The pool's address space: sparse, so only what is written in it takes the disk (host.workspace_storage_mb
bounds that)."""
MOUNT_TRIES = 25
POOL_LOG = "64m"
"""XFS's smallest log with reflinks (a 1 TiB filesystem would otherwise get 512 MiB)."""


def clone(source: Path, target: Path) -> None:
    """Make `target` (new, never an existing file) a clone of `source`: no data copied."""
    with open(source, "rb") as reading, open(target, "xb") as writing:
        try:
            fcntl.ioctl(writing.fileno(), FICLONE, reading.fileno())
        except OSError:
            target.unlink(missing_ok=True)
            raise


def clones_in(folder: Path) -> bool:
    """Whether files in `folder` can be cloned (its filesystem has reflinks)."""
    probe = folder / f".clone-probe-{secrets.token_hex(8)}"
    copy = probe.with_name(probe.name + "-copy")
    try:
        probe.write_bytes(b"\0" * 4096)
        clone(probe, copy)
        return True
    except OSError:
        return False
    finally:
        probe.unlink(missing_ok=True)
        copy.unlink(missing_ok=True)


def without_pool() -> str | None:
    """Why this host can make no pool (None when it can)."""
    if shutil.which("mkfs.xfs") is None:
        return "mkfs.xfs not found (Debian's xfsprogs)"
    try:
        with open("/proc/filesystems", encoding="utf-8") as known:
            if "xfs" not in known.read().split():
                return "the kernel has no XFS"
    except OSError:
        return "the kernel's filesystems cannot be read"
    return None


def pool(root: Path) -> Path | None:
    """Where a state folder's images clone: the folder itself when its filesystem has reflinks, else its pool
    (made the first time, mounted if it is not); None when neither can be had (then images are copied)."""
    if clones_in(root):
        return root
    if without_pool() is not None:
        return None
    image, folder = root / POOL_FILE, root / POOL_FOLDER
    if str(folder.resolve()) not in mounts.mounted(folder):
        made = image.exists()
        try:
            if not made:
                _make(image)
            folder.mkdir(mode=0o700, exist_ok=True)
        except (OSError, mounts.MountError):
            return None  # no pool: nothing lives in one yet
        _mount(image, folder)  # images live in it: a pool that cannot be mounted is an error, not a fallback
    return folder if clones_in(folder) else None


def let_go_of_pool(root: Path) -> None:
    """The server is stopping: unmount the pool (lazily when an image's loop device still holds it: it goes when
    that is let go of); never raises."""
    folder = root / POOL_FOLDER
    if folder.exists() and str(folder.resolve()) in mounts.mounted(folder):
        if subprocess.run(["umount", str(folder)], capture_output=True, check=False).returncode != 0:
            mounts.detach(str(folder))


def _mount(image: Path, folder: Path) -> None:
    """Mount the pool; a server that stopped a moment ago may still be letting go of it (its last images' loop
    devices), and XFS refuses a second mount of one filesystem meanwhile: tried again for a few seconds."""
    options = "loop,discard,noatime,nodev,nosuid,noexec"
    for attempt in range(MOUNT_TRIES):
        try:
            _run("mount", "-t", "xfs", "-o", options, str(image), str(folder))
            return
        except mounts.MountError:
            if attempt == MOUNT_TRIES - 1:
                raise
            time.sleep(0.2)


def _make(image: Path) -> None:
    """A new pool: a sparse file holding an XFS filesystem with reflinks (written whole, or not at all)."""
    making = image.with_name(f".{image.name}.new")
    with open(making, "wb") as sparse:
        sparse.truncate(POOL_BYTES)
    try:
        _run("mkfs.xfs", "-q", "-f", "-m", "reflink=1", "-l", f"size={POOL_LOG}", "-L", "sbx-pool", str(making))
        os.replace(making, image)
    finally:
        making.unlink(missing_ok=True)


def _run(*argv: str) -> None:
    done = subprocess.run(argv, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise mounts.MountError(5, f"{argv[0]} failed: {done.stderr.strip() or done.returncode}")
