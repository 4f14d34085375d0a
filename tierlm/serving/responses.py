"""Non-streamed JSON answers, built off the event loop when they are large.

A chat completion with n = 8 choices of 800 tokens and 20 top logprobs holds ~130,000 logprob
entries: building its pydantic model, dumping and serialising it took seconds, and on the event
loop that froze every other client's stream (gaps of 5.7 s) and /health for as long.
"""
from __future__ import annotations

import asyncio
from collections.abc import Callable

from pydantic import BaseModel
from starlette.responses import JSONResponse

OFF_LOOP_ENTRIES = 2048  # tokens (and logprob entries) past which an answer is built in a thread


async def json_answer(build: Callable[[], BaseModel], entries: int) -> JSONResponse:
    """`build()` as a JSON response; in a worker thread if it holds `entries` tokens and logprob
    entries or more (a small one costs less than the hand-off)."""
    if entries < OFF_LOOP_ENTRIES:
        return JSONResponse(build().model_dump())
    return await asyncio.to_thread(lambda: JSONResponse(build().model_dump()))  # renders the body too
