"""Hot reload: watch a policy's folder, swap in a valid change, keep the old policy on a broken one."""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Iterable
from pathlib import Path

import anyio
import anyio.abc

from sandbox_server.errors import ConfigError
from sandbox_server.policy.loader import HostFacts, load_policy
from sandbox_server.policy.model import Policy
from sandbox_server.shipped import policies_dir

__all__ = ["watch_policy"]

logger = logging.getLogger("sandbox_server")


def _signature(folders: Iterable[Path]) -> tuple[tuple[str, int, int], ...]:
    entries = []
    for folder in folders:
        for path in sorted(folder.glob("*.y*ml")):
            try:
                stat = path.stat()
            except FileNotFoundError:
                continue
            entries.append((str(path), stat.st_mtime_ns, stat.st_size))
    return tuple(entries)


async def watch_policy(
    reference: str,
    source: Path,
    tool_names: list[str],
    host: Callable[[], HostFacts],
    on_change: Callable[[Policy], Awaitable[None]],
    interval_s: float = 0.25,
    *,
    task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED,
) -> None:
    """Poll the policy's folder (and the shipped one, for `extends`) until cancelled."""
    folders = {source.parent.resolve(), policies_dir().resolve()}
    seen = _signature(folders)
    task_status.started()  # what changes from now on is seen
    said = ""  # the last refusal logged: a folder that changes again (an editor's swap file) does not repeat it
    while True:
        await anyio.sleep(interval_s)
        try:
            current = _signature(folders)
        except OSError as exc:  # a full descriptor table, say: look again at the next turn
            logger.warning("could not look at the policy's folder (%s); looking again shortly", exc)
            continue
        if current == seen:
            continue
        seen = current
        try:
            policy = await anyio.to_thread.run_sync(load_policy, reference, tool_names, host())
        except OSError as exc:
            seen = ()  # read it again at the next turn
            logger.warning("could not read the changed policy (%s); trying again shortly", exc)
            continue
        except ConfigError as exc:
            if str(exc) != said:
                logger.warning("policy change ignored, the previous policy stays in force: %s", exc)
            said = str(exc)
            continue
        said = ""
        await on_change(policy)
