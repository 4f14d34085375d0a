"""Non-streamed JSON answers, built off the event loop when they are large.

A chat completion with n = 8 choices of 800 tokens and 20 top logprobs holds ~130,000 logprob
entries: building its pydantic model, dumping and serialising it took seconds, and on the event
loop that froze every other client's stream (gaps of 5.7 s) and /health for as long.
"""
from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import TypeVar

from pydantic import BaseModel
from starlette.responses import JSONResponse

T = TypeVar("T")

OFF_LOOP_ENTRIES = 2048  # tokens (and logprob entries) past which an answer is built in a thread


async def json_answer(build: Callable[[], BaseModel], entries: int) -> JSONResponse:
    """`build()` as a JSON response; in a worker thread if it holds `entries` tokens and logprob
    entries or more (a small one costs less than the hand-off)."""
    return await off_loop(lambda: JSONResponse(build().model_dump()), entries)  # renders the body too


async def off_loop(build: Callable[[], T], entries: int) -> T:
    """`build()`, in a worker thread if its work is `entries` tokens and logprob entries or more."""
    if entries < OFF_LOOP_ENTRIES:
        return build()
    return await asyncio.to_thread(build)
