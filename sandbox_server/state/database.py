"""The PostgreSQL database replicas share: a pool of connections, the migrations run at start, each replica's
heartbeat, and keys made once and read by every replica.

psycopg 3 serves both of the server's sides. The stores run in worker threads (as the file-backed ones do their
disk work there), so they use its blocking API over one pool. The statements on every call's path (counting the
call, holding its workspace, letting both go) use its asyncio API over a second pool, on the event loop itself:
a trip to a worker thread costs more than the statement.

A database that does not answer is `StateUnavailable`, a Refusal: a call that needs it is answered with an
`isError` result saying so, and the sweeps that need it log it and try again at their next turn.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import re
import secrets
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

import psycopg
import psycopg_pool

from sandbox_server.errors import Refusal, UsageError
from sandbox_server.state.schema import MIGRATIONS

__all__ = ["BEAT_S", "REPLICA_LOST_S", "Database", "StateUnavailable", "lock_key", "shown_url"]

logger = logging.getLogger("sandbox_server")

BEAT_S = 2.0
"""How often a replica says it is alive."""
REPLICA_LOST_S = 10.0
"""A replica that has not said so for this long is taken for dead: its tasks fail, its calls stop counting."""
CONNECT_TIMEOUT_S = 5
POOL_WAIT_S = 5.0
"""How long a request waits for a connection of the pool before it is answered that the state is unavailable."""
_MIGRATION_LOCK = 0x5A4E_0001


class StateUnavailable(Refusal):
    """The shared state's database does not answer (down, restarting, unreachable)."""

    def __init__(self, where: str, exc: BaseException) -> None:
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        super().__init__(
            f"busy: the server's shared state (PostgreSQL at {where}) does not answer ({reason}); nothing of this "
            "call was kept; retry in a few seconds",
            "serve --state",
            kind="busy",
            retry_after_s=5,
        )


def shown_url(url: str) -> str:
    """A database URL without its password, as logs and answers name it."""
    return re.sub(r"(://[^:/@]*):[^@]*@", r"\1:***@", url)


def lock_key(name: str) -> int:
    """A signed 64-bit advisory lock key for a name (the same on every replica)."""
    return int.from_bytes(hashlib.sha256(name.encode()).digest()[:8], "big", signed=True)


class Database:
    """One replica's connections to the shared state."""

    def __init__(
        self, url: str, owner: str, max_connections: int = 10, max_calls: int = 20, name: str | None = None
    ) -> None:
        self.url, self.owner, self.name = url, owner, name
        """`owner`: this process (host, pid, start); `name`: the replica's, the same across its restarts."""
        self.beat_s = BEAT_S
        self.where = re.sub(r"^.*@", "", shown_url(url)).split("?", 1)[0] or "the default socket"
        settings: dict[str, Any] = {
            "min_size": 1,
            "open": False,
            "timeout": POOL_WAIT_S,
            "kwargs": {"autocommit": True, "connect_timeout": CONNECT_TIMEOUT_S},
        }
        self.pool = psycopg_pool.ConnectionPool(url, max_size=max_connections, name="sandbox-state", **settings)
        self.calls = psycopg_pool.AsyncConnectionPool(url, max_size=max_calls, name="sandbox-calls", **settings)
        """The event loop's pool: a call holding an archived workspace keeps one of its connections while it runs,
        so `max_calls` bounds those calls on this replica."""
        self._calls_open = False

    def open(self, replica: bool = True, alive: Callable[[str], bool] = lambda owner: True) -> None:
        """Connect, migrate the schema to this version's, and (a replica) take its name and say it is alive
        (`alive`: whether a replica's process still runs, as far as this host can tell)."""
        try:
            self.pool.open(wait=True, timeout=POOL_WAIT_S)
        except psycopg_pool.PoolTimeout as exc:
            raise StateUnavailable(self.where, exc) from exc
        applied = self.migrate()
        if applied:
            logger.info("shared state at %s: %d migration(s) applied", self.where, applied)
        if replica:
            self._take_name(alive)
            self.beat()

    def close(self) -> None:
        """Say this replica stopped (its calls stop counting at once), and close the pool."""
        with contextlib.suppress(Refusal):
            self.run("DELETE FROM replicas WHERE owner = %s", (self.owner,))
        self.pool.close()

    @contextlib.contextmanager
    def connection(self) -> Iterator[psycopg.Connection[Any]]:
        """A connection of the pool (autocommit: wrap statements in `connection.transaction()` to group them)."""
        try:
            with self.pool.connection() as connection:
                yield connection
        except (psycopg.OperationalError, psycopg_pool.PoolTimeout) as exc:
            raise StateUnavailable(self.where, exc) from exc

    @contextlib.asynccontextmanager
    async def aconnection(self) -> AsyncIterator[psycopg.AsyncConnection[Any]]:
        """A connection of the event loop's pool (opened at its first use, on the loop it then serves)."""
        try:
            if not self._calls_open:
                await self.calls.open()
                self._calls_open = True
            async with self.calls.connection() as connection:
                yield connection
        except (psycopg.OperationalError, psycopg_pool.PoolTimeout) as exc:
            raise StateUnavailable(self.where, exc) from exc

    @contextlib.contextmanager
    def dedicated(self) -> Iterator[psycopg.Connection[Any]]:
        """A connection of its own, outside the pools, for something that waits long (a person's answer) holding
        a session's advisory lock: closing it lets go of the lock, and the pools' connections never wait for it."""
        try:
            with psycopg.connect(self.url, autocommit=True, connect_timeout=CONNECT_TIMEOUT_S) as connection:
                yield connection
        except psycopg.OperationalError as exc:
            raise StateUnavailable(self.where, exc) from exc

    async def arun(self, sql: str, params: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
        """One statement on the event loop; the rows it returns."""
        async with self.aconnection() as connection:
            cursor = await connection.execute(sql, params)
            return await cursor.fetchall() if cursor.description is not None else []

    async def aclose(self) -> None:
        """Close the event loop's pool (on that loop, before `close`)."""
        if self._calls_open:
            await self.calls.close()

    def run(self, sql: str, params: tuple[Any, ...] | dict[str, Any] = ()) -> list[tuple[Any, ...]]:
        """One statement; the rows it returns (none for a statement that returns none)."""
        with self.connection() as connection:
            cursor = connection.execute(sql, params)
            return cursor.fetchall() if cursor.description is not None else []

    def migrate(self) -> int:
        """Apply the migrations this database has not had, in order; how many were applied."""
        with self.connection() as connection, connection.transaction():
            connection.execute("SELECT pg_advisory_xact_lock(%s)", (_MIGRATION_LOCK,))
            connection.execute("CREATE TABLE IF NOT EXISTS schema_version (version integer NOT NULL)")
            row = connection.execute("SELECT max(version) FROM schema_version").fetchone()
            current = row[0] if row is not None and row[0] is not None else 0
            if current > len(MIGRATIONS):
                raise Refusal(
                    f"refused: the shared state at {self.where} is at schema version {current}, newer than this "
                    f"server's {len(MIGRATIONS)}; upgrade this replica",
                    "serve --state",
                )
            for version in range(current + 1, len(MIGRATIONS) + 1):
                connection.execute(MIGRATIONS[version - 1])
                connection.execute("INSERT INTO schema_version (version) VALUES (%s)", (version,))
        return len(MIGRATIONS) - current

    def check(self) -> None:
        """Replace the pool's idle connections a restarted database dropped (at each heartbeat, rather than a
        round trip before every use)."""
        self.pool.check()

    async def acheck(self) -> None:
        """The same for the event loop's pool."""
        if self._calls_open:
            await self.calls.check()

    def beat(self, draining: bool = False, address: str | None = None) -> bool:
        """Say this replica is alive, whether it drains, and where its peers reach it (serve --advertise): whether
        an operator asked it to drain."""
        try:
            rows = self.run(
                "INSERT INTO replicas (owner, draining, address, name) VALUES (%s, %s, %s, %s) ON CONFLICT (owner) "
                "DO UPDATE SET beat_at = now(), draining = excluded.draining, address = excluded.address "
                "RETURNING drain_asked",
                (self.owner, draining, address, self.name),
            )
        except psycopg.errors.UniqueViolation as exc:  # its row forgotten by a peer, its name then taken by another
            held, self.name = self.name, None
            raise UsageError(
                f"--name {held}: another replica took this name while this one was forgotten (the shared state was "
                "away longer than a replica may be silent); this replica goes on serving without a name"
            ) from exc
        return bool(rows and rows[0][0])

    def _take_name(self, alive: Callable[[str], bool]) -> None:
        """This replica's name, taken from a replica of that name that is gone (a restart of this one); a replica
        that still has it is refused: UsageError naming it."""
        if self.name is None:
            return
        held = self.run(
            "SELECT owner, extract(epoch FROM now() - beat_at) FROM replicas WHERE name = %s AND owner <> %s",
            (self.name, self.owner),
        )
        for holder, ago in held:
            if float(ago) <= REPLICA_LOST_S and alive(holder):
                raise UsageError(
                    f"--name {self.name}: the replica {holder} has this name and is alive (heard from "
                    f"{float(ago):.0f} s ago): give each replica a name of its own"
                )
            self.run("UPDATE replicas SET name = NULL WHERE owner = %s", (holder,))  # gone: the name is free

    def replicas(self) -> list[dict[str, Any]]:
        """Every replica that said it was alive lately: its name and owner (process), seconds since its last word,
        whether it drains or was asked to, where its peers reach it, and how many workspaces live on it."""
        rows = self.run(
            "SELECT r.name, r.owner, extract(epoch FROM now() - r.beat_at), r.draining, r.drain_asked, r.address, "
            "(SELECT count(*) FROM workspaces w WHERE w.home = r.owner) FROM replicas r ORDER BY r.name, r.owner"
        )
        return [{"name": name, "replica": owner, "beat_s_ago": round(float(ago), 1), "draining": draining,
                 "drain_asked": asked, "address": address, "workspaces_homed": homed}
                for name, owner, ago, draining, asked, address, homed in rows]  # fmt: skip

    def ask_to_drain(self, replica: str) -> bool:
        """Ask a replica, by its name or owner, to drain (it begins at its next heartbeat): whether there is one."""
        return bool(
            self.run(
                "UPDATE replicas SET drain_asked = true WHERE owner = %s OR name = %s RETURNING owner",
                (replica, replica),
            )
        )

    def alive(self, owner: str) -> bool:
        """Whether a replica said it was alive within REPLICA_LOST_S (a replica of another version included)."""
        rows = self.run(
            "SELECT 1 FROM replicas WHERE owner = %s AND beat_at > now() - make_interval(secs => %s)",
            (owner, REPLICA_LOST_S),
        )
        return bool(rows)

    def forget_lost(self) -> int:
        """Forget the replicas that stopped saying they are alive (their running calls with them), the calls
        older than a minute, questions that lapsed, and hosts answered live (network.ask) not used for a day."""
        rows = self.run(
            "DELETE FROM replicas WHERE beat_at < now() - make_interval(secs => %s) RETURNING owner",
            (REPLICA_LOST_S * 3,),
        )
        self.run("DELETE FROM rate_calls WHERE at <= now() - interval '60 s'")
        self.run("DELETE FROM questions WHERE lapses_at <= now()")
        self.run("DELETE FROM host_answers WHERE at < now() - interval '1 day'")
        self.run("DELETE FROM host_questions WHERE at < now() - interval '1 day'")
        return len(rows)

    def key(self, name: str, size: int = 32) -> bytes:
        """A secret every replica shares, made by the first that asks for it."""
        self.run(
            "INSERT INTO keys (name, secret) VALUES (%s, %s) ON CONFLICT DO NOTHING", (name, secrets.token_bytes(size))
        )
        return bytes(self.run("SELECT secret FROM keys WHERE name = %s", (name,))[0][0])

    def problem(self) -> str | None:
        """Why the database cannot serve now (None: it answers)."""
        try:
            self.run("SELECT 1")
        except Refusal as exc:
            return str(exc)
        return None
