"""Images as OCI bundles' root filesystems, for sandboxes made by runc itself rather than through the engine.

An image's filesystem is unpacked once, by its id, into a folder of the server's (the engine's export of a
created, never started container, unpacked by tar as root with its owners and modes), and then shared by every
sandbox of that image: each mounts it read-only as its root. A folder being unpacked has a name of its own and
is renamed into place when whole, so a sandbox never sees half an image; one left by a killed process is
removed by the next.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import subprocess
from pathlib import Path
from typing import Any

from sandbox_server.sandbox.oci import oci_config
from sandbox_server.sandbox.spec import SandboxSpec

__all__ = ["image_root", "write_bundle"]

WHOLE = ".whole"
"""Written last into an unpacked image's folder: it is complete."""


def image_root(api: Any, image: str, folder: Path) -> Path:
    """The image's root filesystem, unpacked under `folder` by its id (made on first use, then shared)."""
    image_id = str(api.inspect_image(image)["Id"]).removeprefix("sha256:")[:24]
    place = folder / image_id
    if (place / WHOLE).exists():
        return place / "rootfs"
    folder.mkdir(parents=True, exist_ok=True, mode=0o700)
    for left in folder.glob(f".{image_id}-*"):  # a killed process's half-unpacked copy
        shutil.rmtree(left, ignore_errors=True)
    making = folder / f".{image_id}-{secrets.token_hex(4)}"
    (making / "rootfs").mkdir(parents=True)
    created = api.create_container(image, command=["true"], network_disabled=True)
    try:
        with subprocess.Popen(
            ["tar", "-x", "-p", "--numeric-owner", "-f", "-", "-C", str(making / "rootfs")], stdin=subprocess.PIPE
        ) as unpack:
            assert unpack.stdin is not None
            with contextlib.closing(unpack.stdin):
                for part in api.export(created["Id"]):
                    unpack.stdin.write(part)
        if unpack.returncode != 0:
            raise OSError(f"tar could not unpack {image} (exit {unpack.returncode})")
        (making / WHOLE).write_text(image + "\n")
        try:
            os.rename(making, place)
        except OSError:  # another process unpacked it meanwhile
            shutil.rmtree(making, ignore_errors=True)
    finally:
        api.remove_container(created["Id"], force=True)
        shutil.rmtree(making, ignore_errors=True)
    return place / "rootfs"


def write_bundle(bundle: Path, spec: SandboxSpec, rootfs: Path, argv: list[str], slot: str | None = None) -> Path:
    """A bundle folder (its config.json) for one sandbox of `spec` on an unpacked root."""
    bundle.mkdir(parents=True, exist_ok=True, mode=0o700)
    (bundle / "config.json").write_text(json.dumps(oci_config(spec, str(rootfs), argv, slot)))
    return bundle
