"""Tasks replicas share (`serve --state postgresql://…`): each task is a row, written whole as the file-backed
records are, so any replica answers tasks/get, tasks/list and tasks/result for any task, and a cancel that
reaches another replica than the one running the task is left in the row for that replica to act on."""

from __future__ import annotations

import json
import time
from dataclasses import asdict

from sandbox_server.state.database import Database, lock_key
from sandbox_server.tasks.records import TaskFiles, TaskRecord

__all__ = ["TaskRows"]

INSERT = "INSERT INTO tasks (id, owner, server, record) VALUES (%s, %s, %s, %s)"
"""A task's row: the column `owner` holds the task's holder (named before the word was settled)."""


def _row(record: TaskRecord) -> tuple[str, str, str, str]:
    """A task's row as INSERT writes it."""
    return record.id, record.holder, record.server, json.dumps(asdict(record), ensure_ascii=False)


class TaskRows:
    """The task records of the shared state (the same operations as TaskFiles)."""

    shared = True

    def __init__(self, database: Database) -> None:
        self.database = database

    valid = staticmethod(TaskFiles.valid)

    def save(self, record: TaskRecord) -> None:
        self.database.run(
            f"{INSERT} ON CONFLICT (id) DO UPDATE SET record = EXCLUDED.record, server = EXCLUDED.server", _row(record)
        )

    def save_output(self, task_id: str, text: str) -> None:
        self.database.run("UPDATE tasks SET output = %s WHERE id = %s", (text, task_id))

    def output(self, task_id: str) -> str | None:
        rows = self.database.run("SELECT output FROM tasks WHERE id = %s", (task_id,))
        return rows[0][0] if rows else None

    def load(self, task_id: str) -> TaskRecord | None:
        if not self.valid(task_id):
            return None
        rows = self.database.run("SELECT record FROM tasks WHERE id = %s", (task_id,))
        return TaskRecord.of(rows[0][0]) if rows else None

    def all(self) -> list[TaskRecord]:
        return [TaskRecord.of(row[0]) for row in self.database.run("SELECT record FROM tasks ORDER BY id")]

    def working(self) -> list[TaskRecord]:
        rows = self.database.run("SELECT record FROM tasks WHERE record->>'status' = 'working' ORDER BY id")
        return [TaskRecord.of(row[0]) for row in rows]

    def remove(self, task_id: str) -> None:
        self.database.run("DELETE FROM tasks WHERE id = %s", (task_id,))

    def reserve(self, record: TaskRecord, most_held: int, most_running: int) -> tuple[str, int] | None:
        """Hold a place for a task of `record.holder` among its tasks on every replica, in one step (the holder's
        advisory lock taken, the counts and the row written together): None when held, else the cap it would pass
        (`per_caller` for those kept, `running_per_caller` for those working) and the holder's count of them. The
        row is the task's record from then on."""
        now = time.time()
        with self.database.connection() as connection, connection.transaction():
            connection.execute("SELECT pg_advisory_xact_lock(%s)", (lock_key(f"tasks of {record.holder}"),))
            row = connection.execute(
                "SELECT count(*), count(*) FILTER (WHERE record->>'status' = 'working') FROM tasks WHERE owner = %s "
                "AND (record->>'created_at')::float8 + (record->>'ttl_s')::float8 > %s",
                (record.holder, now),
            ).fetchone()
            held, running = (int(row[0]), int(row[1])) if row is not None else (0, 0)
            if held >= most_held:
                return "per_caller", held
            if running >= most_running:
                return "running_per_caller", running
            connection.execute(INSERT, _row(record))
        return None

    def ask_cancel(self, task_id: str) -> None:
        """Leave a cancel for the replica that runs the task."""
        self.database.run("UPDATE tasks SET cancel_asked = true WHERE id = %s", (task_id,))

    def cancels_for(self, server: str) -> list[str]:
        """The tasks of this replica someone asked another replica to cancel."""
        rows = self.database.run("SELECT id FROM tasks WHERE server = %s AND cancel_asked", (server,))
        return [row[0] for row in rows]
