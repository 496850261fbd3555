"""Host ids of its own for each sandbox runc makes: a user namespace per sandbox, and the mounts it sees made for it.

The kernel counts some limits per host user: inotify instances and watches, the bytes of POSIX message queues,
user namespaces, processes. Were every sandbox host uid 1000, one holding its 128 inotify instances or its
819,200 bytes of queues would make `inotify_init` and `mq_open` fail in every other for as long as it ran. So
each sandbox runc makes takes a range of 65,536 host ids no other sandbox holds (from `BASE` up, as Podman's
subordinate ids are ranges of a host's), and runs in a user namespace that maps its ids 0-65535 onto that range:
its user 1000 is host id `first + 1000`. The namespace is made by a process running as the range's first id,
which so owns it: what the sandbox's processes hold is counted, in the host's own namespace, against that id, and
against no other sandbox's. A range taken is a file in the state folder, made exclusively, so that servers of one
host never share one; it is given back when the sandbox is deleted.

Files keep the ids they have on disk. The image's root, the workspace bound at a call and every folder a policy
mounts are seen through a mount of their own, idmapped (mount_setattr(2)) for the sandbox's namespace: a file of
uid 1000 on disk is the sandbox user's inside, what the sandbox writes is uid 1000 on disk, and root's files are
root's. These mounts, and the namespace itself (held by a bind of its file), lie in the sandbox's bundle folder
and go with it.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
from dataclasses import dataclass, replace
from pathlib import Path

from sandbox_server.sandbox import mounts
from sandbox_server.sandbox.runc import userns_maker, views
from sandbox_server.sandbox.runc.oci import SPAN
from sandbox_server.sandbox.spec import SandboxSpec

__all__ = [
    "BASE", "SPAN", "HostIdsError", "OwnIds", "detach_all", "first_id", "give_back", "give_own_ids", "held_by",
    "make_namespace", "range_of", "share_ids", "take", "unavailable",
]  # fmt: skip

BASE = 1 << 30
"""The first host id of the server's ranges (far above the ids of people and of system users)."""
RANGES = 16384
"""How many ranges the server may hand out at once (BASE + RANGES * SPAN is 2**31)."""
IDS = "ids"
"""The state folder's folder of taken ranges: a file per range, named by its number, holding the sandbox's name."""
NAMESPACE = "userns"
"""In a bundle: the file its user namespace is bound on."""
VIEWS = "views"
"""In a bundle: the folder of the idmapped mounts its sandbox is given."""


class HostIdsError(OSError):
    """A range or a namespace of a sandbox's own that the host could not make."""


def first_id(index: int) -> int:
    """The first host id of range `index`."""
    return BASE + index * SPAN


def take(state: Path, name: str, hint: int = 0) -> int:
    """A range no sandbox of any server holds, taken for sandbox `name` (its index); HostIdsError when all are."""
    folder = state / IDS
    folder.mkdir(parents=True, exist_ok=True, mode=0o700)
    for step in range(RANGES):
        index = (hint + step) % RANGES
        try:
            handle = os.open(folder / str(index), os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        except FileExistsError:
            continue
        with os.fdopen(handle, "w") as file:
            file.write(name)
        return index
    raise HostIdsError(errno.EUSERS, f"all {RANGES} host id ranges are held by sandboxes")


def give_back(state: Path, index: int, name: str) -> None:
    """Give back range `index` if sandbox `name` holds it; never raises."""
    place = state / IDS / str(index)
    with contextlib.suppress(OSError):
        if place.read_text() == name:
            place.unlink()


def held_by(state: Path) -> dict[int, str]:
    """Every range taken here, with the name of the sandbox that holds it."""
    found = {}
    with contextlib.suppress(OSError):
        for place in (state / IDS).iterdir():
            with contextlib.suppress(OSError, ValueError):
                found[int(place.name)] = place.read_text()
    return found


@dataclass(frozen=True, slots=True)
class OwnIds:
    """What a sandbox with host ids of its own is made of: its namespace, the first host id of its range, and the
    views its bundle names in place of the host's paths."""

    rootfs: Path
    spec: SandboxSpec
    """The spec whose mounts are the views of its folders."""
    slot: str | None
    index: int = -1
    namespace: Path | None = None
    """None: the host's ids (what the bundle names are the host's own paths)."""
    first: int = 0

    @property
    def mapping(self) -> tuple[str, int] | None:
        """The namespace's file and the first host id of its range, as oci_config takes them."""
        return None if self.namespace is None else (str(self.namespace), self.first)


def give_own_ids(state: Path, bundle: Path, name: str, rootfs: Path, spec: SandboxSpec, slot: str | None, hint: int) -> OwnIds:  # fmt: skip
    """A range for sandbox `name`, its namespace, and in `bundle` the views of its root, of its spec's mounts and
    of its workspace's slot (a plain copy, which the workspace bound there at a call reaches: the copy is a peer
    of the slots' shared mount). What was made is undone by `detach_all` and `give_back` (the bundle says the
    range in its `ids` file)."""
    bundle.mkdir(parents=True, exist_ok=True, mode=0o711)  # the sandbox's root, host id `first`, passes through
    index = take(state, name, hint)
    (bundle / IDS).write_text(str(index))
    first, namespace = first_id(index), bundle / NAMESPACE
    make_namespace(namespace, first)
    return replace(share_ids(bundle, namespace, first, rootfs, spec, slot), index=index)


def share_ids(bundle: Path, namespace: Path, first: int, rootfs: Path, spec: SandboxSpec, slot: str | None) -> OwnIds:
    """In `bundle`, the views of a sandbox's root, mounts and slot for a user namespace it shares (a warm
    template's: sandbox.template.warm), which stays when the sandbox goes."""
    bundle.mkdir(parents=True, exist_ok=True, mode=0o711)
    folder = bundle / VIEWS
    folder.mkdir(mode=0o711, exist_ok=True)
    views.view(rootfs, folder / "rootfs", namespace)  # writable here for runc to make mount points; read-only inside
    seen = []
    for number, mount in enumerate(spec.mounts):
        target = folder / f"mount-{number}"
        views.view(mount.host_path, target, namespace, read_only=mount.read_only)
        seen.append(replace(mount, host_path=str(target)))
    slot_view = None
    if slot is not None:
        views.view(slot, folder / "slot", None)
        slot_view = str(folder / "slot")
    return OwnIds(folder / "rootfs", replace(spec, mounts=tuple(seen)), slot_view, -1, namespace, first)


def range_of(bundle: Path) -> int | None:
    """The range a bundle's sandbox holds (None: none)."""
    with contextlib.suppress(OSError, ValueError):
        return int((bundle / IDS).read_text())
    return None


def make_namespace(held: Path, first: int) -> None:
    """A user namespace owned by host id `first`, mapping ids 0-65535 onto `first` up, held by a bind of its file
    on `held` (made here): made by a process running as `first` (sandbox.runc.userns_maker)."""
    userns_maker.make(held, first)


def detach_all(bundle: Path) -> bool:
    """Detach a bundle's views and its namespace's bind; whether none is left mounted (a bundle that still has
    one must not be removed file by file: its root's view and its slot's lead to what every sandbox shares);
    never raises."""
    places = [bundle / NAMESPACE]
    with contextlib.suppress(OSError):
        places += list((bundle / VIEWS).iterdir())
    for place in places:
        mounts.detach(str(place))
    return not any(os.path.ismount(place) for place in places)


def unavailable(state: Path, probe_source: Path) -> str | None:
    """Why sandboxes cannot have host ids of their own here (None: they can), found by making a namespace and an
    idmapped view of `probe_source` (the images' folder) in a folder of `state`."""
    state.mkdir(parents=True, exist_ok=True)
    with open(state / "ids-probe.lock", "a") as lock:  # servers starting together probe in turn: each removes it
        fcntl.flock(lock, fcntl.LOCK_EX)
        return _probe(state, state / "ids-probe", probe_source)


def _probe(state: Path, place: Path, probe_source: Path) -> str | None:
    place.mkdir(exist_ok=True, mode=0o700)
    index = -1
    try:
        index = take(state, place.name)
        make_namespace(place / NAMESPACE, first_id(index))
        views.view(probe_source, place / "view", place / NAMESPACE)
    except OSError as exc:
        return f"the kernel would not give a sandbox a user namespace and idmapped mounts ({exc})"
    finally:
        give_back(state, index, place.name)
        mounts.detach(str(place / "view"))
        mounts.detach(str(place / NAMESPACE))
        with contextlib.suppress(OSError):
            for leftover in place.iterdir():
                (leftover.rmdir if leftover.is_dir() else leftover.unlink)()
            place.rmdir()
    return None
