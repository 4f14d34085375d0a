"""Turn last-position logits into next tokens, per request's SamplingParams.

Everything is batched over the rows of one step except the final draw, which uses each
request's own torch.Generator when it has a seed, so a seeded request is reproducible no
matter what else shares its batch.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch

from tierlm.engine.outputs import TokenLogprob
from tierlm.engine.request import Request


def apply_penalties(logits: torch.Tensor, reqs: Sequence[Request]) -> torch.Tensor:
    """Repetition (HF-style, over prompt+output), presence and frequency (OpenAI-style, output)."""
    for i, r in enumerate(reqs):
        p = r.params
        if not p.uses_penalties:
            continue
        row = logits[i]
        if p.repetition_penalty != 1.0:
            seen = torch.tensor(sorted(set(r.all_token_ids)), dtype=torch.long, device=row.device)
            vals = row[seen]
            row[seen] = torch.where(vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty)
        if r.output_token_ids and (p.presence_penalty or p.frequency_penalty):
            out = torch.tensor(r.output_token_ids, dtype=torch.long, device=row.device)
            counts = torch.bincount(out, minlength=row.shape[0])[: row.shape[0]].to(row.dtype)
            row -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(row.dtype)
    return logits


def _filter(logits: torch.Tensor, top_k: int, top_p: float, min_p: float) -> torch.Tensor:
    if top_k > 0 and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if min_p > 0.0:
        probs = torch.softmax(logits, dim=-1)
        logits = logits.masked_fill(probs < min_p * probs.max(), float("-inf"))
    if top_p < 1.0:
        sorted_logits, idx = torch.sort(logits, descending=True)
        cum = torch.softmax(sorted_logits, dim=-1).cumsum(-1)
        drop = cum - torch.softmax(sorted_logits, dim=-1) > top_p  # keep the token that crosses p
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.full_like(logits, float("-inf")).scatter(0, idx, sorted_logits)
    return logits


class Sampler:
    def __init__(self, seed: int = 0) -> None:
        self.default_generator = torch.Generator().manual_seed(seed)

    @torch.inference_mode()
    def __call__(self, logits: torch.Tensor, reqs: Sequence[Request]) -> tuple[list[int], list[TokenLogprob | None]]:
        logits = logits.float()
        want_logprobs = any(r.params.logprobs is not None for r in reqs)
        raw_logprobs = torch.log_softmax(logits, dim=-1) if want_logprobs else None
        logits = apply_penalties(logits.clone() if want_logprobs else logits, reqs)
        greedy_ids = logits.argmax(dim=-1).tolist()
        tokens: list[int] = []
        for i, r in enumerate(reqs):
            p = r.params
            if p.greedy:
                tokens.append(greedy_ids[i])
                continue
            row = _filter(logits[i] / p.temperature, p.top_k, p.top_p, p.min_p)
            probs = torch.softmax(row, dim=-1).cpu()
            gen = r.generator or self.default_generator
            tokens.append(int(torch.multinomial(probs, 1, generator=gen)))
        lps: list[TokenLogprob | None] = [None] * len(reqs)
        if raw_logprobs is not None:
            for i, r in enumerate(reqs):
                n = r.params.logprobs
                if n is None:
                    continue
                row = raw_logprobs[i]
                top = torch.topk(row, n) if n > 0 else None
                lps[i] = TokenLogprob(
                    token_id=tokens[i], logprob=float(row[tokens[i]]),
                    top=list(zip(top.indices.tolist(), top.values.tolist())) if top is not None else [])
        return tokens, lps
