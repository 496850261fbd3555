"""Sandbox images: find their build contexts, hash them, build only what changed.

Each folder under the shipped `images/` is one image, tagged
`sandbox-server/<name>:latest` and labelled with a hash of its build context (and
of its parent's hash), so a second build with nothing changed builds nothing.
When no registry serves `debian:bookworm-slim`, the base's root filesystem is made
locally with debootstrap and imported. Python wheels an image pins in `wheels.lock`
(`sha256  file-name` lines) are downloaded on the host with pip, checked against
their hash and unpacked into `site/` of a temporary copy of the build context.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
import shutil
import subprocess
import tempfile
import zipfile
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

from sandbox_server import shipped
from sandbox_server.errors import EngineError, ImageError
from sandbox_server.sandbox.engine.connection import ImageRecord, engine_errors
from sandbox_server.sandbox.engine.runtime import DockerRuntime
from sandbox_server.sandbox.engine.wheels import IMAGE_PYTHON, WHEELS_LOCK, fetch_wheel, locked_wheels, read_lock

__all__ = [
    "expected_hash",
    "HASH_LABEL",
    "ImageDefinition",
    "ImageStatus",
    "build_images",
    "build_with_packages",
    "catalog",
    "context_digest",
    "steps_said",
    "image_reference",
    "image_status",
    "drop_replaced",
]

PREFIX = "sandbox-server"
HASH_LABEL = "org.sandbox-server.context-hash"
NAME_LABEL = "org.sandbox-server.image"
ROOTFS_LABEL = "org.sandbox-server.rootfs"
"""The python3 of Debian bookworm, which the images run; pinned wheels must be built for it."""
UPSTREAM_ROOTFS = "debian:bookworm-slim"
LOCAL_ROOTFS = f"{PREFIX}/rootfs:bookworm"
_FROM_OURS = re.compile(rf"^\s*FROM\s+{PREFIX}/([a-z0-9-]+)(?::\S+)?", re.IGNORECASE | re.MULTILINE)

Say = Callable[[str], None]


def image_reference(name: str) -> str:
    """The tag an image of ours is built under."""
    return f"{PREFIX}/{name}:latest"


@dataclass(frozen=True, slots=True)
class ImageDefinition:
    """One buildable image: its folder and the image of ours it starts FROM, if any."""

    name: str
    context_dir: Path
    parent: str | None

    @property
    def reference(self) -> str:
        """The tag it is built under."""
        return image_reference(self.name)


@dataclass(frozen=True, slots=True)
class ImageStatus:
    """Whether an image is built and built from the current context."""

    name: str
    reference: str
    built: bool
    current: bool
    expected_hash: str
    built_hash: str | None
    size_bytes: int


def catalog(images_dir: Path | None = None) -> dict[str, ImageDefinition]:
    """All image definitions, parents before children."""
    found: dict[str, ImageDefinition] = {}
    for dockerfile in sorted((images_dir or shipped.images_dir()).glob("*/Dockerfile")):
        match = _FROM_OURS.search(dockerfile.read_text())
        found[dockerfile.parent.name] = ImageDefinition(
            dockerfile.parent.name, dockerfile.parent, match.group(1) if match else None
        )
    ordered: dict[str, ImageDefinition] = {}

    def visit(name: str, trail: tuple[str, ...]) -> None:
        if name in ordered:
            return
        if name in trail:
            raise ImageError(f"images {' -> '.join(trail + (name,))} start FROM each other in a cycle")
        definition = found.get(name)
        if definition is None:
            raise ImageError(f"image {trail[-1]!r} starts FROM {image_reference(name)}, which has no folder")
        if definition.parent:
            visit(definition.parent, trail + (name,))
        ordered[name] = definition

    for name in found:
        visit(name, ())
    return ordered


WIRE_NAME = "sandbox_wire.py"
"""The host/launcher contract's name in a build context; an image whose Dockerfile names it receives it."""


def _shared_files(context_dir: Path) -> dict[str, Path]:
    """Files from the host package that this image's Dockerfile asks for, by their name in the context."""
    return {WIRE_NAME: shipped.wire_module()} if WIRE_NAME in (context_dir / "Dockerfile").read_text() else {}


CONTEXT_MAX_BYTES = 2 * 1024**3
"""The most a build context may hold: the engine is sent all of it for each build, and it is hashed at every
policy load that names it."""


def context_digest(context_dir: Path) -> hashlib._Hash:
    """The hash of a build context's files (their names, modes and contents, each read in pieces); ImageError for a
    context past CONTEXT_MAX_BYTES, naming its largest file."""
    digest = hashlib.sha256()
    files = {path.relative_to(context_dir).as_posix(): path for path in context_dir.rglob("*") if path.is_file()}
    files.update(_shared_files(context_dir))
    sizes = {relative: path.stat().st_size for relative, path in files.items() if "__pycache__" not in relative}
    if sum(sizes.values()) > CONTEXT_MAX_BYTES:
        largest = max(sizes, key=lambda relative: sizes[relative])
        raise ImageError(
            f"the build context {context_dir} holds {sum(sizes.values())} bytes, above the cap of "
            f"{CONTEXT_MAX_BYTES} (its largest file: {largest}, {sizes[largest]} bytes): leave what the build "
            "does not need out of the folder"
        )
    for relative in sorted(sizes):
        path = files[relative]
        digest.update(relative.encode() + b"\0")
        digest.update(oct(path.stat().st_mode & 0o777).encode() + b"\0")
        with open(path, "rb") as handle:
            digest.update(hashlib.file_digest(handle, "sha256").digest())
    return digest


def expected_hash(definition: ImageDefinition, foundation: str) -> str:
    """Hash of the build context and of what it is built upon (parent hash or rootfs id)."""
    digest = context_digest(definition.context_dir)
    digest.update(b"upon\0" + foundation.encode())
    return digest.hexdigest()[:24]


def _foundation(runtime: DockerRuntime, definition: ImageDefinition) -> str:
    """What an image is built upon, as known now: the parent's hash label, or the rootfs image id."""
    if definition.parent:
        parent = runtime.image(image_reference(definition.parent))
        return (parent.labels.get(HASH_LABEL, "") if parent else "") or "unbuilt"
    for reference in (UPSTREAM_ROOTFS, LOCAL_ROOTFS):
        record = runtime.image(reference)
        if record is not None:
            return record.image_id
    return "unbuilt"


def image_status(runtime: DockerRuntime, definition: ImageDefinition) -> ImageStatus:
    """Compare a built image's hash label with the hash of its context now."""
    expected = expected_hash(definition, _foundation(runtime, definition))
    record = runtime.image(definition.reference)
    built_hash = record.labels.get(HASH_LABEL) if record else None
    return ImageStatus(
        name=definition.name,
        reference=definition.reference,
        built=record is not None,
        current=built_hash == expected,
        expected_hash=expected,
        built_hash=built_hash,
        size_bytes=record.size_bytes if record else 0,
    )


def _ensure_rootfs(runtime: DockerRuntime, say: Say) -> str:
    """A Debian bookworm root filesystem image: local, pulled, or made with debootstrap."""
    for reference in (UPSTREAM_ROOTFS, LOCAL_ROOTFS):
        if runtime.image(reference) is not None:
            return reference
    say(f"[rootfs] pulling {UPSTREAM_ROOTFS}")
    if runtime.try_pull(UPSTREAM_ROOTFS):
        return UPSTREAM_ROOTFS
    say(f"[rootfs] no registry serves {UPSTREAM_ROOTFS}; building it with debootstrap")
    _debootstrap(runtime, say)
    return LOCAL_ROOTFS


def _debootstrap(runtime: DockerRuntime, say: Say) -> None:
    tool = shutil.which("debootstrap")
    if tool is None:
        raise ImageError(
            "no registry serves debian:bookworm-slim and debootstrap is not installed: "
            "run `sandbox-server setup` (it installs debootstrap with the engine) or `apt-get install debootstrap`"
        )
    if os.geteuid() != 0:
        raise ImageError("building the base root filesystem with debootstrap needs root: run `images build` as root")
    mirror = os.environ.get("SANDBOX_DEBIAN_MIRROR", "http://deb.debian.org/debian")
    with tempfile.TemporaryDirectory(prefix="sandbox-rootfs-") as work:
        target = Path(work) / "rootfs"
        command = [tool, "--variant=minbase", "bookworm", str(target), mirror]
        process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        assert process.stdout is not None
        last: list[str] = []
        for line in process.stdout:
            last = (last + [line.rstrip()])[-20:]
            if line.startswith(("I: Retrieving Release", "I: Validating", "I: Installing", "I: Base system")):
                say(f"[rootfs] {line.rstrip()}")
        if process.wait() != 0:
            raise ImageError("debootstrap failed:\n" + "\n".join(last))
        for leftover in ("var/cache/apt/archives", "var/lib/apt/lists"):
            for entry in (target / leftover).glob("*"):
                if entry.is_file():
                    entry.unlink()
        tarball = Path(work) / "rootfs.tar"
        subprocess.run(["tar", "-C", str(target), "--numeric-owner", "-cf", str(tarball), "."], check=True)
        say(f"[rootfs] importing as {LOCAL_ROOTFS}")
        runtime.import_rootfs(
            str(tarball),
            LOCAL_ROOTFS,
            changes=[
                "ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
                'CMD ["/bin/bash"]',
                f"LABEL {ROOTFS_LABEL}=debootstrap-minbase-bookworm",
            ],
        )


@contextlib.contextmanager
def _build_context(definition: ImageDefinition, say: Say) -> Iterator[Path]:
    """The folder to build from: the context itself, or a copy with the shared files it asks for and its
    pinned wheels unpacked in site/."""
    pinned = locked_wheels(definition.context_dir)
    shared = _shared_files(definition.context_dir)
    if not pinned and not shared:
        yield definition.context_dir
        return
    wheels = [fetch_wheel(sha256, filename, say) for sha256, filename in pinned]
    with tempfile.TemporaryDirectory(prefix=f"sandbox-image-{definition.name}-") as work:
        context = Path(work) / "context"
        shutil.copytree(definition.context_dir, context, ignore=shutil.ignore_patterns("__pycache__", "site"))
        for name, source in shared.items():
            shutil.copy2(source, context / name)
        if wheels:
            site = context / "site"
            site.mkdir()
            for wheel in wheels:
                with zipfile.ZipFile(wheel) as archive:
                    archive.extractall(site)
        yield context


def steps_said(lines: Iterable[str], width: int = 110) -> Iterator[str]:
    """A build's progress condensed to one line per step (`Step 2/5 : RUN make`), each cut to `width`."""
    for line in lines:
        if line.startswith("Step "):
            yield line if len(line) <= width else line[: width - 1] + "…"


@dataclass(frozen=True, slots=True)
class BuildOutcome:
    """What `build_images` did for one image."""

    name: str
    rebuilt: bool
    context_hash: str


def build_images(
    runtime: DockerRuntime,
    names: list[str] | None = None,
    say: Say = print,
    force: bool = False,
    images_dir: Path | None = None,
) -> list[BuildOutcome]:
    """Build the named images (and their parents) when their context hash changed."""
    definitions = catalog(images_dir)
    unknown = [name for name in names or [] if name not in definitions]
    if unknown:
        raise ImageError(f"unknown image(s) {', '.join(unknown)}; known: {', '.join(definitions)}")
    wanted: set[str] = set()
    for name in names or list(definitions):
        while name and name not in wanted:
            wanted.add(name)
            name = definitions[name].parent or ""
    outcomes = []
    replaced: list[tuple[ImageRecord | None, ImageDefinition]] = []
    for definition in definitions.values():
        if definition.name not in wanted:
            continue
        buildargs: dict[str, str] = {}
        if definition.parent is None:
            buildargs["ROOTFS"] = _ensure_rootfs(runtime, say)
        status = image_status(runtime, definition)
        if status.current and not force:
            say(f"[{definition.name}] current ({status.expected_hash}), nothing to build")
            outcomes.append(BuildOutcome(definition.name, False, status.expected_hash))
            continue
        say(f"[{definition.name}] building {definition.reference} ({status.expected_hash})")
        labels = {HASH_LABEL: status.expected_hash, NAME_LABEL: definition.name}
        replaced.append((runtime.image(definition.reference), definition))
        with _build_context(definition, say) as context:
            for line in steps_said(runtime.build(str(context), definition.reference, buildargs, labels)):
                say(f"[{definition.name}] {line}")
        outcomes.append(BuildOutcome(definition.name, True, status.expected_hash))
    for record, built in reversed(replaced):  # (a child's first: its parent is removed only once it is gone)
        drop_replaced(runtime, record, built.reference, built.name, say)
    return outcomes


def drop_replaced(runtime: DockerRuntime, replaced: ImageRecord | None, reference: str, name: str, say: Say) -> None:
    """The image a rebuild replaced (`replaced`: what `reference` named before it) removed, with the layers only it
    held: each rebuild of a changed image left the one before it untagged, a gigabyte at a time for python-data's.
    One a container still uses, or another name still names, is kept, and said."""
    now = runtime.image(reference)
    if replaced is None or now is None or now.image_id == replaced.image_id:
        return
    if runtime.image(replaced.image_id) is None:
        return  # (gone already: the engine removes the untagged images below one it removes, a child's)
    try:
        with engine_errors(f"remove the image {reference} replaced"):
            runtime.api.remove_image(replaced.image_id)
    except EngineError as exc:
        say(f"[{name}] the image it replaced is kept: {exc}")


WITH_PACKAGES = f"""\
FROM {{base}}
USER root
COPY site/ /usr/local/lib/python{IMAGE_PYTHON}/dist-packages/
RUN python3 -m compileall -q -j 0 /usr/local/lib/python{IMAGE_PYTHON}/dist-packages > /dev/null
USER {{user}}
"""
"""A policy's own wheels added to a tool's image, compiled to bytecode as the image's own are."""


def build_with_packages(
    runtime: DockerRuntime, image: str, base: str, lock: Path, user: str, say: Say = print, force: bool = False
) -> BuildOutcome:
    """Build `image`: `base` with the wheels `lock` pins (a tool's `packages`), when the lock or the base changed."""
    record = runtime.image(base)
    if record is None:
        raise ImageError(f"{base} is not built: run `sandbox-server images build` first")
    name = image.split("/", 1)[-1].rsplit(":", 1)[0]
    with tempfile.TemporaryDirectory(prefix="sandbox-packages-") as work:
        context = Path(work)
        (context / "Dockerfile").write_text(WITH_PACKAGES.format(base=base, user=user))
        shutil.copy2(lock, context / WHEELS_LOCK)
        digest = context_digest(context)
        digest.update(b"upon\0" + (record.labels.get(HASH_LABEL) or record.image_id).encode())
        expected = digest.hexdigest()[:24]
        built = runtime.image(image)
        if built is not None and built.labels.get(HASH_LABEL) == expected and not force:
            say(f"[{name}] current ({expected}), nothing to build")
            return BuildOutcome(name, False, expected)
        say(f"[{name}] building {image}: {base} and the {len(read_lock(lock))} wheel(s) of {lock}")
        labels = {HASH_LABEL: expected, NAME_LABEL: name}
        with _build_context(ImageDefinition(name, context, None), say) as unpacked:
            for line in steps_said(runtime.build(str(unpacked), image, {}, labels)):
                say(f"[{name}] {line}")
        drop_replaced(runtime, built, image, name, say)
    return BuildOutcome(name, True, expected)
