"""What replicas know, count and ask together: the callers and their tokens' hashes, (`serve --state postgresql://…`); a caller's calls of the last minute
and calls running now, across every replica, and the approval questions of the 2026-07-28 era, which any replica
may receive the answer to (each good for one answer, wherever it arrives), and the hosts people approved or
declined live (network.ask)."""

from __future__ import annotations

import contextlib
import functools
import logging
import math
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import anyio

from sandbox_server.access.approval import lapses_at, new_question
from sandbox_server.access.tokens import Caller, TokensFile, caller_of, new_caller
from sandbox_server.errors import ConfigError, Refusal
from sandbox_server.policy import RateLimits
from sandbox_server.state.calls import SharedCall, workspace_lock
from sandbox_server.state.database import REPLICA_LOST_S, Database, StateUnavailable, lock_key
from sandbox_server.state.files import SharedFiles

__all__ = ["SharedAccess", "SharedAnswers", "SharedQuestions", "SharedRate", "SharedTokens"]


class SharedRate:
    """Calls per minute and calls running at once, per limits key, counted across replicas (on the event loop:
    one statement each)."""

    def __init__(self, database: Database) -> None:
        self.database = database

    async def admit(self, key: str, rate: RateLimits, policy_name: str, workspace: str | None = None) -> SharedCall:
        """Count one call against the key's calls of the last minute and as running on this replica, once its turn
        comes here; a Refusal when the key may make no more calls this minute, or runs as many as its policy allows
        on the live replicas together. One statement: the schema's sandbox_admit_call (its rows older than a
        minute are swept at each heartbeat), which for a call naming a `workspace` also reads its record and
        generation and takes its lock, on a connection the call then keeps until `leave` (state.calls)."""
        import psycopg

        call = SharedCall(str(uuid.uuid4()), self.database, workspace)
        try:
            row = await self._admitted(call, key, rate)
        except psycopg.errors.ForeignKeyViolation:  # forgotten by a peer while the database was away: back first
            await self._rejoin()
            try:
                row = await self._admitted(call, key, rate)
            except psycopg.errors.ForeignKeyViolation as exc:
                raise StateUnavailable(self.database.where, exc) from exc
        refused, amount, left_s = row[:3] if row is not None else (None, 0, None)
        if refused == "rate.calls_per_minute":
            retry = max(1, math.ceil(float(left_s or 1)))
            raise Refusal(
                f"rate limited: {rate.calls_per_minute} calls/min (policy '{policy_name}', field "
                f"rate.calls_per_minute, counted across every replica); retry in {retry} s",
                "rate.calls_per_minute",
                kind="rate_limited",
                retry_after_s=retry,
            )
        if refused is not None:
            raise Refusal(
                f"busy: {amount} calls of this caller already running on the server's replicas together "
                f"(policy '{policy_name}', field rate.concurrent_calls); retry in 1 s",
                "rate.concurrent_calls",
                kind="busy",
                retry_after_s=1,
            )
        return call

    async def _rejoin(self) -> None:
        """This replica said alive again at once, when a peer forgot it (the database was away longer than a replica
        may be silent, and the peer's heartbeat came back first): its calls are counted against its row. Its next
        heartbeat says where it is reached and whether it drains."""
        await self.database.arun(
            "INSERT INTO replicas (owner, name) VALUES (%s, %s) ON CONFLICT DO NOTHING",
            (self.database.owner, self.database.name),
        )

    async def _admitted(self, call: SharedCall, key: str, rate: RateLimits) -> tuple[Any, ...] | None:
        """The admission's row (refused, amount, seconds left, and for a call naming a workspace its record,
        generation and whether its lock was taken: then the call keeps the connection holding it)."""
        workspace = call.workspace_id
        params = (call.id, key, self.database.owner, rate.calls_per_minute, rate.concurrent_calls, REPLICA_LOST_S)
        with anyio.CancelScope(shield=True):  # a lock taken is kept by the call, which lets go of it
            async with contextlib.AsyncExitStack() as stack:
                connection = await stack.enter_async_context(self.database.aconnection())
                if workspace is None:
                    cursor = await connection.execute(_ADMIT, params)
                else:
                    cursor = await connection.execute(_ADMIT_IN, (workspace_lock(workspace), *params, workspace))
                row = await cursor.fetchone()
                if row is not None and workspace is not None:
                    call.record, call.generation = row[3], int(row[4] or 0)
                    if row[5]:
                        call.keep(connection, stack.pop_all())
        return row

    async def leave(self, call: SharedCall) -> None:
        """The call ended (a replica that dies stops counting when its heartbeat stops): let go of it and of the
        workspace lock it may still hold, in one statement."""
        await call.end()


_ADMIT = "SELECT * FROM sandbox_admit_call(%s, %s, %s, %s, %s, %s)"
_ADMIT_IN = (
    "SELECT a.refused, a.amount, a.left_s, w.record, w.generation, "
    "CASE WHEN a.refused IS NULL AND w.id IS NOT NULL THEN pg_try_advisory_lock(%s) END "
    "FROM sandbox_admit_call(%s, %s, %s, %s, %s, %s) a LEFT JOIN workspaces w ON w.id = %s"
)
"""The same for a call naming a workspace: also its record and generation, and its lock when nobody holds it
(taken only for an admitted call; a call that finds it held waits for it as any other, later)."""


class SharedQuestions:
    """Approval answers already used, in the shared state, until they lapse (the questions travel sealed in their
    requestState: see protocol.asking.Questions), so an answer is used once whichever replica it reaches."""

    def __init__(self, database: Database) -> None:
        self.database = database

    def ask(self, caller: str, lapse_s: float) -> str:
        """A new question's id: nothing is stored until it is answered."""
        return new_question(lapse_s)

    def take(self, caller: str, question_id: str) -> bool:
        """Whether the question may be answered now (not lapsed, not answered on any replica): used up now."""
        lapses = lapses_at(question_id)
        if lapses is None or lapses <= time.time():
            return False
        with self.database.connection() as connection, connection.transaction():
            connection.execute("DELETE FROM questions WHERE lapses_at <= now()")
            taken = connection.execute(
                "INSERT INTO questions (id, caller, lapses_at) VALUES (%s, %s, to_timestamp(%s)) "
                "ON CONFLICT (id) DO NOTHING RETURNING 1",
                (question_id, caller, lapses),
            ).fetchall()
        return bool(taken)


class SharedAnswers:
    """One session's or caller's answers to network.ask questions (calls.hosts.AnswerScope), in the shared state:
    a host approved or declined through one replica is decided alike by every other, and the policy's number of
    questions counts those of every replica."""

    def __init__(self, database: Database, key: str) -> None:
        self.database, self.key = database, key
        self.turn = threading.Lock()

    def known(self, target: str) -> bool | None:
        rows = self.database.run(
            "SELECT allowed FROM host_answers WHERE scope = %s AND target = %s", (self.key, target)
        )
        return bool(rows[0][0]) if rows else None

    @contextlib.contextmanager
    def asking(self) -> Iterator[None]:
        """An advisory lock on a connection of its own while the person is asked: a replica dying meanwhile lets
        go of it with its connection."""
        with self.database.dedicated() as connection:
            connection.execute("SELECT pg_advisory_lock(%s)", (lock_key(f"ask:{self.key}"),))
            yield

    def take_question(self, most: int) -> bool:
        rows = self.database.run(
            "INSERT INTO host_questions AS q (scope, asked) VALUES (%s, 1) ON CONFLICT (scope) DO UPDATE "
            "SET asked = q.asked + 1, at = now() WHERE q.asked < %s RETURNING q.asked",
            (self.key, most),
        )
        return bool(rows)

    def keep(self, target: str, allowed: bool) -> None:
        self.database.run(
            "INSERT INTO host_answers (scope, target, allowed) VALUES (%s, %s, %s) "
            "ON CONFLICT (scope, target) DO UPDATE SET allowed = EXCLUDED.allowed, at = now()",
            (self.key, target, allowed),
        )


@dataclass(frozen=True, slots=True)
class SharedAccess:
    """What a replica's protocol and calls share with the other replicas."""

    rate: SharedRate
    questions: SharedQuestions
    request_state_key: bytes
    """Seals the 2026-07-28 era's requestState, so an answer is opened by whichever replica it reaches."""
    files: SharedFiles
    """The files calls returned, readable through any replica."""
    answers: Callable[[str], SharedAnswers]
    """Each session's or caller's answers to network.ask questions, by its key."""

    @classmethod
    def of(cls, database: Database) -> SharedAccess:
        return cls(
            SharedRate(database),
            SharedQuestions(database),
            database.key("request-state"),
            SharedFiles(database),
            functools.partial(SharedAnswers, database),
        )


logger = logging.getLogger("sandbox_server")

CALLERS_FRESH_S = 1.0
"""How long a replica trusts the callers it read: a revoked token is refused everywhere within this."""


class SharedTokens:
    """The callers every replica knows (the same operations as TokensFile). A tokens file seeds them once, when
    the database has none; from then on `sandbox-server token add|list|revoke --state URL` changes them."""

    def __init__(self, database: Database, seed: TokensFile | None = None) -> None:
        self.database = database
        self._lock = threading.Lock()
        self._read_at = -math.inf
        self._callers: list[Caller] = []
        if seed is not None:
            with database.connection() as connection, connection.transaction():
                connection.execute("LOCK TABLE callers IN EXCLUSIVE MODE")
                row = connection.execute("SELECT count(*) FROM callers").fetchone()
                if row is not None and row[0] == 0:
                    for caller in seed.callers():
                        connection.execute(
                            "INSERT INTO callers (name, policy, sha256, created) VALUES (%s, %s, %s, %s)",
                            (caller.name, caller.policy, caller.sha256, caller.created),
                        )

    def callers(self) -> list[Caller]:
        """The callers in force: read again when older than CALLERS_FRESH_S; while the database does not answer,
        the last read stay in force (as a tokens file with an error keeps the previous one), so requests that
        need no database go on."""
        with self._lock:
            if time.monotonic() - self._read_at > CALLERS_FRESH_S:
                try:
                    rows = self.database.run("SELECT name, policy, sha256, created FROM callers ORDER BY name")
                except StateUnavailable as exc:
                    if self._read_at == -math.inf:
                        raise
                    logger.warning("%s; the callers read last stay in force", exc)
                    self._read_at = time.monotonic()  # asked again after CALLERS_FRESH_S, not at every request
                else:
                    self._callers, self._read_at = [Caller(*row) for row in rows], time.monotonic()
            return list(self._callers)

    def find(self, token: str) -> Caller | None:
        return caller_of(self.callers(), token)

    def add(self, name: str, policy: str, check_policy: Callable[[str], str | None]) -> str:
        """A new caller's token (shown once; only its hash is kept)."""
        caller, token = new_caller(name, policy, check_policy)
        added = self.database.run(
            "INSERT INTO callers (name, policy, sha256, created) VALUES (%s, %s, %s, %s) "
            "ON CONFLICT (name) DO NOTHING RETURNING 1",
            (caller.name, caller.policy, caller.sha256, caller.created),
        )
        if not added:
            raise ConfigError(f"a caller named {name!r} exists; `token revoke {name}` first to replace its token")
        return token

    def revoke(self, name: str) -> None:
        """Remove a caller: every replica refuses its token within CALLERS_FRESH_S."""
        if not self.database.run("DELETE FROM callers WHERE name = %s RETURNING 1", (name,)):
            raise ConfigError(f"no caller named {name!r} in the shared state (`token list` names them)")
