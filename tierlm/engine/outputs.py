"""What the engine hands back: streaming deltas and final per-request outputs."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class TokenLogprob:
    """The sampled token's log-probability and the top-N alternatives at that position."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)
    rank: int = 1  # the sampled token's place in the distribution (1 = most likely), as vLLM reports it
    # Where the token's text begins in the output text (characters), as the detokenizer read it:
    # so which tokens lie in a text cut at a stop string, or hold its U+FFFDs, is exact. A token
    # that adds no text (a skipped special token, EOS) begins where the next text will.
    text_start: int = 0


@dataclass
class StreamDelta:
    """New output of one request since the previous delta (what `AsyncEngine.generate` yields).

    `text` never holds a partial UTF-8 character and never holds (part of) a matched stop
    string. Counters are cumulative so the last delta carries the usage figures.
    """

    request_id: str
    text: str
    token_ids: list[int]
    finished: bool = False
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error" (stop_reason: why)
    stop_reason: str | int | None = None  # matched stop string, or stop token id; None for EOS
    logprobs: list[TokenLogprob] | None = None
    # With params.prompt_logprobs, on the delta that brings the first token: one entry per prompt
    # token, None for the first (nothing precedes it), as vLLM's RequestOutput.prompt_logprobs.
    prompt_logprobs: list[TokenLogprob | None] | None = None
    # A pooling request's embedding (on its only delta, which finishes it): see PoolingParams.
    embedding: list[float] | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    num_output_tokens: int = 0
    # Engine timestamps (time.monotonic() seconds) for queue / prefill / decode telemetry.
    arrival_time: float | None = None
    first_scheduled_time: float | None = None
    first_token_time: float | None = None


@dataclass
class CompletionOutput:
    """One generated sequence (vLLM-compatible field names)."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None
    stop_reason: str | int | None = None
    logprobs: list[TokenLogprob] | None = None
    # The sum of the sampled tokens' logprobs when logprobs were asked for, else None (as vLLM's).
    cumulative_logprob: float | None = None


@dataclass
class RequestOutput:
    """A finished request as `LLM.generate` returns it."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = True
    num_cached_tokens: int = 0
    # With params.prompt_logprobs: one entry per prompt token, None for the first (vLLM's field;
    # each entry a TokenLogprob where vLLM has a dict of token id to Logprob).
    prompt_logprobs: list[TokenLogprob | None] | None = None


@dataclass
class EmbeddingOutput:
    embedding: list[float]


@dataclass
class EmbeddingRequestOutput:
    """A prompt's embedding as `LLM.embed` returns it (vLLM's field names)."""

    request_id: str
    prompt_token_ids: list[int]
    outputs: EmbeddingOutput
    finished: bool = True
    num_cached_tokens: int = 0
