"""Wheel locks: `<sha256>  <file>.whl` lines, one wheel each, pinned by its hash.

An image's own (`images/<name>/wheels.lock`) and a policy's (a tool's `packages`: a team's
own stack, added to the tool's image in one of its own) are read alike, without the engine.
"""

from __future__ import annotations

import hashlib
import re
from pathlib import Path

from sandbox_server.errors import ImageError

__all__ = ["read_lock", "with_packages"]


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
