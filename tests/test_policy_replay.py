"""`sandbox-server policy replay` over a trail the real server wrote through the official client: a call allowed,
one refused, one a person approved, one that reached an allowed host and was refused another, a timeout, an
out-of-memory kill, a long call and a loud one; judged again under three changed policies, each giving exactly the
changes it should, from the command line while the server holds the trail and after."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest

from sandbox_server.sandbox.engine.runtime import DockerRuntime
from tests.conftest import run_cli
from tests.mcp_harness import Person, answer, connect, stdio_parameters
from tests.upstreams import Upstreams, upstreams_fixture  # noqa: F401 (the upstreams fixture)

pytestmark = pytest.mark.anyio

CALLS: list[tuple[str, str, dict[str, Any]]] = [  # (what it is, tool, arguments)
    ("allowed", "execute_command", {"command": "echo hi"}),
    ("refused", "execute_command", {"command": "echo late", "timeout_s": 500}),
    ("approved", "execute_command", {"command": "rm -f /workspace/nothing-here"}),
    ("egress", "execute_command",
     {"command": "curl -sS -m 10 -o /dev/null http://web.test/; curl -sS -m 10 -o /dev/null http://secure.test/"}),
    ("timeout", "execute_command", {"command": "sleep 10", "timeout_s": 1}),
    ("oom", "run_python", {"code": "x = b'x' * (400 * 2**20)"}),
    ("long", "execute_command", {"command": "sleep 2.5"}),
    ("loud", "execute_command", {"command": "head -c 5000 /dev/zero | tr '\\0' x"}),
]  # fmt: skip


def _policy(upstreams: Upstreams, allow: str, **changes: Any) -> dict[str, Any]:
    """The recorded policy, or a change of it: every field a change names replaces the recorded one."""
    network = {"allow": [allow], "egress_network": upstreams.network,
               "hosts": {"web.test": upstreams.web, "secure.test": upstreams.secure}}  # fmt: skip
    return {
        "name": "tuned",
        "extends": "default",
        "approval": {"commands": ["rm"]},
        "defaults": {"limits": {"timeout_s": 5}},
        "workspace": {"persist": False},
        "tools": {"execute_command": {"network": network}, "run_python": {"limits": {"memory_mb": 128}}},
        **changes,
    }


def _replay(trail: Path, policy: Path) -> dict[str, Any]:
    said = run_cli("policy", "replay", str(trail), "--policy", str(policy), "--json")
    assert said.returncode in (0, 1) and said.stdout, said.stderr
    found: dict[str, Any] = json.loads(said.stdout)
    assert found["judged"] == len(CALLS) and found["unreadable_lines"] == 0, found
    return found


def _changed(found: dict[str, Any], lines: dict[str, str]) -> dict[str, list[str]]:
    """Each kind of change that happened, with the calls (by what they are) it names."""
    names = {where: name for name, where in lines.items()}
    return {kind: [names[c["where"]] for c in listed] for kind, listed in found["changes"].items() if listed}


async def test_a_recorded_trail_replayed_under_three_changed_policies_gives_exactly_their_changes(
    upstreams: Upstreams, tmp_path: Path, runtime: DockerRuntime
) -> None:
    trail = tmp_path / "audit.jsonl"
    recorded = tmp_path / "tuned.yaml"
    recorded.write_text(json.dumps(_policy(upstreams, "web.test")))  # JSON is YAML
    person = Person()
    serve = stdio_parameters("--policy", str(recorded), "--audit-log", str(trail), "--no-pool")
    async with connect(serve, elicitation_callback=person) as client:
        answers = {name: await answer(client, tool, arguments) for name, tool, arguments in CALLS}
        same = recorded.with_name("same.yaml")
        same.write_text(recorded.read_text())
        running = run_cli("policy", "replay", str(trail), "--policy", str(same))  # the server holds the trail
    assert len(person.shown) == 1 and "rm -f" in person.shown[0]
    assert answers["refused"]["error"]["field"] == "limits.max_timeout_s", answers["refused"]["text"]
    assert answers["approved"]["is_error"] is False and answers["egress"]["network"]["denied"] == ["secure.test:80"]
    assert answers["timeout"]["timed_out"] and answers["oom"]["oom_killed"], answers["oom"]["text"]
    assert running.returncode == 0, running.stdout + running.stderr  # the same policy changes nothing
    assert f"replayed {len(CALLS)} call(s) recorded under policy 'tuned'" in running.stdout, running.stdout
    assert re.search(rf"^unchanged +{len(CALLS)}$", running.stdout, re.M), running.stdout

    calls = [n for n, line in enumerate(trail.read_text().splitlines(), 1) if '"event"' not in line]
    lines = {name: f"audit.jsonl:{number}" for (name, _, _), number in zip(CALLS, calls, strict=True)}

    looser = tmp_path / "looser.yaml"  # approvals and caps: one refused call now runs, one approval goes, one comes
    looser.write_text(json.dumps(_policy(
        upstreams, "web.test", approval={"tools": ["run_python"]},
        defaults={"limits": {"timeout_s": 5, "max_timeout_s": 600}},
    )))  # fmt: skip
    found = _replay(trail, looser)
    assert _changed(found, lines) == {
        "now_allowed": ["refused"],
        "no_longer_asked": ["approved"],
        "now_asked": ["oom"],
    }, found
    assert "limits.max_timeout_s" in found["changes"]["now_allowed"][0]["said"]
    assert "approval (approval.tools) now" in found["changes"]["now_asked"][0]["said"]

    elsewhere = tmp_path / "elsewhere.yaml"  # the network and the tools: a host closed, one opened, a tool gone
    changed_tools = _policy(upstreams, "secure.test")["tools"] | {"run_python": {"enabled": False}}
    elsewhere.write_text(json.dumps(_policy(upstreams, "secure.test", tools=changed_tools)))
    found = _replay(trail, elsewhere)
    assert _changed(found, lines) == {"now_refused": ["oom"], "egress_blocked": ["egress"], "egress_opened": ["egress"]}
    assert found["changes"]["egress_blocked"][0]["said"].startswith("web.test:80 was reached; refused (network.allow)")
    assert found["changes"]["egress_opened"][0]["said"].startswith("secure.test:80 was refused")
    assert "tools.run_python.enabled" in found["changes"]["now_refused"][0]["said"]

    tighter = tmp_path / "tighter.yaml"  # limits: a long call and a loud one cut short, the killed one let be
    tighter_tools = _policy(upstreams, "web.test")["tools"] | {"run_python": {"limits": {"memory_mb": 512}}}
    tighter.write_text(json.dumps(_policy(
        upstreams, "web.test", defaults={"limits": {"timeout_s": 2, "output_bytes": 2000}}, tools=tighter_tools,
    )))  # fmt: skip
    found = _replay(trail, tighter)
    assert _changed(found, lines) == {"cut_short": ["long", "loud"], "cut_lifted": ["oom"]}, found
    short = [c["said"] for c in found["changes"]["cut_short"]]
    assert "the new timeout is 2 s (limits.timeout_s)" in short[0] and "limits.output_bytes" in short[1], short
    assert "the new cap is 512 MiB" in found["changes"]["cut_lifted"][0]["said"]

    shown = run_cli("policy", "replay", str(trail), "--policy", str(tighter), "--since", "1d")
    assert shown.returncode == 1 and re.search(
        r"^would have been cut short by the new limits +2$", shown.stdout, re.M
    ), shown.stdout
    ran = re.search(rf"{re.escape(lines['long'])}: ran (\d+(?:\.\d+)?) s", shown.stdout)  # 3 s is said "3 s"
    assert ran and float(ran.group(1)) >= 2.5, shown.stdout  # the measured run time (a busy host's may be longer)
    none = run_cli("policy", "replay", str(trail), "--policy", str(tighter), "--from-policy", "other", "--json")
    assert json.loads(none.stdout)["other_policies"] == {"tuned": len(CALLS)}, none.stdout
