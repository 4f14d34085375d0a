"""A request's state inside the engine: tokens, KV blocks, progress and stop bookkeeping."""
from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

import torch

from typing import TYPE_CHECKING

from tierlm.engine.outputs import TokenLogprob
from tierlm.kv.block_pool import KVBlock
from tierlm.kv.prefix_cache import BlockHash
from tierlm.sampling_params import BadWords, PoolingParams, SamplingParams, ThinkingTracker


if TYPE_CHECKING:
    import numpy as np

    from tierlm.engine.grammar import GrammarFollower
    from tierlm.models.lora import LoRAAdapter


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    max_tokens: int
    eos_token_ids: frozenset[int]
    prompt: str | None = None
    priority: int = 0
    tenant_id: str | None = None
    # Its tenant's share of the engine within the priority (fairness.py): 2 gets twice a 1's.
    tenant_weight: float = 1.0
    # The most of the device KV pool its tenant's running requests may hold (quotas.py); None: no cap.
    kv_share: float | None = None
    # The share of the device KV pool its tenant's cached prefixes keep as a partition of their
    # own (kv/block_pool.py); None: ranked with every other tenant's.
    kv_cache_share: float | None = None
    cache_salt: str | None = None
    arrival_time: float = field(default_factory=time.monotonic)
    arrival_seq: int = 0

    status: RequestStatus = RequestStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    blocks: list[KVBlock] = field(default_factory=list)
    block_hashes: list[BlockHash] = field(default_factory=list)
    num_registered_blocks: int = 0
    num_cached_tokens: int = -1  # prompt tokens served by the prefix cache (set when first scheduled)
    num_preemptions: int = 0
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    generator: torch.Generator | None = None
    # params.allowed_token_ids as a CPU tensor, without repeats, and params.bad_words as token ids:
    # made once, when the request is made (the engine knows the vocabulary and the tokenizer).
    allowed_token_ids: torch.Tensor | None = None
    # The allowed set as a vocabulary-wide mask on the logits' device, built at its first step
    # (rebuilding it from the ids every step cost ~50 ms for 32 rows allowing 150k tokens each).
    allowed_mask: torch.Tensor | None = None
    # params.logit_bias as CPU tensors (token ids, biases), built at its first step: rebuilding
    # Python lists of up to 1,024 entries per row every step was the sampler's per-step cost.
    logit_bias_tensors: tuple[torch.Tensor, torch.Tensor] | None = None
    bad_words: BadWords | None = None
    thinking: ThinkingTracker | None = None  # params.thinking_budget, followed step by step
    grammar: "GrammarFollower | None" = None  # params.structured_outputs, followed step by step
    # Timestamps for metrics (monotonic seconds).
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    final_text: str = ""
    # params.prompt_logprobs' entries as they are computed: entry i is prompt token i + 1's (the
    # first token has none). Its length is how far the prompt has been scored, which also caps
    # the prefix a cache may serve it (kv/manager.py): a cached block's positions give no logits.
    prompt_logprobs: list[TokenLogprob] | None = None
    # Set: the request wants the prompt's embedding, not tokens (it ends when its prompt is in).
    pooling: PoolingParams | None = None
    # Set: the LoRA adapter the request runs with (its own object: removing the adapter from the
    # engine meanwhile does not take it from under the request).
    lora: "LoRAAdapter | None" = None
    # Speculative decoding (speculative.py): the guesses the scheduler gave this step (checked
    # by the model after the last real token, then cleared), and the tokens as an array for the
    # n-gram lookup, extended as tokens come.
    spec_token_ids: list[int] = field(default_factory=list)
    spec_buffer: "np.ndarray | None" = None
    spec_buffer_len: int = 0

    def __post_init__(self) -> None:
        self.all_token_ids: list[int] = list(self.prompt_token_ids)
        if self.params.prompt_logprobs is not None and self.prompt_logprobs is None:
            self.prompt_logprobs = []

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status == RequestStatus.FINISHED

    def append_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)

    def sort_key(self) -> tuple[int, float, int]:
        """Scheduling order: lower priority value first, then earlier arrival."""
        return (self.priority, self.arrival_time, self.arrival_seq)
