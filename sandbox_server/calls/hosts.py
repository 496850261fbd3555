"""Hosts a person approved live for a session or a caller (a policy's `network.ask`), and one call's asker.

A call whose policy asks gets a CallAsker: the proxy's helper finds it by its sandbox's address and it decides
each request to a host the allow list does not name. An answer, once given, holds for the rest of the session
(or the caller's calls, as the policy says): the next request to that host is decided at once, and a declined or
unanswered host is not asked again. Questions are asked one at a time per session (or caller), at most the
policy's number while the server runs; the person is asked through the protocol layer's `Question`.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Coroutine
from typing import Any

import anyio.from_thread
import anyio.lowlevel

from sandbox_server.network.asking import AskSettings, Gatekeeper

__all__ = ["CallAsker", "Grants", "Question"]

Question = Callable[[str, float], Coroutine[Any, Any, str]]
"""Puts a question to the person (the message, how long to wait): their action (accept, decline, cancel), or
"no answer" once the wait is over."""
SCOPES_KEPT = 10_000
"""Sessions and callers whose answers are kept (the least recently asked for go first)."""


class _Scope:
    def __init__(self) -> None:
        self.answers: dict[str, bool] = {}
        self.asked = 0
        self.turn = threading.Lock()
        """Held while its one question waits for the person."""


class Grants:
    """The answers of every session and caller, in this process."""

    def __init__(self) -> None:
        self._scopes: OrderedDict[str, _Scope] = OrderedDict()
        self._lock = threading.Lock()

    def scope(self, key: str) -> _Scope:
        with self._lock:
            scope = self._scopes.get(key)
            if scope is None:
                scope = self._scopes[key] = _Scope()
                while len(self._scopes) > SCOPES_KEPT:
                    self._scopes.popitem(last=False)
            self._scopes.move_to_end(key)
            return scope


class CallAsker:
    """Decides, for one call's sandbox, the requests to hosts its allow list does not name (from the proxy's
    helper threads); what was asked goes into the call's `network` record."""

    def __init__(
        self,
        settings: AskSettings,
        scope: _Scope,
        question: Question | None,
        unable: str,
        policy_name: str,
        gatekeeper: Gatekeeper,
        proxy_key: str,
    ) -> None:
        self.settings, self._scope, self._question, self._unable = settings, scope, question, unable
        self.policy_name = policy_name
        self._gatekeeper, self._proxy_key = gatekeeper, proxy_key
        self._token = anyio.lowlevel.current_token()
        self.asked: list[dict[str, Any]] = []
        """Each host decided for this call that was not on the list: its answer and how it came."""

    def watch(self, address: str) -> Callable[[], None]:
        """From now (the sandbox at `address` is about to run), its requests are decided here; what ends it."""
        return self._gatekeeper.watch(self._proxy_key, address, self)

    def decide(self, host: str, port: int) -> tuple[bool, str]:
        target = f"{host}:{port}"
        scope, remember = self._scope, self.settings.remember
        with scope.turn:  # one question at a time: a second host waits for the first answer
            known = scope.answers.get(target)
            if known is not None:
                self._note(host, port, "approved earlier" if known else "declined earlier")
                return known, f"it was declined earlier in this {remember}"
            if self._question is None:
                self._note(host, port, "not asked", self._unable)
                return False, self._unable
            if scope.asked >= self.settings.questions:
                why = f"the {self.settings.questions} questions of this {remember} are used (network.ask.questions)"
                self._note(host, port, "not asked", why)
                return False, why
            scope.asked += 1
            message = (
                f"The program in the sandbox wants {target}, which policy '{self.policy_name}' does not allow "
                f"(network.allow). Allow it for this {remember}?"
            )
            action: str = anyio.from_thread.run(self._question, message, self.settings.wait_s, token=self._token)
            allowed = action == "accept"
            scope.answers[target] = allowed
            self._note(host, port, action)
        return allowed, "the person declined" if action != "no answer" else "no answer came in time"

    def _note(self, host: str, port: int, answer: str, why: str | None = None) -> None:
        note: dict[str, Any] = {"host": host, "port": port, "answer": answer}
        if why is not None:
            note["why"] = why
        self.asked.append(note)
