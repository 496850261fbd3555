"""Which image a tool runs in: the one its policy names, that one with a team's pinned wheels added (`packages`),
or a team's own build context made a sandbox image (`build`); paths are relative to the policy file."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from sandbox_server.errors import ImageError
from sandbox_server.sandbox.engine.team_images import team_image_reference
from sandbox_server.sandbox.engine.wheels import with_packages

__all__ = ["tool_image"]


def tool_image(
    settings: Mapping[str, Any], default: str, folder: Path, error: Callable[[str, str], None]
) -> tuple[str, tuple[str, str] | None, str | None]:
    """(the image, (the image its packages are added to, the lock) or None, the build context or None); a wrong
    setting is told to `error` with its field."""
    image = str(settings.get("image", default))
    if settings.get("build"):
        context = Path(settings["build"])
        context = context if context.is_absolute() else folder / context
        if settings.get("packages"):
            error("build", "a tool with its own build context adds its packages in its Dockerfile: drop packages")
        elif not (context / "Dockerfile").is_file():
            error("build", f"{context} holds no Dockerfile")
        else:
            try:
                return team_image_reference(context.resolve()), None, str(context.resolve())
            except OSError as exc:
                error("build", f"cannot read the build context {context}: {exc.strerror or exc}")
    elif settings.get("packages"):
        lock = Path(settings["packages"])
        lock = lock if lock.is_absolute() else folder / lock
        try:
            return with_packages(image, lock), (image, str(lock)), None
        except OSError as exc:
            error("packages", f"cannot read the lock {lock}: {exc.strerror or exc}")
        except ImageError as exc:
            error("packages", str(exc))
    return image, None, None
