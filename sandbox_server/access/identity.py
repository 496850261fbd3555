"""Who calls, never by anything the client may choose, and what that decides.

One word per idea: the *caller* is who calls, as the audit record names them; the
*limits key* is whose calls the rate and concurrency limits count together; the *tenant*
is whose kept files and workspaces a call may see. A handshake-era *session* is a
connection's own workspace, which is a different thing from any of these.
"""

from __future__ import annotations

import functools
import getpass
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from sandbox_server.access.auth import POLICY_CLAIM

__all__ = ["ANONYMOUS", "Identity", "anonymous", "local_user", "token_identity"]

ANONYMOUS = "anonymous"
"""The one caller every unauthenticated HTTP client is (only loopback is served without authentication)."""


@dataclass(frozen=True, slots=True)
class Identity:
    caller: str
    """Who calls, as the audit record names them."""
    policy: str | None
    """The policy reference their token names (None: the server's)."""
    limits_key: str
    """Whose calls the limits count together: an authenticated caller's, the local user's, or the anonymous
    caller's (never a name the client gives itself)."""
    tenant: str | None
    """Whose files and workspaces the call may see: an authenticated caller's, an anonymous HTTP session's or the
    anonymous caller's (None: over stdio, where one client is served)."""

    @property
    def holder(self) -> str:
        """Whose workspaces and tasks these are, counted against their caps: the tenant, else the limits key
        (anonymous handshake sessions keep apart, each counting its own)."""
        return self.tenant or self.limits_key


def token_identity(subject: str, claims: Mapping[str, Any]) -> Identity:
    """The identity of a checked bearer token's caller: its subject, per issuer (a `sub` is unique only per issuer)."""
    reference, issuer = claims.get(POLICY_CLAIM), claims.get("iss")
    key = subject if issuer is None else f"{subject} ({issuer})"
    return Identity(subject, str(reference) if reference is not None else None, key, key)


@functools.cache
def local_user() -> Identity:
    """Over stdio: the local user running the server, the one client it serves (looked up once: a lookup reads
    the user database, half a millisecond of the event loop on every call)."""
    caller = f"local user {getpass.getuser()}"
    return Identity(caller, None, caller, None)


def anonymous(session: str | None) -> Identity:
    """Over HTTP without tokens (loopback): one anonymous caller, whose files are its handshake session's when it
    has one, else the anonymous caller's."""
    return Identity(ANONYMOUS, None, ANONYMOUS, f"{ANONYMOUS} session {session}" if session else ANONYMOUS)
