"""A team's own sandbox image: a build context beside its policy (`build:`), built into a sandbox image.

The context's Dockerfile starts FROM one of ours (`sandbox-server/shell:latest`) or FROM any image the engine has
(no registry serves one here). It is built as written; then, with no build step of its own (each costs the engine
a container), it is made a sandbox image: in a container of it that never starts, the server looks for what its
tools' calls run (a shell, tar, Python and the cell runner for run_python), writes its launcher, a user 1000 when
the image has none and `/workspace`, and commits that with `USER 1000:1000`. Refused, naming why: a Dockerfile
whose image runs as root by its own choice (a last `USER root`), a failing step (its number, instruction and last
lines), an image without what its tools' calls run (what is missing), and one whose environment would run its
own code in the launcher (LD_PRELOAD and the loader's other variables, BASH_ENV, ENV). Whatever ENTRYPOINT and CMD
it keeps, no sandbox runs them: every container of it is made with the launcher (or a service's program) as its
entrypoint.

The image is named by its context's content (`sandbox-server/team-<folder>-<hash>:latest`): a changed context is
another image, which `serve` refuses until `images build --policy` has built it. Its hash label also covers what
it is built upon, so a rebuilt base rebuilds it.
"""

from __future__ import annotations

import io
import json
import re
import tarfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from sandbox_server import shipped
from sandbox_server.errors import ImageError
from sandbox_server.sandbox import wire
from sandbox_server.sandbox.engine.images import (
    HASH_LABEL,
    NAME_LABEL,
    PREFIX,
    BuildOutcome,
    build_images,
    catalog,
    context_digest,
    drop_replaced,
    steps_said,
)  # fmt: skip
from sandbox_server.sandbox.engine.runtime import DockerRuntime

__all__ = ["BASE_LABEL", "CONTEXT_LABEL", "TeamImage", "build_team_image", "team_image_reference", "team_image_status"]

CONTEXT_LABEL = "org.sandbox-server.build-context"
"""The folder a team's image was built from."""
BASE_LABEL = "org.sandbox-server.base"
"""The image a team's Dockerfile starts FROM."""
_FROM = re.compile(r"^\s*FROM\s+(?:--platform=\S+\s+)?(\S+)", re.IGNORECASE | re.MULTILINE)
_USER = re.compile(r"^\s*USER\s+(\S+)", re.IGNORECASE | re.MULTILINE)
ROOT_USERS = {"root", "0"}
BUILD_MAX_S = 1800.0
"""The longest a team's build may take, every step together (`images build --max-s`)."""
_RUNS_FIRST = re.compile(r"LD_[A-Z0-9_]+|BASH_ENV|ENV")
"""Variables that make every process of the launcher load or run something first: the dynamic loader's (LD_PRELOAD,
LD_AUDIT, LD_LIBRARY_PATH, …) and the shells' start-up files."""

LAUNCHER_NEEDS = ("sh", "tar", "mkdir", "rm", "cat", "sleep", "setsid")
"""The programs every sandbox's launcher runs (images/base/sandbox-launch)."""
TOOL_NEEDS = {"run_python": ("python3", wire.RUN_CELL), "analyze_csv": ("python3", wire.ANALYZE_CSV)}
"""What a tool's calls run beyond the launcher: programs by name, files by path."""

DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
SANDBOX_USER = ("sandbox:x:1000:1000::/workspace:/bin/sh\n", "sandbox:x:1000:\n")
"""The lines /etc/passwd and /etc/group get when nothing in them has the id 1000."""


def team_image_reference(context: Path) -> str:
    """The tag a context's image is built under: its folder's name (`team-` said once, when the folder's name
    starts with it) and a hash of its files."""
    slug = re.sub(r"[^a-z0-9]+", "-", context.name.lower()).strip("-").removeprefix("team-")[:40] or "image"
    return f"{PREFIX}/team-{slug}-{context_digest(context).hexdigest()[:12]}:latest"


def dockerfile_base(context: Path) -> str:
    """The image the context's Dockerfile (its last stage) starts FROM."""
    found = _FROM.findall((context / "Dockerfile").read_text())
    if not found:
        raise ImageError(f"{context / 'Dockerfile'} has no FROM line")
    return str(found[-1])


@dataclass(frozen=True, slots=True)
class TeamImage:
    """One team image a policy asks for: its tag, its context and what its tools' calls run."""

    reference: str
    context: Path
    tools: tuple[str, ...]

    @property
    def needs(self) -> tuple[str, ...]:
        wanted = dict.fromkeys(LAUNCHER_NEEDS)
        for tool in self.tools:
            wanted.update(dict.fromkeys(TOOL_NEEDS.get(tool, ())))
        return tuple(wanted)


def _foundation(runtime: DockerRuntime, base: str, say: Callable[[str], None]) -> str:
    """What the image is built upon, built first when it is one of ours; refused when the engine lacks it."""
    ours = {definition.reference: name for name, definition in catalog().items()}
    if base in ours or f"{base}:latest" in ours:

        def building(line: str) -> None:  # that ours are current was said already
            if not line.endswith("nothing to build"):
                say(line)

        build_images(runtime, [ours.get(base) or ours[f"{base}:latest"]], say=building)
    found = _built_upon(runtime, base)
    if found is None:
        raise ImageError(
            f"its Dockerfile starts FROM {base}, which this engine does not have (no registry is asked): "
            f"build or load it first, or start FROM one of ours ({', '.join(sorted(ours))})"
        )
    return found


def _built_upon(runtime: DockerRuntime, base: str) -> str | None:
    """What an image built FROM `base` is built upon, as its hash label says: one of ours by its context's hash,
    any other image by its id (None: the engine has no such image)."""
    record = runtime.image(base)
    return (record.labels.get(HASH_LABEL) or record.image_id) if record is not None else None


def expected_hash(context: Path, foundation: str) -> str:
    digest = context_digest(context)
    digest.update(b"upon\0" + foundation.encode() + b"\0" + (shipped.images_dir() / "base/sandbox-launch").read_bytes())
    return digest.hexdigest()[:24]


def team_image_status(runtime: DockerRuntime, image: TeamImage) -> tuple[bool, bool, int]:
    """(built, current, size in bytes) of a team's image, without building anything."""
    record = runtime.image(image.reference)
    if record is None:
        return False, False, 0
    foundation = _built_upon(runtime, dockerfile_base(image.context)) or "unbuilt"
    return True, record.labels.get(HASH_LABEL) == expected_hash(image.context, foundation), record.size_bytes


def build_team_image(
    runtime: DockerRuntime, image: TeamImage, say: Callable[[str], None] = print, force: bool = False,
    max_s: float = BUILD_MAX_S,
) -> BuildOutcome:  # fmt: skip
    """Build a team's image when its context or its base changed; ImageError says why one is refused (a build
    past `max_s` among the reasons)."""
    name = image.reference.split("/", 1)[1].rsplit(":", 1)[0]
    dockerfile = image.context / "Dockerfile"
    if not dockerfile.is_file():
        raise ImageError(f"{image.context} has no Dockerfile")
    base = dockerfile_base(image.context)
    expected = expected_hash(image.context, _foundation(runtime, base, say))
    built = runtime.image(image.reference)
    if built is not None and built.labels.get(HASH_LABEL) == expected and not force:
        say(f"[{name}] current ({expected}), nothing to build")
        return BuildOutcome(name, False, expected)
    users = _USER.findall(dockerfile.read_text())
    if users and users[-1].split(":")[0].lower() in ROOT_USERS:
        raise ImageError(
            f"{dockerfile} leaves its image running as {users[-1]}: sandboxes run as the non-root user 1000 "
            "(no root inside, as every image of ours); end it with `USER 1000:1000`"
        )
    say(f"[{name}] building {image.reference} from {image.context} (FROM {base})")
    stage = f"{PREFIX}/{name}:stage"
    try:
        try:
            for line in steps_said(runtime.build(str(image.context), stage, {}, {}, within_s=max_s)):
                say(f"[{name}] {line}")
        except ImageError as exc:
            raise ImageError(str(exc).replace(stage, image.reference)) from exc
        labels = {HASH_LABEL: expected, NAME_LABEL: name, BASE_LABEL: base, CONTEXT_LABEL: str(image.context)}
        _make_sandbox_image(runtime, image, stage, labels)
    finally:
        runtime.untag(stage)
    say(f"[{name}] built: the sandbox user, the launcher and /workspace added; {', '.join(image.needs)} found")
    drop_replaced(runtime, built, image.reference, name, say)
    return BuildOutcome(name, True, expected)


def _make_sandbox_image(runtime: DockerRuntime, image: TeamImage, stage: str, labels: dict[str, str]) -> None:
    """The built image made a sandbox image without another build step: what its tools' calls run looked for, the
    launcher, the user 1000 and /workspace written into a container of it that never starts, then committed."""
    config = runtime.image_config(stage)
    env = dict(item.split("=", 1) for item in config.get("Env") or () if "=" in item)
    foreign = sorted(name for name in env if _RUNS_FIRST.fullmatch(name))
    if foreign:
        raise ImageError(
            f"{image.reference} sets {', '.join(foreign)} in its environment, which would run code of the image's "
            "inside the server's launcher before every call (the dynamic loader's and the shell's start-up): "
            "remove those ENV lines from its Dockerfile (a program that needs one can be given it in its command)"
        )
    with runtime.unstarted(stage) as container:
        folders = env.get("PATH", DEFAULT_PATH).split(":")
        missing = [
            need for need in ("/bin/sh", *image.needs)
            if not any(runtime.has_path(container, path) for path in _places(need, folders))
        ]  # fmt: skip
        if missing:
            raise ImageError(
                f"{image.reference} lacks what its tools' calls run ({', '.join(image.tools)}): "
                f"{', '.join(dict.fromkeys(missing))}; install them in its Dockerfile, or start FROM one of ours"
            )
        runtime.put_files(container, _sandbox_files(runtime, container))
        changes = ["USER 1000:1000", "WORKDIR /workspace", "ENV HOME=/workspace", "ENTRYPOINT []", 'CMD ["/bin/sh"]']
        if "LANG" not in env:
            changes.append("ENV LANG=C.UTF-8")
        changes += [f"LABEL {key}={json.dumps(value)}" for key, value in labels.items()]
        runtime.commit(container, image.reference, changes)


def _places(need: str, folders: list[str]) -> list[str]:
    """Where a need may be: a path is itself; a program is in one of the PATH folders."""
    return [need] if need.startswith("/") else [f"{folder.rstrip('/')}/{need}" for folder in folders if folder]


def _sandbox_files(runtime: DockerRuntime, container: str) -> bytes:
    """A tar of the launcher (and the folders above it that are missing), /etc/passwd and /etc/group with a user
    1000 when they have none, and /workspace owned by it."""
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as archive:

        def add(path: str, data: bytes | None, mode: int, owner: int = 0) -> None:
            info = tarfile.TarInfo(path.lstrip("/"))
            info.mode, info.uid, info.gid, info.mtime = mode, owner, owner, int(time.time())
            if data is None:
                info.type = tarfile.DIRTYPE
                archive.addfile(info)
            else:
                info.size = len(data)
                archive.addfile(info, io.BytesIO(data))

        parents = Path(wire.LAUNCHER).parents
        for folder in reversed([str(p) for p in parents if str(p) != "/"]):
            if not runtime.has_path(container, folder):
                add(folder, None, 0o755)
        add(wire.LAUNCHER, (shipped.images_dir() / "base/sandbox-launch").read_bytes(), 0o755)
        for path, line in zip(("/etc/passwd", "/etc/group"), SANDBOX_USER, strict=True):
            text = (runtime.read_file(container, path) or b"").decode("utf-8", "replace")
            if not any(entry.split(":")[2:3] == ["1000"] for entry in text.splitlines()):
                add(path, (text + ("" if not text or text.endswith("\n") else "\n") + line).encode(), 0o644)
        add("/workspace", None, 0o755, owner=1000)
    return buffer.getvalue()
