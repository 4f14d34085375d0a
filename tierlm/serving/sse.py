"""Server-sent events: frame formatting and a response that notices disconnects.

`EventStreamResponse` always listens for `http.disconnect` while streaming (Starlette's
`StreamingResponse` only does for older ASGI servers) and, whatever ends the stream —
completion, disconnect, server shutdown — runs `on_close` shielded from cancellation, so the
engine request is aborted and its KV blocks freed at once.

A client that stops reading without closing would otherwise hold its request for ever (the
engine generating, the output piling up, shutdown waiting for it): each write may wait at most
the server's `stream_send_timeout` for the client to take data, after which the request is
aborted and the connection closed.
"""
from __future__ import annotations

import json
import logging
from typing import Any, AsyncIterator, Awaitable, Callable

import anyio
from starlette.responses import StreamingResponse
from starlette.types import Message, Receive, Scope, Send

from tierlm.serving.client_waits import client_wait, waits_of

logger = logging.getLogger("tierlm.serving")

DEFAULT_STREAM_SEND_TIMEOUT = 60.0  # seconds one write to a streaming client may wait for it to read

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
        timeout = _send_timeout(scope)
        waits = waits_of(scope)
        stalled = False

        async def send_in_time(message: Message) -> None:
            nonlocal stalled
            with client_wait(waits, timeout) as deadline:  # cut short once a shutdown has aborted the rest
                await send(message)
            if deadline.cancelled_caught:
                stalled = True
                raise _SendStalled

        try:
            async with anyio.create_task_group() as group:

                async def stream_then_stop() -> None:
                    try:
                        await self.stream_response(send_in_time)
                    except _SendStalled:
                        pass
                    group.cancel_scope.cancel()

                group.start_soon(stream_then_stop)
                await _wait_for_disconnect(receive)
                group.cancel_scope.cancel()
        finally:
            with anyio.CancelScope(shield=True):
                if stalled:  # said before the abort frees the request, so the line comes first
                    _log_stall(scope, timeout, at_shutdown=waits is not None and waits.cut_short)
                await _aclose(self.body_iterator)
                if self._on_close is not None:
                    try:
                        await self._on_close()
                    except Exception:  # cleanup must never mask the original outcome
                        logger.exception("error while closing an event stream")
                if stalled:
                    await _drop_connection(scope)


def _log_stall(scope: Scope, timeout: float | None, at_shutdown: bool = False) -> None:
    request_id = scope.get("state", {}).get("request_id", "req_unknown")
    if at_shutdown:
        logger.warning("request %s: its client is not reading its stream, which cannot end with an error at "
                       "shutdown; closing the connection", request_id)
        return
    logger.warning("request %s aborted: a write to its client waited %g s for it to read (--stream-send-timeout); "
                   "closing the connection", request_id, timeout)


async def _drop_connection(scope: Scope) -> None:
    """Close a stalled client's connection now, unsent data and all (a plain close would wait
    for the client to read it, that is for ever)."""
    abort_connection = scope.get("extensions", {}).get("tierlm.abort_connection")
    if abort_connection is not None:  # else the server closes it once this returns
        abort_connection()
        await anyio.sleep(0)  # the server hears of the closed connection before this returns


class _SendStalled(Exception):
    """A write to the client did not complete within the send timeout."""


def _send_timeout(scope: Scope) -> float | None:
    app = scope.get("app")
    state = getattr(getattr(app, "state", None), "tierlm", None)
    return getattr(state, "stream_send_timeout", None) or None



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
