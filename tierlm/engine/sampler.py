"""Turn last-position logits into next tokens, per request's SamplingParams.

Everything is batched over the rows of one step, on the logits' device; only top-k/top-p/min-p
filters run per row that asks for them. A sampled row draws one uniform number from its
request's own torch.Generator when it has a seed (so a seeded request is reproducible no matter
what else shares its batch), else from the engine's, and takes the token where that number
falls in the row's cumulative distribution. One draw per row, not one per vocabulary entry:
torch.multinomial's CPU path draws an exponential per entry, ~1 ms per row at 32k tokens, which
on a GPU was 45% of a 32-row decode step (bench_results/h200/device_run2.log).
"""
from __future__ import annotations

import hashlib
from collections.abc import Sequence

import torch

from tierlm.engine.outputs import TokenLogprob
from tierlm.engine.request import Request
from tierlm.sampling_params import SamplingParams


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


def _hold_stops(logits: torch.Tensor, reqs: Sequence[Request]) -> torch.Tensor:
    """Rows short of their `min_tokens`: EOS (unless ignored) and the stop tokens cannot be drawn."""
    for i, r in enumerate(reqs):
        p = r.params
        if p.min_tokens and r.num_output_tokens < p.min_tokens:
            stops = [t for t in (*p.stop_token_ids, *(() if p.ignore_eos else r.eos_token_ids))
                     if 0 <= t < logits.shape[1]]
            if stops:
                logits[i, stops] = float("-inf")
    return logits


def _filter_rows(rows: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """Top-k, then min-p, then top-p, each row with its own settings, batched over the rows
    (one sort for all of them, not one per row). Filtered-out tokens become -inf."""
    dev, vocab = rows.device, rows.shape[1]
    ks = [p.top_k if 0 < p.top_k < vocab else 0 for p in params]
    if any(ks):
        k = torch.tensor(ks, dtype=torch.long).to(dev, non_blocking=True)
        top = torch.topk(rows, max(ks), dim=-1).values
        kth = top.gather(1, (k - 1).clamp(min=0).unsqueeze(1))
        kth = torch.where(k.unsqueeze(1) > 0, kth, torch.full_like(kth, float("-inf")))  # k = 0: keep all
        rows = rows.masked_fill(rows < kth, float("-inf"))
    if any(p.min_p > 0.0 for p in params):
        min_p = torch.tensor([p.min_p for p in params], dtype=rows.dtype).to(dev, non_blocking=True)
        probs = torch.softmax(rows, dim=-1)
        rows = rows.masked_fill(probs < min_p.unsqueeze(1) * probs.amax(dim=-1, keepdim=True), float("-inf"))
    if any(p.top_p < 1.0 for p in params):
        top_p = torch.tensor([p.top_p for p in params], dtype=rows.dtype).to(dev, non_blocking=True)
        sorted_rows, order = torch.sort(rows, dim=-1, descending=True)
        sorted_probs = torch.softmax(sorted_rows, dim=-1)
        # Drop a token when the mass before it already reaches p, equal included (as HF's and
        # vLLM's top-p: the token that crosses p stays, one after a set of exactly p does not);
        # rows with top_p = 1 drop nothing, whatever the rounding of their sums.
        drop = (sorted_probs.cumsum(dim=-1) - sorted_probs >= top_p.unsqueeze(1)) & (top_p < 1.0).unsqueeze(1)
        drop[:, 0] = False  # the top token always stays: a top_p below float32's least (1e-46) is 0 here
        rows = rows.scatter(1, order, sorted_rows.masked_fill(drop, float("-inf")))
    return rows


def seeded_generator(seed: int) -> torch.Generator:
    """A request's own generator. torch's CPU generator (mt19937) keeps only the low 32 bits of
    its seed, so the API's 64-bit seeds 5 and 5 + 2**32 would draw the same tokens: all the bits
    (sign included) are hashed into the 32 it keeps."""
    digest = hashlib.blake2b(seed.to_bytes(9, "little", signed=True), digest_size=4).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest, "little"))


class Sampler:
    def __init__(self, seed: int = 0) -> None:
        self.default_generator = seeded_generator(seed)  # all 64 bits of the engine's seed count

    @torch.inference_mode()
    def __call__(self, logits: torch.Tensor, reqs: Sequence[Request]) -> tuple[list[int], list[TokenLogprob | None]]:
        logits = logits.float()
        want_logprobs = any(r.params.logprobs is not None for r in reqs)
        raw_logprobs = torch.log_softmax(logits, dim=-1) if want_logprobs else None
        logits = apply_penalties(logits.clone() if want_logprobs else logits, reqs)
        logits = _hold_stops(logits, reqs)
        drawn = [i for i, r in enumerate(reqs) if not r.params.greedy]
        if len(drawn) == len(reqs):
            picked = self._draw(logits, reqs)
        else:
            picked = logits.argmax(dim=-1)
            if drawn:
                rows = torch.tensor(drawn, dtype=torch.long).to(logits.device, non_blocking=True)
                picked.index_copy_(0, rows, self._draw(logits.index_select(0, rows), [reqs[i] for i in drawn]))
        tokens = picked.tolist()  # the step's one device-to-host sync
        lps: list[TokenLogprob | None] = [None] * len(reqs)
        if raw_logprobs is not None:
            for i, r in enumerate(reqs):
                n = r.params.logprobs
                if n is None:
                    continue
                row = raw_logprobs[i]
                top = torch.topk(row, n) if n > 0 else None
                chosen = row[tokens[i]]
                lps[i] = TokenLogprob(
                    token_id=tokens[i], logprob=float(chosen),
                    top=list(zip(top.indices.tolist(), top.values.tolist())) if top is not None else [],
                    rank=int((row > chosen).sum()) + 1)
        return tokens, lps

    def _draw(self, logits: torch.Tensor, reqs: Sequence[Request]) -> torch.Tensor:
        """One token per row of `logits` [n, vocab], drawn from softmax(row / temperature) after the
        row's filters: the first token whose cumulative probability exceeds u * total, u uniform in
        [0, 1). A token of probability 0 (filtered out) has no width in the cumulative sum, so it
        is never drawn."""
        dev = logits.device
        temps = torch.tensor([r.params.temperature for r in reqs], dtype=logits.dtype)
        rows = _filter_rows(logits / temps.to(dev, non_blocking=True).unsqueeze(1), [r.params for r in reqs])
        cum = torch.softmax(rows, dim=-1).double().cumsum(dim=-1)  # float64: 100k-entry sums stay exact to ~1e-12
        u = torch.cat([torch.rand(1, dtype=torch.float64, generator=r.generator or self.default_generator)
                       for r in reqs])
        total = cum[:, -1]
        # Strictly below the total (u * total can round up to it, a 2^-53 chance), so the token
        # found always has width: probability above 0.
        target = torch.minimum(u.to(dev, non_blocking=True) * total, torch.nextafter(total, torch.zeros_like(total)))
        picked = torch.searchsorted(cum, target.unsqueeze(1), right=True).squeeze(1)
        return picked.clamp_(max=rows.shape[1] - 1)  # a row of NaN (a broken model) finds no place: stay in range
