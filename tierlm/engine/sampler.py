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

from tierlm.engine.grammar import unpack_bitmask
from tierlm.engine.outputs import TokenLogprob
from tierlm.engine.request import Request
from tierlm.sampling_params import MAX_LOGPROBS, SamplingParams


def _padded_ids(id_lists: Sequence[Sequence[int]], pad: int, device: torch.device) -> torch.Tensor:
    """Rows of token ids, right-padded with `pad`, built on the host and sent in one copy (per-row
    tensors would be one blocking copy each on a GPU)."""
    width = max((len(ids) for ids in id_lists), default=0)
    host = torch.full((len(id_lists), max(width, 1)), pad, dtype=torch.long)
    for i, ids in enumerate(id_lists):
        if ids:
            host[i, : len(ids)] = torch.as_tensor(ids, dtype=torch.long)
    return host.to(device, non_blocking=True)


def apply_allowed_tokens(logits: torch.Tensor, reqs: Sequence[Request]) -> torch.Tensor:
    """Rows with `allowed_token_ids`: every other token -inf. Each request's allowed set becomes
    a vocabulary-wide mask on the device once (its ids were checked against the vocabulary when
    it was made); a step stacks the rows' masks."""
    asks = [i for i, r in enumerate(reqs) if r.allowed_token_ids is not None]
    if not asks:
        return logits
    dev, vocab = logits.device, logits.shape[1]
    masks = []
    for i in asks:
        r = reqs[i]
        if r.allowed_mask is None or r.allowed_mask.device != dev or r.allowed_mask.shape[0] != vocab:
            mask = torch.zeros(vocab, dtype=torch.bool)
            mask[r.allowed_token_ids] = True
            r.allowed_mask = mask.to(dev, non_blocking=True)
        masks.append(r.allowed_mask)
    banned = ~torch.stack(masks)
    if len(asks) == len(reqs):
        return logits.masked_fill_(banned, float("-inf"))
    rows = torch.tensor(asks, dtype=torch.long).to(dev, non_blocking=True)
    logits.index_copy_(0, rows, logits.index_select(0, rows).masked_fill_(banned, float("-inf")))
    return logits


def apply_bad_words(logits: torch.Tensor, reqs: Sequence[Request]) -> torch.Tensor:
    """Rows with `bad_words`: each word's last token -inf where the output so far ends with the
    word's other tokens (see BadWords), all rows in one indexed write."""
    rows: list[int] = []
    cols: list[int] = []
    for i, r in enumerate(reqs):
        if r.bad_words is not None:
            banned = r.bad_words.banned(r.output_token_ids)
            rows += [i] * len(banned)
            cols += banned
    if rows:
        index = torch.tensor([rows, cols], dtype=torch.long).to(logits.device, non_blocking=True)
        logits[index[0], index[1]] = float("-inf")
    return logits


def apply_logit_bias(logits: torch.Tensor, reqs: Sequence[Request]) -> torch.Tensor:
    """Each asking row's `logit_bias` added to its logits, all rows in one scatter (ids were checked
    against the vocabulary when the request was made)."""
    rows: list[torch.Tensor] = []
    cols: list[torch.Tensor] = []
    vals: list[torch.Tensor] = []
    for i, r in enumerate(reqs):
        if r.params.logit_bias:
            if r.logit_bias_tensors is None:
                bias = r.params.logit_bias
                r.logit_bias_tensors = (torch.tensor(list(bias), dtype=torch.long),
                                        torch.tensor(list(bias.values()), dtype=torch.float32))
            ids, values = r.logit_bias_tensors
            rows.append(torch.full_like(ids, i))
            cols.append(ids)
            vals.append(values)
    if rows:
        dev = logits.device
        index = torch.stack([torch.cat(rows), torch.cat(cols)]).to(dev, non_blocking=True)
        bias = torch.cat(vals).to(dev, dtype=logits.dtype, non_blocking=True)
        logits.index_put_((index[0], index[1]), bias, accumulate=True)
    return logits


def apply_penalties(logits: torch.Tensor, reqs: Sequence[Request]) -> torch.Tensor:
    """Repetition (HF-style, over prompt+output), presence and frequency (OpenAI-style, output),
    batched over the rows that ask for them: one scatter each, no per-row copies or bincounts
    (each a device-to-host wait on a GPU)."""
    dev, vocab = logits.device, logits.shape[1]
    rep = [i for i, r in enumerate(reqs) if r.params.repetition_penalty != 1.0]
    if rep:
        rows = torch.tensor(rep, dtype=torch.long).to(dev, non_blocking=True)
        ids = _padded_ids([reqs[i].all_token_ids for i in rep], vocab, dev).clamp_(max=vocab)
        seen = torch.zeros(len(rep), vocab + 1, dtype=torch.bool, device=dev)
        seen.scatter_(1, ids, True)  # column `vocab` takes the padding (and anything out of range)
        penalty = torch.tensor([reqs[i].params.repetition_penalty for i in rep],
                               dtype=logits.dtype).to(dev, non_blocking=True).unsqueeze(1)
        vals = logits.index_select(0, rows)
        penalised = torch.where(vals > 0, vals / penalty, vals * penalty)
        logits.index_copy_(0, rows, torch.where(seen[:, :vocab], penalised, vals))
    occ = [i for i, r in enumerate(reqs)
           if r.output_token_ids and (r.params.presence_penalty or r.params.frequency_penalty)]
    if occ:
        rows = torch.tensor(occ, dtype=torch.long).to(dev, non_blocking=True)
        ids = _padded_ids([reqs[i].output_token_ids for i in occ], vocab, dev).clamp_(max=vocab)
        counts = torch.zeros(len(occ), vocab + 1, dtype=logits.dtype, device=dev)
        counts.scatter_add_(1, ids, torch.ones_like(ids, dtype=logits.dtype))
        counts = counts[:, :vocab]
        freq = torch.tensor([reqs[i].params.frequency_penalty for i in occ], dtype=logits.dtype)
        pres = torch.tensor([reqs[i].params.presence_penalty for i in occ], dtype=logits.dtype)
        cut = (freq.to(dev, non_blocking=True).unsqueeze(1) * counts
               + pres.to(dev, non_blocking=True).unsqueeze(1) * (counts > 0).to(logits.dtype))
        logits.index_copy_(0, rows, logits.index_select(0, rows) - cut)
    return logits


def _hold_stops(logits: torch.Tensor, reqs: Sequence[Request]) -> torch.Tensor:
    """Rows short of their `min_tokens`: EOS (unless ignored) and the stop tokens cannot be drawn.
    One indexed write for all rows (a Python-list index per row is a blocking copy on a GPU)."""
    rows: list[int] = []
    cols: list[int] = []
    for i, r in enumerate(reqs):
        p = r.params
        if p.min_tokens and r.num_output_tokens < p.min_tokens:
            stops = {t for t in (*p.stop_token_ids, *(() if p.ignore_eos else r.eos_token_ids))
                     if 0 <= t < logits.shape[1]}
            rows += [i] * len(stops)
            cols += sorted(stops)
    if rows:
        index = torch.tensor([rows, cols], dtype=torch.long).to(logits.device, non_blocking=True)
        logits[index[0], index[1]] = float("-inf")
    return logits


def _refill_empty_rows(logits: torch.Tensor, rows: torch.Tensor, fallback: torch.Tensor) -> None:
    """Rows of `logits` (at `rows`) left with no token at all take their `fallback` instead;
    decided on the device, without a read back."""
    current = logits.index_select(0, rows)
    empty = torch.isneginf(current).all(dim=1, keepdim=True)
    logits.index_copy_(0, rows, torch.where(empty, fallback, current))


def grammar_masks(reqs: Sequence[Request], vocab_size: int,
                  device: torch.device) -> tuple[list[int], torch.Tensor | None]:
    """The rows under a grammar (structured output) and, on `device`, their masks of the tokens
    that keep the answer on it: built on the host as bitmasks, copied in one piece, unpacked there.
    A row still thinking before its grammar starts is left alone (no mask built)."""
    rows = [i for i, r in enumerate(reqs) if r.grammar is not None and r.grammar.constrains(r.output_token_ids)]
    if not rows:
        return [], None
    bitmask = torch.zeros(len(rows), max(reqs[i].grammar.words for i in rows), dtype=torch.int32)
    for j, i in enumerate(rows):
        reqs[i].grammar.fill(reqs[i].output_token_ids, bitmask[j])
    return rows, unpack_bitmask(bitmask.to(device, non_blocking=True), vocab_size)


def apply_forced_tokens(logits: torch.Tensor, reqs: Sequence[Request]) -> torch.Tensor:
    """Rows whose thinking budget is spent: the end marker's next token is the only one left
    (over every other mask: the budget ends the block whatever else the request asked)."""
    rows: list[int] = []
    cols: list[int] = []
    for i, r in enumerate(reqs):
        if r.thinking is not None and (token := r.thinking.forced(r.output_token_ids)) is not None:
            rows.append(i)
            cols.append(token)
    if rows:
        index = torch.tensor([rows, cols], dtype=torch.long).to(logits.device, non_blocking=True)
        logits.index_fill_(0, index[0], float("-inf"))
        logits[index[0], index[1]] = 0.0
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


def _top_k(vocab: int, any_top: bool) -> int:
    """One top-k at the most any row may ask (20), not at the most this batch asks: which of
    several tied tokens a top-k returns depends on k, so a row's top list would depend on its
    neighbours' N (and a prompt position's on its request's)."""
    return min(MAX_LOGPROBS, vocab) if any_top else 0


def _chosen_and_top(logprobs: torch.Tensor, tokens: torch.Tensor, k: int
                    ) -> tuple[torch.Tensor, torch.Tensor, "torch.return_types.topk | None"]:
    """Per row of `logprobs` [rows, vocab]: the logprob of `tokens`' token, its rank (1 = most
    likely; vLLM's: 1 + how many tokens are strictly likelier) and the top `k` (None for 0)."""
    chosen = logprobs.gather(1, tokens.unsqueeze(1))
    ranks = (logprobs > chosen).sum(dim=1) + 1
    return chosen.flatten(), ranks, (torch.topk(logprobs, k, dim=-1) if k > 0 else None)


# Prompt positions scored per vocabulary projection: [256, 150k] float32 logits are 150 MB.
PROMPT_PIECE = 256


@torch.inference_mode()
def prompt_logprobs(compute_logits, hidden: torch.Tensor, targets: Sequence[int], n: int,
                    piece: int = PROMPT_PIECE) -> list[TokenLogprob]:
    """Prompt logprobs: row i of `hidden` (final hidden states) projected by `compute_logits` is
    the model's raw distribution for prompt token `targets[i]`; each entry holds that token's
    logprob and rank and the top `n`, as a sampled token's do (the same top-k, so a position's
    list is what sampling there would report). Projected `piece` rows at a time."""
    out: list[TokenLogprob] = []
    for at in range(0, len(targets), piece):
        logits = compute_logits(hidden[at:at + piece]).float()
        raw = torch.log_softmax(logits, dim=-1)
        wanted = torch.tensor(targets[at:at + piece], dtype=torch.long).to(raw.device, non_blocking=True)
        chosen, ranks, top = _chosen_and_top(raw, wanted, _top_k(raw.shape[1], n > 0))
        # One copy to the host per piece (on a GPU each .tolist() is a sync): float64 holds the
        # float32 values and the ids and ranks (< 2^53) exactly.
        parts = [chosen[:, None], ranks[:, None]] + ([top.indices[:, :n], top.values[:, :n]] if top is not None else [])
        rows = torch.cat([p.double() for p in parts], dim=1).tolist()
        k = n if top is not None else 0
        out.extend(TokenLogprob(token_id=t, logprob=row[0], top=[(int(i), v) for i, v in zip(row[2:2 + k], row[2 + k:])],
                                rank=int(row[1]))
                   for t, row in zip(targets[at:at + piece], rows))
    return out


class Sampler:
    def __init__(self, seed: int = 0) -> None:
        self.default_generator = seeded_generator(seed)  # all 64 bits of the engine's seed count

    @torch.inference_mode()
    def __call__(self, logits: torch.Tensor, reqs: Sequence[Request], drafts: Sequence[int] | None = None
                 ) -> tuple[list[int], list[TokenLogprob | None]]:
        """One token per row of `logits`. `drafts`: per row, a speculative guess at the token
        (-1: none) that a sampled row keeps with the probability its distribution gives it, else
        it draws from the rest (see `_draw`); a greedy row needs no help (its argmax is the
        check). A row's token has the distribution of the row's own, guess or not."""
        logits = logits.float()
        want_logprobs = any(r.params.logprobs is not None for r in reqs)
        raw_logprobs = torch.log_softmax(logits, dim=-1) if want_logprobs else None
        # vLLM's order: allowed_token_ids, bad_words, logit_bias, then penalties, all before the
        # filters; on a copy when logprobs are reported: they are the model's own distribution, as
        # vLLM's default. (The masks and min_tokens' hold are -inf and the bias is added, so only
        # the penalties' place could change a result, and -inf stays -inf through them.)
        logits = logits.clone() if want_logprobs else logits
        # Structured output: first, so that every other mask works inside the grammar; a row that
        # the others would leave empty keeps to the grammar alone (the grammar always wins).
        grammar_rows, grammar_masks_ = grammar_masks(reqs, logits.shape[1], logits.device)
        if grammar_masks_ is not None:
            g_rows = torch.tensor(grammar_rows, dtype=torch.long).to(logits.device, non_blocking=True)
            on_grammar = logits.index_select(0, g_rows).masked_fill_(~grammar_masks_, float("-inf"))
            logits.index_copy_(0, g_rows, on_grammar)
        logits = apply_allowed_tokens(logits, reqs)
        # Rows whose allowed set bad words or min_tokens' hold may empty at some step ("dd" a bad
        # word and only "d" allowed, after one "d"): kept as allowed, to fall back to.
        guarded = [i for i, r in enumerate(reqs)
                   if r.allowed_token_ids is not None and (r.bad_words is not None or r.params.min_tokens)]
        if guarded:
            guard_rows = torch.tensor(guarded, dtype=torch.long).to(logits.device, non_blocking=True)
            allowed_only = logits.index_select(0, guard_rows)
        logits = apply_bad_words(logits, reqs)
        logits = apply_logit_bias(logits, reqs)
        logits = apply_penalties(logits, reqs)
        logits = _hold_stops(logits, reqs)
        if guarded:
            # A row left with no token at all would draw token 0 (greedy) or the vocabulary's last
            # (sampled), outside its set: the ban or hold lapses for that step instead; the allowed
            # set holds.
            _refill_empty_rows(logits, guard_rows, allowed_only)
        if grammar_masks_ is not None:
            _refill_empty_rows(logits, g_rows, on_grammar)
        logits = apply_forced_tokens(logits, reqs)
        drawn = [i for i, r in enumerate(reqs) if not r.params.greedy]
        guesses = None if drafts is None or all(d < 0 for d in drafts) else drafts
        if len(drawn) == len(reqs):
            picked = self._draw(logits, reqs, guesses)
        else:
            picked = logits.argmax(dim=-1)
            if drawn:
                rows = torch.tensor(drawn, dtype=torch.long).to(logits.device, non_blocking=True)
                picked.index_copy_(0, rows, self._draw(logits.index_select(0, rows), [reqs[i] for i in drawn],
                                                       None if guesses is None else [guesses[i] for i in drawn]))
        lps: list[TokenLogprob | None] = [None] * len(reqs)
        if raw_logprobs is None:
            return picked.tolist(), lps  # the step's one device-to-host sync
        # Logprobs for every row that asks, batched: one top-k, the sampled tokens' values and
        # ranks, all read back together with the tokens.
        asks = [i for i, r in enumerate(reqs) if r.params.logprobs is not None]
        dev = logits.device
        rows = torch.tensor(asks, dtype=torch.long).to(dev, non_blocking=True)
        k = _top_k(logits.shape[1], any(reqs[i].params.logprobs for i in asks))
        chosen, ranks, top = _chosen_and_top(raw_logprobs.index_select(0, rows), picked.index_select(0, rows), k)
        longs = torch.cat([picked, ranks] + ([top.indices.flatten()] if top is not None else []))
        floats = torch.cat([chosen] + ([top.values.flatten()] if top is not None else []))
        longs_l, floats_l = longs.tolist(), floats.tolist()  # the step's device-to-host reads
        n_rows = len(reqs)
        tokens = longs_l[:n_rows]
        ids_at, vals_at = n_rows + len(asks), len(asks)  # where the top-k rows begin in each list
        for j, i in enumerate(asks):
            n = reqs[i].params.logprobs
            top_ids = longs_l[ids_at + j * k: ids_at + j * k + n]
            top_vals = floats_l[vals_at + j * k: vals_at + j * k + n]
            lps[i] = TokenLogprob(token_id=tokens[i], logprob=floats_l[j], top=list(zip(top_ids, top_vals)),
                                  rank=longs_l[n_rows + j])
        return tokens, lps

    def _draw(self, logits: torch.Tensor, reqs: Sequence[Request], drafts: Sequence[int] | None = None
              ) -> torch.Tensor:
        """One token per row of `logits` [n, vocab], drawn from softmax(row / temperature) after the
        row's filters: the first token whose cumulative probability exceeds u * total, u uniform in
        [0, 1). A token of probability 0 (filtered out) has no width in the cumulative sum, so it
        is never drawn.

        A row with a guess (`drafts`, -1 for none) first keeps it with its probability p (one
        more uniform, drawn before the usual one); rejected, the guess's probability is zeroed
        and the draw is from the rest. P(guess) = p, P(x) = (1 - p) p(x) / (1 - p) = p(x): the
        row's own distribution (speculative sampling with a one-token proposal)."""
        dev = logits.device
        temps = torch.tensor([r.params.temperature for r in reqs], dtype=logits.dtype)
        rows = _filter_rows(logits / temps.to(dev, non_blocking=True).unsqueeze(1), [r.params for r in reqs])
        probs = torch.softmax(rows, dim=-1).double()  # float64: 100k-entry sums stay exact to ~1e-12
        kept = None
        if drafts is not None and any(d >= 0 for d in drafts):
            guessed = [i for i, d in enumerate(drafts) if d >= 0]
            g_rows = torch.tensor(guessed, dtype=torch.long).to(dev, non_blocking=True)
            g_toks = torch.tensor([drafts[i] for i in guessed], dtype=torch.long).to(dev, non_blocking=True)
            u = torch.cat([torch.rand(1, dtype=torch.float64, generator=reqs[i].generator or self.default_generator)
                           for i in guessed]).to(dev, non_blocking=True)
            p_guess = probs[g_rows, g_toks] / probs[g_rows].sum(dim=-1)
            accept = u < p_guess
            kept = torch.full((len(reqs),), -1, dtype=torch.long, device=dev)
            kept[g_rows] = torch.where(accept, g_toks, -1)
            probs[g_rows, g_toks] = torch.where(accept, probs[g_rows, g_toks], 0.0)  # rejected: from the rest
        cum = probs.cumsum(dim=-1)
        u = torch.cat([torch.rand(1, dtype=torch.float64, generator=r.generator or self.default_generator)
                       for r in reqs])
        total = cum[:, -1]
        # Strictly below the total (u * total can round up to it, a 2^-53 chance), so the token
        # found always has width: probability above 0.
        target = torch.minimum(u.to(dev, non_blocking=True) * total, torch.nextafter(total, torch.zeros_like(total)))
        picked = torch.searchsorted(cum, target.unsqueeze(1), right=True).squeeze(1)
        picked = picked.clamp_(max=rows.shape[1] - 1)  # a row of NaN (a broken model) finds no place: stay in range
        return picked if kept is None else torch.where(kept >= 0, kept, picked)
