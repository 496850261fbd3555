"""What a policy lets one server and one caller run as tasks, each refusal naming its field: tasks running at
once (a call with several side by side counts each), and tasks a caller holds until they are forgotten."""

from __future__ import annotations

from sandbox_server.errors import Refusal
from sandbox_server.policy import TaskSettings
from sandbox_server.words import duration

__all__ = ["refuse_past_held", "refuse_past_running"]


def refuse_past_running(
    settings: TaskSettings, policy_name: str, asking: tuple[str, int], running: list[tuple[str, int]]
) -> None:
    """Refuse a task that would run past tasks.running or tasks.running_per_caller; `asking` is its holder and the
    calls it runs side by side, `running` each running task's."""
    holder, slots = asking
    if settings.running <= 0:
        raise Refusal(f"refused: policy '{policy_name}' runs no tasks (field tasks.running is 0)", "tasks.running")
    asked = f"; this one runs {slots} calls side by side, each counted" if slots > 1 else ""
    busy = sum(count for _, count in running)
    if busy + slots > settings.running:
        raise Refusal(
            f"busy: {busy} tasks are running, the most policy '{policy_name}' "
            f"allows at once (field tasks.running: {settings.running}{asked}); retry when one ends",
            "tasks.running",
            kind="busy",
            retry_after_s=settings.poll_interval_ms / 1000,
        )
    mine = sum(count for who, count in running if who == holder)
    if mine + slots > settings.running_per_caller:
        raise Refusal(
            f"busy: you have {mine} tasks running, the most policy '{policy_name}' allows a caller "
            f"(field tasks.running_per_caller: {settings.running_per_caller}{asked}); wait for one to end or "
            "cancel one",
            "tasks.running_per_caller",
            kind="busy",
            retry_after_s=settings.poll_interval_ms / 1000,
        )


def refuse_past_held(settings: TaskSettings, policy_name: str, cap: str, count: int) -> None:
    """Refuse a task past a cap the caller's held tasks reached: `per_caller` (kept), else running on the replicas
    together."""
    if cap == "per_caller":
        raise Refusal(
            f"refused: you hold {count} tasks, the most policy '{policy_name}' keeps for a caller "
            f"(field tasks.per_caller); they are forgotten {duration(settings.ttl_s)} after they start (tasks.ttl_s)",
            "tasks.per_caller",
        )
    raise Refusal(
        f"busy: you have {count} tasks running on the replicas together, the most policy '{policy_name}' allows "
        "a caller (field tasks.running_per_caller); wait for one to end or cancel one",
        "tasks.running_per_caller",
        kind="busy",
        retry_after_s=settings.poll_interval_ms / 1000,
    )
