"""How a server keeps its workspaces (serve --workspaces, --state-dir, --state): its state folder, archives or
mounted filesystems, alone or with replicas; chosen and said once at start."""

from __future__ import annotations

import argparse
import functools
import logging
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from sandbox_server.errors import SandboxServerError

if TYPE_CHECKING:
    from sandbox_server.policy import Policy
    from sandbox_server.sandbox.engine.runtime import DockerRuntime
    from sandbox_server.state.database import Database
    from sandbox_server.workspaces.contents import Contents
    from sandbox_server.workspaces.shared import SharedBook
    from sandbox_server.workspaces.store import WorkspaceStore

__all__ = ["host_folders", "workspace_store"]


def workspace_store(
    args: argparse.Namespace,
    runtime: DockerRuntime,
    database: Database | None,
    policy: Policy,
    alive: Callable[[str], bool],
    log: logging.Logger,
) -> WorkspaceStore:
    """The kept workspaces, in this server's own state folder, swept of what expired while it was away."""
    from sandbox_server.state.folder import claim_state_folder, default_state_dir
    from sandbox_server.workspaces.store import WorkspaceStore

    # A folder given to this server alone is refused when held; the default (SANDBOX_STATE_DIR's, inherited by
    # every server a client's configuration starts) gives a second server a subfolder of its own.
    chosen = bool(args.state_dir)
    held = claim_state_folder(Path(args.state_dir) if args.state_dir else default_state_dir(), chosen)
    state_dir = held.path  # this server's alone while it runs: the lock goes with the process
    if held.shared_with is not None:
        log.info(
            "the state folder %s is another server's (process %s): this one keeps its state in %s",
            state_dir.parent.parent, held.shared_with or "unknown", state_dir,
        )  # fmt: skip
    if database is None:
        contents, book = _contents(args.workspaces, runtime, log), None
    else:
        contents, book = _shared_contents(args.workspaces, runtime, database, policy, log)
    elsewhere = None
    if database is None and not chosen:  # servers on the default folder: where a name given through another is
        from sandbox_server.workspaces.names import named_elsewhere

        default = state_dir if held.shared_with is None else state_dir.parent.parent
        elsewhere = functools.partial(named_elsewhere, default, state_dir)
    workspaces = WorkspaceStore(
        state_dir / "workspaces", policy.workspace, policy.host.workspace_storage_mb * 1024 * 1024, contents, book,
        alive if database is not None else None, callers_share_the_host=bool(args.tokens or args.issuer),
        names_elsewhere=elsewhere,
    )  # fmt: skip
    swept = workspaces.sweep(alive)
    if swept:
        log.info("removed %d expired or orphaned workspace(s)", swept)
    return workspaces


def _contents(choice: str, runtime: DockerRuntime, log: logging.Logger) -> Callable[[Path], Contents]:
    """How a server alone keeps workspace files (serve --workspaces)."""
    from sandbox_server.sandbox.engine.removal import owner_alive
    from sandbox_server.workspaces.contents import ArchivedContents
    from sandbox_server.workspaces.mounted import MountedContents

    reason = _archives_because(choice, runtime)
    if reason is not None:
        log.info("workspaces are kept as archives carried in and out of each call (%s)", reason)
        return ArchivedContents
    log.info("workspaces are kept as sized filesystems mounted into each call's container")
    return lambda root: MountedContents(root, runtime.owner, owner_alive, runtime.activity)


def _archives_because(choice: str, runtime: DockerRuntime) -> str | None:
    """Why workspaces are kept as archives (None: they are mounted); `--workspaces mounted` where they cannot be
    mounted is refused, saying why."""
    from sandbox_server.sandbox import mounts

    if choice == "archived":
        return "as asked"
    why_not = mounts.unavailable(runtime.on_this_host())
    if why_not is None:
        return None
    if choice == "mounted":
        raise SandboxServerError(f"--workspaces mounted: kept workspaces cannot be mounted here: {why_not}")
    return f"{why_not}, so they cannot be mounted"


def _shared_contents(
    choice: str, runtime: DockerRuntime, database: Database, policy: Policy, log: logging.Logger
) -> tuple[Callable[[Path], Any], SharedBook]:
    """How replicas keep workspace files: mounted on each one's home replica (saved to the shared state after its
    calls) where this replica can mount them, else archives in the shared state."""
    from sandbox_server.protocol.handover import asking_for
    from sandbox_server.sandbox.engine.removal import owner_alive
    from sandbox_server.state.homes import Homes
    from sandbox_server.workspaces.homed import HomedMounts
    from sandbox_server.workspaces.shared import SharedArchives, SharedBook

    book = SharedBook(database)
    archives = functools.partial(SharedArchives, book=book)
    reason = _archives_because(choice, runtime)  # auto: homes where this replica can mount, as on one server
    if reason is not None:
        log.info("workspaces are kept as archives in the shared state, continued on any replica (%s)", reason)
        return archives, book
    homes = Homes(book.database)
    ask_hand_over = asking_for(homes, book.database.key("forwarding"))  # the signed channel forwarding uses
    log.info("workspaces are mounted on their home replica, each saved to the shared state after its calls")

    def homed(root: Path) -> HomedMounts:
        return HomedMounts(
            root, runtime.owner, owner_alive, runtime.activity, archives(root), homes, policy.workspace, ask_hand_over
        )

    return homed, book


def host_folders(runtime: DockerRuntime, state: Path, audit: Path) -> tuple[str, ...]:
    """The folders of this host no answer names a path into: the server's state and trail, and runc's bundles."""
    from sandbox_server.sandbox.runc.runtime import RuncRuntime

    folders = [state, audit, *([runtime.state] if isinstance(runtime, RuncRuntime) else [])]
    return tuple(sorted({str(f) for folder in folders for f in (folder, folder.resolve())}))
