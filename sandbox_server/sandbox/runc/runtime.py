"""Sandboxes made by runc itself, beside the engine: a call's container without dockerd's and containerd's cost.

The engine spends most of a quarter second of its own to start a container on a small machine; runc alone,
given a bundle, a fraction of that. Where it can (the server is root on the engine's host, the call's policy
runs on runc), this runtime makes the call's sandbox from a bundle: the image's root filesystem unpacked once and
shared read-only (sandbox.bundles), and a config with the engine's own hardening (sandbox.oci). One on an allow
list's network, or beside a workspace's services on theirs, is plugged into the engine's bridge of each, at an
address of the server's own (sandbox.veth), and finds the services by their names in a hosts file the server keeps
(sandbox.hosts). gVisor's are made by runsc itself from the same bundles (sandbox.gvisor). Everything else goes
through the engine as before: image builds, services, the proxy.

Each sandbox runs under a `runc run` of its own, a child of the server that waits for it and gives its exit
status, its stdio three pipes read as the engine's attach stream (sandbox.pipes). It is made ahead, as the
engine's warm containers are: its launcher waits on stdin for its request. After its trailer the launcher stops
itself, and the host reads the sandbox's counters from its cgroup before deleting it (`--keep` leaves a sandbox
killed for memory in place until then, so its cgroup can say so).

A sandbox's name carries its server's pid and start time, and its bundle the owner label: a server killed with
SIGKILL leaves sandboxes that its reaper, or the next server's sweep, deletes (sandbox.runc_state).
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

import docker

from sandbox_server.errors import EngineError, EngineUnavailable
from sandbox_server.sandbox import wire
from sandbox_server.sandbox.activity import Activity
from sandbox_server.sandbox.engine.connection import engine_errors
from sandbox_server.sandbox.engine.removal import Remover, owned_by, owner_alive
from sandbox_server.sandbox.engine.runtime import DockerRuntime
from sandbox_server.sandbox.gvisor.runsc import gvisor_exit, start_gvisor
from sandbox_server.sandbox.polling import readable
from sandbox_server.sandbox.runc import host_ids, userns_maker
from sandbox_server.sandbox.runc.bundles import Inspected, is_unpacked, prune_unpacked, unpacked, write_config
from sandbox_server.sandbox.runc.hosts import ensure_hosts, forget_hosts, write_hosts
from sandbox_server.sandbox.runc.oci import INIT_SOURCE, oci_config
from sandbox_server.sandbox.runc.pipes import PipeStream
from sandbox_server.sandbox.runc.state import (
    CGROUP_PARENT,
    IMAGES,
    STATE,
    Run,
    delete,
    delete_left_by,
    hosts_folder,
    is_runc,
    listed,
    oom_kills,
    owners_left,
    runc_path,
    runsc_path,
    sandbox_name,
    started_pid,
)  # fmt: skip
from sandbox_server.sandbox.runc.veth import Addresses, Layout, layout_of, on_network, plug
from sandbox_server.sandbox.spec import Mount, SandboxSpec
from sandbox_server.sandbox.template.host import Forked, Templates
from sandbox_server.sandbox.template.launch import ROOTFS, WARM, forked, held_memory, warm_request
from sandbox_server.sandbox.template.userns import WarmNamespaces
from sandbox_server.sandbox.warm_container import SETTLE_S, WarmContainer, sandbox_processes

__all__ = ["RuncRuntime", "runc_usable"]

STARTED_WITHIN_S = 30.0
"""The longest runc may take to start a sandbox before the call is told the runtime failed."""


def runc_usable() -> str | None:
    """Why sandboxes cannot be made by runc here, or None when they can (the facts a start and `doctor` say)."""
    if os.geteuid() != 0:
        return "the server does not run as root"
    if runc_path() is None:
        return "no runc binary is installed"
    if not os.access(INIT_SOURCE, os.X_OK):
        return f"the engine's init ({INIT_SOURCE}) is missing"
    return None


def runc_refusal(engine: DockerRuntime) -> str | None:
    """Why runc cannot make sandboxes beside this engine (None: it can); EngineUnavailable while it is away."""
    why_not = runc_usable()
    if why_not is None and engine.dialect.podman:
        why_not = "the engine is Podman"
    if why_not is None and not engine.on_this_host():
        why_not = "the engine runs on another host"
    return why_not


def unpack_for_runc(
    engine: DockerRuntime, references: Iterable[str], say: Callable[[str], None], folder: Path = IMAGES
) -> None:
    """Unpack the images runc makes sandboxes of before their first one (python-data takes some 20 s on two
    cores), and remove the unpacked images the engine has no longer tagged; nothing where runc makes none."""
    why_not = runc_refusal(engine)
    if why_not is not None:
        say(f"images not unpacked for runc's sandboxes: {why_not}")
        return
    for reference in references:
        with engine_errors(f"inspect image {reference}"):
            inspected = engine.api.inspect_image(reference)
        if not is_unpacked(inspected, folder):
            try:
                unpacked(engine.api, reference, inspected, folder)
            except (OSError, docker.errors.DockerException) as exc:
                raise EngineError(f"could not unpack {reference} for runc: {exc}") from exc
            say(f"[{reference}] unpacked for runc's sandboxes in {folder}")
    with engine_errors("list images"):
        removed = prune_unpacked(engine.api, folder, STATE / "bundles")
    if removed:
        say(f"removed {len(removed)} unpacked image(s) the engine no longer has tagged")


class RuncRemover(Remover):
    """The engine's remover, which deletes the sandboxes runc runs itself with runc."""

    def __init__(
        self,
        api: Callable[[], docker.APIClient],
        activity: Activity,
        state: Path,
        runs: dict[str, Run],
        addresses: Addresses,
    ) -> None:
        super().__init__(api, activity, state)
        self._runs = runs
        self._addresses = addresses

    def remove(self, container_id: str) -> None:
        if not is_runc(container_id):
            super().remove(container_id)
            return
        run = self._runs.pop(container_id, None)
        if run is not None:
            # Killed here, a sandbox is deleted as a stopped one (runc's own --force kill waits in steps of 0.1 s).
            run.kill()
        delete(self.state, container_id, stopped=run is not None and run.process.returncode is not None)
        self._addresses.give_back(container_id)  # its namespace, and the veth in it, went with its last process

    def reap(self, owner: str) -> int:
        removed = super().reap(owner)
        for other in owners_left(self.state) - {owner}:  # its sandboxes, cgroups, warm templates' namespaces, ids
            if not owner_alive(other):  # (a server whose reaper died with it)
                removed += delete_left_by(other, self.state)
        return removed


class RuncRuntime(DockerRuntime):
    """The engine's runtime, whose calls' sandboxes runc (runsc for gVisor) runs itself where it may."""

    def __init__(
        self,
        client: docker.DockerClient | None = None,
        sandboxes: str = "runc",
        state: Path = STATE,
        images: Path = IMAGES,
    ) -> None:
        """`sandboxes`: "runc" (runc makes what it can, or the server does not start), "template" (as "runc", each
        sandbox forked from its image's template where the image can have one: sandbox.template), "engine" (the
        engine makes every sandbox), "auto" (as "template" where this host lets runc make sandboxes)."""
        super().__init__(client)
        self.sandboxes = sandboxes
        self.templates = Templates() if sandboxes in ("template", "auto") else None
        """The templates sandboxes are forked from (None: runc starts each)."""
        self.state, self.images, self.inspected = state, images, Inspected()
        self.warm_namespaces = WarmNamespaces(state, lambda: sandbox_name(self.owner))
        self._runs: dict[str, Run] = {}
        self._chosen: str | None = None
        self._own_ids: str | None = None
        self._next_range = 0
        self.addresses = Addresses()
        """The addresses of the server's half of its allow lists' networks (sandbox.veth), each held by a sandbox."""
        self.removal = RuncRemover(lambda: self.api, self.activity, state, self._runs, self.addresses)

    def close_connection(self) -> None:
        if self.templates is not None:  # (after every sandbox forked from them is deleted)
            self.templates.close()
        self.warm_namespaces.close()
        userns_maker.close()
        super().close_connection()

    def runc_refused(self) -> str | None:
        """Why runc makes no sandbox here (None: it makes those it can), decided once; asked for runc, a host that
        cannot refuses with EngineError."""
        if self._chosen is None:
            try:
                why_not = "as asked" if self.sandboxes == "engine" else runc_refusal(self)
            except EngineUnavailable:  # asked again once it answers; until then no sandbox is made at all
                return "the engine does not answer yet"
            if why_not is not None and self.sandboxes in ("runc", "template"):
                raise EngineError(f"--sandboxes {self.sandboxes}: runc cannot make sandboxes here: {why_not}")
            self._chosen = why_not or ""
        return self._chosen or None

    def own_ids_refused(self) -> str | None:
        """Why runc's sandboxes share the sandbox user's host ids here (None: each has a range of its own,
        sandbox.host_ids), found once by trying."""
        if self._own_ids is None:
            self.images.mkdir(parents=True, exist_ok=True)
            self._own_ids = host_ids.unavailable(self.state, self.images) or ""
        return self._own_ids or None

    def takes(self, spec: SandboxSpec) -> bool:
        """Whether runc (runsc for gVisor) may make this spec's sandbox, else the engine does: a runc policy's; a
        gVisor policy's (which has no network here) where runsc is installed."""
        if self.runc_refused() is not None:
            return False
        if spec.runtime == "runsc":
            return not spec.networked and runsc_path() is not None
        return spec.runtime == "runc"

    def makes_itself(self, spec: SandboxSpec) -> bool:
        """Whether runc itself makes this spec's sandboxes (not runsc, not the engine): a pool of them may be kept
        deeper, as a policy's `pool.runc` says."""
        with contextlib.suppress(EngineError):  # runc asked for and refused here: the engine's depth, said at start
            return spec.runtime == "runc" and self.takes(spec)
        return False

    def name_services(self, networks: Mapping[str, Mapping[str, str]]) -> None:
        """Write the hosts file of each services' network in `networks` (its services' names and addresses), which
        its sandboxes have bound at /etc/hosts, and remove those of networks no longer there."""
        folder = hosts_folder(self.state, self.owner)
        for network, names in networks.items():
            write_hosts(folder, network, names)
        forget_hosts(folder, networks)

    def sandbox_containers(self) -> list[str]:
        return [*super().sandbox_containers(), *sorted(listed(self.state))]

    def prepare(self, spec: SandboxSpec) -> WarmContainer:
        if not self.takes(spec):
            return super().prepare(spec)
        layouts = []  # as the engine joins them: an allow list's network first, then the services'
        for network in (spec.network if spec.network != "none" else None, spec.service_network):
            if network is not None:
                with engine_errors(f"inspect network {network}"):
                    layout = layout_of(self.api.inspect_network(network))
                if layout is None:  # a network made without the server's half of its addresses
                    return super().prepare(spec)
                layouts.append(layout)
        if self.templates is not None:  # before this server's first bundle: see WarmNamespaces.share_bundles
            self.warm_namespaces.share_bundles()
        slot = tempfile.mkdtemp(prefix="slot-", dir=spec.workspace_slots) if spec.workspace_slots else None
        try:
            if slot is not None:  # empty, root's until a call's; a sandbox's own root (not the host's) enters it
                os.chmod(slot, 0o755)
            return self._run_ahead(spec, slot, layouts)
        except BaseException:
            if slot is not None:
                os.rmdir(slot)
            raise

    def _run_ahead(self, spec: SandboxSpec, slot: str | None, layouts: list[Layout]) -> WarmContainer:
        bundled = spec  # the spec as its bundle says it: beside services, their names bound at /etc/hosts
        if spec.runtime != "runsc":  # and its launcher lingers after its trailer, as on the engine's path
            bundled = replace(spec, env=(*spec.env, (wire.LINGER_ENV, "1")))
        if spec.service_network is not None:  # (what the engine's resolver would answer)
            names = ensure_hosts(hosts_folder(self.state, self.owner), spec.service_network)
            bundled = replace(bundled, mounts=(*spec.mounts, Mount(str(names), "/etc/hosts")))
        with engine_errors(f"inspect image {spec.image}"):
            inspected = self.inspected.of(self.api, spec.image)
        try:
            rootfs = unpacked(self.api, spec.image, inspected, self.images)
        except (OSError, docker.errors.DockerException) as exc:
            raise EngineError(f"could not unpack {spec.image} for runc: {exc}") from exc
        name, image_env = sandbox_name(self.owner), (inspected.get("Config") or {}).get("Env") or []
        place, own, warm = self.state / "bundles" / name, host_ids.OwnIds(rootfs, bundled, slot), None
        try:
            if spec.runtime == "runc" and self.own_ids_refused() is None:
                warm = warm_request(self.templates, self.warm_namespaces, rootfs, spec, image_env)
                if warm is not None:  # forked warm, in its template's user namespace
                    own = host_ids.share_ids(place, Path(warm["userns"]), warm["first"], rootfs, bundled, slot)
                else:
                    own = host_ids.give_own_ids(self.state, place, name, rootfs, bundled, slot, self._next_range)
                    self._next_range = own.index + 1
            annotations = {**owned_by(self.owner), **dict(spec.labels), **on_network(layouts), ROOTFS: str(rootfs)}
            config = oci_config(
                own.spec, str(own.rootfs), [wire.LAUNCHER], own.slot, user_namespace=own.mapping,
                image_env=image_env, cgroups_path=f"/{CGROUP_PARENT}/{name}",
                annotations={**annotations, WARM: json.dumps(warm)} if warm else annotations,
            )  # fmt: skip
            bundle = write_config(place, config)
        except BaseException as exc:
            delete(self.state, name)
            if isinstance(exc, OSError):
                raise EngineError(f"could not make sandbox {name}'s bundle: {exc}") from exc
            raise
        stream = PipeStream()
        assert stream.sandbox_ends is not None
        address = ""
        try:
            try:
                pid = self._launch(name, bundle, config, stream.sandbox_ends, spec.runtime == "runsc")
            finally:
                stream.handed_over()
            for index, layout in enumerate(layouts):  # on each network, at an address of the server's half
                taken = self.addresses.take(layout, name)
                plug(pid, name, layout, taken, index)
                if layout.network == spec.network:  # the address the proxy and the egress audit know it by
                    address = str(taken)
        except BaseException:
            stream.close()
            self.removal.remove(name)
            raise
        key, now, run = spec.container_key(), time.monotonic(), self._runs[name]
        ends = run.init if isinstance(run.process, Forked) and run.process.ends_with_first else None
        return WarmContainer(name, stream, key, now, None, slot, pid, address, own.namespace, ends)

    def _launch(
        self, name: str, bundle: Path, config: Mapping[str, Any], stdio: tuple[int, int, int], gvisor: bool
    ) -> int:
        """Start the sandbox of `bundle` under runc (or runsc for gVisor), known to the remover from the first
        moment (runsc's own state says a gVisor one); the host pid of its first process once it runs."""
        if gvisor:  # one that runsc made but could not start is still deleted: runsc keeps its state
            process, pid = start_gvisor(self.state, bundle, name, stdio, STARTED_WITHIN_S)
            self._runs[name] = run = Run(process, gvisor=True)
        elif self.templates is not None and (made := forked(self.templates, bundle, config, stdio, STARTED_WITHIN_S)):
            self._runs[name] = run = Run(made)
            pid = made.pid
        else:
            command = [runc_path() or "runc", "--root", str(self.state / "runc"), "--log", str(bundle / "runc.log")]
            command += ["run", "--keep", "--bundle", str(bundle), "--pid-file", str(bundle / "pid"), name]
            stdin, stdout, stderr = stdio
            try:
                process = subprocess.Popen(command, stdin=stdin, stdout=stdout, stderr=stderr, start_new_session=True)
            except OSError as exc:
                raise EngineError(f"could not run runc: {exc}") from exc
            self._runs[name] = run = Run(process)
            pid = started_pid(name, process, bundle, STARTED_WITHIN_S)
        run.init = os.pidfd_open(pid)
        return pid

    def healthy(self, warm: WarmContainer) -> bool:  # type: ignore[override]
        if not is_runc(warm.container_id):
            return DockerRuntime.healthy(warm)
        run = self._runs.get(warm.container_id)
        stream = warm.stream
        assert isinstance(stream, PipeStream)
        if run is None or run.process.poll() is not None or stream.said_anything():
            return False
        return not (isinstance(run.process, Forked) and run.process.superseded())  # (replaced by a warm one)

    def memory(self, warm: WarmContainer) -> int:  # type: ignore[override]
        if is_runc(warm.container_id):  # one forked from a template: what it holds of its own
            held = held_memory(self.state / "bundles" / warm.container_id)
            if held is not None:
                return held
        return DockerRuntime.memory(warm)

    def host_pids(self, container_id: str) -> list[int]:
        if not is_runc(container_id):
            return super().host_pids(container_id)
        try:
            first = int((self.state / "bundles" / container_id / "pid").read_text())
        except (OSError, ValueError) as exc:
            raise EngineError(f"sandbox {container_id} is not running") from exc
        found = sandbox_processes(first)
        if not found:
            raise EngineError(f"sandbox {container_id}: its processes cannot be read here")
        return found

    def _finish(self, container_id: str, lingering: bool) -> tuple[int | None, bool]:
        if not is_runc(container_id):
            return super()._finish(container_id, lingering)
        run = self._runs.get(container_id)
        if run is None:
            return None, False
        if run.process.poll() is None and lingering:
            run.kill_init()
        try:
            if isinstance(run.process, subprocess.Popen) and run.gvisor:
                code = gvisor_exit(run.process.communicate(timeout=30)[0])
            else:
                code = run.process.wait(timeout=30)
        except subprocess.TimeoutExpired as exc:
            raise EngineError(f"sandbox {container_id} did not end after its output did") from exc
        oom = oom_kills(container_id) > 0  # a sandbox killed so exited as SIGKILL ends it (runsc may say nothing)
        return (137 if code is None and oom else code), oom

    def _settled(self, warm: WarmContainer, spec: SandboxSpec) -> bool:
        run = self._runs.get(warm.container_id)
        if run is None or not run.gvisor:
            return super()._settled(warm, spec)
        return bool(readable([run.init], SETTLE_S))  # gVisor's sandbox process has ended
