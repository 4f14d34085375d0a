"""Server-sent events: frame formatting and a response that notices disconnects.

`EventStreamResponse` always listens for `http.disconnect` while streaming (Starlette's
`StreamingResponse` only does for older ASGI servers) and, whatever ends the stream —
completion, disconnect, server shutdown — runs `on_close` shielded from cancellation, so the
engine request is aborted and its KV blocks freed at once.
"""
from __future__ import annotations

import json
import logging
from typing import Any, AsyncIterator, Awaitable, Callable

import anyio
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

logger = logging.getLogger("tierlm.serving")

SSE_HEADERS = {"cache-control": "no-cache", "x-accel-buffering": "no"}


def sse_event(event: str, data: dict[str, Any]) -> bytes:
    """An Anthropic-style frame: `event:` line + `data:` line whose type matches."""
    return f"event: {event}\ndata: {json.dumps(data, separators=(',', ':'))}\n\n".encode()


def sse_data(data: dict[str, Any] | str) -> bytes:
    """An OpenAI-style frame: `data:` line only (`[DONE]` is sent as a bare string)."""
    payload = data if isinstance(data, str) else json.dumps(data, separators=(",", ":"))
    return f"data: {payload}\n\n".encode()


class EventStreamResponse(StreamingResponse):
    media_type = "text/event-stream"

    def __init__(
        self,
        content: AsyncIterator[bytes],
        *,
        on_close: Callable[[], Awaitable[None]] | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(content, headers={**SSE_HEADERS, **(headers or {})})
        self._on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            async with anyio.create_task_group() as group:

                async def stream_then_stop() -> None:
                    await self.stream_response(send)
                    group.cancel_scope.cancel()

                group.start_soon(stream_then_stop)
                await _wait_for_disconnect(receive)
                group.cancel_scope.cancel()
        finally:
            with anyio.CancelScope(shield=True):
                await _aclose(self.body_iterator)
                if self._on_close is not None:
                    try:
                        await self._on_close()
                    except Exception:  # cleanup must never mask the original outcome
                        logger.exception("error while closing an event stream")


async def _wait_for_disconnect(receive: Receive) -> None:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


async def _aclose(iterator: Any) -> None:
    aclose = getattr(iterator, "aclose", None)
    if aclose is not None:
        try:
            await aclose()
        except Exception:
            logger.exception("error while closing an event stream body")
