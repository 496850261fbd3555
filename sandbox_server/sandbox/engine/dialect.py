"""Which engine answers on the Docker API, and how a hardened container is said to it.

Docker is the engine the project is built on. Podman's Docker-compatible service (Debian's
podman 4.3, `podman system service`) runs the same sandboxes once a few things are said its
way; each difference is named here, so `doctor` and the docs can say what it costs:

- it ignores a container's runtime (HostConfig.Runtime): every container runs on its default
  runtime, so it is the only one a policy may name (`strict`, on runsc, is refused at load);
- its networks (CNI in 4.3) take none of the Docker bridge options a network of sandboxes is made
  safe with (no IPv4 gateway, no traffic between its members) and name no container without the
  dnsname plugin: allow lists through the proxy and services are refused with the reason;
- its tmpfs takes neither `uid=`/`gid=` nor `nr_inodes=`: the owner is given with its own `U`
  option, and a tmpfs's inode cap is not applied (its size cap is);
- its security option `seccomp=` names a file the engine reads, where Docker's carries the profile
  itself: the profile is written to a folder of this process's own (so the engine must run on this
  host, as a local socket's does);
- it gives every container open-file and process limits of 1048576 unless told otherwise, which
  a host without CAP_SYS_RESOURCE cannot grant: the process limit is stated, the engine's own as
  Docker's containers inherit theirs (the sandbox's pids cgroup is what bounds its processes).
"""

from __future__ import annotations

import atexit
import hashlib
import os
import resource
import shutil
import tempfile
import threading
from dataclasses import dataclass
from typing import Any

__all__ = ["DOCKER", "EngineDialect", "dialect_of"]


@dataclass(frozen=True, slots=True)
class EngineDialect:
    """The engine's name and version, and what it takes of a hardened container's settings."""

    name: str = "Docker"
    version: str = ""
    chooses_runtime: bool = True
    """A container's runtime (HostConfig.Runtime) is honoured; if not, only the engine's default may be named."""
    bridge_networks: bool = True
    """The engine's networks take Docker's bridge options and resolve their containers' names."""
    tmpfs_owner_option: bool = False
    """The tmpfs owner is set with `U` (the container's user) rather than `uid=`/`gid=`."""
    tmpfs_inode_cap: bool = True
    """The engine passes `nr_inodes=` to a tmpfs."""
    seccomp_by_path: bool = False
    """The engine reads a seccomp profile from the file `seccomp=` names (on its own host), not from the option."""
    process_limit: int | None = None
    """The RLIMIT_NPROC every container is given (-1: none), when the engine's default is more than a host may
    grant; None to leave the engine's."""

    @property
    def podman(self) -> bool:
        """Whether this is Podman's Docker-compatible service."""
        return self.name == "Podman"

    def differences(self) -> tuple[str, ...]:
        """What a sandbox on this engine lacks or does differently from one on Docker, each in a sentence."""
        found = []
        if not self.chooses_runtime:
            found.append(
                f"{self.runtime_ignored()}, so every sandbox runs on its default one and a policy naming another "
                "(runsc, as `strict` does) is refused"
            )
        if not self.bridge_networks:
            found.append(self.networks_missing())
        if not self.tmpfs_inode_cap:
            found.append(
                f"{self.name}'s tmpfs takes no nr_inodes=, so the inode caps of /tmp and of an unkept workspace "
                "(limits.workspace_inodes) are not applied; their size caps are"
            )
        return tuple(found)

    def runtime_ignored(self) -> str:
        """Why a runtime other than the engine's default is refused on this engine."""
        return f"{self.name}'s Docker-compatible API ignores a container's runtime"

    def networks_missing(self) -> str:
        """Why a network through the proxy, or a service, is refused on this engine."""
        return (
            f"{self.name}'s networks take none of the Docker bridge options a network of sandboxes is made safe with "
            "(no IPv4 gateway, no traffic between sandboxes) and do not resolve services' names, so allow lists "
            "(network) and services are refused"
        )

    def adapt(self, options: dict[str, Any]) -> dict[str, Any]:
        """A HostConfig's keyword arguments (host_config.host_config_kwargs) said this engine's way."""
        if self.tmpfs_owner_option or not self.tmpfs_inode_cap:
            options["tmpfs"] = {path: self._tmpfs(settings) for path, settings in options["tmpfs"].items()}
        if self.seccomp_by_path:
            options["security_opt"] = [_seccomp_file(opt) for opt in options["security_opt"]]
        if self.process_limit is not None:
            nproc = {"name": "nproc", "soft": self.process_limit, "hard": self.process_limit}
            options["ulimits"] = [*options["ulimits"], nproc]
        return options

    def _tmpfs(self, settings: str) -> str:
        kept, owned = [], False
        for option in settings.split(","):
            key = option.partition("=")[0]
            if key == "nr_inodes" and not self.tmpfs_inode_cap:
                continue
            if key in ("uid", "gid") and self.tmpfs_owner_option:
                owned = True
                continue
            kept.append(option)
        if owned:
            kept.append("U")  # owned by the container's user, as uid=/gid= would have made it
        return ",".join(kept)


DOCKER = EngineDialect()


def dialect_of(version: dict[str, Any], engine_pid: int | None = None) -> EngineDialect:
    """The dialect of the engine whose `GET /version` answer this is; `engine_pid`, the engine's process when it
    runs on this host (its limits are then read; else this process's are taken as the best guess)."""
    components = {str(item.get("Name", "")): str(item.get("Version", "")) for item in version.get("Components") or ()}
    if "Podman Engine" in components:
        return EngineDialect(
            "Podman",
            components["Podman Engine"],
            chooses_runtime=False,
            bridge_networks=False,
            tmpfs_owner_option=True,
            tmpfs_inode_cap=False,
            seccomp_by_path=True,
            process_limit=process_limit(engine_pid),
        )
    return EngineDialect("Docker", str(version.get("Version", "")))


def process_limit(pid: int | None) -> int:
    """The hard RLIMIT_NPROC of a process (this one when None or unreadable); -1 when unlimited."""
    try:
        hard = resource.prlimit(pid or 0, resource.RLIMIT_NPROC)[1]
    except (OSError, ValueError):
        hard = resource.getrlimit(resource.RLIMIT_NPROC)[1]
    return -1 if hard == resource.RLIM_INFINITY else hard


_profiles: dict[str, str] = {}
_profiles_lock = threading.Lock()


def _seccomp_file(option: str) -> str:
    """`seccomp=<profile JSON>` as `seccomp=<file holding it>`; any other option as it is. The files live in a
    folder only this process's user may write (mode 0700, made once per process, removed at exit)."""
    name, _, value = option.partition("=")
    if name != "seccomp" or not value.lstrip().startswith("{"):
        return option
    digest = hashlib.sha256(value.encode()).hexdigest()[:24]
    with _profiles_lock:
        if digest not in _profiles:
            if not _profiles:
                folder = tempfile.mkdtemp(prefix="sandbox-server-seccomp-")
                atexit.register(shutil.rmtree, folder, True)
                _profiles[""] = folder
            path = os.path.join(_profiles[""], f"{digest}.json")
            with open(path, "w", encoding="utf-8") as profile:
                profile.write(value)
            _profiles[digest] = path
        return f"seccomp={_profiles[digest]}"
