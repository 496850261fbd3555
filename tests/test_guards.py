"""Pure logic of the guards: audit rotation and host admission."""

import json
from pathlib import Path

import pytest

from sandbox_server.access.admission import Admission
from sandbox_server.access.audit import AuditLog
from sandbox_server.errors import Refusal
from sandbox_server.policy import HostAdmission, RateLimits


def test_audit_log_appends_json_lines_and_rotates_by_size(tmp_path: Path) -> None:
    log = AuditLog(tmp_path / "audit.jsonl", max_bytes=4096, keep=2)
    for index in range(200):
        log.write({"call": index, "padding": "x" * 40})
    current = [json.loads(line) for line in (tmp_path / "audit.jsonl").read_text().splitlines()]
    rotated = [json.loads(line) for line in (tmp_path / "audit.jsonl.1").read_text().splitlines()]
    assert current[-1]["call"] == 199
    assert rotated[-1]["call"] == current[0]["call"] - 1
    assert (tmp_path / "audit.jsonl.2").exists() and not (tmp_path / "audit.jsonl.3").exists()
    assert all(path.stat().st_size <= 4096 for path in tmp_path.iterdir())


def test_a_saturated_host_refuses_new_sandboxes_and_says_which_field() -> None:
    admission = Admission(RateLimits(), HostAdmission(min_available_memory_mb=10**9, max_load_per_cpu=8), "p")
    with pytest.raises(Refusal) as refused:
        admission.admit("client")
    assert refused.value.message.startswith("busy: the host has")
    assert refused.value.field == "host.min_available_memory_mb" and refused.value.kind == "busy"
    assert admission.running == 0


def test_admission_forgets_clients_idle_for_a_minute() -> None:
    now = [1000.0]
    admission = Admission(
        RateLimits(), HostAdmission(min_available_memory_mb=0, max_load_per_cpu=10**6), "p", lambda: now[0]
    )
    for number in range(300):
        admission.admit(f"client-{number}").release()
    assert admission.remembered == 300
    now[0] += 61
    admission.admit("late").release()
    assert admission.remembered == 1
