"""What a call's sandbox asked of the network, put in its answer and its audit record: each request it made
through its proxy (in the answer, the allowed first when there are many, so a flood of refused ones pushes none
out), the hosts the proxy refused, named in a note with the policy field, and the hosts a person was asked about."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from sandbox_server.network.proxy_log import ProxyRequest
from sandbox_server.tools.base import ToolOutcome

__all__ = ["ANSWERED_REQUESTS", "DENIED_NAMED", "with_requests"]

DENIED_NAMED = 20
"""Hosts the proxy refused that an answer's note names (the answer's `network.denied` lists more)."""
ANSWERED_REQUESTS = 200
"""Requests (the latest) and refused hosts an answer lists: thousands would pass the 1 MiB a client takes in one
message; the audit trail keeps every one the proxy kept, and the answer counts the rest."""


UNREACHED = {
    "ERR_CONNECT_FAIL": "connect to it: nothing listens there, or it refused the connection",
    "ERR_DNS_FAIL": "find its address: the name does not resolve",
    "ERR_CONNECT_TIMEOUT": "connect to it in time",
    "ERR_READ_TIMEOUT": "read its answer in time",
    "ERR_CANNOT_FORWARD": "reach it",
}
"""The proxy's own error pages for a host the allow list opens that it could not reach, and what each means."""


def with_requests(outcome: ToolOutcome, requests: list[ProxyRequest], dropped: int, asked: list[Any]) -> ToolOutcome:
    """The outcome with the requests its sandbox made through the proxy (`dropped`: earlier ones not kept) and the
    hosts a person was asked about, in its answer, notes and audit record."""
    records = [request.record() for request in requests]
    denied = sorted({f"{r.host}:{r.port}" for r in requests if not r.allowed})
    network: dict[str, Any] = {"requests": records, "denied": denied}
    if asked:
        network["asked"] = asked
    notes = outcome.notes
    if dropped:
        network["requests_not_kept"] = dropped
        notes = (*notes, f"{dropped} earlier requests through the proxy are counted but not listed")
    if denied:
        named = ", ".join(denied[:DENIED_NAMED]) + (
            f" and {len(denied) - DENIED_NAMED} more" if len(denied) > DENIED_NAMED else ""
        )
        notes = (*notes, f"the proxy refused {named} (policy field network.allow)")
    unreached: dict[tuple[str, str], int] = {}  # (host:port, the proxy's error) -> the status it answered with
    for r in requests:
        if r.allowed and r.error in UNREACHED:
            unreached.setdefault((f"{r.host}:{r.port}", str(r.error)), r.http_status)
    for (where, error), status in sorted(unreached.items())[:DENIED_NAMED]:
        notes = (*notes, f"{where} is allowed, but the proxy could not {UNREACHED[error]} ({error}): its "
                         f"{status} page is the proxy's, not the host's")  # fmt: skip
    audit = {**(outcome.audit or {}), "network": network} if outcome.audit is not None else None
    answered = dict(network)
    if len(records) > ANSWERED_REQUESTS:  # the allowed first (a flood of refused ones pushes none out), then
        allowed = [i for i, r in enumerate(records) if r["allowed"]][:ANSWERED_REQUESTS]  # the latest refused
        refused = [i for i, r in enumerate(records) if not r["allowed"]]
        refused = refused[len(refused) - (ANSWERED_REQUESTS - len(allowed)) :]
        answered["requests"] = [records[i] for i in sorted(allowed + refused)]
        answered["requests_not_kept"] = dropped + len(records) - ANSWERED_REQUESTS
    if len(denied) > ANSWERED_REQUESTS:
        answered["denied"], answered["denied_not_listed"] = (
            denied[:ANSWERED_REQUESTS],
            len(denied) - ANSWERED_REQUESTS,
        )
    structured = {**outcome.structured, "network": answered} if outcome.structured is not None else None
    return replace(outcome, structured=structured, notes=notes, audit=audit)
