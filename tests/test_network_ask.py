"""Hosts approved live (network.ask): a request to a host the allow list does not name pauses at the real proxy
while the person is asked through the official client's elicitation callback (through one server, and through
two replicas sharing a real PostgreSQL).

The hosts asked for are the test's own upstream under other names, every one pinned in the policy's `hosts`, so
the proxy resolves nothing through DNS whatever the answer; refusals are the proxy's 403 pages.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.mcp_harness import (
    CheckedClient,
    Person,
    answer,
    audit_records,
    connect,
    http_server,
    stdio_parameters,
)
from tests.replicas import postgres, start_replica
from tests.upstreams import Upstreams, upstreams_fixture  # noqa: F401 (the upstreams fixture)

pytestmark = pytest.mark.anyio

MANY = 100
PAGE = "hello from web /page\n 200"
"""What the upstream answers through the proxy, with the status `fetch` prints after it."""


@dataclass
class Asking:
    policy: Path
    audit: Path

    def records(self) -> list[dict[str, Any]]:
        return audit_records(self.audit)


@pytest.fixture
def asking(upstreams: Upstreams, tmp_path: Path) -> Iterator[Asking]:
    names = ["other.test", "third.test", *(f"h{index}.test" for index in range(MANY))]
    network = {
        "allow": ["web.test:80"],
        "egress_network": upstreams.network,
        "hosts": {name: upstreams.web for name in ["web.test", *names]},
        "ask": {"questions": 3, "wait_s": 30},
    }
    policy, audit = tmp_path / "asking.yaml", tmp_path / "audit.jsonl"
    policy.write_text(json.dumps({"name": "asking", "extends": "default", "audit": {"path": str(audit)},
                                  "tools": {"execute_command": {"network": network}}}))  # fmt: skip
    yield Asking(policy, audit)


async def run(client: CheckedClient, command: str) -> dict[str, Any]:
    return await answer(client, "execute_command", {"command": command})


def fetch(*hosts: str) -> str:
    """A command printing, for each host, the status and body its page answered with through the proxy."""
    return "; ".join(f"curl -sS -m 60 -w ' %{{http_code}}\\n' http://{host}/page" for host in hosts)


async def test_handshake_era_accept_opens_the_host_for_the_session_and_decline_keeps_the_403(
    asking: Asking,
) -> None:
    person = Person()
    async with connect(stdio_parameters("--policy", str(asking.policy)), elicitation_callback=person) as client:
        listed = await run(client, fetch("web.test"))
        assert PAGE in listed["stdout"] and person.shown == [], listed
        opened = await run(client, fetch("other.test", "other.test"))
        assert opened["stdout"].count(PAGE) == 2, opened
        assert len(person.shown) == 1 and "other.test:80" in person.shown[0] and "'asking'" in person.shown[0]
        assert opened["network"]["asked"] == [
            {"host": "other.test", "port": 80, "answer": "accept"},
            {"host": "other.test", "port": 80, "answer": "approved earlier"},
        ], opened["network"]
        again = await run(client, fetch("other.test"))  # the next call: no question
        assert PAGE in again["stdout"] and len(person.shown) == 1, again
        assert again["network"]["asked"] == [{"host": "other.test", "port": 80, "answer": "approved earlier"}]

        person.answer = "decline"
        declined = await run(client, fetch("third.test"))
        assert " 403" in declined["stdout"] and "not approved when asked (field network.ask)" in declined["stdout"]
        assert "the person declined" in declined["stdout"] and len(person.shown) == 2, declined
        assert declined["network"]["asked"] == [{"host": "third.test", "port": 80, "answer": "decline"}]
        assert "third.test:80" in declined["network"]["denied"]
        still = await run(client, fetch("third.test"))  # one question per host per session
        assert " 403" in still["stdout"] and len(person.shown) == 2, still
        assert still["network"]["asked"][0]["answer"] == "declined earlier"
    asked = [r["network"].get("asked") for r in asking.records() if r.get("event") is None and "network" in r]
    assert [a[0]["answer"] for a in asked if a] == ["accept", "approved earlier", "decline", "declined earlier"]


async def test_a_sandbox_asking_for_a_hundred_hosts_gets_at_most_the_policys_number_of_questions(
    asking: Asking,
) -> None:
    person = Person()
    async with connect(stdio_parameters("--policy", str(asking.policy)), elicitation_callback=person) as client:
        hosts = [f"h{index}.test" for index in range(MANY)]
        many = await run(client, "for h in " + " ".join(hosts) + "; do curl -s -o /dev/null -w '%{http_code} ' -m 60 "
                         "http://$h/; done")  # fmt: skip
        codes = many["stdout"].split()
        assert codes == ["200"] * 3 + ["403"] * (MANY - 3), many
        assert len(person.shown) == 3, person.shown
        asked = many["network"]["asked"]
        assert [a["answer"] for a in asked] == ["accept"] * 3 + ["not asked"] * (MANY - 3)
        assert "the 3 questions of this session are used (network.ask.questions)" in asked[-1]["why"]


async def test_a_client_without_elicitation_is_never_asked_and_the_403_says_why(asking: Asking) -> None:
    async with connect(stdio_parameters("--policy", str(asking.policy))) as client:
        refused = await run(client, fetch("other.test"))
        assert " 403" in refused["stdout"] and "declares no form elicitation" in refused["stdout"], refused
        assert refused["network"]["asked"][0]["answer"] == "not asked"


async def test_2026_era_the_call_runs_on_while_the_client_asks_between_rounds(asking: Asking) -> None:
    person = Person()
    with http_server("--policy", str(asking.policy), "--no-pool") as url:
        async with connect(url, mode="2026-07-28", elicitation_callback=person) as client:
            opened = await run(client, "echo before; " + fetch("other.test", "other.test"))
            assert opened["stdout"].startswith("before\n") and opened["stdout"].count(PAGE) == 2, opened
            assert len(person.shown) == 1 and "other.test:80" in person.shown[0]
            workspace = opened["workspace"]  # the session of the 2026-07-28 era: the workspace passed back
            result = await client.call_tool("execute_command", {"command": fetch("other.test"), "workspace": workspace})
            assert result.structured_content is not None and PAGE in result.structured_content["stdout"]
            assert len(person.shown) == 1, person.shown
            fresh = await run(client, fetch("other.test"))  # no workspace passed: another session, asked afresh
            assert PAGE in fresh["stdout"] and len(person.shown) == 2, fresh
            person.answer = "decline"
            declined = await run(client, fetch("third.test"))
            assert " 403" in declined["stdout"] and "the person declined" in declined["stdout"], declined
            assert declined["network"]["asked"] == [{"host": "third.test", "port": 80, "answer": "decline"}]
    assert len(person.shown) == 3


async def test_replicas_decide_alike_and_count_their_questions_together(asking: Asking, tmp_path: Path) -> None:
    """Two replicas on one shared state: a host approved or declined through one is decided alike through the
    other, without a question, and the policy's 3 questions count those asked through both."""
    person = Person()
    with postgres() as database:
        replicas = [
            start_replica(
                tmp_path / name, database.url, "--policy", str(asking.policy), "--no-pool", "--workspaces", "archived"
            )
            for name in ("one", "two")
        ]
        try:
            async with (
                connect(replicas[0].url, mode="2026-07-28", elicitation_callback=person) as one,
                connect(replicas[1].url, mode="2026-07-28", elicitation_callback=person) as two,
            ):
                opened = await run(one, fetch("other.test"))
                assert PAGE in opened["stdout"] and len(person.shown) == 1, opened
                workspace = opened["workspace"]  # the session the answers hold for, continued on either replica

                async def on(client: CheckedClient, command: str) -> dict[str, Any]:
                    return await answer(client, "execute_command", {"command": command, "workspace": workspace})

                again = await on(two, fetch("other.test"))
                assert PAGE in again["stdout"] and len(person.shown) == 1, again
                assert again["network"]["asked"] == [{"host": "other.test", "port": 80, "answer": "approved earlier"}]

                person.answer = "decline"
                declined = await on(two, fetch("third.test"))
                assert " 403" in declined["stdout"] and len(person.shown) == 2, declined
                still = await on(one, fetch("third.test"))
                assert " 403" in still["stdout"] and len(person.shown) == 2, still
                assert still["network"]["asked"][0]["answer"] == "declined earlier"

                third = await on(one, fetch("h0.test"))  # the session's third question, asked through one
                assert len(person.shown) == 3 and third["network"]["asked"][0]["answer"] == "decline", third
                past = await on(two, fetch("h1.test"))  # none left through the other either
                assert " 403" in past["stdout"] and len(person.shown) == 3, past
                assert "the 3 questions of this session are used" in past["network"]["asked"][0]["why"], past
        finally:
            for replica in replicas:
                replica.stop()
