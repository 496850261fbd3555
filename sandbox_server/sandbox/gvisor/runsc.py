"""gVisor's sandboxes (the `strict` policy's) made by runsc itself, beside the engine, from the same bundles as runc's.

`runsc run` deletes its sandbox, and with it the cgroup that says whether memory ran out, as it ends; so a sandbox
is made with runsc's own steps: `create` (the three pipes as its stdio, donated to the sandbox), `start`, and a
`runsc wait` child that ends with the sandbox and says its exit status. The call's answer never waits for that
word: the launcher's trailer gives the program's exit status, and the host sees the sandbox end through a pidfd of
its process. `runsc wait` (1 to 2 s after the sandbox ended, on runsc 2022-12-19) is asked only when the launcher
said nothing (it was killed: out of memory, most often, which its cgroup then says), and `runsc delete` removes the
sandbox and its cgroups.
"""

from __future__ import annotations

import contextlib
import json
import subprocess
from pathlib import Path

from sandbox_server.errors import EngineError
from sandbox_server.sandbox.runc.state import RUNSC_FLAGS, runsc_path

__all__ = ["start_gvisor", "gvisor_exit"]


def start_gvisor(
    state: Path, bundle: Path, name: str, stdio: tuple[int, int, int], within_s: float
) -> tuple[subprocess.Popen[bytes], int]:
    """Create and start the sandbox `name` of `bundle`, its stdio the three ends given; returns the `runsc wait`
    child and the host pid of the sandbox's process. EngineError (the runsc log's last line) when runsc would not."""
    base = [runsc_path() or "runsc", "--root", str(state / "runsc"), *RUNSC_FLAGS, "--log", str(bundle / "runsc.log")]
    stdin, stdout, stderr = stdio
    try:
        created = subprocess.run(
            [*base, "create", "--bundle", str(bundle), "--pid-file", str(bundle / "pid"), name],
            stdin=stdin, stdout=stdout, stderr=stderr, timeout=within_s, check=False, start_new_session=True,
        )  # fmt: skip
        if created.returncode == 0:
            started = subprocess.run(
                [*base, "start", name], stdin=subprocess.DEVNULL, capture_output=True, timeout=within_s, check=False
            )
            if started.returncode == 0:
                waiter = subprocess.Popen(
                    [*base, "wait", name], stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                    stderr=subprocess.DEVNULL, start_new_session=True,
                )  # fmt: skip
                return waiter, int((bundle / "pid").read_text())
    except (OSError, ValueError, subprocess.SubprocessError) as exc:
        raise EngineError(f"runsc could not start sandbox {name}: {exc}") from exc
    said = ""
    with contextlib.suppress(OSError, IndexError):
        said = (bundle / "runsc.log").read_text(errors="replace").strip().splitlines()[-1][:400]
    raise EngineError(f"runsc could not start sandbox {name}: {said or 'it said nothing'}")


def gvisor_exit(said: bytes) -> int | None:
    """The exit status `runsc wait` printed (`{"id": …, "exitStatus": N}`), or None when it said none."""
    try:
        status = json.loads(said)["exitStatus"]
    except (ValueError, KeyError, TypeError):
        return None
    return int(status) if isinstance(status, int) else None
