"""Images as OCI bundles' root filesystems, for sandboxes made by runc itself rather than through the engine.

An image's filesystem is unpacked once, by its id, into a folder of the server's (the engine's export of a
created, never started container, unpacked by tar as root with its owners and modes), and then shared by every
sandbox of that image: each mounts it read-only as its root. A folder being unpacked has a name of its own and
is renamed into place when whole, so a sandbox never sees half an image; one left by a killed process is
removed by the next.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import secrets
import shutil
import stat
import subprocess
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from sandbox_server.sandbox.runc.oci import oci_config
from sandbox_server.sandbox.spec import SandboxSpec

__all__ = ["Inspected", "image_root", "is_unpacked", "prune_unpacked", "unpacked", "write_bundle", "write_config"]

WHOLE = ".whole-harmless"
"""Written last into an unpacked image's folder: it is complete, and made harmless (a copy an earlier version
unpacked, without this, is unpacked again)."""
UNPACKED_MAX_BYTES = 16 * 1024**3
"""The most an image may hold unpacked for runc (the engine's export of it, holes written out)."""
SPARSE_FROM_BYTES = 16 * 1024**2
"""Files at least this large have their runs of zeros made holes again after unpacking."""


INSPECTED_FOR_S = 1.0
"""How long the engine's word on what an image tag names serves sandboxes made one after another: a tag moved by a
build is seen within a second, and a burst of sandboxes asks the engine once a second rather than once each."""


class Inspected:
    """The engine's inspection of each image tag, asked again once INSPECTED_FOR_S has passed."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._said: dict[str, tuple[float, dict[str, Any]]] = {}

    def of(self, api: Any, image: str) -> dict[str, Any]:
        now = time.monotonic()
        with self._lock:
            said = self._said.get(image)
        if said is not None and now - said[0] < INSPECTED_FOR_S:
            return said[1]
        inspected: dict[str, Any] = api.inspect_image(image)
        with self._lock:
            self._said[image] = (now, inspected)
        return inspected


def image_root(api: Any, image: str, folder: Path) -> Path:
    """The image's root filesystem, unpacked under `folder` by its id (made on first use, then shared)."""
    return unpacked(api, image, api.inspect_image(image), folder)


def _folder_name(image_id: str) -> str:
    return image_id.removeprefix("sha256:")[:24]


def is_unpacked(inspected: dict[str, Any], folder: Path) -> bool:
    return (folder / _folder_name(str(inspected["Id"])) / WHOLE).exists()


def unpacked(api: Any, image: str, inspected: dict[str, Any], folder: Path) -> Path:
    """The root filesystem of the image the engine described as `inspected`, unpacked under `folder` by its id."""
    image_id = _folder_name(str(inspected["Id"]))
    place = folder / image_id
    if (place / WHOLE).exists():
        return place / "rootfs"
    folder.mkdir(parents=True, exist_ok=True, mode=0o700)
    with open(folder / f".{image_id}.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one unpacker per image (threads and servers alike); the others wait
        if (place / WHOLE).exists():
            return place / "rootfs"
        for left in folder.glob(f".{image_id}-*"):  # a killed process's half-unpacked copy
            shutil.rmtree(left, ignore_errors=True)
        shutil.rmtree(place, ignore_errors=True)  # an earlier version's copy
        _unpack(api, image, inspected, folder, place)
    return place / "rootfs"


def _unpack(api: Any, image: str, inspected: dict[str, Any], folder: Path, place: Path) -> None:
    image_id = place.name
    making = folder / f".{image_id}-{secrets.token_hex(4)}"
    (making / "rootfs").mkdir(parents=True)
    created = api.create_container(inspected["Id"], command=["true"], network_disabled=True)
    try:
        with subprocess.Popen(
            ["tar", "-x", "-p", "--numeric-owner", "-f", "-", "-C", str(making / "rootfs")], stdin=subprocess.PIPE
        ) as unpack:
            assert unpack.stdin is not None
            sent = 0
            with contextlib.closing(unpack.stdin):
                for part in api.export(created["Id"]):
                    sent += len(part)
                    if sent > UNPACKED_MAX_BYTES:
                        unpack.kill()
                        raise OSError(f"{image} is larger than {UNPACKED_MAX_BYTES} bytes unpacked: not unpacked")
                    unpack.stdin.write(part)
        if unpack.returncode != 0:
            raise OSError(f"tar could not unpack {image} (exit {unpack.returncode})")
        made_harmless(making / "rootfs")
        (making / WHOLE).write_text(image + "\n")
        os.rename(making, place)
    finally:
        api.remove_container(created["Id"], force=True)
        shutil.rmtree(making, ignore_errors=True)


def made_harmless(root: Path) -> None:
    """An unpacked copy on the host's disk without what could serve someone on the host: no device node (an image
    may carry the host's root disk, or /dev/mem), FIFO or socket, and no setuid or setgid bit; and runs of zeros
    in large files made holes again (the engine's export writes a sparse file's holes out)."""
    for folder, folders, names in os.walk(root):
        for name in [*names, *folders]:
            path = os.path.join(folder, name)
            found = os.lstat(path)
            if (
                stat.S_ISCHR(found.st_mode)
                or stat.S_ISBLK(found.st_mode)
                or stat.S_ISFIFO(found.st_mode)
                or (stat.S_ISSOCK(found.st_mode))
            ):
                os.unlink(path)
                continue
            if stat.S_ISLNK(found.st_mode):
                continue
            if found.st_mode & (stat.S_ISUID | stat.S_ISGID):
                os.chmod(path, stat.S_IMODE(found.st_mode) & ~(stat.S_ISUID | stat.S_ISGID))
            if stat.S_ISREG(found.st_mode) and found.st_size >= SPARSE_FROM_BYTES and found.st_blocks:
                subprocess.run(["fallocate", "--dig-holes", path], capture_output=True, check=False)


def prune_unpacked(api: Any, folder: Path, bundles: Path) -> list[str]:
    """Remove the unpacked images that no tagged image of the engine is (rebuilt since, or deleted) and no bundle
    under `bundles` runs on; returns their folders' names."""
    tagged = {
        _folder_name(str(image["Id"]))
        for image in api.images()
        if any(tag != "<none>:<none>" for tag in image.get("RepoTags") or ())
    }
    in_use = set()
    for config in bundles.glob("*/config.json"):
        with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
            in_use.add(Path(json.loads(config.read_text())["root"]["path"]).parent.name)
    removed = []
    for place in sorted(folder.glob("[!.]*")):
        if place.is_dir() and place.name not in tagged | in_use:
            shutil.rmtree(place, ignore_errors=True)
            (folder / f".{place.name}.lock").unlink(missing_ok=True)
            removed.append(place.name)
    return removed


def write_bundle(
    bundle: Path, spec: SandboxSpec, rootfs: Path, argv: list[str], slot: str | None = None, **options: Any
) -> Path:
    """A bundle folder (its config.json) for one sandbox of `spec` on an unpacked root (`options`: oci_config's)."""
    return write_config(bundle, oci_config(spec, str(rootfs), argv, slot, **options))


def write_config(bundle: Path, config: Mapping[str, Any]) -> Path:
    """A bundle folder holding `config` as its config.json."""
    bundle.mkdir(parents=True, exist_ok=True, mode=0o700)
    (bundle / "config.json").write_text(json.dumps(config))
    return bundle
