"""Where the files shipped beside the code are: sandbox images, policies, the engine script.

In a checkout they are top-level folders of the repository (`images/`, `policies/`,
`scripts/`); in an installed wheel the build maps them into the package
(`sandbox_server/images/`, ...). This is the one module that knows both layouts; every
other module asks it.
"""

from __future__ import annotations

from importlib import resources
from pathlib import Path

from sandbox_server.errors import ConfigError

__all__ = ["engine_script", "images_dir", "policies_dir", "policy_schema_path", "seccomp_dir", "wire_module"]

_PACKAGE = Path(str(resources.files("sandbox_server")))


def _shipped(name: str) -> Path:
    """A shipped folder: the checkout's top-level one when running from a clone, else the package's."""
    checkout = _PACKAGE.parent
    if (checkout / "pyproject.toml").is_file() and (checkout / name).is_dir():
        return checkout / name
    installed = _PACKAGE / name
    if installed.is_dir():
        return installed
    raise ConfigError(
        f"the shipped folder {name!r} is missing from this installation (looked in {installed} and {checkout / name}); "
        "reinstall sandbox-server"
    )


def images_dir() -> Path:
    """The folder holding one build context per sandbox image."""
    return _shipped("images")


def policies_dir() -> Path:
    """The folder of shipped policies (`default.yaml`, ...)."""
    return _shipped("policies")


def seccomp_dir() -> Path:
    """The folder of shipped seccomp profiles."""
    return policies_dir() / "seccomp"


def engine_script() -> Path:
    """The script that installs and starts a Docker engine on a Debian host."""
    return _shipped("scripts") / "engine-up"


def policy_schema_path() -> Path:
    """The JSON Schema of policy files, which lives with the policy code."""
    return _PACKAGE / "policy" / "schema.json"


def wire_module() -> Path:
    """The host/launcher contract, which image build contexts receive as `sandbox_wire.py`."""
    return _PACKAGE / "sandbox" / "wire.py"
