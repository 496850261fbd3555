"""The files calls returned (`sandbox://calls/<id>/out/…`), kept in the shared state for their tenant, so that a
resources/read that reaches another replica than the call finds them: each tenant's newest first up to its cap,
for at most an hour."""

from __future__ import annotations

from sandbox_server.state.database import Database

__all__ = ["KEEP_S", "SharedFiles"]

KEEP_S = 3600
"""How long a returned file stays readable on every replica (each replica's own copy follows its own caps)."""

Kept = tuple[str, str, bytes, "str | None"]
"""A returned file: its URI, MIME type, bytes, and the tenant it is for."""


class SharedFiles:
    """Returned files of every replica, per tenant."""

    def __init__(self, database: Database, max_bytes_per_tenant: int = 64 * 1024 * 1024) -> None:
        self.database = database
        self.max_bytes_per_tenant = max_bytes_per_tenant

    def keep(self, files: list[Kept]) -> None:
        """Keep a call's returned files; the tenant's oldest beyond its cap, and files past KEEP_S, go."""
        with self.database.connection() as connection, connection.transaction():
            for uri, mime, content, tenant in files:
                connection.execute(
                    "INSERT INTO result_files (uri, tenant, mime, content, size) VALUES (%s, %s, %s, %s, %s) "
                    "ON CONFLICT (uri) DO NOTHING",
                    (uri, tenant, mime, content, len(content)),
                )
            for tenant in {tenant for *_, tenant in files}:
                connection.execute(
                    "DELETE FROM result_files WHERE uri IN (SELECT uri FROM (SELECT uri, sum(size) OVER "
                    "(ORDER BY kept_at DESC, uri) AS held FROM result_files WHERE tenant IS NOT DISTINCT FROM %s) "
                    "newest WHERE held > %s)",
                    (tenant, self.max_bytes_per_tenant),
                )
            connection.execute("DELETE FROM result_files WHERE kept_at < now() - make_interval(secs => %s)", (KEEP_S,))

    def get(self, uri: str, tenant: str | None) -> tuple[str, bytes] | None:
        """A returned file's MIME type and bytes, when it was kept for this tenant."""
        rows = self.database.run(
            "SELECT mime, content FROM result_files WHERE uri = %s AND tenant IS NOT DISTINCT FROM %s", (uri, tenant)
        )
        return (rows[0][0], bytes(rows[0][1])) if rows else None
