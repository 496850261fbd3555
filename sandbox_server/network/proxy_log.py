"""The proxy's log read back: each request a sandbox made through its proxy (one line of the `sandbox` log
format `egress.squid_config` writes), kept per sandbox until its call files them in its answer and audit record."""

from __future__ import annotations

from collections import OrderedDict, deque
from dataclasses import dataclass
from typing import Any

__all__ = ["SANDBOX_RECORD", "SANDBOXES_RECORDED", "ProxyRequest", "RequestRecords", "parse_log_line"]


@dataclass(frozen=True, slots=True)
class ProxyRequest:
    """One request the proxy handled, from its log."""

    client: str
    method: str
    host: str
    port: int
    status: str
    """Squid's result, e.g. TCP_MISS, TCP_TUNNEL, TCP_DENIED."""
    http_status: int
    bytes_in: int
    """Bytes sent to the sandbox."""
    bytes_out: int
    """Bytes the sandbox sent."""
    error: str | None = None
    """The error page the proxy answered with itself (ERR_CONNECT_FAIL: nothing took the connection), else None."""

    @property
    def allowed(self) -> bool:
        return "DENIED" not in self.status

    def record(self) -> dict[str, Any]:
        """As the answer and the audit record show it."""
        said = {
            "method": self.method,
            "host": self.host,
            "port": self.port,
            "allowed": self.allowed,
            "status": self.http_status,
            "bytes_in": self.bytes_in,
            "bytes_out": self.bytes_out,
        }
        return said | ({"proxy_error": self.error} if self.error else {})


def parse_log_line(line: str) -> ProxyRequest | None:
    """A line of the proxy's `sandbox` log format (see egress.squid_config); None for anything else."""
    parts = line.split()
    if len(parts) not in (9, 10):  # (a proxy started before %err_code was logged writes 9)
        return None
    _, client, method, host, port, status, http_status, bytes_in, bytes_out, *error = parts
    said = error[0] if error and error[0] != "-" else None
    try:
        return ProxyRequest(
            client, method, host, int(port), status, int(http_status), int(bytes_in), int(bytes_out), said
        )
    except ValueError:
        return None


SANDBOX_RECORD = 10_000
"""Requests kept per sandbox until its call files them, allowed and denied ones each (the latest; the answer counts
the rest): a flood of cheap denied requests pushes out none of the sandbox's allowed ones."""
SANDBOXES_RECORDED = 4096
"""Sandboxes whose requests are kept until filed; the longest unfiled go first."""


@dataclass(slots=True)
class _Record:
    """One sandbox's requests not yet filed: allowed and denied ones in bounds of their own, in order of arrival."""

    allowed: deque[tuple[int, ProxyRequest]]
    denied: deque[tuple[int, ProxyRequest]]
    dropped: int = 0
    arrived: int = 0


class RequestRecords:
    """The proxy's requests not yet filed, each sandbox's (by its address) in a bounded record of its own, so
    that no sandbox's requests push out another's, nor its denied requests its allowed ones."""

    def __init__(self, per_sandbox: int = SANDBOX_RECORD, sandboxes: int = SANDBOXES_RECORDED) -> None:
        self.per_sandbox, self.sandboxes = per_sandbox, sandboxes
        self._records: OrderedDict[str, _Record] = OrderedDict()

    def file(self, request: ProxyRequest) -> None:
        """Keep one request in its sandbox's record (the oldest of its kind goes past the bound, counted)."""
        record = self._records.get(request.client)
        if record is None:
            bound = self.per_sandbox
            record = self._records[request.client] = _Record(deque(maxlen=bound), deque(maxlen=bound))
            while len(self._records) > self.sandboxes:  # never taken: a sandbox long gone
                self._records.popitem(last=False)
        kind = record.allowed if request.allowed else record.denied
        if len(kind) == self.per_sandbox:
            record.dropped += 1
        kind.append((record.arrived, request))
        record.arrived += 1

    def take(self, client: str) -> tuple[list[ProxyRequest], int]:
        """A sandbox's requests, oldest first, and how many earlier ones its record could not keep; forgets them."""
        record = self._records.pop(client, None)
        if record is None:
            return [], 0
        kept = sorted([*record.allowed, *record.denied], key=lambda arrived: arrived[0])
        return [request for _, request in kept], record.dropped
