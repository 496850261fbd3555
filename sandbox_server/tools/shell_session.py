"""execute_command's shell session in a kept workspace: each call's sandbox is fresh, its shell's state is not.

A coding agent's shell remembers where it is: `cd src` in one call and `make` in the next, an
exported variable, a function, an alias, `set -o pipefail`. Nothing of a call's process lives on
(its sandbox is gone with it), so the state is carried instead. The command runs in bash, in
the same shell that sources the state the previous call left. When it exits (by reaching its
end or by `exit`), the shell's state is compared with the state it began with; only a call that
changed it writes the state it leaves: the exported variables it added, changed or removed
(against the environment it was given, so a policy's or the image's own values are never
overridden by an older copy), its functions, aliases, `set -o` and `shopt` options (as they
differ from a fresh bash's), and its working folder when that is under /workspace. Every step is
a builtin (no program is started for it), and the code that writes the state is parsed only by
a call that needs it. The file is the sandbox's own, in the workspace beside the kept variables
of run_python: it follows the workspace when it is forked, branched, exported and resumed, and
the server never reads it. A program replaced by `exec`, or stopped at its deadline, leaves the
state the call found. `reset` starts from a clean shell; `workdir` starts the call in the folder
it names rather than where the last one ended, and leaves the session's folder as it was.
"""

from __future__ import annotations

from sandbox_server import shipped
from sandbox_server.sandbox import wire

__all__ = ["SHELL_STATE", "session_argv"]

SHELL_STATE = ".sandbox/shell.sh"
"""The shell's state, relative to the workspace (a bash script the next call's shell sources)."""

SESSION = f"{wire.LAUNCHERS_DIR}/shell-session.bash"
"""Where the project's own images hold the session's script (images/base/shell-session.bash): bash reads it there
as its BASH_ENV, so a call's request carries only the command line, which bash then runs as `bash -c` runs one
(its errors name `bash: line 1`, its trace is the command's own)."""
FLAGS_ENV = "SANDBOX_SHELL"
"""The call's flags for the session's script (`workdir`, `reset`), which unsets it with BASH_ENV before anything
runs: neither reaches the command, nor a bash it starts."""
SOURCE = (shipped.images_dir() / "base" / "shell-session.bash").read_text()
"""The same script, sent inline (`bash -c`) to an image of another maker's, which has no copy of its own."""


def _minified(source: str) -> str:
    """The script as the sandbox receives it: each line's indentation dropped and the names shortened. It travels
    in the call's request, which the launcher reads line by line with the shell's `read`, a byte at a time: each
    kilobyte costs a call about half a millisecond."""
    lines = source.replace("__sbx_", "_Z").splitlines()
    return "\n".join(line.strip() for line in lines if line.strip() and not line.startswith("#")) + "\n"


SCRIPT = _minified(SOURCE)

_NO_BASH = (
    'command -v bash >/dev/null 2>&1 && exec bash -c "$3" "$0" "$1" "$2"; '
    'echo "sandbox: no bash in this image: the shell\'s state is not carried" >&2; exec /bin/sh -c "$1"'
)
"""An image of another maker's may hold no bash: then the command runs as a plain `sh -c`, and says so."""


OURS = ("base", "shell", "python-data", "toolchain")
"""The images of this project's catalog, built FROM base: each holds SESSION (a test holds the catalog to it)."""


def _ours(image: str) -> bool:
    """An image of this project's own catalog, whose base holds SESSION (not a team's, nor one a policy names)."""
    name = image.rsplit(":", 1)[0] if ":" in image.rsplit("/", 1)[-1] else image
    return name in {f"sandbox-server/{own}" for own in OURS}


def session_argv(
    command: str, image: str, workdir: bool, reset: bool
) -> tuple[tuple[str, ...], tuple[tuple[str, str], ...]]:
    """The argv that runs `command` in the workspace's shell session, and the environment it adds."""
    flags = " ".join(flag for flag, asked in (("workdir", workdir), ("reset", reset)) if asked)
    if _ours(image):
        return ("/bin/bash", "-c", command, "bash"), (("BASH_ENV", SESSION), (FLAGS_ENV, flags))
    return ("/bin/sh", "-c", _NO_BASH, "/bin/bash", command, flags, SCRIPT), ()
