"""A sandbox of runc's path forked from its image's template rather than started by `runc run`: the same bundle
(its config.json is what the template's child applies), the same cgroups, the same stdio pipes."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from sandbox_server.errors import EngineError
from sandbox_server.sandbox import wire
from sandbox_server.sandbox.runc.oci import RLIMITS
from sandbox_server.sandbox.spec import SandboxSpec
from sandbox_server.sandbox.template import cgroups
from sandbox_server.sandbox.template.host import Asked, Forked, Templates
from sandbox_server.sandbox.template.userns import WarmNamespaces

__all__ = ["MARK", "ROOTFS", "WARM", "forked", "held_memory", "remove_cgroups", "warm_request"]

ROOTFS = "sandbox-server.rootfs"
"""The bundle's annotation naming the image's unpacked root (its root is a view of it when the sandbox has host ids
of its own), so that the bundle says which image it runs: a template per image."""
WARM = "sandbox-server.warm"
"""The bundle's annotation for a sandbox forked from a warm template: that template's request (its user namespace,
the image's environment and the preload list), as JSON."""
MARK = "template"
"""The file in a bundle that says its sandbox was forked from a template (its cgroups are the server's to remove)."""


def forked(
    templates: Templates, bundle: Path, config: Mapping[str, Any], stdio: tuple[int, int, int], within_s: float
) -> Forked | None:
    """The sandbox of `bundle` (`config`: its config.json's) forked from its image's template, running (its first
    process's pid known); None when its image can have no template (runc runs it)."""
    annotations = config.get("annotations", {})
    image_root = Path(annotations.get(ROOTFS, config["root"]["path"]))  # (its root may be a view)
    if not templates.serves(image_root):
        return None
    linux = config["linux"]
    path = linux["cgroupsPath"]
    (bundle / MARK).write_text(path)
    (bundle / "root").mkdir(exist_ok=True)
    userns = next((n.get("path") for n in linux.get("namespaces", []) if n["type"] == "user"), None)
    warm = json.loads(annotations[WARM]) if WARM in annotations else None
    template: Asked
    try:
        made = templates.warm(image_root, linux.get("seccomp"), warm) if warm else None
        if made is not None:  # in the warm template's user namespace already
            template, userns = made, None
        else:  # (a warm one's while its template is made: forked cold, its program importing what it uses)
            template = templates.of(image_root, linux.get("seccomp"))
        procs = cgroups.made(path, linux["resources"])
    except OSError as exc:
        raise EngineError(f"could not make the sandbox's template or cgroups: {exc}") from exc
    report, told = os.pipe()
    given = {**config, "linux": {k: v for k, v in linux.items() if k != "seccomp"}, "annotations": {}}
    process = dict(config["process"])
    if RLIMITS in annotations:  # set by the child on itself, before anything of the image runs
        process["rlimits"] = json.loads(annotations[RLIMITS])
    if warm and made is None:  # no interpreter importing the list a second time beside the template's
        process["env"] = _without_preload(process.get("env", []))
    given["process"] = process
    try:
        template.fork({"config": given, "root": str(bundle / "root"), "userns": userns}, [*stdio, told, *procs])
    except OSError as exc:
        os.close(report)
        raise EngineError(f"the template of {config['root']['path']} did not answer: {exc}") from exc
    finally:
        os.close(told)
        for fd in procs:
            os.close(fd)
    sandbox = Forked(report, path)
    # (a template with a helper forks each program with a copy of its preloaded heap, whose end takes milliseconds
    # the answer need not wait for: those are looked at in /proc, and taken for ended as they begin to exit)
    sandbox.ends_with_first = made is not None and warm is not None and not warm.get("helper")
    if warm and made is None:  # once its warm template is made, a fresh sandbox forked from it serves better
        sandbox.superseded = lambda: templates.warm(image_root, linux.get("seccomp"), warm) is not None
    try:
        pid = sandbox.started(within_s)
    except BaseException:
        sandbox.close()
        raise
    (bundle / "pid").write_text(str(pid))
    return sandbox


def _without_preload(env: list[str]) -> list[str]:
    """A cold sandbox's environment while its warm template imports: its program imports what it uses itself,
    rather than the launcher starting an interpreter that imports the whole list, as the template is doing."""
    return [entry for entry in env if not entry.startswith(f"{wire.PRELOAD_ENV}=")]


def held_memory(bundle: Path) -> int | None:
    """The memory a forked sandbox holds of its own (None: the bundle is not one's): its cgroup's charge, not its
    processes' resident sizes, which count every page of its template's it maps."""
    try:
        path = (bundle / MARK).read_text()
    except OSError:
        return None
    return cgroups.charged(path)


def remove_cgroups(bundle: Path) -> bool:
    """A forked sandbox's cgroups gone, every process in them killed (True where the bundle is not one's)."""
    try:
        path = (bundle / MARK).read_text()
    except OSError:
        return True
    return cgroups.kill_and_remove(path)


def warm_request(
    templates: Templates | None, namespaces: WarmNamespaces, rootfs: Path, spec: SandboxSpec, image_env: list[str]
) -> dict[str, Any] | None:
    """The request of the warm template this spec's sandboxes are forked from (None: they are forked cold, or not
    at all): on runc's path, of an image with the warm interpreter (python-data's and the images built on it),
    whatever the policy preloads (nothing preloaded, its cells still start in no new interpreter). Its user
    namespace is made here, at the first. A template that preloads something has a helper fork its sandboxes'
    first processes and forks their programs itself, so that a call copies its heap once (`helper`); one that
    preloads nothing has little to copy, and its first processes fork their programs, cheaper by the steps and
    hand-overs that saves."""
    preload = dict(spec.env).get(wire.PRELOAD_ENV, "")
    if templates is None or spec.runtime != "runc" or not templates.serves(rootfs) or not namespaces.share_bundles():
        return None
    if not (rootfs / wire.WARM_PYTHON.lstrip("/")).is_file():
        return None
    held, first, view = namespaces.of(json.dumps([str(rootfs), preload]), rootfs)
    env = _without_preload(image_env)
    return {
        "userns": str(held), "first": first, "rootfs": str(view), "env": [*env, f"{wire.PRELOAD_ENV}={preload}"],
        "launchers": wire.LAUNCHERS_DIR, "helper": bool(preload.split()),
    }  # fmt: skip
