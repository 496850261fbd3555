"""The tasks kept on disk, without an engine: what a killed server left, expiry, ids, both eras' shapes."""

from __future__ import annotations

import json
import time
from dataclasses import asdict
from pathlib import Path

from sandbox_server.access.audit import AuditLog
from sandbox_server.tasks.manager import Tasks
from sandbox_server.tasks.records import TaskFiles, TaskRecord, new_task_id


def record(holder: str, server: str, created_at: float, ttl_s: float = 600, status: str = "working") -> TaskRecord:
    return TaskRecord(new_task_id(), holder, holder, "execute_command", "default", server, created_at, created_at,
                      ttl_s, 2000, status)  # fmt: skip


def test_a_task_a_killed_server_left_working_is_failed_saying_why_and_an_expired_one_goes(tmp_path: Path) -> None:
    files = TaskFiles(tmp_path / "tasks")
    now = time.time()
    left = record("alice", "host:111:1", now)
    alive = record("alice", "host:222:2", now)
    old = record("bob", "host:111:1", now - 700, status="completed")
    for kept in (left, alive, old):
        files.save(kept)
    audit = AuditLog(tmp_path / "audit.jsonl")
    tasks = Tasks(tmp_path / "tasks", "host:333:3", audit, alive=lambda server: server == "host:222:2")
    assert tasks.recover() == 1
    failed = files.load(left.id)
    assert failed is not None and failed.status == "failed" and failed.error is not None
    assert "stopped before it ended" in failed.message and failed.error["code"] == -32603
    assert files.load(alive.id) == alive  # another live server's task is its own
    assert files.load(old.id) is None  # past its time to live
    events = [json.loads(line)["event"] for line in (tmp_path / "audit.jsonl").read_text().splitlines()]
    assert events == ["task_failed", "task_expired"]


def test_a_task_is_its_holders_alone_and_no_other_string_touches_the_disk(tmp_path: Path) -> None:
    tasks = Tasks(tmp_path / "tasks", "host:1:1", None)
    mine = record("alice", "host:1:1", time.time(), status="completed")
    tasks.files.save(mine)
    assert tasks.status(mine.id, "alice") == mine
    assert tasks.status(mine.id, "bob") is None and tasks.output(mine.id, "bob") is None
    for forged in ("../tasks/" + mine.id, mine.id.upper(), mine.id + ".json", ""):
        assert tasks.status(forged, "alice") is None


def test_each_era_writes_a_task_its_own_way() -> None:
    done = record("alice", "s", 1_700_000_000.0, status="completed")
    done = done.moved("completed", "completed after 3 s", result={"content": [], "isError": False})
    old, new = done.wire(era_2026=False), done.wire(era_2026=True)
    assert old["ttl"] == 600_000 and old["pollInterval"] == 2000 and "result" not in old
    assert (
        new["ttlMs"] == 600_000 and new["pollIntervalMs"] == 2000 and new["result"] == {"content": [], "isError": False}
    )
    assert old["createdAt"] == "2023-11-14T22:13:20.000Z"


def test_a_record_an_earlier_version_wrote_with_its_owner_is_read_with_its_holder(tmp_path: Path) -> None:
    files = TaskFiles(tmp_path / "tasks")
    kept = record("alice", "host:1:1", time.time())
    fields = {("owner" if name == "holder" else name): value for name, value in asdict(kept).items()}
    (tmp_path / "tasks" / f"{kept.id}.json").write_text(json.dumps(fields))
    assert "owner" in fields and "holder" not in fields
    assert files.load(kept.id) == kept
    files.save(kept)
    assert json.loads((tmp_path / "tasks" / f"{kept.id}.json").read_text())["holder"] == "alice"
