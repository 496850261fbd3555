"""Wheel locks: `<sha256>  <file>.whl` lines, one wheel each, pinned by its hash; and the wheels they pin, fetched
once into a cache with their hashes checked.

An image's own (`images/<name>/wheels.lock`) and a policy's (a tool's `packages`: a team's
own stack, added to the tool's image in one of its own) are read alike, without the engine.
"""

from __future__ import annotations

import hashlib
import os
import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

from sandbox_server import shipped
from sandbox_server.errors import ImageError

__all__ = [
    "IMAGE_PYTHON",
    "NAMED_LIBRARIES",
    "WHEELS_LOCK",
    "fetch_wheel",
    "libraries",
    "locked_wheels",
    "read_lock",
    "wheel_cache",
    "with_packages",
]

WHEELS_LOCK = "wheels.lock"
IMAGE_PYTHON = "3.11"
"""The Python of the images' Debian, whose wheels are fetched."""


def read_lock(lock: Path) -> list[tuple[str, str]]:
    """(sha256, file name) of each wheel a lock pins; ImageError naming the line that is not one."""
    pinned = []
    for number, line in enumerate(lock.read_text().splitlines(), start=1):
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        fields = line.split()
        if len(fields) != 2 or not re.fullmatch(r"[0-9a-f]{64}", fields[0]) or not fields[1].endswith(".whl"):
            raise ImageError(f"{lock}:{number}: expected '<sha256>  <file>.whl', found {line!r}")
        pinned.append((fields[0], fields[1]))
    return pinned


def with_packages(image: str, lock: Path) -> str:
    """The image a tool runs in when its policy adds a lock's wheels to `image`: named by both, so another lock
    (or another base) is another image, and one a second policy shares is built once."""
    pinned = "\n".join(f"{sha256}  {name}" for sha256, name in sorted(read_lock(lock)))
    digest = hashlib.sha256(f"{image}\n{pinned}".encode()).hexdigest()[:12]
    return f"{image.rsplit(':', 1)[0]}-{digest}:latest"


def wheel_cache() -> Path:
    """Where downloaded wheels are kept between builds."""
    configured = os.environ.get("SANDBOX_WHEEL_CACHE")
    if configured:
        return Path(configured)
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "sandbox-server" / "wheels"


def locked_wheels(context_dir: Path) -> list[tuple[str, str]]:
    """(sha256, file name) pairs of an image's wheels.lock; none when it has no lock."""
    lock = context_dir / WHEELS_LOCK
    return read_lock(lock) if lock.is_file() else []


NAMED_LIBRARIES = (
    "numpy", "pandas", "matplotlib", "scipy", "scikit-learn", "statsmodels", "seaborn", "pyarrow", "polars",
    "plotly", "networkx", "duckdb", "openpyxl", "requests",
)  # fmt: skip
"""The libraries an image's lock pins that answers and `doctor` name, in this order (their dependencies are not)."""


def libraries(name: str, images_dir: Path | None = None) -> list[tuple[str, str]]:
    """(library, version) of the named libraries an image's wheels.lock pins (none when it has no lock)."""
    context = (images_dir or shipped.images_dir()) / name
    pinned = {}
    for _, filename in locked_wheels(context) if context.is_dir() else []:
        wheel, version = filename.split("-")[:2]
        pinned[wheel.lower().replace("_", "-")] = version
    return [(library, pinned[library]) for library in NAMED_LIBRARIES if library in pinned]


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def fetch_wheel(sha256: str, filename: str, say: Callable[[str], None]) -> Path:
    """A pinned wheel from the cache, downloaded with pip when missing; its hash checked."""
    cache = wheel_cache()
    path = cache / filename
    if not path.is_file():
        name, version = filename.split("-")[:2]
        platform = filename.removesuffix(".whl").split("-")[-1].split(".")[-1]
        say(f"[wheels] downloading {name}=={version} ({platform}, Python {IMAGE_PYTHON})")
        cache.mkdir(parents=True, exist_ok=True)
        command = [
            sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary=:all:",
            "--platform", platform, "--python-version", IMAGE_PYTHON, "--implementation", "cp",
            "--dest", str(cache), f"{name}=={version}",
        ]  # fmt: skip
        done = subprocess.run(command, capture_output=True, text=True)
        if done.returncode != 0 or not path.is_file():
            raise ImageError(
                f"could not download {filename} with pip ({done.stderr.strip()[-500:] or 'another file came'}); "
                f"put the file in {cache} by hand and build again"
            )
    found = _sha256(path)
    if found != sha256:
        path.unlink()
        raise ImageError(f"{filename} has sha256 {found}, but {WHEELS_LOCK} pins {sha256}; the download was removed")
    return path
