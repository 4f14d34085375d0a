"""Offline batch inference, shaped like vLLM's `LLM` class."""
from __future__ import annotations

import numbers
from collections.abc import Sequence

from tqdm.auto import tqdm

from tierlm.config import EngineConfig
from tierlm.engine.engine import LLMEngine
from tierlm.engine.outputs import CompletionOutput, RequestOutput
from tierlm.sampling_params import SamplingParams


def is_token_ids(prompts: object) -> bool:
    """Whether `prompts` is one prompt's token ids (a non-empty list of integers), not a list of prompts."""
    return (isinstance(prompts, list) and bool(prompts)
            and all(isinstance(t, numbers.Integral) and not isinstance(t, bool) for t in prompts))


class LLM:
    """`LLM(model=DIR).generate(prompts, params)` runs everything to completion in this thread."""

    def __init__(self, model: str | None = None, **kwargs) -> None:
        self.engine = LLMEngine(EngineConfig(model=model, **kwargs))
        self._counter = 0

    def close(self) -> None:
        """Release the KV tiers (see `LLMEngine.close`); also on leaving a `with LLM(...)` block."""
        self.engine.close()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def generate(self, prompts: str | dict | Sequence[str | dict | list[int]],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = False, priority: Sequence[int] | None = None) -> list[RequestOutput]:
        if isinstance(prompts, (str, dict)) or is_token_ids(prompts):  # one prompt (a flat list of ids, as in vLLM)
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params = [sampling_params or SamplingParams()] * len(prompts)
        else:
            params = list(sampling_params)
            if len(params) != len(prompts):
                raise ValueError(f"got {len(prompts)} prompts but {len(params)} sampling params; pass one or one per prompt")
        if priority is not None and len(priority) != len(prompts):
            raise ValueError(f"got {len(prompts)} prompts but {len(priority)} priorities; pass one per prompt")
        # Validate every request before queueing any, so a bad one changes nothing.
        reqs = []
        for i, (p, sp) in enumerate(zip(prompts, params)):
            self._counter += 1
            reqs.append(self.engine.make_request(p, sp, f"llm-{self._counter}",
                                                 priority=priority[i] if priority else 0))
        for r in reqs:
            self.engine.add(r)
        order = {r.request_id: i for i, r in enumerate(reqs)}
        results: list[RequestOutput | None] = [None] * len(reqs)
        tokens: dict[str, list[int]] = {r.request_id: [] for r in reqs}
        logprobs: dict[str, list] = {r.request_id: [] for r in reqs}
        bar = tqdm(total=len(reqs), desc="generating", disable=not use_tqdm)
        try:
            self._run(reqs, order, results, tokens, logprobs, bar)
        except BaseException:
            # A failed step (or Ctrl-C) must not leave these requests queued, holding KV blocks and
            # failing every later call: abort what is still unfinished, then re-raise.
            for r in reqs:
                if not r.is_finished:
                    self.engine.abort(r.request_id)
            raise
        finally:
            bar.close()
        return results  # type: ignore[return-value]

    def _run(self, reqs, order, results, tokens, logprobs, bar) -> None:
        while self.engine.has_unfinished():
            for d in self.engine.step():
                if d.request_id not in order:
                    continue
                tokens[d.request_id].extend(d.token_ids)
                if d.logprobs:
                    logprobs[d.request_id].extend(d.logprobs)
                if d.finished:
                    r = reqs[order[d.request_id]]
                    lps = logprobs[d.request_id] if r.params.logprobs is not None else None
                    out = CompletionOutput(0, r.final_text, tokens[d.request_id], d.finish_reason, d.stop_reason,
                                           lps, cumulative_logprob=None if lps is None else sum(lp.logprob for lp in lps))
                    results[order[d.request_id]] = RequestOutput(r.request_id, r.prompt, r.prompt_token_ids, [out],
                                                                 num_cached_tokens=d.num_cached_tokens)
                    bar.update(1)

    def chat(self, messages: list[dict] | list[list[dict]], sampling_params: SamplingParams | None = None,
             tools: list[dict] | None = None, use_tqdm: bool = False) -> list[RequestOutput]:
        convs = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [{"prompt_token_ids": self.engine.apply_chat_template(c, tools)} for c in convs]
        return self.generate(prompts, sampling_params, use_tqdm)
