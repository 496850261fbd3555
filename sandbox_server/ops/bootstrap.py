"""`sandbox-server setup`: what a host needs before the first call, from the installed package alone.

An engine that answers (or, on a Debian host where we are root, the shipped engine
script installs and starts one), every sandbox image built and current, the cgroup2
hierarchy mounted so that a sandbox joins its cgroups without waiting (cgroups.FAVOR_MOVES),
and the data folder the `data-science` policy mounts. Each step does nothing when its work is done,
so running it again is cheap.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

from sandbox_server.errors import EngineUnavailable, SandboxServerError
from sandbox_server.policy.loader import HostFacts, load_policy
from sandbox_server.sandbox.engine.images import build_images
from sandbox_server.sandbox.engine.runtime import DockerRuntime
from sandbox_server.sandbox.runc.runtime import unpack_for_runc
from sandbox_server.sandbox.template.cgroups import favor_moves
from sandbox_server.shipped import engine_script
from sandbox_server.tools import all_tools

__all__ = ["DATA_FOLDER", "SetupFailed", "host_facts", "policy_images", "setup_host"]

DATA_FOLDER = Path("/srv/sandbox-data")
"""The host folder the shipped data-science policy mounts read-only at /data."""
ENGINE_SCRIPT_TIMEOUT_S = 900

Say = Callable[[str], None]


class SetupFailed(SandboxServerError):
    """A setup step could not be done; the message says which and what to do."""


def _engine(say: Say) -> DockerRuntime:
    """A connected engine, started with the shipped script when none answers and we may start one."""
    try:
        return DockerRuntime.connect()
    except EngineUnavailable as exc:
        first_error = exc
    script = engine_script()
    if os.geteuid() != 0 or not Path("/etc/debian_version").exists() or shutil.which("bash") is None:
        raise SetupFailed(
            f"{first_error}. This is not a Debian host where we are root, so setup cannot install an engine: "
            "install and start Docker Engine 20.10 or newer (optionally gVisor's runsc as runtime 'runsc'), "
            "then run `sandbox-server setup` again"
        )
    say(f"no engine answers; starting one with {script}")
    try:
        subprocess.run(["bash", str(script)], check=True, timeout=ENGINE_SCRIPT_TIMEOUT_S)
    except (OSError, subprocess.SubprocessError) as exc:
        raise SetupFailed(f"the engine script {script} failed ({exc}); its messages are above") from exc
    return DockerRuntime.connect()


def setup_host(say: Say, force_images: bool = False) -> None:
    """Engine, images and data folder: everything a call needs on this host."""
    runtime = _engine(say)
    try:
        info = runtime.info()
        say(f"engine: {info.dialect.name} {info.server_version}, runtimes {', '.join(info.runtimes)}")
        outcomes = build_images(runtime, None, say=say, force=force_images)
        rebuilt = [outcome.name for outcome in outcomes if outcome.rebuilt]
        say(f"images built: {', '.join(rebuilt)}" if rebuilt else "images: all current, nothing rebuilt")
        unpack_for_runc(runtime, policy_images("default", host_facts(runtime)), say)
    finally:
        runtime.close()
    moves = favor_moves()
    if moves is not None:
        say(moves)
    if not DATA_FOLDER.is_dir():
        try:
            DATA_FOLDER.mkdir(parents=True)
            say(f"made {DATA_FOLDER} (the data-science policy mounts it read-only at /data)")
        except OSError as exc:
            say(f"could not make {DATA_FOLDER} ({exc.strerror}): the data-science policy needs it; make it as root")


def policy_images(reference: str, facts: HostFacts) -> list[str]:
    """The images the policy's tools run, each once."""
    names = [tool.name for tool in all_tools() if tool.sandbox]
    policy = load_policy(reference, names, facts)
    return sorted({policy.for_tool(name).image for name in names})


def host_facts(runtime: DockerRuntime) -> HostFacts:
    """What the engine can honour, for checking policies; unknown while no engine answers."""
    try:
        info = runtime.info()
        dialect, facts = info.dialect, HostFacts(frozenset(info.runtimes))
        if info.cpus:
            facts = replace(facts, cpus=info.cpus)
        if info.memory_bytes:
            facts = replace(facts, memory_mb=info.memory_bytes // (1024 * 1024))
        if not dialect.chooses_runtime:
            facts = replace(facts, runtime_advice=f"{dialect.runtime_ignored()}: use Docker for it, or choose runc")
        if not dialect.bridge_networks:
            facts = replace(facts, networks_missing=dialect.networks_missing())
        return facts
    except SandboxServerError:
        return HostFacts()  # engine down: runtimes cannot be checked now; each call will say so
