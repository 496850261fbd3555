"""What a changed policy would have done to the calls an audit trail recorded (`sandbox-server policy replay`).

Nothing runs. Each call record is judged again under the new policy (calls.judge) and set beside what its record
says happened: refused then or now (and by which field), a person asked then or now, the hosts its sandbox reached
through the proxy against the new allow list, and its measured run time, memory peak and output against the new
caps. The trail is read a line at a time, so its length bounds the time a replay takes, never its memory: each kind
of change is counted in full and listed up to a bound.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from sandbox_server.access.audit_verify import trail_files, trail_lines
from sandbox_server.calls.judge import Judge, Verdict
from sandbox_server.policy import Policy
from sandbox_server.tools import all_tools

__all__ = ["KINDS", "Change", "Replay", "replay_trail"]

KINDS = {
    "now_refused": "would now be refused",
    "now_allowed": "refused then, would now run",
    "now_asked": "would now ask a person first",
    "no_longer_asked": "a person was asked then, would now run without asking",
    "egress_blocked": "a host reached then would now be refused",
    "egress_opened": "a host refused then would now be reached",
    "cut_short": "would have been cut short by the new limits",
    "cut_lifted": "cut short then, below the new limits",
}
"""Each kind of change, in the order the report shows them."""
MIB = 1024 * 1024
POLICY_FIELDS = re.compile(r"^(limits\.|commands\.|mounts|workspace\.exec|workdir|tools\.|approval|name$)")
"""Refusals a policy's judgment of the call made (others came later: its caller's rate, a workspace, the engine)."""
NOT_RECORDED = "the call's arguments (recorded before the trail kept what a policy judges): only its tool and size"


@dataclass(frozen=True, slots=True)
class Change:
    """One recorded call and what the new policy changes of it."""

    kind: str
    said: str
    where: str
    """The record's file and line."""
    time: str
    caller: str
    tool: str

    def as_json(self) -> dict[str, str]:
        return {"kind": self.kind, "said": self.said, "where": self.where, "time": self.time,
                "caller": self.caller, "tool": self.tool}  # fmt: skip


@dataclass(slots=True)
class Replay:
    """A replay's findings: counts of every kind, the calls listed (up to `listed` of each kind)."""

    policy: str
    from_policy: str
    listed: int
    judged: int = 0
    unchanged: int = 0
    counts: Counter[str] = field(default_factory=Counter)
    changes: dict[str, list[Change]] = field(default_factory=dict)
    unjudged: Counter[str] = field(default_factory=Counter)
    """What could not be judged, by how many calls."""
    other_policies: Counter[str] = field(default_factory=Counter)
    """Calls recorded under other policies, not judged (by policy)."""
    unreadable: int = 0
    first_time: str = ""
    last_time: str = ""
    files: list[str] = field(default_factory=list)

    def add(self, change: Change) -> None:
        self.counts[change.kind] += 1
        shown = self.changes.setdefault(change.kind, [])
        if len(shown) < self.listed:
            shown.append(change)

    def as_json(self) -> dict[str, Any]:
        return {
            "policy": self.policy, "from_policy": self.from_policy, "files": self.files, "judged": self.judged,
            "unchanged": self.unchanged, "first_time": self.first_time, "last_time": self.last_time,
            "counts": {kind: self.counts[kind] for kind in KINDS},
            "changes": {kind: [c.as_json() for c in self.changes.get(kind, [])] for kind in KINDS},
            "not_judged": dict(self.unjudged), "other_policies": dict(self.other_policies),
            "unreadable_lines": self.unreadable,
        }  # fmt: skip


def _records(path: Path, replay: Replay) -> Iterator[tuple[str, dict[str, Any]]]:
    """Each readable record of the trail, oldest first, with where it is."""
    replay.files = [str(file) for file in trail_files(path)]
    for line in trail_lines(path):
        if line.record is None:
            replay.unreadable += 1
        else:
            yield f"{line.file}:{line.number}", line.record


def replay_trail(
    path: Path, policy: Policy, from_policy: str | None = None, since: datetime | None = None, listed: int = 50
) -> Replay:
    """Judge every call the trail at `path` recorded under `from_policy` (default: the new policy's name; `*`:
    every policy) again under `policy`, from `since` on."""
    wanted = from_policy or policy.name
    replay = Replay(policy.name, wanted, listed)
    judge = Judge(policy, all_tools())
    for where, record in _records(path, replay):
        if "event" in record or not isinstance(record.get("tool"), str):
            continue  # a task's or a service's life, not a call
        recorded_time = str(record.get("time") or "")
        if since is not None and not _at_or_after(recorded_time, since):
            continue
        if wanted != "*" and record.get("policy") != wanted:
            replay.other_policies[str(record.get("policy"))] += 1
            continue
        replay.judged += 1
        replay.first_time = replay.first_time or recorded_time
        replay.last_time = recorded_time
        changed = False
        for change in _changes(judge, record, where, replay.unjudged):
            replay.add(change)
            changed = True
        replay.unchanged += not changed
    return replay


def _at_or_after(recorded: str, since: datetime) -> bool:
    try:
        when = datetime.fromisoformat(recorded)
    except ValueError:
        return True  # a record without a readable time is judged rather than lost
    return (when if when.tzinfo is not None else when.replace(tzinfo=UTC)) >= since


def _changes(judge: Judge, record: Mapping[str, Any], where: str, unjudged: Counter[str]) -> Iterator[Change]:
    """What the new policy changes of one recorded call."""
    tool = str(record["tool"])
    if record.get("kind") == "invalid_arguments":
        return  # arguments the tool's schema refused: no policy judged them, none would
    verdict = _verdict(judge, tool, record)
    for note in verdict.unjudged:
        unjudged[note] += 1

    def change(kind: str, said: str) -> Change:
        return Change(kind, said, where, str(record.get("time") or ""), str(record.get("caller") or ""), tool)

    then = _then(record, tool)
    if verdict.decision != then.decision:
        kind = {
            "refused": "now_refused",
            "approval": "now_asked",
            "allowed": "no_longer_asked" if then.decision == "approval" else "now_allowed",
        }[verdict.decision]
        was = f"{then.said()} then" + (f": {then.reason}" if then.reason and then.decision == "refused" else "")
        yield change(kind, f"{was}; {verdict.said()} now" + (f": {verdict.reason}" if verdict.reason else ""))
    if verdict.decision == "refused" or then.decision == "refused":
        return
    yield from (change(kind, said) for kind, said in _egress(judge, tool, record))
    yield from (change(kind, said) for kind, said in _limits(judge.policy, tool, record))


def _verdict(judge: Judge, tool: str, record: Mapping[str, Any]) -> Verdict:
    arguments, facts = record.get("arguments"), record.get("judged")
    if isinstance(arguments, Mapping):  # the trail keeps arguments whole (audit.include_arguments)
        return judge.call(tool, arguments, bool(record.get("task")) or bool((facts or {}).get("long")))
    size = record.get("arguments_bytes")
    size = int(size) if isinstance(size, int) else None
    if isinstance(facts, Mapping):
        return judge.recorded(tool, facts, size)
    verdict = judge.recorded(tool, None, size)
    return Verdict(verdict.decision, verdict.field, verdict.reason, (*verdict.unjudged, NOT_RECORDED))


def _then(record: Mapping[str, Any], tool: str) -> Verdict:
    """What the policy of the time decided, as the record says: a person asked, refused by a field, or allowed
    (a call that passed the policy's judgment, whatever became of it later)."""
    approval = record.get("approval")
    if isinstance(approval, Mapping):
        return Verdict("approval", str(approval.get("field") or "approval"), str(approval.get("reason") or ""))
    refused_by = record.get("field")
    if record.get("outcome") == "refused" and isinstance(refused_by, str) and POLICY_FIELDS.match(refused_by):
        if refused_by == "name":  # an unknown tool: the policy offered none of that name
            refused_by = f"tools.{tool}.enabled"
        return Verdict("refused", refused_by, str(record.get("reason") or ""))
    return Verdict("allowed")


def _egress(judge: Judge, tool: str, record: Mapping[str, Any]) -> Iterator[tuple[str, str]]:
    """Hosts the call's sandbox reached (or was refused) through the proxy, judged by the new allow list."""
    requests = ((record.get("network") or {}).get("requests")) or []
    seen: dict[tuple[str, int], bool] = {}
    for request in requests:
        if isinstance(request, Mapping) and isinstance(request.get("host"), str):
            key = (request["host"], int(request.get("port") or 443))
            seen[key] = seen.get(key, False) or bool(request.get("allowed"))
    for (host, port), allowed in sorted(seen.items()):
        now = judge.host(tool, host, port)
        if allowed and now.decision != "allowed":
            yield "egress_blocked", f"{host}:{port} was reached; {now.said()} now: {now.reason}"
        elif not allowed and now.decision == "allowed":
            yield "egress_opened", f"{host}:{port} was refused; the new allow list opens it"


def _limits(policy: Policy, tool: str, record: Mapping[str, Any]) -> Iterator[tuple[str, str]]:
    """The call's measured run time, memory peak and output against the new caps (calls that ran a sandbox)."""
    then = record.get("limits")
    if not isinstance(then, Mapping):
        return
    new = policy.for_tool(tool)
    facts = record.get("judged") or {}
    asked = (facts.get("arguments") or {}).get("timeout_s")
    if asked is not None:
        timeout, timeout_field = float(asked), "the call's own timeout_s"
    elif facts.get("long") or record.get("task"):
        timeout, timeout_field = new.max_task_s, "limits.max_task_s"
    else:
        timeout, timeout_field = new.limits.timeout_s, "limits.timeout_s"
    usage = record.get("usage") or {}
    ran_s = float(record["run_ms"]) / 1000 if record.get("run_ms") is not None else float(usage.get("wall_s") or 0)
    old_timeout = float(then.get("timeout_s") or 0)
    if record.get("timed_out"):
        if timeout > old_timeout:
            yield "cut_lifted", f"timed out at {old_timeout:g} s; the new timeout is {timeout:g} s ({timeout_field})"
    elif ran_s > timeout:
        yield "cut_short", f"ran {ran_s:.3g} s; the new timeout is {timeout:g} s ({timeout_field}): it would time out"
    memory, old_memory = new.limits.memory_mb, int(then.get("memory_mb") or 0)
    peak = usage.get("peak_memory_bytes")
    if record.get("oom_killed"):
        if memory > old_memory:
            yield (
                "cut_lifted",
                f"killed at its memory cap of {old_memory} MiB; the new cap is {memory} MiB (limits.memory_mb)",
            )
    elif isinstance(peak, int) and peak > memory * MIB:
        yield (
            "cut_short",
            f"its memory peaked at {peak / MIB:.1f} MiB, above the new cap of {memory} MiB "
            "(limits.memory_mb): it would be killed",
        )
    output = max(int(record.get("stdout_bytes") or 0), int(record.get("stderr_bytes") or 0))
    cap = new.limits.output_bytes
    if output > cap >= 0 and output <= int(then.get("output_bytes") or 0):
        yield (
            "cut_short",
            f"it wrote {output} bytes to one stream, above the new cap of {cap} (limits.output_bytes): "
            "its answer would be cut",
        )
