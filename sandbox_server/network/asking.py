"""Hosts approved live: a request to a host the allow list does not name pauses at the proxy while a person is
asked (a policy's `network.ask`).

Squid asks an external ACL helper (its own mechanism for slow decisions) about each such request: the helper is a
short relay the server writes beside the proxy's configuration, which passes Squid's lines to the server over a
Unix socket in that folder and the server's answers back. The server finds the call whose sandbox has the
request's address, and that call's asker decides: a host already answered in its scope is answered at once, else
the person is asked (the protocol layer's question), within the policy's number of questions. Any request nobody
can be asked for (a service's, a finished call's) keeps its 403.

Squid keeps no answer (`cache=0`): addresses are reused by later sandboxes, so every request is decided again by
the server, which remembers the answers per session or caller.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import socket
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Protocol

__all__ = [
    "HELPER",
    "HELPER_NAME",
    "AskChannel",
    "AskSettings",
    "Gatekeeper",
    "HostAsker",
    "ask_lines",
    "parse_ask",
]

log = logging.getLogger("sandbox_server")

SOCKET_NAME = "ask.sock"
"""The server's socket, in the folder bound into the proxy (read-only: a Unix socket is still connected to)."""
HELPER_NAME = "ask-helper.pl"
HELPER = r"""#!/usr/bin/perl
# sandbox-server: relays Squid's external ACL lines to the server's socket and its answers back;
# without the server, every request is refused (fail closed).
use strict; use warnings; use IO::Socket::UNIX;
$| = 1;
my $s = IO::Socket::UNIX->new(Type => SOCK_STREAM(), Peer => $ARGV[0]);
if (!$s) {
    while (my $l = <STDIN>) { my ($id) = split / /, $l; print "$id ERR message=\"the server does not answer\"\n"; }
    exit 0;
}
$s->autoflush(1);
my $pid = fork();
if ($pid == 0) { while (my $l = <$s>) { print STDOUT $l; } exit 0; }
while (my $l = <STDIN>) { print $s $l; }
shutdown($s, 1); waitpid($pid, 0);
"""
"""Squid's helper (Debian's Squid depends on Perl, so the proxy image has it)."""
REMEMBER = ("session", "caller")
LINE = re.compile(r"^(\d+) (\S+) (\S+) (\d+)(?: .*)?$")
"""Squid's line: channel, client address, host, port (then the ACL's arguments, `-` for none)."""


@dataclass(frozen=True, slots=True)
class AskSettings:
    """`network.ask`: whom an answer is remembered for, how many questions at most, how long one waits."""

    remember: str = "session"
    questions: int = 5
    """Questions per session (or caller) while the server runs; one at a time."""
    wait_s: float = 120.0
    """How long a question waits for an answer (then it counts as declined); the request waits as long."""


def parse_ask(value: object, field: str, errors: list[str]) -> AskSettings | None:
    """`network.ask`: false/absent (None), true (the defaults) or {remember, questions, wait_s}."""
    if value is None or value is False:
        return None
    if value is True:
        return AskSettings()
    if not isinstance(value, Mapping) or not set(value) <= {"remember", "questions", "wait_s"}:
        errors.append(f"{field}: true, or an object with remember (session|caller), questions and wait_s")
        return None
    remember, questions, wait_s = value.get("remember", "session"), value.get("questions", 5), value.get("wait_s", 120)
    if remember not in REMEMBER:
        errors.append(f"{field}.remember: {remember!r}: session or caller")
    elif not isinstance(questions, int) or isinstance(questions, bool) or not 1 <= questions <= 100:
        errors.append(f"{field}.questions: {questions!r}: a whole number from 1 to 100")
    elif not isinstance(wait_s, int | float) or isinstance(wait_s, bool) or not 1 <= wait_s <= 600:
        errors.append(f"{field}.wait_s: {wait_s!r}: seconds, from 1 to 600")
    else:
        return AskSettings(str(remember), questions, float(wait_s))
    return None


def ask_lines(config_dir: str) -> tuple[list[str], list[str]]:
    """Squid's lines for a proxy that asks: (what defines the helper and its ACL, the access rules that put the
    question to a host the allow list does not name). The rules go around the special-address check: a host
    approved live is still refused when it resolves to this host, a private or a link-local address. The helper
    (HELPER) is one of the proxy's files, as HELPER_NAME."""
    helper = (
        f"external_acl_type sandbox_ask ttl=0 negative_ttl=0 cache=0 children-max=2 children-startup=1 "
        f"concurrency=1000 %>a %>rd %>rP /usr/bin/perl {config_dir}/{HELPER_NAME} {config_dir}/{SOCKET_NAME}"
    )
    return [helper, "acl asked external sandbox_ask"], ["http_access deny !allowed !asked"]


class HostAsker(Protocol):
    """Decides for one call's sandbox whether a host it asked for may be reached (blocks while a person is
    asked): (allowed, why when not)."""

    def decide(self, host: str, port: int) -> tuple[bool, str]: ...


class Gatekeeper:
    """The calls whose sandboxes may be asked for, by their proxy and address."""

    def __init__(self) -> None:
        self._watched: dict[tuple[str, str], HostAsker] = {}
        self._lock = threading.Lock()

    def watch(self, key: str, address: str, asker: HostAsker) -> Callable[[], None]:
        """From now until the returned function is called, the requests of the sandbox at `address` behind the
        proxy `key` are decided by `asker`."""
        with self._lock:
            self._watched[(key, address)] = asker

        def unwatch() -> None:
            with self._lock:
                if self._watched.get((key, address)) is asker:
                    del self._watched[(key, address)]

        return unwatch

    def decide(self, key: str, client: str, host: str, port: int) -> tuple[bool, str]:
        with self._lock:
            asker = self._watched.get((key, client))
        if asker is None:
            return False, "no call of this sandbox is running to ask for it (services are never asked for)"
        return asker.decide(host, port)


class AskChannel:
    """The Unix socket one proxy's helpers connect to; each line is decided in a thread of its own, so a question
    waiting for a person holds no other request."""

    def __init__(self, folder: str, key: str, gatekeeper: Gatekeeper) -> None:
        self.key, self.gatekeeper = key, gatekeeper
        self.path = os.path.join(folder, SOCKET_NAME)
        self._server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._server.bind(self.path)
        os.chmod(self.path, 0o666)  # the proxy's user connects; only the proxy's container sees the folder
        self._server.listen(8)
        self._closed = False
        self._connections: set[socket.socket] = set()
        threading.Thread(target=self._accept, name="sandbox-ask-accept", daemon=True).start()

    def close(self) -> None:
        """Stop listening and end the helpers' connections (their requests are refused: the helper fails closed)."""
        self._closed = True
        for connection in (self._server, *list(self._connections)):
            with contextlib.suppress(OSError):
                connection.shutdown(socket.SHUT_RDWR)
            connection.close()

    def _accept(self) -> None:
        while not self._closed:
            try:
                connection, _ = self._server.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(connection,), name="sandbox-ask-helper", daemon=True).start()

    def _serve(self, connection: socket.socket) -> None:
        sending = threading.Lock()
        self._connections.add(connection)
        try:
            with connection, connection.makefile("rb") as lines:
                for raw in lines:
                    line = raw.decode(errors="replace").strip()
                    threading.Thread(target=self._answer, args=(connection, sending, line), daemon=True).start()
        except OSError:
            return
        finally:
            self._connections.discard(connection)

    def _answer(self, connection: socket.socket, sending: threading.Lock, line: str) -> None:
        found = LINE.match(line)
        if found is None:
            channel = line.split(" ", 1)[0]
            allowed, why = False, "the proxy's question could not be read"
        else:
            channel, client, host, port = found.groups()
            try:
                allowed, why = self.gatekeeper.decide(self.key, client, host.lower(), int(port))
            except Exception as exc:  # a question that failed is a refusal, never a helper left waiting
                log.warning("network.ask: deciding %s:%s failed: %r", host, port, exc)
                allowed, why = False, "the server could not ask"
        reply = f"{channel} OK\n" if allowed else f'{channel} ERR message="{_quoted(why)}"\n'
        with sending, contextlib.suppress(OSError):
            connection.sendall(reply.encode())


def _quoted(text: str) -> str:
    """Text as a quoted value of Squid's helper reply (its quotes and backslashes escaped, one line)."""
    return text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", " ")
