"""OpenTelemetry spans of each call, exported over OTLP/HTTP when the server is told where (`serve --otlp-endpoint`,
or the standard OTEL_EXPORTER_OTLP_ENDPOINT): the call, and within it its admission, its workspace, its container
and its proxy's log. Spans carry names, ids and numbers (caller, tool, policy, outcome, usage), never arguments or
output. Without an endpoint no span is made and the library is not imported (`sandbox-server[telemetry]`)."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from opentelemetry.trace import Tracer

__all__ = ["Tracing", "otlp_tracing"]

_RECORDED = ("caller", "tool", "exposed_as", "policy", "outcome", "kind", "field", "task", "container_id", "replica")


class Tracing:
    """Spans of calls (none without a tracer)."""

    def __init__(self, tracer: Tracer | None = None) -> None:
        self.tracer = tracer

    @contextlib.contextmanager
    def span(self, name: str) -> Iterator[None]:
        """A span around a step of the current call (a child of the call's own)."""
        if self.tracer is None:
            yield
            return
        from opentelemetry.trace import Status, StatusCode

        # An exception's message can hold what a call was given (a path, a command): only its type is said.
        with self.tracer.start_as_current_span(name, record_exception=False, set_status_on_exception=False) as span:
            try:
                yield
            except BaseException as exc:
                span.set_status(Status(StatusCode.ERROR, type(exc).__name__))
                raise

    def describe(self, record: Mapping[str, Any]) -> None:
        """Name the current call's span after its audit record: who, what, how it ended, what it used."""
        if self.tracer is None:
            return
        from opentelemetry import trace

        span = trace.get_current_span()
        span.update_name(f"tools/call {record.get('tool', '?')}")
        span.set_attributes({f"sandbox.{key}": str(record[key]) for key in _RECORDED if record.get(key) is not None})
        usage = record.get("usage") or {}
        span.set_attributes({f"sandbox.usage.{key}": value for key, value in usage.items() if value is not None})


def otlp_tracing(endpoint: str | None, owner: str) -> tuple[Tracing, Callable[[], None]] | None:
    """Spans exported over OTLP/HTTP in batches to `endpoint` (the collector's base URL, or its /v1/traces), or
    where the standard environment says; None when neither names one. Also how to flush and stop at the end."""
    if not endpoint and not (
        os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT") or os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
    ):
        return None
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    if endpoint and not endpoint.rstrip("/").endswith("/v1/traces"):
        endpoint = endpoint.rstrip("/") + "/v1/traces"
    resource = Resource.create({"service.name": "sandbox-server", "service.instance.id": owner})
    provider = TracerProvider(resource=resource)
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint or None)))
    return Tracing(provider.get_tracer("sandbox_server")), provider.shutdown
