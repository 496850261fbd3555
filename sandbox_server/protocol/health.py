"""`GET /healthz` beside /mcp: whether this replica can serve calls now, for a load balancer's health checks.

It asks the engine (a ping) and, with shared state, the database (one query), each bounded in time; 200 with
`{"engine": "ok", "state": "ok"}` when both answer, else 503 naming what does not. It says nothing about callers,
so it needs no token.
"""

from __future__ import annotations

from collections.abc import Callable

import anyio
import anyio.to_thread
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

__all__ = ["health_route"]

CHECK_S = 3.0

Check = Callable[[], str | None]
"""A part's problem, or None when it answers."""


def health_route(checks: dict[str, Check]) -> Route:
    """The /healthz route over these parts' checks (engine, state)."""

    async def health(request: Request) -> JSONResponse:
        found: dict[str, str] = {}
        for name, check in checks.items():
            problem: str | None = f"no answer within {CHECK_S:g} s"
            with anyio.move_on_after(CHECK_S):
                problem = await anyio.to_thread.run_sync(check, abandon_on_cancel=True)
            found[name] = "ok" if problem is None else problem
        healthy = all(value == "ok" for value in found.values())
        return JSONResponse(found, status_code=200 if healthy else 503, headers={"Cache-Control": "no-store"})

    return Route("/healthz", health, methods=["GET", "HEAD"])
