"""Preview links: a signed address that opens one service for the caller who started it, once, for a while.

A link is made when an answer describes a service and checked when a browser first opens it
(`protocol/preview.py` serves what it opens). A server that serves no previews, or serves them where no person
can open a link, gives none and says why (`why_not`), so a caller learns what to change.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import time
from urllib.parse import urlencode

from sandbox_server.services.service import Service

__all__ = ["LINK_TTL_S", "PREVIEW_PREFIX", "PreviewLinks"]

PREVIEW_PREFIX = "/preview"
LINK_TTL_S = 600.0
"""A preview link is good for this long, and once."""


class PreviewLinks:
    """The links one server gives to its services' previews, and the ones already used."""

    def __init__(self, base_url: str | None = None, why_not: str = "") -> None:
        self.base_url = base_url.rstrip("/") if base_url is not None else None
        """Where previews are served (None: nowhere)."""
        self.why_not = why_not
        """Why no link is given, and what to do ("" when links are given, or when previews are off by design)."""
        self._key = secrets.token_bytes(32)
        self._used: dict[str, float] = {}
        """Links already used -> their expiry (then forgotten)."""

    @property
    def given(self) -> bool:
        return self.base_url is not None and not self.why_not

    def link(self, service: Service) -> str | None:
        """A signed link that opens a service in its caller's browser (None when the server gives none, or the
        service's policy allows no preview)."""
        if not self.given or not service.settings.preview:
            return None
        expires, nonce = int(time.time() + LINK_TTL_S), secrets.token_hex(8)  # each link its own: each opens once
        grant = f"{expires}.{nonce}.{self._signature(service.id, service.caller, expires, nonce)}"
        return f"{self.base_url}{PREVIEW_PREFIX}/{service.id}/?{urlencode({'grant': grant})}"

    def redeem(self, service: Service, grant: str) -> bool:
        """Whether a link's grant opens this service now; a grant that does is used up."""
        expires_text, _, rest = grant.partition(".")
        nonce, _, signature = rest.partition(".")
        now = time.time()
        self._used = {used: until for used, until in self._used.items() if until > now}
        valid = expires_text.isdigit() and int(expires_text) > now and signature not in self._used
        readable = expires_text.isdigit() and nonce.isalnum()
        expected = self._signature(service.id, service.caller, int(expires_text), nonce) if readable else ""
        if not valid or not hmac.compare_digest(signature, expected):
            return False
        self._used[signature] = float(expires_text)
        return True

    def _signature(self, service_id: str, caller: str, expires: int, nonce: str) -> str:
        message = f"{service_id}|{caller}|{expires}|{nonce}".encode()
        return hmac.new(self._key, message, hashlib.sha256).hexdigest()[:32]
