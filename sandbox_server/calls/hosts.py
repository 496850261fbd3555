"""Hosts a person approved live for a session or a caller (a policy's `network.ask`), and one call's asker.

A call whose policy asks gets a CallAsker: the proxy's helper finds it by its sandbox's address and it decides
each request to a host the allow list does not name. An answer, once given, holds for the rest of the session
(or the caller's calls, as the policy says): the next request to that host is decided at once, and a declined or
unanswered host is not asked again. Questions are asked one at a time per session (or caller), at most the
policy's number while the server runs; the person is asked through the protocol layer's `Question`. Replicas
(`serve --state`) keep the answers and the questions asked in the shared state instead, so that every replica
decides alike and the number counts the questions of all of them.
"""

from __future__ import annotations

import contextlib
import threading
from collections import OrderedDict
from collections.abc import Callable, Coroutine
from contextlib import AbstractContextManager
from typing import Any, Protocol

import anyio.from_thread
import anyio.lowlevel

from sandbox_server.network.asking import AskSettings, Gatekeeper

__all__ = ["AnswerScope", "CallAsker", "Grants", "LocalScope", "Question"]

Question = Callable[[str, float], Coroutine[Any, Any, str]]
"""Puts a question to the person (the message, how long to wait): their action (accept, decline, cancel), or
"no answer" once the wait is over."""
SCOPES_KEPT = 10_000
"""Sessions and callers whose answers are kept (the least recently asked for go first)."""


class AnswerScope(Protocol):
    """The answers of one session or caller, and its questions asked: in this process (LocalScope) or in the
    replicas' shared state."""

    turn: threading.Lock
    """Held while this process decides one of the scope's requests: one question at a time."""

    def known(self, target: str) -> bool | None:
        """The answer given for `host:port` (None: never asked)."""
        ...

    def asking(self) -> AbstractContextManager[object]:
        """Held around a question: no other process asks one for this scope meanwhile."""
        ...

    def take_question(self, most: int) -> bool:
        """Count one more question, unless `most` were asked already (False: none is left)."""
        ...

    def keep(self, target: str, allowed: bool) -> None:
        """Remember the person's answer for the rest of the session (or the caller's calls)."""
        ...


class LocalScope:
    """A scope's answers in this process (a server alone: they last while it runs)."""

    def __init__(self) -> None:
        self.answers: dict[str, bool] = {}
        self.asked = 0
        self.turn = threading.Lock()

    def known(self, target: str) -> bool | None:
        return self.answers.get(target)

    def asking(self) -> AbstractContextManager[object]:
        return contextlib.nullcontext()

    def take_question(self, most: int) -> bool:
        if self.asked >= most:
            return False
        self.asked += 1
        return True

    def keep(self, target: str, allowed: bool) -> None:
        self.answers[target] = allowed


class Grants:
    """The scopes of every session and caller this process has seen: their own answers (LocalScope), or the
    shared state's made by `shared` (replicas)."""

    def __init__(self, shared: Callable[[str], AnswerScope] | None = None) -> None:
        self._scopes: OrderedDict[str, AnswerScope] = OrderedDict()
        self._lock = threading.Lock()
        self._shared = shared

    def scope(self, key: str) -> AnswerScope:
        with self._lock:
            scope = self._scopes.get(key)
            if scope is None:
                scope = self._scopes[key] = LocalScope() if self._shared is None else self._shared(key)
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
        scope: AnswerScope,
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
        scope, remember, question = self._scope, self.settings.remember, self._question
        with scope.turn:  # one question at a time: a second host waits for the first answer
            known = scope.known(target)
            if known is None and question is not None:
                with scope.asking():  # replicas: one question at a time across them too
                    known = scope.known(target)  # answered on another replica while this one waited
                    if known is None:
                        return self._ask(question, host, port)
            if known is not None:
                self._note(host, port, "approved earlier" if known else "declined earlier")
                return known, f"it was declined earlier in this {remember}"
            self._note(host, port, "not asked", self._unable)
            return False, self._unable

    def _ask(self, question: Question, host: str, port: int) -> tuple[bool, str]:
        scope, target, remember = self._scope, f"{host}:{port}", self.settings.remember
        if not scope.take_question(self.settings.questions):
            why = f"the {self.settings.questions} questions of this {remember} are used (network.ask.questions)"
            self._note(host, port, "not asked", why)
            return False, why
        message = (
            f"The program in the sandbox wants {target}, which policy '{self.policy_name}' does not allow "
            f"(network.allow). Allow it for this {remember}?"
        )
        action: str = anyio.from_thread.run(question, message, self.settings.wait_s, token=self._token)
        allowed = action == "accept"
        scope.keep(target, allowed)
        self._note(host, port, action)
        return allowed, "the person declined" if action != "no answer" else "no answer came in time"

    def _note(self, host: str, port: int, answer: str, why: str | None = None) -> None:
        note: dict[str, Any] = {"host": host, "port": port, "answer": answer}
        if why is not None:
            note["why"] = why
        self.asked.append(note)
