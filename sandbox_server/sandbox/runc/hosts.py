"""How a sandbox runc runs beside a workspace's services finds them by name: the engine's resolver answers only its
own containers, so the server keeps one hosts file per services' network, the running services' names and their
addresses there, and binds it read-only at each such sandbox's `/etc/hosts`.

The file is rewritten in place (the same file, which every sandbox on the network has bound) whenever a service of
the network starts, restarts or stops, so a sandbox made before a service started finds it as the engine's resolver
would. A name that no service holds is not found, as the engine's resolver, which forwards nowhere, does not find
it either.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterable, Mapping
from pathlib import Path

__all__ = ["LOCAL_NAMES", "ensure_hosts", "forget_hosts", "hosts_file", "write_hosts"]

LOCAL_NAMES = (
    "127.0.0.1\tlocalhost\n"
    "::1\tlocalhost ip6-localhost ip6-loopback\n"
    "fe00::0\tip6-localnet\n"
    "ff00::0\tip6-mcastprefix\n"
    "ff02::1\tip6-allnodes\n"
    "ff02::2\tip6-allrouters\n"
)
"""What the engine writes at the top of every container's /etc/hosts."""


def hosts_file(folder: Path, network: str) -> Path:
    """The hosts file of a services' network, in its server's folder (runc_state.hosts_folder)."""
    return folder / network


def write_hosts(folder: Path, network: str, names: Mapping[str, str]) -> Path:
    """Write the hosts file of `network` with `names` (a service's name: its address there), in place."""
    path = hosts_file(folder, network)
    folder.mkdir(parents=True, exist_ok=True)
    text = LOCAL_NAMES + "".join(f"{address}\t{name}\n" for name, address in sorted(names.items()) if address)
    data = text.encode()
    descriptor = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        # Blank lines over what a shorter file leaves of the longer one: a sandbox reading it meanwhile reads
        # names whole, never the end of an old line.
        os.pwrite(descriptor, data + b"\n" * max(0, os.fstat(descriptor).st_size - len(data)), 0)
        os.ftruncate(descriptor, len(data))
    finally:
        os.close(descriptor)
    return path


def ensure_hosts(folder: Path, network: str) -> Path:
    """The hosts file of `network`, made with no service's name unless it exists (never emptied: its services'
    names may have been written a moment before)."""
    path = hosts_file(folder, network)
    folder.mkdir(parents=True, exist_ok=True)
    with contextlib.suppress(FileExistsError):
        descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
        try:
            os.write(descriptor, LOCAL_NAMES.encode())
        finally:
            os.close(descriptor)
    return path


def forget_hosts(folder: Path, keep: Iterable[str]) -> None:
    """Remove the hosts files of `folder` but those of the networks in `keep`, and the folder once it is empty."""
    kept = set(keep)
    with contextlib.suppress(OSError):
        for path in folder.iterdir():
            if path.name not in kept:
                path.unlink(missing_ok=True)
    with contextlib.suppress(OSError):
        folder.rmdir()  # not empty: some are kept
