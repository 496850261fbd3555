"""One HTTP connection under the server's caps (`http_limits`): counted against the connections open in all and
from its address, and dropped when its client is too slow to send a request's headers or body."""

from __future__ import annotations

import asyncio
import logging
from collections import defaultdict
from dataclasses import dataclass, field
from typing import ClassVar

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from sandbox_server.protocol.http_limits import ConnectionLimits

__all__ = ["BoundedH11Protocol", "Connections", "bounded_protocol"]

log = logging.getLogger("sandbox_server")


def _refusal(status: str, text: str) -> bytes:
    body = text.encode("utf-8") + b"\n"
    head = (
        f"HTTP/1.1 {status}\r\ncontent-type: text/plain; charset=utf-8\r\nconnection: close\r\n"
        f"retry-after: 1\r\ncontent-length: {len(body)}\r\n\r\n"
    )
    return head.encode("ascii") + body


@dataclass(slots=True)
class Connections:
    """The connections open now, in all and by address (one per server)."""

    total: int = 0
    by_address: defaultdict[str, int] = field(default_factory=lambda: defaultdict(int))

    def add(self, address: str) -> None:
        self.total += 1
        self.by_address[address] += 1

    def remove(self, address: str) -> None:
        self.total -= 1
        self.by_address[address] -= 1
        if self.by_address[address] <= 0:
            del self.by_address[address]


class BoundedH11Protocol(H11Protocol):
    """One HTTP connection, counted, and dropped when its client is too slow to send a request; a subclass per
    server (`bounded_protocol`) names its limits and counts its connections."""

    limits: ClassVar[ConnectionLimits]
    open_now: ClassVar[Connections]

    _address: str | None = None
    _deadline: asyncio.TimerHandle | None = None
    _waiting_for: str = ""

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        address = self.client[0] if self.client else "unknown"
        if self.open_now.total >= self.limits.max_connections:
            self._refuse(
                f"too many connections: the server holds {self.open_now.total}, its most "
                f"(serve --max-connections {self.limits.max_connections}); retry shortly"
            )
            return
        if self.open_now.by_address[address] >= self.limits.max_per_address:
            self._refuse(
                f"too many connections from {address}: {self.open_now.by_address[address]} are open, the most one "
                f"address may hold (serve --max-connections-per-address {self.limits.max_per_address}); "
                "close some and retry"
            )
            return
        self._address = address
        self.open_now.add(address)
        self._expect("headers")

    def _refuse(self, text: str) -> None:
        log.warning("refused an HTTP connection: %s", text)
        transport = self.transport
        transport.write(_refusal("503 Service Unavailable", text))
        transport.close()

    def connection_lost(self, exc: Exception | None) -> None:
        self._stop_waiting()
        if self._address is not None:
            self.open_now.remove(self._address)
            self._address = None
        super().connection_lost(exc)

    def _expect(self, what: str) -> None:
        """Start the clock for the client's request headers or body."""
        self._stop_waiting()
        timeout = self.limits.header_timeout_s if what == "headers" else self.limits.body_timeout_s
        self._waiting_for = what
        self._deadline = self.loop.call_later(timeout, self._too_slow, timeout)

    def _stop_waiting(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None
        self._waiting_for = ""

    def _too_slow(self, timeout: float) -> None:
        what, self._deadline = self._waiting_for, None
        option = "--header-timeout-s" if what == "headers" else "--body-timeout-s"
        log.info(
            "closed an HTTP connection from %s: no complete request %s within %g s (serve %s)",
            self._address,
            what,
            timeout,
            option,
        )
        if not self.transport.is_closing():
            if self.conn.their_state is h11.IDLE and self.conn.our_state is h11.IDLE:
                self.transport.write(
                    _refusal("408 Request Timeout", f"no complete request {what} within {timeout:g} s ({option})")
                )
            self.transport.close()

    def handle_events(self) -> None:
        super().handle_events()
        self._follow_request()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing():
            self._follow_request()

    def _follow_request(self) -> None:
        """Keep the clock running only while the client owes us part of a request."""
        if self._address is None or self.transport.is_closing():
            return
        state = self.conn.their_state
        if state is h11.IDLE and self.conn.our_state is h11.IDLE:
            if self._waiting_for != "headers":
                self._expect("headers")
        elif state is h11.SEND_BODY:
            if self._waiting_for != "body":
                self._expect("body")
        elif self._waiting_for:
            self._stop_waiting()


def bounded_protocol(limits: ConnectionLimits) -> type[asyncio.Protocol]:
    """uvicorn's h11 protocol with the connection caps and the header and body timeouts of `limits`, counting
    its own connections."""
    return type("BoundedH11Protocol", (BoundedH11Protocol,), {"limits": limits, "open_now": Connections()})
