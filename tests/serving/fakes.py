"""Test doubles for the serving layer: a scripted engine and a real uvicorn server in a thread.

`FakeEngine` honours the AsyncEngine contract (generate/abort/stats/chat template) with
scripted replies, so HTTP behaviour — framing, stop sequences, tool calls, disconnects, KV
accounting — is tested deterministically and fast. It uses the demo model's real tokenizer
and chat template, so prompts render exactly as with the real engine.
"""
from __future__ import annotations

import asyncio
import math
import socket
import threading
import time
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Callable

import uvicorn

from tierlm.serving.server import make_server
from tierlm.engine.outputs import StreamDelta, TokenLogprob
from tierlm.engine.tokenizer import render_chat
from tierlm.errors import EngineDeadError, InvalidRequestError, RequestTooLongError
from tierlm.sampling_params import SamplingParams

DEFAULT_REPLY = "Hello! I am a scripted reply from the fake engine, one token at a time."


@dataclass
class FakeStats:
    num_running: int
    num_waiting: int
    kv_blocks_used: int
    kv_blocks_total: int


@dataclass
class Call:
    """What the server asked the engine for (for assertions)."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    priority: int
    tenant_id: str | None
    cache_salt: str | None
    prompt_text: str = ""


class FakeEngine:
    def __init__(self, tokenizer: Any, *, model_name: str = "fake-model", max_model_len: int = 512,
                 block_size: int = 16, num_blocks: int = 1024) -> None:
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.max_model_len = max_model_len
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.eos_id = tokenizer.convert_tokens_to_ids("<|im_end|>")
        self.reset()

    def reset(self) -> None:
        self.reply: Callable[[str], str] = lambda prompt: DEFAULT_REPLY
        self.token_delay = 0.0
        self.fail_after: int | None = None  # raise EngineDeadError after this many deltas
        self.calls: list[Call] = []
        self.blocks: dict[str, int] = {}
        self.aborted: set[str] = set()
        self.cached_prefixes: set[tuple[int, ...]] = set()
        self.started = False

    # -- contract ---------------------------------------------------------------------------
    async def start(self) -> None:
        self.started = True

    async def shutdown(self) -> None:
        self.started = False
        for rid in list(self.blocks):
            await self.abort(rid)

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False)

    def apply_chat_template(self, messages: list[dict], tools: list[dict] | None = None,
                            add_generation_prompt: bool = True, continue_final_message: bool = False) -> list[int]:
        return render_chat(self.tokenizer, messages, tools, add_generation_prompt, continue_final_message)

    def stats(self) -> FakeStats:
        return FakeStats(num_running=len(self.blocks), num_waiting=0,
                         kv_blocks_used=sum(self.blocks.values()), kv_blocks_total=self.num_blocks)

    async def abort(self, request_id: str) -> None:
        if request_id in self.blocks:
            self.aborted.add(request_id)
            self.blocks.pop(request_id, None)

    async def generate(self, prompt: str | list[int], params: SamplingParams, request_id: str | None = None, *,
                       priority: int = 0, tenant_id: str | None = None,
                       cache_salt: str | None = None) -> AsyncIterator[StreamDelta]:
        ids = self.encode(prompt) if isinstance(prompt, str) else list(prompt)
        rid = request_id or f"fake-{len(self.calls)}"
        if not ids:
            raise InvalidRequestError("the prompt is empty", param="prompt")
        if any(not 0 <= t < len(self.tokenizer) for t in ids):
            raise InvalidRequestError("prompt token ids out of range", param="prompt")
        max_tokens = params.max_tokens if params.max_tokens is not None else self.max_model_len - len(ids)
        if len(ids) + max_tokens > self.max_model_len:
            raise RequestTooLongError("prompt + max_tokens exceeds max_model_len", param="max_tokens")
        prompt_text = self.tokenizer.decode(ids)
        self.calls.append(Call(rid, ids, params, priority, tenant_id, cache_salt, prompt_text))
        reply_ids = self.encode(self.reply(prompt_text))
        cached = self._cached_prefix(ids)
        self.blocks[rid] = math.ceil(len(ids) / self.block_size)
        out: list[int] = []
        shown = ""
        try:
            for n, token in enumerate(reply_ids + [self.eos_id], start=1):
                await asyncio.sleep(self.token_delay)
                if rid in self.aborted:
                    yield self._delta(rid, "", [], ids, cached, out, "abort", None)
                    return
                if self.fail_after is not None and n > self.fail_after:
                    raise EngineDeadError("the fake engine was told to fail")
                logprobs = self._logprobs(token, params)
                if token == self.eos_id:
                    yield self._delta(rid, "", [token], ids, cached, out + [token], "stop", None, logprobs)
                    return
                out.append(token)
                self.blocks[rid] = math.ceil((len(ids) + len(out)) / self.block_size)
                full = self.tokenizer.decode(out)
                for stop in params.stop or []:
                    at = full.find(stop)
                    if at >= 0:
                        yield self._delta(rid, full[len(shown):at], [token], ids, cached, out, "stop", stop, logprobs)
                        return
                if len(out) >= max_tokens:
                    yield self._delta(rid, full[len(shown):], [token], ids, cached, out, "length", None, logprobs)
                    return
                visible = full[: len(full) - _holdback(full, params.stop or [])]
                text, shown = visible[len(shown):], visible
                yield self._delta(rid, text, [token], ids, cached, out, None, None, logprobs)
        finally:
            self.blocks.pop(rid, None)
            self.aborted.discard(rid)
            self._remember(ids)

    # -- helpers ----------------------------------------------------------------------------
    def _delta(self, rid: str, text: str, tokens: list[int], prompt: list[int], cached: int, out: list[int],
               finish: str | None, stop: str | int | None, logprobs: list[TokenLogprob] | None = None) -> StreamDelta:
        return StreamDelta(request_id=rid, text=text, token_ids=tokens, finished=finish is not None,
                           finish_reason=finish, stop_reason=stop, logprobs=logprobs,
                           num_prompt_tokens=len(prompt), num_cached_tokens=cached, num_output_tokens=len(out))

    def _logprobs(self, token: int, params: SamplingParams) -> list[TokenLogprob] | None:
        if params.logprobs is None:
            return None
        top = [(token, -0.25)] + [((token + k) % len(self.tokenizer), -1.0 - k) for k in range(1, 25)]
        return [TokenLogprob(token_id=token, logprob=-0.25, top=top[: params.logprobs])]

    def _cached_prefix(self, ids: list[int]) -> int:
        """Longest block-aligned prefix seen before, never the whole prompt (as real caches)."""
        best = 0
        for n in range(self.block_size, len(ids), self.block_size):
            if tuple(ids[:n]) in self.cached_prefixes:
                best = n
        return best

    def _remember(self, ids: list[int]) -> None:
        for n in range(self.block_size, len(ids) + 1, self.block_size):
            self.cached_prefixes.add(tuple(ids[:n]))


def _holdback(text: str, stops: list[str]) -> int:
    """Characters at the end of `text` that could still become a stop string."""
    best = 0
    for stop in stops:
        for n in range(min(len(stop) - 1, len(text)), 0, -1):
            if stop.startswith(text[-n:]):
                best = max(best, n)
                break
    return best


@dataclass
class ServerThread:
    """The production server (`make_server`) on 127.0.0.1, a free port, in a background thread.

    `stop()` does what SIGTERM does (signals only reach the main thread).
    """

    app: Any
    graceful_timeout: float = 5.0
    server: uvicorn.Server = field(init=False)
    thread: threading.Thread = field(init=False)
    port: int = field(init=False)

    def __post_init__(self) -> None:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        # asyncio only sets TCP_NODELAY on sockets created with proto=IPPROTO_TCP (as uvicorn's
        # own binding does); without it every response waits ~40 ms for a delayed ACK.
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.bind(("127.0.0.1", 0))
        self.port = sock.getsockname()[1]
        self._socket = sock
        self.server = make_server(self.app, shutdown_timeout=self.graceful_timeout, log_level="warning")
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [sock]}, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout: float = 120.0) -> "ServerThread":
        self.thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if not self.thread.is_alive():
                raise RuntimeError("the test server thread died while starting; see the log above")
            if time.monotonic() > deadline:
                raise TimeoutError(f"the test server did not start within {timeout}s")
            time.sleep(0.02)
        return self

    def stop(self, timeout: float = 30.0) -> None:
        self.server.should_exit = True
        self.thread.join(timeout)
        self._socket.close()


API_KEY = "sk-tierlm-test-key"
SMALL_BODY_LIMIT = 256 * 1024


def parse_sse(raw: str) -> list[tuple[str | None, Any]]:
    """(event name, decoded data) per frame; `[DONE]` stays a string."""
    import json

    frames = []
    for block in raw.strip().split("\n\n"):
        event, data = None, None
        for line in block.split("\n"):
            if line.startswith("event: "):
                event = line[len("event: "):]
            elif line.startswith("data: "):
                payload = line[len("data: "):]
                data = payload if payload == "[DONE]" else json.loads(payload)
        frames.append((event, data))
    return frames
