"""`GET /metrics` beside /mcp: the server's metrics in Prometheus' text format, for a scraper holding the metrics
token (its own, not a caller's: `serve --metrics-token-file`). Without that option there is no such route."""

from __future__ import annotations

import hmac

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.requests import Request
from starlette.responses import PlainTextResponse, Response
from starlette.routing import Route

from sandbox_server.calls.metrics import Metrics

__all__ = ["metrics_route"]


def metrics_route(metrics: Metrics, token: str) -> Route:
    """The /metrics route, answering only a bearer of `token`."""
    expected = f"Bearer {token}".encode()

    async def scrape(request: Request) -> Response:
        given = request.headers.get("authorization", "").encode("utf-8", "replace")
        if not hmac.compare_digest(given, expected):
            return PlainTextResponse(
                "the metrics need the metrics token (serve --metrics-token-file), as a bearer token\n",
                status_code=401,
                headers={"WWW-Authenticate": 'Bearer realm="metrics"', "Cache-Control": "no-store"},
            )
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    return Route("/metrics", scrape, methods=["GET"])
