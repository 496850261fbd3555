"""Over stdio, every message the SDK cannot read is answered, as JSON-RPC asks, rather than dropped.

The SDK's stdio transport hands a line it cannot read to the server as an exception, which the server logs and
forgets: a client that sent malformed JSON, nesting past the parser's depth, a batch (MCP has none) or anything
that is not a JSON-RPC message waited for ever. Here each such line is answered with the error the JSON-RPC
specification gives (-32700 parse error, -32600 invalid request, with a null id, as the id could not be read),
and the server goes on reading. Every line is read by the SDK's own parser, which bounds its depth, so a deep or
large message costs one failed parse; a batch is refused whole, however long.
"""

from __future__ import annotations

import logging
from types import TracebackType
from typing import Any, Self

import anyio
import mcp_types as types
from mcp.shared.message import SessionMessage
from pydantic import ValidationError

__all__ = ["AnsweringMalformed", "error_for"]

log = logging.getLogger("sandbox_server")


def error_for(exc: Exception) -> types.JSONRPCError:
    """The JSON-RPC error answering a line the transport could not read."""
    problems: list[dict[str, Any]] = [dict(p) for p in exc.errors()] if isinstance(exc, ValidationError) else []
    first = problems[0] if problems else {}
    if first.get("type") == "json_invalid":
        why = str(first.get("msg", "invalid JSON"))
        code, message = types.PARSE_ERROR, f"Parse error: {why}"
    elif isinstance(first.get("input"), list):
        code, message = types.INVALID_REQUEST, "Invalid Request: a JSON-RPC batch (MCP sends one message per line)"
    else:
        code, message = types.INVALID_REQUEST, "Invalid Request: not a JSON-RPC 2.0 request, notification or response"
    return types.JSONRPCError(jsonrpc="2.0", id=None, error=types.ErrorData(code=code, message=message[:300]))


class AnsweringMalformed:
    """The server's read stream: the transport's messages, with every line it could not read answered on the write
    stream and skipped."""

    def __init__(self, inner: Any, write: Any) -> None:
        self._inner, self._write = inner, write

    @property
    def last_context(self) -> Any:
        """The sender's context of the last message (the SDK reads it, when there is one)."""
        return getattr(self._inner, "last_context", None)

    async def receive(self) -> SessionMessage | Exception:
        while True:
            item: SessionMessage | Exception = await self._inner.receive()
            if not isinstance(item, Exception):
                return item
            answer = error_for(item)
            log.info("answered an unreadable message on stdio: %s", answer.error.message)
            await self._write.send(SessionMessage(answer))

    async def aclose(self) -> None:
        await self._inner.aclose()

    def __aiter__(self) -> Self:
        return self

    async def __anext__(self) -> SessionMessage | Exception:
        try:
            return await self.receive()
        except (anyio.EndOfStream, anyio.ClosedResourceError):
            raise StopAsyncIteration from None

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> bool | None:
        await self.aclose()
        return None
