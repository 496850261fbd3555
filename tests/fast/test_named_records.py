"""Named workspaces' records: how long they last and what a sweep does to them (no engine: the store alone)."""

from __future__ import annotations

import os
import time
from dataclasses import replace
from pathlib import Path

import anyio
import pytest

from sandbox_server.errors import Refusal
from sandbox_server.policy import WorkspaceSettings
from sandbox_server.sandbox.mounts import copy_sparse
from sandbox_server.workspaces.records import session_key
from sandbox_server.workspaces.store import WorkspaceStore


def _store(root: Path, **settings: float) -> WorkspaceStore:
    return WorkspaceStore(root, WorkspaceSettings(persist=True, **settings), 1 << 30)  # type: ignore[arg-type]


def test_a_named_workspace_lasts_keep_s_and_outlives_its_session_while_an_unnamed_one_goes(tmp_path: Path) -> None:
    store = _store(tmp_path, idle_ttl_s=60, keep_s=3600)
    session = session_key("server-1", "s1")
    named, _ = store.open(None, session, "client")
    kept = store.keep(named, "kept-one", "p")
    plain, _ = store.open(None, session_key("server-1", "s2"), "client")
    assert (kept.name, kept.session) == ("kept-one", session)  # its session goes on in it
    assert store.end_session(session) == 0  # its session ended: the named one is no longer its
    an_hour_less = time.time() - 600  # past idle_ttl_s, within keep_s
    for record in (kept, plain):
        store._records[record.id] = replace(store._records[record.id], last_used=an_hour_less)
    assert store.sweep(lambda server: True) == 1
    assert store.find(kept.id, None) is not None and store.find(plain.id, session_key("server-1", "s2")) is None
    reopened, _ = store.open("kept-one", session_key("server-2", "s9"), "client")  # another server's session
    assert reopened.id == kept.id
    # A restarted server reads it back from its record.
    again = _store(tmp_path, idle_ttl_s=60, keep_s=3600)
    assert again.open("kept-one", None, "client")[0].id == kept.id


def test_names_are_per_caller_and_bounded(tmp_path: Path) -> None:
    store = _store(tmp_path, named_per_caller=1)
    mine, _ = store.open(None, None, "a", tenant="alice")
    theirs, _ = store.open(None, None, "b", tenant="bob")
    store.keep(mine, "same", "p")
    store.keep(theirs, "same", "p")  # another caller's name space
    with pytest.raises(Refusal) as refused:
        store.open("same", None, "a", tenant="carol")
    assert refused.value.field == "workspace"
    assert store.open("same", None, "b", tenant="bob")[0].id == theirs.id
    other, _ = store.open(None, None, "a", tenant="alice")
    with pytest.raises(Refusal) as over:
        store.keep(other, "second", "p")
    assert over.value.field == "workspace.named_per_caller" and "named_per_caller: 1" in over.value.message
    with pytest.raises(Refusal) as bad:
        store.keep(other, "Bad Name", "p")
    assert bad.value.field == "name" and "lower-case letters" in bad.value.message


def test_an_images_copy_has_its_data_and_leaves_its_holes_holes(tmp_path: Path) -> None:
    source, target = tmp_path / "a.img", tmp_path / "b.img"
    with open(source, "wb") as image:
        image.truncate(64 << 20)
        for offset in (0, 40 << 20):
            image.seek(offset)
            image.write(os.urandom(1 << 20))
    copied = copy_sparse(source, target)
    assert target.read_bytes() == source.read_bytes()
    assert copied == 2 << 20 and target.stat().st_blocks * 512 < 4 << 20  # 2 MiB of data, not 64
    with pytest.raises(FileExistsError):  # never over an existing file
        copy_sparse(source, target)


def test_a_new_workspace_whose_first_call_has_not_ended_is_not_removed_to_make_room(tmp_path: Path) -> None:
    """Between a workspace's opening and its call's start (the proxy, the scope) its call holds nothing yet: a
    new workspace asked for meanwhile finds no room, rather than removing it from under its call; once its call
    has begun and ended it is idle, and makes room."""
    store = _store(tmp_path, max_per_client=1, protect_recent_s=0)
    first, _ = store.open(None, None, "client")
    with pytest.raises(Refusal, match="each is in use") as refused:
        store.open(None, None, "client")
    assert refused.value.field == "workspace.max_per_client"

    async def first_call() -> None:
        async with store.using(first, 1):
            pass

    anyio.run(first_call)  # its call began and ended: idle now, and the oldest
    second, notes = store.open(None, None, "client")
    assert second.id != first.id and notes and f"workspace {first.id} (no call continued it) was removed" in notes[0]
