"""A team's own sandbox image: a build context beside its policy (`build:`), built into a sandbox image.

The context's Dockerfile starts FROM one of ours (`sandbox-server/shell:latest`) or FROM any image the engine has
(no registry serves one here). It is built as written, then made a sandbox image in a second, small step: the
launcher of this server, a user 1000 when the image has none, `/workspace`, and `USER 1000:1000`. Refused, naming
why: a Dockerfile whose image runs as root by its own choice (a last `USER root`), a failing step (named with its
number and instruction), and an image without what its tools' calls run (a shell, tar, Python and the cell runner
for run_python), found by running it once as the sandbox user with no network.

The image is named by its context's content (`sandbox-server/team-<folder>-<hash>:latest`): a changed context is
another image, which `serve` refuses until `images build --policy` has built it. Its hash label also covers what
it is built upon, so a rebuilt base rebuilds it.
"""

from __future__ import annotations

import re
import shutil
import tempfile
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

from sandbox_server import shipped
from sandbox_server.errors import ImageError
from sandbox_server.sandbox import wire
from sandbox_server.sandbox.docker_runtime import DockerRuntime
from sandbox_server.sandbox.images import (
    HASH_LABEL,
    NAME_LABEL,
    PREFIX,
    BuildOutcome,
    build_images,
    catalog,
    context_digest,
    steps_said,
)  # fmt: skip

__all__ = ["BASE_LABEL", "CONTEXT_LABEL", "TeamImage", "build_team_image", "team_image_reference", "team_image_status"]

CONTEXT_LABEL = "org.sandbox-server.build-context"
"""The folder a team's image was built from."""
BASE_LABEL = "org.sandbox-server.base"
"""The image a team's Dockerfile starts FROM."""
_FROM = re.compile(r"^\s*FROM\s+(?:--platform=\S+\s+)?(\S+)", re.IGNORECASE | re.MULTILINE)
_USER = re.compile(r"^\s*USER\s+(\S+)", re.IGNORECASE | re.MULTILINE)
ROOT_USERS = {"root", "0"}

LAUNCHER_NEEDS = ("sh", "tar", "mkdir", "rm", "cat", "sleep", "setsid")
"""The programs every sandbox's launcher runs (images/base/sandbox-launch)."""
TOOL_NEEDS = {"run_python": ("python3", wire.RUN_CELL), "analyze_csv": ("python3", wire.ANALYZE_CSV)}
"""What a tool's calls run beyond the launcher: programs by name, files by path."""

SANDBOXED = """\
FROM {stage}
USER root
COPY sandbox-launch {launcher}
RUN chmod 755 {launcher} \\
 && if ! grep -q '^[^:]*:[^:]*:1000:' /etc/group; then echo 'sandbox:x:1000:' >> /etc/group; fi \\
 && if ! grep -q '^[^:]*:[^:]*:1000:' /etc/passwd; then \\
        echo 'sandbox:x:1000:1000::/workspace:/bin/sh' >> /etc/passwd; fi \\
 && mkdir -p /workspace && chown 1000:1000 /workspace
USER 1000:1000
WORKDIR /workspace
ENV HOME=/workspace LANG=${{LANG:-C.UTF-8}}
"""
"""The step that makes a team's image a sandbox image (run with the image's own /bin/sh)."""

PROBE = """\
missing=
for program in {programs}; do command -v "$program" >/dev/null 2>&1 || missing="$missing $program"; done
for file in {files}; do [ -e "$file" ] || missing="$missing $file"; done
[ -d /workspace ] || missing="$missing /workspace"
echo "missing:$missing"
"""


def team_image_reference(context: Path) -> str:
    """The tag a context's image is built under: its folder's name and a hash of its files."""
    slug = re.sub(r"[^a-z0-9]+", "-", context.name.lower()).strip("-")[:40] or "image"
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
    record = runtime.image(base)
    if record is None:
        raise ImageError(
            f"its Dockerfile starts FROM {base}, which this engine does not have (no registry is asked): "
            f"build or load it first, or start FROM one of ours ({', '.join(sorted(ours))})"
        )
    return record.labels.get(HASH_LABEL) or record.image_id


def expected_hash(context: Path, foundation: str) -> str:
    digest = context_digest(context)
    digest.update(b"upon\0" + foundation.encode() + b"\0" + (shipped.images_dir() / "base/sandbox-launch").read_bytes())
    return digest.hexdigest()[:24]


def team_image_status(runtime: DockerRuntime, image: TeamImage) -> tuple[bool, bool, int]:
    """(built, current, size in bytes) of a team's image, without building anything."""
    record = runtime.image(image.reference)
    if record is None:
        return False, False, 0
    base = runtime.image(dockerfile_base(image.context))
    foundation = (base.labels.get(HASH_LABEL) or base.image_id) if base is not None else "unbuilt"
    return True, record.labels.get(HASH_LABEL) == expected_hash(image.context, foundation), record.size_bytes


def build_team_image(
    runtime: DockerRuntime, image: TeamImage, say: Callable[[str], None] = print, force: bool = False
) -> BuildOutcome:
    """Build a team's image when its context or its base changed; ImageError says why one is refused."""
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
    stage = f"{PREFIX}/{name}:stage"
    say(f"[{name}] building {image.reference} from {image.context} (FROM {base})")
    try:
        for line in steps_said(runtime.build(str(image.context), stage, {}, {})):
            say(f"[{name}] {line}")
    except ImageError as exc:
        raise ImageError(str(exc).replace(stage, image.reference)) from exc
    try:
        _make_sandbox_image(runtime, image, stage, {HASH_LABEL: expected, NAME_LABEL: name, BASE_LABEL: base})
    finally:
        runtime.untag(stage)
    missing = _lacks(runtime, image.reference, image.needs)
    if missing:
        runtime.untag(image.reference)
        raise ImageError(
            f"{image.reference} lacks what its tools' calls run ({', '.join(image.tools)}): {', '.join(missing)}; "
            "install them in its Dockerfile, or start FROM one of ours"
        )
    say(f"[{name}] built: the sandbox user, the launcher and /workspace added; {', '.join(image.needs)} found")
    return BuildOutcome(name, True, expected)


def _make_sandbox_image(runtime: DockerRuntime, image: TeamImage, stage: str, labels: dict[str, str]) -> None:
    with tempfile.TemporaryDirectory(prefix="sandbox-team-image-") as work:
        context = Path(work)
        (context / "Dockerfile").write_text(SANDBOXED.format(stage=stage, launcher=wire.LAUNCHER))
        shutil.copy2(shipped.images_dir() / "base/sandbox-launch", context / "sandbox-launch")
        try:
            for _ in runtime.build(str(context), image.reference, {}, {**labels, CONTEXT_LABEL: str(image.context)}):
                pass
        except ImageError as exc:
            raise ImageError(
                f"{image.reference} could not be made a sandbox image (the launcher, a user 1000, /workspace), "
                f"which needs /bin/sh, grep, chmod, chown and mkdir in it: {exc}"
            ) from exc


def _lacks(runtime: DockerRuntime, reference: str, needs: Iterable[str]) -> list[str]:
    """What of `needs` (programs by name, files by path) the image lacks, run once as the sandbox user."""
    programs = " ".join(need for need in needs if not need.startswith("/"))
    files = " ".join(need for need in needs if need.startswith("/"))
    said = runtime.run_once(reference, PROBE.format(programs=programs, files=files), "1000:1000") or ""
    line = next((text for text in said.splitlines() if text.startswith("missing:")), None)
    return line.removeprefix("missing:").split() if line is not None else ["/bin/sh"]
