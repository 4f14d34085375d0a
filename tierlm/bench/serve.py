"""`tierlm bench serve`: a load generator for any Anthropic- or OpenAI-compatible server.

It measures what a client sees, so the same run can be pointed at tierlm and at a peer
(vLLM, SGLang, a hosted API) and the numbers compared. Every request is streamed; per request
it records time to first token (TTFT), the gaps between streamed chunks (ITL), time per output
token after the first (TPOT) and end-to-end latency (E2EL). Token counts come from the server's
own `usage` figures, so nothing depends on having the server's tokenizer here.

Workloads:
- random prompts of `--input-len` tokens (± `--range-ratio`), sent as token ids on the OpenAI
  completions route (exact lengths) or as text made of common words (approximate lengths);
- replay of a Mooncake trace (`--trace`): each 512-token `hash_id` block becomes a block of
  `--trace-block-tokens` tokens generated from a seed of that id, so equal ids give equal
  blocks and the trace's prefix reuse is real on the server; timestamps and lengths are scaled.

Arrivals: all at once (default, optionally capped by `--max-concurrency`), Poisson or gamma
(`--burstiness` < 1 is burstier) at `--request-rate`, or the trace's own timestamps.
Writes JSON (summary + per-request records) and PNG plots (latency CDFs, throughput and
latency over time).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import logging
import math
import os
import random
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, AsyncIterator, Sequence

import httpx
import numpy as np

from tierlm.cli import in_range

PERCENTILES = (50, 90, 99)
TRACE_BLOCK = 512  # tokens per hash_id in the Mooncake traces
DEFAULT_TOKEN_RANGE = (100, 600)  # ids valid (and not special) in every tokenizer we target, the demo one included
ANTHROPIC_VERSION = "2023-06-01"
MAX_LOGPROBS = 20  # OpenAI's top_logprobs limit (tierlm's for both routes)

# Words that are one or two tokens in common BPE vocabularies; text prompts are built from them.
WORDS = (
    "the of and to in is that for it as was with be by on not he this are or his from at which but have an "
    "they you were her she there one all we their been has would when if so what no out up more said about "
    "into them some could time these two may first then do any like my now over such our man me even most "
    "made after also did many before must through back years where much your way well down should because "
    "each just those people how too little state good very make world still own see men work long get here "
    "between both life being under never day same another know while last might us great old year off come "
    "since against go came right used take three"
).split()


# ---- workload ----------------------------------------------------------------------------


@dataclass
class BenchRequest:
    """One request to send: the prompt, its intended lengths and (trace replay) its arrival time."""

    prompt: str | list[int]
    prompt_len: int
    output_len: int
    arrival: float | None = None  # seconds after the benchmark starts; None: drawn from the rate


def _token_block(key: str, n: int, token_range: tuple[int, int]) -> list[int]:
    rng = random.Random(key)
    return [rng.randrange(*token_range) for _ in range(n)]


def _word_block(key: str, n: int) -> list[str]:
    rng = random.Random(key)
    return [rng.choice(WORDS) for _ in range(n)]


def random_requests(n: int, input_len: int, output_len: int, *, range_ratio: float = 0.0, seed: int = 0,
                    prompt_format: str = "ids", token_range: tuple[int, int] = DEFAULT_TOKEN_RANGE
                    ) -> list[BenchRequest]:
    """`n` unrelated prompts (no shared prefixes) with lengths uniform in L·[1-r, 1+r]."""
    if not 0 <= range_ratio < 1:
        raise ValueError(f"--range-ratio must be in [0, 1), got {range_ratio}")
    rng = random.Random(seed)
    out = []
    for i in range(n):
        lin = max(1, round(input_len * rng.uniform(1 - range_ratio, 1 + range_ratio)))
        lout = max(1, round(output_len * rng.uniform(1 - range_ratio, 1 + range_ratio)))
        key = f"random:{seed}:{i}"
        prompt: str | list[int] = (_token_block(key, lin, token_range) if prompt_format == "ids"
                                   else " ".join(_word_block(key, lin)))
        out.append(BenchRequest(prompt, lin, lout))
    return out


@dataclass
class TraceScaling:
    """How a Mooncake trace is shrunk to fit the server: block size, time and output length."""

    block_tokens: int = 32  # tokens per hash_id block (the trace's are 512)
    time_scale: float = 1.0  # multiply arrival times (0.1 = ten times faster)
    output_scale: float = 1.0  # multiply output lengths
    max_input: int | None = None  # cap on scaled input tokens
    max_output: int | None = None  # cap on scaled output tokens


def trace_requests(path: str | Path, n: int, scaling: TraceScaling, *, start: int = 0, seed: int = 0,
                   prompt_format: str = "ids", token_range: tuple[int, int] = DEFAULT_TOKEN_RANGE
                   ) -> list[BenchRequest]:
    """Requests `start .. start+n` of a Mooncake trace, with prompts synthesised from hash_ids.

    Block i of a prompt is generated from a seed of `hash_ids[i]` alone, so two requests that
    share leading hash ids share a token prefix, exactly as in the trace.
    """
    if scaling.block_tokens < 1:
        raise ValueError("--trace-block-tokens must be >= 1")
    rows = []
    try:
        with open(path) as f:
            for i, line in enumerate(f):
                if i < start:
                    continue
                if len(rows) >= n:
                    break
                if line.strip():
                    rows.append(json.loads(line))
    except OSError as e:
        raise ValueError(f"cannot read --trace {path}: {e.strerror or e}; give a Mooncake JSONL trace file") from None
    if not rows:
        raise ValueError(f"trace {path} has no requests from line {start}; check --trace and --trace-start")
    t0 = rows[0]["timestamp"]
    out = []
    for row in rows:
        hash_ids = row.get("hash_ids") or [f"row{row['timestamp']}"]
        lin = math.ceil(row["input_length"] * scaling.block_tokens / TRACE_BLOCK)
        lin = max(1, min(lin, len(hash_ids) * scaling.block_tokens))
        if scaling.max_input:
            lin = min(lin, scaling.max_input)
        lout = max(1, round(row["output_length"] * scaling.output_scale))
        if scaling.max_output:
            lout = min(lout, scaling.max_output)
        nblocks = math.ceil(lin / scaling.block_tokens)
        if prompt_format == "ids":
            ids: list[int] = []
            for h in hash_ids[:nblocks]:
                ids += _token_block(f"trace:{seed}:{h}", scaling.block_tokens, token_range)
            prompt: str | list[int] = ids[:lin]
        else:
            words: list[str] = []
            for h in hash_ids[:nblocks]:
                words += _word_block(f"trace:{seed}:{h}", scaling.block_tokens)
            prompt = " ".join(words[:lin])
        arrival = (row["timestamp"] - t0) / 1000.0 * scaling.time_scale
        out.append(BenchRequest(prompt, lin, lout, arrival=arrival))
    return out


def arrival_times(n: int, request_rate: float, burstiness: float = 1.0, seed: int = 0) -> list[float]:
    """Send times (seconds from start): gamma-distributed gaps with mean 1/rate.

    burstiness 1 is a Poisson process; below 1 arrivals bunch up, above 1 they even out.
    An infinite rate sends everything at t=0.
    """
    if math.isinf(request_rate):
        return [0.0] * n
    if request_rate <= 0 or burstiness <= 0:
        raise ValueError("--request-rate and --burstiness must be positive")
    gaps = np.random.default_rng(seed).gamma(shape=burstiness, scale=1.0 / (request_rate * burstiness), size=n)
    gaps[0] = 0.0  # the first request goes out at once
    return np.cumsum(gaps).tolist()


# ---- one streamed request ------------------------------------------------------------------


@dataclass
class RequestResult:
    """What the client saw of one request. Times are seconds since the benchmark started."""

    ok: bool
    start: float
    prompt_len: int  # intended
    output_len: int  # asked for
    input_tokens: int = 0  # as the server counted them (falls back to prompt_len)
    output_tokens: int = 0
    cached_tokens: int = 0
    ttft: float | None = None
    e2el: float | None = None
    itl: list[float] = field(default_factory=list)
    chunk_times: list[float] = field(default_factory=list)  # arrivals of chunks that carried tokens
    error: str = ""

    @property
    def tpot(self) -> float | None:
        if self.ttft is None or self.e2el is None or self.output_tokens < 2:
            return None
        return (self.e2el - self.ttft) / (self.output_tokens - 1)

    @property
    def end(self) -> float:
        return self.start + (self.e2el or 0.0)


@dataclass
class Target:
    """The server under test and how to talk to it."""

    base_url: str
    api: str  # "openai" | "anthropic"
    model: str
    endpoint: str | None = None
    api_key: str | None = None
    ignore_eos: bool = True
    temperature: float = 0.0
    timeout: float = 600.0
    logprobs: int | None = None  # OpenAI routes: makes servers stream a chunk for every token

    @property
    def url(self) -> str:
        default = "/v1/messages" if self.api == "anthropic" else "/v1/completions"
        return self.base_url.rstrip("/") + (self.endpoint or default)

    def headers(self) -> dict[str, str]:
        h = {"content-type": "application/json"}
        if self.api == "anthropic":
            h["anthropic-version"] = ANTHROPIC_VERSION
            if self.api_key:
                h["x-api-key"] = self.api_key
        elif self.api_key:
            h["authorization"] = f"Bearer {self.api_key}"
        return h

    def body(self, req: BenchRequest) -> dict[str, Any]:
        if self.api == "anthropic":
            if not isinstance(req.prompt, str):
                raise ValueError("the Anthropic API takes text prompts; use --prompt-format text")
            return {"model": self.model, "max_tokens": req.output_len, "stream": True,
                    "temperature": self.temperature, "messages": [{"role": "user", "content": req.prompt}]}
        body: dict[str, Any] = {"model": self.model, "max_tokens": req.output_len, "stream": True,
                                "stream_options": {"include_usage": True}, "temperature": self.temperature}
        if self.ignore_eos:
            body["ignore_eos"] = True  # vLLM / SGLang / tierlm extension: fixed output lengths
        chat = (self.endpoint or "").endswith("/chat/completions")
        if chat:
            if not isinstance(req.prompt, str):
                raise ValueError("the chat completions route takes text prompts; use --prompt-format text")
            body["messages"] = [{"role": "user", "content": req.prompt}]
        else:
            body["prompt"] = req.prompt
        if self.logprobs is not None:
            body.update({"logprobs": True, "top_logprobs": self.logprobs} if chat else {"logprobs": self.logprobs})
        return body


async def _sse(response: httpx.Response) -> AsyncIterator[tuple[str | None, str]]:
    """(event name, data) pairs of a server-sent-event stream."""
    event: str | None = None
    data: list[str] = []
    async for line in response.aiter_lines():
        if not line:
            if data:
                yield event, "\n".join(data)
            event, data = None, []
        elif line.startswith("event:"):
            event = line[6:].strip()
        elif line.startswith("data:"):
            data.append(line[5:].lstrip())
    if data:
        yield event, "\n".join(data)


async def send_request(client: httpx.AsyncClient, target: Target, req: BenchRequest, t0: float) -> RequestResult:
    """Stream one request and time it; never raises (a failure is a result with ok=False)."""
    start = time.perf_counter()
    res = RequestResult(ok=False, start=start - t0, prompt_len=req.prompt_len, output_len=req.output_len)
    last: float | None = None
    first_any: float | None = None
    text_chunks = 0
    usage_in: int | None = None
    usage_out: int | None = None
    try:
        async with asyncio.timeout(target.timeout):  # the whole request: httpx's timeout is per read
            async with client.stream("POST", target.url, json=target.body(req), headers=target.headers()) as r:
                if r.status_code != 200:
                    body = (await r.aread()).decode(errors="replace")
                    res.error = f"HTTP {r.status_code}: {body[:300]}"
                    res.e2el = time.perf_counter() - start
                    return res
                async for event, data in _sse(r):
                    if data == "[DONE]":
                        break
                    now = time.perf_counter()
                    msg = json.loads(data)
                    failed = isinstance(msg, dict) and "error" in msg and msg.get("type") != "message"
                    if event == "error" or failed:
                        err = msg.get("error", msg)
                        res.error = f"stream error: {err.get('message', err) if isinstance(err, dict) else err}"
                        res.e2el = now - start
                        return res
                    kind, u_in, u_out, cached = _parse_chunk(target.api, msg)
                    if u_in is not None:
                        usage_in = u_in
                    if u_out is not None:
                        usage_out = u_out
                    if cached is not None:
                        res.cached_tokens = cached
                    if kind is None:
                        continue
                    if first_any is None:
                        first_any = now
                    if kind != "output":
                        continue
                    text_chunks += 1
                    if res.ttft is None:
                        res.ttft = now - start
                    elif last is not None:
                        res.itl.append(now - last)
                    last = now
                    res.chunk_times.append(now - t0)
        end = time.perf_counter()
    except TimeoutError:
        res.error = f"timed out after {target.timeout:g} s (--timeout)"
        res.e2el = time.perf_counter() - start
        return res
    except (httpx.HTTPError, json.JSONDecodeError, ValueError) as exc:
        res.error = f"{type(exc).__name__}: {exc}"
        res.e2el = time.perf_counter() - start
        return res
    if res.ttft is None and first_any is not None:  # the output decoded to no text at all
        res.ttft = first_any - start
    res.e2el = end - start
    res.input_tokens = usage_in if usage_in is not None else req.prompt_len
    res.output_tokens = usage_out if usage_out is not None else text_chunks
    res.ok = True
    return res


def _parse_chunk(api: str, msg: dict[str, Any]) -> tuple[str | None, int | None, int | None, int | None]:
    """(kind, input tokens, output tokens, cached tokens) of one event. kind is None for events
    without a choice/content delta, "output" when the chunk carries text or token logprobs (so
    it marks the arrival of tokens), "empty" otherwise (e.g. a bare finish_reason chunk)."""
    if api == "anthropic":
        kind = msg.get("type")
        if kind == "message_start":
            u = msg.get("message", {}).get("usage") or {}
            cached = u.get("cache_read_input_tokens") or 0
            inp = (u.get("input_tokens") or 0) + cached + (u.get("cache_creation_input_tokens") or 0)
            return None, inp, None, cached
        if kind == "content_block_delta":
            d = msg.get("delta", {})
            return "output" if (d.get("text") or d.get("partial_json")) else "empty", None, None, None
        if kind == "message_delta":
            u = msg.get("usage") or {}
            inp = None
            if u.get("input_tokens") is not None:
                inp = u["input_tokens"] + (u.get("cache_read_input_tokens") or 0) + (
                    u.get("cache_creation_input_tokens") or 0)
            return None, inp, u.get("output_tokens"), None
        return None, None, None, None
    u = msg.get("usage") or {}
    details = u.get("prompt_tokens_details") or {}
    cached = details.get("cached_tokens")
    choices = msg.get("choices") or []
    kind = None
    if choices:
        c = choices[0]
        text = c.get("text") if "text" in c else (c.get("delta") or {}).get("content")
        lp = c.get("logprobs") or {}
        has_lp = bool(lp.get("tokens") or lp.get("content")) if isinstance(lp, dict) else False
        kind = "output" if (text or has_lp) else "empty"
    return kind, u.get("prompt_tokens"), u.get("completion_tokens"), cached


# ---- the run -------------------------------------------------------------------------------


@dataclass
class SLO:
    """Service-level objective for goodput: a request is good if it meets every bound given."""

    ttft_ms: float | None = None
    tpot_ms: float | None = None
    e2el_ms: float | None = None

    @classmethod
    def parse(cls, text: str) -> "SLO":
        slo = cls()
        for part in filter(None, (p.strip() for p in text.split(","))):
            key, sep, value = part.partition("=")
            if not sep or key.strip() not in ("ttft_ms", "tpot_ms", "e2el_ms"):
                raise ValueError(f"--slo expects ttft_ms=…,tpot_ms=…,e2el_ms=… (any subset), got '{part}'")
            try:
                bound = float(value)
            except ValueError:
                bound = math.nan
            if not bound > 0:
                raise ValueError(f"--slo bounds are positive milliseconds, got '{part}'")
            setattr(slo, key.strip(), bound)
        return slo

    def met(self, r: RequestResult) -> bool:
        if not r.ok:
            return False
        # A bound with no value to check (TPOT of a one-token answer) counts as met.
        checks = ((self.ttft_ms, r.ttft), (self.tpot_ms, r.tpot), (self.e2el_ms, r.e2el))
        return all(value * 1000 <= bound for bound, value in checks if bound is not None and value is not None)


def latency_stats(values_s: Sequence[float]) -> dict[str, float | None]:
    """mean / std / min / max / p50 / p90 / p99 in milliseconds (None when there are no samples)."""
    keys = ["mean", "std", "min", "max"] + [f"p{p}" for p in PERCENTILES]
    if not values_s:
        return dict.fromkeys(keys)
    a = np.asarray(values_s, dtype=float) * 1000.0
    out = {"mean": float(a.mean()), "std": float(a.std()), "min": float(a.min()), "max": float(a.max())}
    for p in PERCENTILES:
        out[f"p{p}"] = float(np.percentile(a, p))
    return out


def summarize(results: Sequence[RequestResult], duration: float, slo: SLO | None = None) -> dict[str, Any]:
    """The headline figures of a run (the JSON's top level)."""
    ok = [r for r in results if r.ok]
    duration = max(duration, 1e-9)
    total_in = sum(r.input_tokens for r in ok)
    total_out = sum(r.output_tokens for r in ok)
    out: dict[str, Any] = {
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "duration_s": duration,
        "total_input_tokens": total_in,
        "total_output_tokens": total_out,
        "total_cached_tokens": sum(r.cached_tokens for r in ok),
        "request_throughput": len(ok) / duration,
        "output_token_throughput": total_out / duration,
        "total_token_throughput": (total_in + total_out) / duration,
        "ttft_ms": latency_stats([r.ttft for r in ok if r.ttft is not None]),
        "tpot_ms": latency_stats([r.tpot for r in ok if r.tpot is not None]),
        "itl_ms": latency_stats([g for r in ok for g in r.itl]),
        "e2el_ms": latency_stats([r.e2el for r in ok if r.e2el is not None]),
    }
    if slo is not None:
        good = sum(1 for r in results if slo.met(r))
        out["slo"] = asdict(slo)
        out["good_requests"] = good
        out["goodput"] = good / duration
        out["slo_attainment"] = good / len(results) if results else 0.0
    errors: dict[str, int] = {}
    for r in results:
        if not r.ok:
            errors[r.error[:120]] = errors.get(r.error[:120], 0) + 1
    if errors:
        out["errors"] = errors
    blind = sum(1 for r in ok if r.output_tokens > 1 and len(r.chunk_times) <= 1)
    if blind:  # TTFT/ITL of these are not per-token timings
        out["requests_without_streamed_tokens"] = blind
    return out


class _Progress:
    """A one-line progress display on stderr (tqdm when available and a terminal is attached)."""

    def __init__(self, total: int, enabled: bool) -> None:
        self.total, self.done, self.failed = total, 0, 0
        self.enabled = enabled
        self._bar = None
        self._t0 = time.perf_counter()
        self._last = 0.0
        if enabled and sys.stderr.isatty():
            try:
                from tqdm import tqdm
                self._bar = tqdm(total=total, desc="requests", unit="req", file=sys.stderr)
            except ImportError:
                pass

    def update(self, r: RequestResult) -> None:
        self.done += 1
        self.failed += 0 if r.ok else 1
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.update(1)
            self._bar.set_postfix(failed=self.failed)
            return
        now = time.perf_counter()
        if now - self._last >= 2.0 or self.done == self.total:
            self._last = now
            print(f"  {self.done}/{self.total} done ({self.failed} failed), {now - self._t0:.1f}s", file=sys.stderr,
                  flush=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()


def warmup_requests(like: Sequence[BenchRequest], n: int, seed: int = 0,
                    token_range: tuple[int, int] = DEFAULT_TOKEN_RANGE) -> list[BenchRequest]:
    """`n` requests shaped like the first ones of `like`, with prompts of their own, so a warm-up
    never puts the measured prompts into the server's prefix cache."""
    out = []
    for i in range(n):
        ref = like[i % len(like)]
        key = f"warmup:{seed}:{i}"
        prompt: str | list[int] = (" ".join(_word_block(key, ref.prompt_len)) if isinstance(ref.prompt, str)
                                   else _token_block(key, ref.prompt_len, token_range))
        out.append(BenchRequest(prompt, ref.prompt_len, min(ref.output_len, 8)))
    return out


async def run_benchmark(target: Target, requests: Sequence[BenchRequest], *, request_rate: float = math.inf,
                        burstiness: float = 1.0, max_concurrency: int | None = None, seed: int = 0,
                        warmups: Sequence[BenchRequest] = (), progress: bool = True
                        ) -> tuple[list[RequestResult], float]:
    """Send `warmups` one by one (not measured), then `requests` on their schedule; returns
    per-request results and the run's duration.

    Requests with an `arrival` (trace replay) keep it unless a finite `request_rate` is given.
    """
    use_trace = all(r.arrival is not None for r in requests) and math.isinf(request_rate)
    times = ([r.arrival or 0.0 for r in requests] if use_trace
             else arrival_times(len(requests), request_rate, burstiness, seed))
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    timeout = httpx.Timeout(target.timeout, connect=30.0)
    async with httpx.AsyncClient(timeout=timeout, limits=limits) as client:
        for req in warmups:
            w = await send_request(client, target, req, time.perf_counter())
            if not w.ok:
                raise RuntimeError(f"warm-up request to {target.url} failed: {w.error}")
        sem = asyncio.Semaphore(max_concurrency) if max_concurrency else None
        bar = _Progress(len(requests), progress)

        async def one(req: BenchRequest) -> RequestResult:
            if sem is None:
                r = await send_request(client, target, req, t0)
            else:
                async with sem:
                    r = await send_request(client, target, req, t0)
            bar.update(r)
            return r

        t0 = time.perf_counter()
        tasks = []
        for req, at in zip(requests, times):
            delay = t0 + at - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one(req)))
        results = list(await asyncio.gather(*tasks))
        duration = time.perf_counter() - t0
        bar.close()
    return results, duration


_WHAT_TO_DO = {
    401: "pass --api-key or set $TIERLM_API_KEY",
    403: "pass --api-key or set $TIERLM_API_KEY",
    404: "check --base-url (the server's root, without /v1), or pass --model",
}


def _error_text(r: httpx.Response) -> str:
    """The server's own error message (OpenAI and Anthropic shapes), first line, if it sent one."""
    try:
        message = r.json()["error"]["message"]
    except (ValueError, KeyError, TypeError):
        return ""
    return f" ({str(message).splitlines()[0][:200]})" if message else ""


async def discover_model(base_url: str, api_key: str | None) -> str:
    """The first model the server lists (`GET /v1/models`), for when --model is not given."""
    headers = {"anthropic-version": ANTHROPIC_VERSION}
    if api_key:
        headers.update({"authorization": f"Bearer {api_key}", "x-api-key": api_key})
    url = base_url.rstrip("/") + "/v1/models"
    async with httpx.AsyncClient(timeout=30.0) as client:
        try:
            r = await client.get(url, headers=headers)
        except httpx.TransportError as e:
            raise ValueError(f"cannot reach the server at {base_url} ({type(e).__name__}: {e}); check the URL "
                             "and that the server is running") from None
    if r.is_error:  # one line, not httpx's two-line status error
        raise ValueError(f"GET {url} answered {r.status_code} {r.reason_phrase}{_error_text(r)}; "
                         + _WHAT_TO_DO.get(r.status_code, "check the server's log, or pass --model"))
    try:
        data = r.json().get("data") or []
    except (ValueError, AttributeError):
        raise ValueError(f"GET {url} answered {r.status_code} but not with a model list; check --base-url "
                         "(the server's root), or pass --model") from None
    if not data:
        raise ValueError(f"{base_url} lists no models; pass --model")
    return data[0]["id"]


# ---- output --------------------------------------------------------------------------------


def timeline(results: Sequence[RequestResult], duration: float, bins: int = 30,
             min_width: float = 1.0) -> dict[str, list[float]]:
    """Throughput over the run in intervals of max(duration/bins, min_width) seconds, and each
    request's TTFT (at its first token) and E2E latency (at its completion), in time order."""
    width = max(duration / bins, min_width, 1e-3)
    n = max(1, math.ceil(duration / width))
    tokens = [0.0] * n
    done = [0.0] * n
    ok = [r for r in results if r.ok]
    for r in ok:
        if r.chunk_times:  # spread the request's tokens over the chunks that carried them
            share = r.output_tokens / len(r.chunk_times)
            for t in r.chunk_times:
                tokens[min(int(t / width), n - 1)] += share
        done[min(int(r.end / width), n - 1)] += 1
    ttft = sorted((r.start + r.ttft, r.ttft * 1000) for r in ok if r.ttft is not None)
    e2el = sorted((r.end, (r.e2el or 0.0) * 1000) for r in ok)
    # The last interval may be shorter than the others: rates over its own width.
    widths = [width] * (n - 1) + [max(duration - (n - 1) * width, 1e-3)]
    return {
        "t_s": [i * width + w / 2 for i, w in enumerate(widths)],
        "output_tok_per_s": [x / w for x, w in zip(tokens, widths)],
        "requests_per_s": [x / w for x, w in zip(done, widths)],
        "ttft_at_s": [t for t, _ in ttft], "ttft_ms": [v for _, v in ttft],
        "e2el_at_s": [t for t, _ in e2el], "e2el_ms": [v for _, v in e2el],
    }


def write_plots(json_path: Path, results: Sequence[RequestResult], duration: float, title: str) -> list[str]:
    from tierlm.bench.plots import cdf_plot, stacked_plot
    ok = [r for r in results if r.ok]
    if not ok:
        return []
    stem = json_path.with_suffix("")
    cdf = cdf_plot(str(stem) + "_latency_cdf.png", {
        "TTFT": [r.ttft * 1000 for r in ok if r.ttft is not None],
        "TPOT": [r.tpot * 1000 for r in ok if r.tpot is not None],
        "ITL": [g * 1000 for r in ok for g in r.itl],
        "E2E latency": [r.e2el * 1000 for r in ok if r.e2el is not None],
    }, title=f"Latency CDFs — {title}", xlabel="ms", logx=True)
    tl = timeline(results, duration)
    xs = tl["t_s"]
    over_time = stacked_plot(str(stem) + "_timeline.png", {
        "throughput": ("per second", {"output tokens/s": (xs, tl["output_tok_per_s"]),
                                      "completed requests/s": (xs, tl["requests_per_s"])}),
        "latency of each request": ("ms", {"TTFT (at first token)": (tl["ttft_at_s"], tl["ttft_ms"]),
                                           "E2E latency (at completion)": (tl["e2el_at_s"], tl["e2el_ms"])}),
    }, title=f"Over time — {title}", xlabel="seconds since start", markers=True)
    return [cdf, over_time]


def request_records(results: Sequence[RequestResult]) -> list[dict[str, Any]]:
    """Per-request figures for the JSON (enough to recompute goodput under another SLO)."""
    def ms(v: float | None) -> float | None:
        return None if v is None else round(v * 1000, 3)

    return [{"start_s": round(r.start, 4), "ok": r.ok, "input_tokens": r.input_tokens,
             "output_tokens": r.output_tokens, "cached_tokens": r.cached_tokens, "ttft_ms": ms(r.ttft),
             "tpot_ms": ms(r.tpot), "e2el_ms": ms(r.e2el), **({"error": r.error} if r.error else {})}
            for r in results]


def to_json(obj: Any) -> str:
    """Strict JSON (infinite rates become the string "inf", NaN becomes null)."""
    def clean(x: Any) -> Any:
        if isinstance(x, float) and not math.isfinite(x):
            return None if math.isnan(x) else ("inf" if x > 0 else "-inf")
        if isinstance(x, dict):
            return {k: clean(v) for k, v in x.items()}
        if isinstance(x, (list, tuple)):
            return [clean(v) for v in x]
        return x
    return json.dumps(clean(obj), indent=2, allow_nan=False)


def report_text(summary: dict[str, Any]) -> str:
    lines = [f"completed {summary['completed']}, failed {summary['failed']} in {summary['duration_s']:.1f}s",
             f"request throughput   {summary['request_throughput']:.3f} req/s",
             f"output throughput    {summary['output_token_throughput']:.1f} tok/s "
             f"(total {summary['total_token_throughput']:.1f} tok/s)"]
    if "goodput" in summary:
        lines.append(f"goodput              {summary['goodput']:.3f} req/s "
                     f"({summary['slo_attainment'] * 100:.0f}% of requests met the SLO)")
    if summary.get("requests_without_streamed_tokens"):
        lines.append(f"warning: {summary['requests_without_streamed_tokens']} requests streamed their tokens in at "
                     "most one chunk (output that decodes to no text?), so TTFT/ITL are not per-token; "
                     "try --logprobs 0")
    for key, label in (("ttft_ms", "TTFT"), ("tpot_ms", "TPOT"), ("itl_ms", "ITL"), ("e2el_ms", "E2E")):
        s = summary[key]
        if s["mean"] is None:
            lines.append(f"{label:<5} (no samples)")
        else:
            lines.append(f"{label:<5} ms  mean {s['mean']:9.1f}  p50 {s['p50']:9.1f}  p90 {s['p90']:9.1f}  "
                         f"p99 {s['p99']:9.1f}")
    return "\n".join(lines)


# ---- CLI -----------------------------------------------------------------------------------


def add_arguments(p: argparse.ArgumentParser, *, sweep: bool = False) -> None:
    """The workload and client options (shared with `bench sweep`, which picks servers and rates itself)."""
    if not sweep:
        p.add_argument("--base-url", required=True, help="server root, e.g. http://127.0.0.1:8000")
    p.add_argument("--api", choices=["openai", "anthropic"], default="openai")
    p.add_argument("--endpoint", default=None,
                   help="route (default /v1/completions for openai, /v1/messages for anthropic)")
    p.add_argument("--model", default=None, help="model name (default: the first one GET /v1/models lists)")
    p.add_argument("--api-key", default=None, help="default: $TIERLM_API_KEY, $OPENAI_API_KEY or $ANTHROPIC_API_KEY")
    p.add_argument("--num-prompts", type=int, default=100)
    p.add_argument("--input-len", type=in_range(int, 1), default=256)
    p.add_argument("--output-len", type=in_range(int, 1), default=64)
    p.add_argument("--range-ratio", type=in_range(float, 0, 1, high_open=True), default=0.0, help="lengths uniform in L·[1-r, 1+r]")
    p.add_argument("--prompt-format", choices=["auto", "ids", "text"], default="auto",
                   help="token ids (exact lengths; OpenAI completions only) or text (lengths in words: ~1.3 "
                        "tokens each with real tokenizers, ~3 with the demo model's); auto picks ids where possible")
    p.add_argument("--token-id-range", default=f"{DEFAULT_TOKEN_RANGE[0]}:{DEFAULT_TOKEN_RANGE[1]}",
                   help="LO:HI, token ids of synthetic prompts are drawn from [LO, HI)")
    if not sweep:
        p.add_argument("--request-rate", type=float, default=None,
                       help="requests/s (default: all at once, or the trace's own timestamps)")
    p.add_argument("--burstiness", type=float, default=1.0, help="gamma shape: 1 = Poisson, <1 burstier")
    p.add_argument("--max-concurrency", type=int, default=None)
    p.add_argument("--trace", default=None, help="Mooncake trace (.jsonl) to replay instead of random prompts")
    p.add_argument("--trace-start", type=in_range(int, 0), default=0, help="first trace line to replay")
    p.add_argument("--trace-block-tokens", type=in_range(int, 1), default=32, help="tokens per hash_id block (trace: 512)")
    p.add_argument("--trace-time-scale", type=in_range(float, 0, low_open=True), default=1.0, help="multiply trace timestamps")
    p.add_argument("--trace-output-scale", type=in_range(float, 0, low_open=True), default=1.0, help="multiply trace output lengths")
    p.add_argument("--trace-max-input", type=in_range(int, 1), default=None, help="cap on scaled input tokens")
    p.add_argument("--trace-max-output", type=in_range(int, 1), default=None, help="cap on scaled output tokens")
    p.add_argument("--slo", default=None, help="goodput objective, e.g. ttft_ms=2000,tpot_ms=100")
    p.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=True,
                   help="ask for exactly max_tokens (OpenAI routes; an extension vLLM and tierlm accept)")
    p.add_argument("--temperature", type=in_range(float, 0), default=0.0)
    p.add_argument("--logprobs", type=in_range(int, 0, MAX_LOGPROBS), default=None, metavar="N",
                   help="OpenAI routes: ask for logprobs so every token is streamed as a chunk, even tokens "
                        "that decode to no text (random-weight models whose vocab outruns the tokenizer); 0-20")
    p.add_argument("--num-warmups", type=in_range(int, 0), default=1 if sweep else 0,
                   help="requests sent (and not counted) before the run")
    p.add_argument("--timeout", type=in_range(float, 0, low_open=True), default=600.0,
                   help="seconds a request may take in all (a slow stream is cut off too)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", required=True, help="write the results here (plots go next to it)")
    if not sweep:
        p.add_argument("--plot", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--progress", action=argparse.BooleanOptionalAction, default=True)


def build_requests(args: argparse.Namespace) -> list[BenchRequest]:
    fmt = args.prompt_format
    if fmt == "auto":
        chat = (args.endpoint or "").endswith("/chat/completions")
        fmt = "text" if (args.api == "anthropic" or chat) else "ids"
    token_range = token_range_of(args)
    if args.trace:
        scaling = TraceScaling(args.trace_block_tokens, args.trace_time_scale, args.trace_output_scale,
                               args.trace_max_input, args.trace_max_output)
        return trace_requests(args.trace, args.num_prompts, scaling, start=args.trace_start, seed=args.seed,
                              prompt_format=fmt, token_range=token_range)
    return random_requests(args.num_prompts, args.input_len, args.output_len, range_ratio=args.range_ratio,
                           seed=args.seed, prompt_format=fmt, token_range=token_range)


def api_key_from(args: argparse.Namespace) -> str | None:
    return args.api_key or os.environ.get("TIERLM_API_KEY") or os.environ.get(
        "OPENAI_API_KEY" if args.api == "openai" else "ANTHROPIC_API_KEY")


def token_range_of(args: argparse.Namespace) -> tuple[int, int]:
    lo, sep, hi = str(args.token_id_range).partition(":")
    if not sep or int(lo) >= int(hi):
        raise ValueError(f"--token-id-range expects LO:HI with LO < HI, got '{args.token_id_range}'")
    return int(lo), int(hi)


def check_args(args: argparse.Namespace) -> None:
    """What the parser cannot see alone (options that conflict), refused before any connection:
    otherwise every request of the run failed on it, one by one."""
    chat = (args.endpoint or "").endswith("/chat/completions")
    if args.prompt_format == "ids" and (args.api == "anthropic" or chat):
        where = "--api anthropic" if args.api == "anthropic" else f"--endpoint {args.endpoint}"
        raise ValueError(f"--prompt-format ids is for the OpenAI completions route only, not {where}; "
                         "use --prompt-format text (or auto)")
    if args.logprobs is not None and args.api == "anthropic":
        raise ValueError("--logprobs applies to the OpenAI API only")


def first_failure(results: Sequence[RequestResult], url: str) -> str | None:
    """When no request completed: the first error, for the console (not only the JSON)."""
    if any(r.ok for r in results):
        return None
    return next((f"all {len(results)} requests to {url} failed; the first: {r.error}" for r in results if r.error),
                None)


async def make_target(args: argparse.Namespace, base_url: str) -> Target:
    check_args(args)
    api_key = api_key_from(args)
    model = args.model or await discover_model(base_url, api_key)
    return Target(base_url, args.api, model, endpoint=args.endpoint, api_key=api_key,
                  ignore_eos=args.ignore_eos, temperature=args.temperature, timeout=args.timeout,
                  logprobs=args.logprobs)


async def bench(args: argparse.Namespace) -> dict[str, Any]:
    """Run one benchmark as described by parsed CLI arguments; returns (and writes) the JSON."""
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one INFO line per request drowns the progress
    # Everything that can be wrong with the arguments fails here, before any connection.
    if args.num_prompts < 1:
        raise ValueError(f"--num-prompts must be at least 1, got {args.num_prompts}")
    if args.max_concurrency is not None and args.max_concurrency < 1:
        raise ValueError(f"--max-concurrency must be at least 1, got {args.max_concurrency}")
    rate = math.inf if args.request_rate is None else args.request_rate
    if not (rate > 0 and args.burstiness > 0):  # also refuses NaN
        raise ValueError(f"--request-rate and --burstiness must be positive, got {rate} and {args.burstiness}")
    from tierlm.bench.outputs import check_outputs
    check_outputs({"--json": args.json}, inputs=[args.trace] if args.trace else [])
    check_args(args)
    requests = build_requests(args)
    warmups = warmup_requests(requests, args.num_warmups, args.seed, token_range_of(args))
    slo = SLO.parse(args.slo) if args.slo else None
    target = await make_target(args, args.base_url)
    model = target.model
    arrivals = ("trace timestamps" if args.trace and args.request_rate is None
                else "all at once" if math.isinf(rate) else f"{rate} req/s, burstiness {args.burstiness}")
    if args.progress:
        print(f"bench serve: {len(requests)} requests to {target.url} (model {model}, {arrivals}"
              f"{f', max concurrency {args.max_concurrency}' if args.max_concurrency else ''})", file=sys.stderr)
    results, duration = await run_benchmark(target, requests, request_rate=rate, burstiness=args.burstiness,
                                            max_concurrency=args.max_concurrency, seed=args.seed,
                                            warmups=warmups, progress=args.progress)
    summary = summarize(results, duration, slo)
    if (failure := first_failure(results, target.url)) is not None:
        print(f"error: {failure}", file=sys.stderr)
    config = {k: v for k, v in vars(args).items() if k not in ("func", "api_key") and not callable(v)}
    config.update(model=model, url=target.url, arrivals=arrivals)
    out = {**summary, "config": config, "requests": request_records(results)}
    path = Path(args.json)
    path.parent.mkdir(parents=True, exist_ok=True)
    if args.plot:
        out["plots"] = write_plots(path, results, duration, f"{model} @ {arrivals}")
    path.write_text(to_json(out))
    return out


def _main(args: argparse.Namespace) -> int:
    try:
        out = asyncio.run(bench(args))
    except (ValueError, OSError, httpx.HTTPError, RuntimeError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(report_text(out))
    print(f"wrote {args.json}" + (f" and {', '.join(out['plots'])}" if out.get("plots") else ""))
    return 0 if out["completed"] else 1


def add_cli(sub: Any) -> None:
    p = sub.add_parser("serve", help="load-test an Anthropic/OpenAI-compatible server (TTFT, TPOT, ITL, goodput)",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(p)
    p.set_defaults(func=_main)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="python -m tierlm.bench.serve", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    sys.exit(_main(parser.parse_args()))
