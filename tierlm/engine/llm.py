"""Offline batch inference, shaped like vLLM's `LLM` class."""
from __future__ import annotations

import dataclasses
import numbers
from collections.abc import Sequence

from tqdm.auto import tqdm

from tierlm.config import EngineConfig
from tierlm.engine.engine import LLMEngine
from tierlm.engine.outputs import CompletionOutput, EmbeddingOutput, EmbeddingRequestOutput, RequestOutput
from tierlm.models.lora import LoRARequest
from tierlm.sampling_params import PoolingParams, SamplingParams, choice_seed


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
                 use_tqdm: bool = False, priority: Sequence[int] | None = None,
                 lora_request: LoRARequest | str | Sequence[LoRARequest | str | None] | None = None
                 ) -> list[RequestOutput]:
        """vLLM's `LLM.generate`. `lora_request`: the LoRA adapter to run every prompt with, or one
        per prompt (None: the base model); a LoRARequest is loaded on first use (the engine needs
        enable_lora=True), a string names a loaded adapter."""
        if isinstance(prompts, (str, dict)) or is_token_ids(prompts):  # one prompt (a flat list of ids, as in vLLM)
            prompts = [prompts]
        prompts = list(prompts)
        if lora_request is None or isinstance(lora_request, (str, LoRARequest)):
            loras = [lora_request] * len(prompts)
        else:
            loras = list(lora_request)
            if len(loras) != len(prompts):
                raise ValueError(f"got {len(prompts)} prompts but {len(loras)} LoRA requests; pass one or one per prompt")
        if isinstance(sampling_params, (dict, str, bytes)):  # (a dict's keys were taken for a list of params)
            raise TypeError(f"sampling_params must be a SamplingParams or a list of them, one per prompt (got a "
                            f"{type(sampling_params).__name__}); write SamplingParams(**your_dict)")
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params = [sampling_params or SamplingParams()] * len(prompts)
        else:
            params = list(sampling_params)
            if len(params) != len(prompts):
                raise ValueError(f"got {len(prompts)} prompts but {len(params)} sampling params; pass one or one per prompt")
        if priority is not None and len(priority) != len(prompts):
            raise ValueError(f"got {len(prompts)} prompts but {len(priority)} priorities; pass one per prompt")
        # Validate every request before queueing any, so a bad one changes nothing. A prompt with
        # n > 1 is n requests, sample i seeded with seed + i as vLLM's (the same seed n times drew
        # the same sample n times), answered as one RequestOutput. Only sample 0 scores the prompt
        # (its prompt logprobs are the output's): scored, every sample computed the whole prompt
        # and its vocabulary projection, the prefix cache serving none of it.
        reqs = []
        outputs: list[list[CompletionOutput | None]] = []
        for i, (p, sp) in enumerate(zip(prompts, params)):
            self._counter += 1
            rid = f"llm-{self._counter}"
            sp = sp.checked_copy() if isinstance(sp, SamplingParams) else sp  # (make_request refuses others)
            n = sp.n if isinstance(sp, SamplingParams) else 1
            outputs.append([None] * n)
            for j in range(n):
                child = sp if n == 1 else dataclasses.replace(
                    sp, n=1, seed=choice_seed(sp.seed, j), prompt_logprobs=sp.prompt_logprobs if j == 0 else None)
                reqs.append((i, j, rid, self.engine.make_request(p, child, rid if n == 1 else f"{rid}-{j}",
                                                                 priority=priority[i] if priority else 0,
                                                                 lora=loras[i])))
        for *_, r in reqs:
            self.engine.add(r)
        slot = {r.request_id: (i, j, rid, r) for i, j, rid, r in reqs}
        results: list[RequestOutput | None] = [None] * len(prompts)
        bar = tqdm(total=len(prompts), desc="generating", disable=not use_tqdm)
        try:
            self._run(slot, outputs, results, bar)
        except BaseException:
            # A failed step (or Ctrl-C) must not leave these requests queued, holding KV blocks and
            # failing every later call: abort what is still unfinished, then re-raise.
            for *_, r in reqs:
                if not r.is_finished:
                    self.engine.abort(r.request_id)
            raise
        finally:
            bar.close()
        return results  # type: ignore[return-value]

    def _run(self, slot, outputs, results, bar) -> None:
        tokens: dict[str, list[int]] = {rid: [] for rid in slot}
        logprobs: dict[str, list] = {rid: [] for rid in slot}
        prompt_lps: dict[str, list | None] = {}
        while self.engine.has_unfinished():
            for d in self.engine.step():
                if d.request_id not in slot:
                    continue
                tokens[d.request_id].extend(d.token_ids)
                if d.logprobs:
                    logprobs[d.request_id].extend(d.logprobs)
                if d.prompt_logprobs is not None:
                    prompt_lps[d.request_id] = d.prompt_logprobs
                if not d.finished:
                    continue
                i, j, rid, r = slot[d.request_id]
                lps = logprobs[d.request_id] if r.params.logprobs is not None else None
                outputs[i][j] = CompletionOutput(j, r.final_text, tokens[d.request_id], d.finish_reason, d.stop_reason,
                                                 lps, cumulative_logprob=None if lps is None else sum(lp.logprob for lp in lps))
                if j == 0:  # the prompt's id and its cache figures are sample 0's
                    results[i] = RequestOutput(rid, r.prompt, r.prompt_token_ids, outputs[i],
                                               num_cached_tokens=d.num_cached_tokens,
                                               prompt_logprobs=prompt_lps.get(d.request_id))
                if all(o is not None for o in outputs[i]):
                    bar.update(1)

    def embed(self, prompts: str | dict | Sequence[str | dict | list[int]],
              pooling_params: PoolingParams | None = None, use_tqdm: bool = False,
              lora_request: LoRARequest | str | None = None) -> list[EmbeddingRequestOutput]:
        """Each prompt's embedding (see PoolingParams: the last token's final hidden state,
        normalised by default), as vLLM's `LLM.embed`; one output per prompt, in order."""
        if isinstance(prompts, (str, dict)) or is_token_ids(prompts):
            prompts = [prompts]
        pooling = pooling_params or PoolingParams()
        reqs = []
        for p in prompts:  # every prompt checked before any is queued: a bad one changes nothing
            self._counter += 1
            reqs.append(self.engine.make_request(p, None, f"llm-{self._counter}", pooling=pooling, lora=lora_request))
        for r in reqs:
            self.engine.add(r)
        found: dict[str, EmbeddingRequestOutput] = {}
        bar = tqdm(total=len(reqs), desc="embedding", disable=not use_tqdm)
        try:
            while self.engine.has_unfinished():
                for d in self.engine.step():
                    if d.finished and d.embedding is not None:
                        found[d.request_id] = EmbeddingRequestOutput(d.request_id, [], EmbeddingOutput(d.embedding),
                                                                     num_cached_tokens=d.num_cached_tokens)
                        bar.update(1)
        except BaseException:
            for r in reqs:
                if not r.is_finished:
                    self.engine.abort(r.request_id)
            raise
        finally:
            bar.close()
        for r in reqs:
            found[r.request_id].prompt_token_ids = r.prompt_token_ids
        return [found[r.request_id] for r in reqs]

    def chat(self, messages: list[dict] | list[list[dict]], sampling_params: SamplingParams | None = None,
             tools: list[dict] | None = None, use_tqdm: bool = False,
             lora_request: LoRARequest | str | None = None, add_generation_prompt: bool = True,
             continue_final_message: bool = False, chat_template_kwargs: dict | None = None) -> list[RequestOutput]:
        """vLLM's `LLM.chat`: each conversation rendered by the model's chat template, then
        generated. `continue_final_message` continues the last (assistant) message instead of
        opening a new turn (so add_generation_prompt must be False, as in vLLM);
        `chat_template_kwargs` are more variables for the template (Qwen3's enable_thinking)."""
        if add_generation_prompt and continue_final_message:
            raise ValueError("continue_final_message continues the last message, add_generation_prompt opens a new "
                             "turn: pass add_generation_prompt=False with it")
        convs = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [{"prompt_token_ids": self.engine.apply_chat_template(
            c, tools, add_generation_prompt, continue_final_message, chat_template_kwargs)} for c in convs]
        return self.generate(prompts, sampling_params, use_tqdm, lora_request=lora_request)

    def get_tokenizer(self):
        """The model's tokenizer (vLLM's name for the `tokenizer` property)."""
        return self.tokenizer
