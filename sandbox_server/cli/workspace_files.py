"""`sandbox-server workspace export|import|list|fork|snapshot|restore|delete`: a kept workspace or snapshot as one
file (a zstd-compressed tar with a manifest and a checksum, workspaces.transfer), written out of a state folder or
made a workspace of one, so that work moves between machines and backups; copied or removed as the `workspaces`
tool does.

All act on the state folder itself, which no server may hold meanwhile (a server holds its folder while it
runs: stop it first). An import is checked as any upload is, against the policy given (its workspace's size and
files, the caller's caps), and the workspace it makes opens by its name in the next server's sessions.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import tarfile
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO

from sandbox_server.errors import Refusal, UsageError

if TYPE_CHECKING:
    from sandbox_server.workspaces.store import WorkspaceStore

__all__ = ["add_workspace_commands"]


def add_workspace_commands(commands: Any) -> None:  # argparse's subparsers action, of the command line's parser class
    """`workspace export` and `workspace import`."""
    workspace = commands.add_parser("workspace", help="export a kept workspace to one file, or import one")
    actions = workspace.add_subparsers(dest="workspace_command", required=True)
    export = actions.add_parser("export", help="write a workspace or snapshot (by name or id) to a .tar.zst file")
    export.add_argument("workspace", help="its name or id")
    export.add_argument("--output", "-o", required=True, help="the file to write (- for standard output)")
    listed = actions.add_parser("list", help="the kept workspaces and snapshots of a caller (JSON lines)")
    imported = actions.add_parser("import", help="make a new workspace of an exported file, a plain tar or a folder")
    imported.add_argument(
        "archive", nargs="?", help="an export (.tar.zst) or a plain tar, compressed or not (- for standard input)"
    )
    imported.add_argument("--from", dest="folder", help="a folder whose files become the workspace's")
    imported.add_argument("--name", help="the name to keep it under (else it is reached by the id printed)")
    copies = {
        "fork": "a new workspace holding what a workspace holds now",
        "snapshot": "a snapshot of a workspace as it is now",
        "restore": "a new workspace of a snapshot",
    }
    copying = []
    for verb, what in copies.items():
        copy = actions.add_parser(verb, help=f"{what} (copy on write where the folder can clone)")
        copy.add_argument("workspace", help="its name or id")
        copy.add_argument("--name", help="the name to keep the copy under (else it is reached by the id printed)")
        copy.set_defaults(handler=workspace_copy)
        copying.append(copy)
    deleted = actions.add_parser("delete", help="remove a workspace or snapshot with its files and variables")
    deleted.add_argument("workspace", help="its name or id")
    deleted.set_defaults(handler=workspace_delete)
    for action in (export, imported, listed, deleted, *copying):
        action.add_argument("--state-dir", help="the state folder (default: as `serve` finds it)")
        action.add_argument("--policy", default="default", help="the policy whose workspace settings apply")
        action.add_argument("--caller", help="the caller it belongs to (a token's name; none over stdio)")
        action.add_argument(
            "--workspaces", choices=["auto", "mounted", "archived"], default="auto",
            help="how the folder keeps workspaces (auto: as found in it)",
        )  # fmt: skip
    export.set_defaults(handler=workspace_export)
    listed.set_defaults(handler=workspace_list)
    imported.set_defaults(handler=workspace_import)


def workspace_export(args: argparse.Namespace) -> int:
    from sandbox_server.workspaces.transfer import ExportStopped

    with _store(args) as (store, _, _):
        try:
            record = store.resolve(args.workspace, None, args.caller)
        except Refusal as refused:
            raise UsageError(refused.message) from None
        try:
            with _opened(args.output, "wb") as out:
                manifest = store.export_to(record, out)
        except ExportStopped as stopped:
            if args.output != "-":
                Path(args.output).unlink(missing_ok=True)  # what was written of it is no export
            raise UsageError(f"not exported: {stopped.message}") from None
    print(f"exported {record.name or record.id}: {manifest['files']} entries, {manifest['bytes']} bytes of files")
    return 0


def workspace_list(args: argparse.Namespace) -> int:
    with _store(args) as (store, _, _):
        for record in store.listed(None, args.caller):
            fields = {
                "id": record.id, "name": record.name, "snapshot": record.snapshot, "origin": record.origin,
                "size_bytes": record.size_bytes, "last_used": record.last_used, "paused": record.paused,
                "services": [entry.get("name") for entry in record.services],
            }  # fmt: skip
            print(json.dumps(fields))
    return 0


def workspace_import(args: argparse.Namespace) -> int:
    if (args.archive is None) == (args.folder is None):
        raise UsageError("workspace import takes a file (or - for standard input), or --from a folder, not both")
    with _store(args) as (store, policy_name, user):
        with _opened(args.archive, "rb") if args.folder is None else _folder_tar(args.folder) as archive:
            try:
                made = store.import_from(archive, args.caller, "cli", args.name, policy_name, user)
            except Refusal as refused:
                raise UsageError(refused.message) from None
    print(f"imported as {made.name or made.id} ({made.id}): pass it as `workspace` to continue it")
    return 0


def workspace_copy(args: argparse.Namespace) -> int:
    """fork, snapshot or restore, as the `workspaces` tool does, with the same caps and refusals."""
    verb = args.workspace_command
    with _store(args) as (store, policy_name, _):
        try:
            source = store.resolve(args.workspace, None, args.caller)
            if verb == "restore" and not source.snapshot:
                raise Refusal(
                    f"refused: {args.workspace!r} is a workspace, not a snapshot; fork it instead", "workspace"
                )
            if verb == "fork" and source.snapshot:
                raise Refusal(f"refused: {args.workspace!r} is a snapshot; restore it instead", "workspace")
            copy = store.snapshot if verb == "snapshot" else store.fork
            made = copy(source, args.name, policy_name)
        except Refusal as refused:
            raise UsageError(refused.message) from None
    what = "snapshot" if made.snapshot else "workspace"
    print(f"{verb}: {what} {made.name or made.id} ({made.id}) made of {source.name or source.id}")
    return 0


def workspace_delete(args: argparse.Namespace) -> int:
    with _store(args) as (store, _, _):
        try:
            record = store.resolve(args.workspace, None, args.caller)
            store.forget(record)
        except Refusal as refused:
            raise UsageError(refused.message) from None
    print(f"deleted {'snapshot' if record.snapshot else 'workspace'} {record.name or record.id} ({record.id})")
    return 0


@contextlib.contextmanager
def _opened(path: str, mode: str) -> Iterator[BinaryIO]:
    if path == "-":
        yield sys.stdout.buffer if "w" in mode else sys.stdin.buffer
        return
    with open(path, mode) as handle:
        yield handle  # type: ignore[misc]


@contextlib.contextmanager
def _folder_tar(folder: str) -> Iterator[BinaryIO]:
    """A folder's files as a plain tar (its links as links: the import checks it as any archive)."""
    if not Path(folder).is_dir():
        raise UsageError(f"--from {folder!r}: no such folder")
    with tempfile.TemporaryFile() as made:
        with tarfile.open(fileobj=made, mode="w", format=tarfile.PAX_FORMAT) as tar:
            for entry in sorted(Path(folder).iterdir()):
                tar.add(entry, arcname=entry.name)
        made.seek(0)
        yield made


@contextlib.contextmanager
def _store(args: argparse.Namespace) -> Iterator[tuple[WorkspaceStore, str, str]]:
    """The state folder's workspaces, held by this process while it works on them."""
    from sandbox_server.policy.loader import load_policy
    from sandbox_server.sandbox import mounts
    from sandbox_server.sandbox.engine.removal import current_owner, owner_alive
    from sandbox_server.state.folder import claim_state_folder, default_state_dir
    from sandbox_server.tools import all_tools
    from sandbox_server.workspaces.contents import ArchivedContents, Contents
    from sandbox_server.workspaces.mounted import MountedContents
    from sandbox_server.workspaces.store import WorkspaceStore

    policy = load_policy(args.policy, [tool.name for tool in all_tools()])
    if not policy.workspace.persist:
        raise UsageError(f"policy {policy.name!r} keeps no workspace (field workspace.persist)")
    folder = Path(args.state_dir) if args.state_dir else default_state_dir()
    held = claim_state_folder(folder, chosen=True)
    root = held.path / "workspaces"
    kind = args.workspaces
    if kind == "auto":
        archived = any(root.glob("ws-*.tar")) or mounts.unavailable(True) is not None
        kind = "archived" if archived else "mounted"
    owner = current_owner()

    def contents(path: Path) -> Contents:
        return ArchivedContents(path) if kind == "archived" else MountedContents(path, owner, owner_alive)

    store = WorkspaceStore(root, policy.workspace, policy.host.workspace_storage_mb * 1024 * 1024, contents)
    try:
        yield store, policy.name, policy.default.user
    finally:
        store.close()
        os.close(held.descriptor)
