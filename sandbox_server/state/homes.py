"""Homes: where the node-bound things of replicas live, so that every replica can find them.

A workspace kept mounted on a replica (`serve --state … --workspaces mounted`) lives on that replica, its
**home**: its image is there, its services run there beside its calls, and the database keeps the archive of its
last call for when that replica is gone. A service lives where its workspace does. Each replica says in its
heartbeat row where its peers reach it (`address`); a replica given a request for a workspace or a service homed
on another live replica forwards it there (protocol/forwarding.py). A home whose replica stopped saying it is
alive is taken over by the next replica that is asked for the workspace: it continues from the last saved archive,
and the services that ran on the lost replica are gone.
"""

from __future__ import annotations

from dataclasses import dataclass

from sandbox_server.state.database import BEAT_S, REPLICA_LOST_S, Database

__all__ = ["Claim", "Home", "Homes"]


@dataclass(frozen=True, slots=True)
class Home:
    """A live replica other than this one, where something asked for lives."""

    replica: str
    address: str


@dataclass(frozen=True, slots=True)
class Claim:
    """What making this replica a workspace's home found."""

    home: str | None
    """The replica that is its home now (this one when the claim took)."""
    lost: str | None = None
    """The replica it was taken over from, which had stopped answering (None: it had no home, or this one)."""
    gone: tuple[str, ...] = ()
    """The services that ran on that replica, gone with it."""
    named: str | None = None
    """The `--name` of the replica that is its home, when another one is and it has a name."""
    silent_s: float = 0.0
    """How long ago that home last said it was alive (it is taken for lost past REPLICA_LOST_S)."""

    @property
    def answering(self) -> bool:
        """Whether that home has said it is alive within its last two beats (else it is on its way to lost)."""
        return self.silent_s <= 2 * BEAT_S

    @property
    def shown(self) -> str:
        """The home as its operator knows it: its name and owner, or its owner alone."""
        return f"{self.named} ({self.home})" if self.named else str(self.home)


_LIVE = "r.beat_at > now() - make_interval(secs => %(lost_s)s)"
_CLAIM = f"""
WITH old AS (SELECT w.id, w.home, (w.home IS NULL OR w.home = %(me)s OR NOT EXISTS (
                 SELECT 1 FROM replicas r WHERE r.owner = w.home AND {_LIVE})) AS free
             FROM workspaces w WHERE w.id = %(id)s FOR UPDATE),
     took AS (UPDATE workspaces w SET home = %(me)s FROM old WHERE w.id = old.id AND old.free RETURNING w.id)
SELECT old.home, old.free, r.name, extract(epoch FROM now() - r.beat_at)
FROM old LEFT JOIN replicas r ON r.owner = old.home
"""
_HOME_OF = f"""
SELECT DISTINCT w.home, r.address FROM workspaces w JOIN replicas r ON r.owner = w.home
WHERE (w.id = %(key)s OR w.record->>'name' = %(key)s) AND w.home <> %(me)s AND r.address IS NOT NULL AND {_LIVE}
"""
_SERVICE_HOME = f"""
SELECT s.replica, r.address FROM services s JOIN replicas r ON r.owner = s.replica
WHERE s.id = %(key)s AND s.replica <> %(me)s AND r.address IS NOT NULL AND {_LIVE}
"""


class Homes:
    """This replica's view of where things live among replicas."""

    def __init__(self, database: Database) -> None:
        self.database = database
        self.me = database.owner

    def _params(self, **more: object) -> dict[str, object]:
        return {"me": self.me, "lost_s": REPLICA_LOST_S, **more}

    def claim(self, workspace_id: str) -> Claim:
        """Make this replica the workspace's home, unless another live replica is: what was found. A home taken
        over from a lost replica drops the services that ran there (named in `gone`)."""
        with self.database.connection() as connection, connection.transaction():
            row = connection.execute(_CLAIM, self._params(id=workspace_id)).fetchone()
            if row is None:
                return Claim(home=None)
            home, free, name, silent = row
            if not free:
                return Claim(home=home, named=name, silent_s=float(silent or 0.0))
            gone = connection.execute(
                "DELETE FROM services WHERE workspace_id = %s AND replica <> %s RETURNING name",
                (workspace_id, self.me),
            ).fetchall()
        lost = (f"{name} ({home})" if name else home) if home not in (None, self.me) else None
        return Claim(home=self.me, lost=lost, gone=tuple(sorted(name for (name,) in gone)))

    def of_workspace(self, key: str) -> Home | None:
        """The live replica other than this one where a workspace (by its id or a name) lives; None when it lives
        here, nowhere yet, on a lost replica, or where one name of several callers' leads to more than one."""
        rows = self.database.run(_HOME_OF, self._params(key=key))
        return Home(*rows[0]) if len(rows) == 1 else None

    def of_service(self, service_id: str) -> Home | None:
        """The live replica other than this one where a service runs (None: here, or nowhere known)."""
        rows = self.database.run(_SERVICE_HOME, self._params(key=service_id))
        return Home(*rows[0]) if rows else None

    def stopping(self, replica: str) -> bool:
        """Whether a replica drains (it lets go of its workspaces as it stops) or has stopped (its row is gone)."""
        rows = self.database.run("SELECT draining FROM replicas WHERE owner = %s", (replica,))
        return not rows or bool(rows[0][0])

    def add_service(self, service_id: str, workspace_id: str, name: str, caller: str) -> None:
        self.database.run(
            "INSERT INTO services (id, workspace_id, replica, name, caller) VALUES (%s, %s, %s, %s, %s) "
            "ON CONFLICT (id) DO NOTHING",
            (service_id, workspace_id, self.me, name, caller),
        )

    def drop_service(self, service_id: str) -> None:
        self.database.run("DELETE FROM services WHERE id = %s AND replica = %s", (service_id, self.me))

    def let_go(self, workspace_id: str | None = None) -> None:
        """This replica is no longer the home of a workspace (None: of any; its services' rows go with them)."""
        if workspace_id is None:
            self.database.run("UPDATE workspaces SET home = NULL WHERE home = %s", (self.me,))
            self.database.run("DELETE FROM services WHERE replica = %s", (self.me,))
        else:
            self.database.run("UPDATE workspaces SET home = NULL WHERE id = %s AND home = %s", (workspace_id, self.me))
