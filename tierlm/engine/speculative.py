"""Speculative decoding by n-gram lookup (vLLM's "ngram" method, prompt lookup decoding).

Why: a decode step reads every weight to make one token per sequence. When what comes next is
already written somewhere in the request (code being edited, a document being quoted, an answer
that repeats a table's rows), the tokens after the latest earlier occurrence of the last few
tokens are a good guess for the next few. The model checks k guesses in one step (k + 1 rows
of one chunk, as a short prefill), so each step yields one to k + 1 tokens for about the price
of one while the weights are what the step waits for.

Exactness: row j's logits are the model's distribution for the token after the real tokens and
the first j guesses. A greedy row keeps the guess when it is the argmax; a sampled row keeps it
with the probability the model gives it, and otherwise draws from the rest of the distribution
(the guess left out, renormalised), which is exactly the model's distribution (Leviathan et
al. 2023, with a proposer that puts all its mass on one token). So speculation changes speed,
never what is generated: greedy output equals that without speculation (the tests check it
against transformers), sampled output has the same distribution.

Which requests speculate: those whose sampling at a position depends only on that position's
logits. Penalties, bad words, structured output, a thinking budget and an unmet `min_tokens`
depend on the tokens before, which for a guessed row are not yet known to be real; a seeded
request would draw differently depending on how many guesses a step had room for, so its
sample would depend on the load. Those decode one token a step, as without speculation.
"""
from __future__ import annotations

import json
import numbers
from dataclasses import dataclass

import numpy as np

from tierlm.engine.request import Request

METHODS = ("ngram",)


@dataclass(frozen=True)
class SpeculativeConfig:
    """vLLM's `speculative_config` for the n-gram method: up to `num_speculative_tokens` guesses a
    step, taken after the latest earlier occurrence of the request's last n tokens, for the
    longest n from `prompt_lookup_max` down to `prompt_lookup_min` that occurs."""

    method: str = "ngram"
    num_speculative_tokens: int = 4
    prompt_lookup_max: int = 4
    prompt_lookup_min: int = 2
    # More running requests than this: no guesses (vLLM v0's knob). A large batch already keeps
    # the weights busy, so guessed rows cost about what they would earn; None: always guess.
    disable_by_batch_size: int | None = None

    @classmethod
    def parse(cls, value: "SpeculativeConfig | dict | str | None") -> "SpeculativeConfig | None":
        """From a dict or its JSON text (the CLI's `--speculative-config`); a ValueError names the
        field that is wrong and what it may be."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise ValueError(f"speculative_config is not valid JSON ({e}); give e.g. "
                                 '\'{"method": "ngram", "num_speculative_tokens": 4}\'') from None
        if not isinstance(value, dict):
            raise ValueError(f"speculative_config must be a dict such as {{'method': 'ngram', "
                             f"'num_speculative_tokens': 4}} (got {type(value).__name__})")
        known = {"method", "num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min", "disable_by_batch_size"}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(f"speculative_config has unknown field(s) {', '.join(unknown)}; tierlm's n-gram "
                             f"speculation takes {', '.join(sorted(known))}")
        method = value.get("method", "ngram")
        if method not in METHODS:
            raise ValueError(f"speculative_config method {method!r} is not supported; tierlm speculates by "
                             f"n-gram lookup: use {', '.join(repr(m) for m in METHODS)} (draft models and EAGLE "
                             "are not implemented)")
        for knob in ("num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min"):
            v = value.get(knob)
            if v is not None and (isinstance(v, bool) or not isinstance(v, numbers.Integral) or not 1 <= v <= 64):
                raise ValueError(f"speculative_config {knob} must be a whole number from 1 to 64 (got {v!r})")
        off = value.get("disable_by_batch_size")
        if off is not None and (isinstance(off, bool) or not isinstance(off, numbers.Integral) or off < 1):
            raise ValueError(f"speculative_config disable_by_batch_size must be a whole number of requests, at least "
                             f"1, or null to guess at any load (got {off!r})")
        k = int(value.get("num_speculative_tokens") or cls.num_speculative_tokens)
        hi = value.get("prompt_lookup_max")
        lo = value.get("prompt_lookup_min")
        hi = int(hi) if hi is not None else max(cls.prompt_lookup_max, int(lo or 0))
        lo = int(lo) if lo is not None else min(cls.prompt_lookup_min, hi)
        if lo > hi:
            raise ValueError(f"speculative_config prompt_lookup_min ({lo}) is above prompt_lookup_max ({hi})")
        return cls(method, k, hi, lo, None if off is None else int(off))


def can_speculate(req: Request) -> bool:
    """Whether `req`'s next tokens may be guessed and checked in one step: its sampling at a
    position must not depend on the tokens before it (see the module's docstring)."""
    p = req.params
    return (req.pooling is None and req.grammar is None and req.bad_words is None and req.thinking is None
            and p.repetition_penalty == 1.0 and not p.presence_penalty and not p.frequency_penalty
            and req.num_output_tokens >= p.min_tokens and (p.greedy or req.generator is None))


class NgramProposer:
    """Guesses a request's next tokens from its own prompt and output."""

    def __init__(self, config: SpeculativeConfig, max_model_len: int) -> None:
        self.config = config
        self.max_model_len = max_model_len

    def guesses_at(self, running: int) -> bool:
        """Whether a step with `running` requests guesses at all (`disable_by_batch_size`)."""
        off = self.config.disable_by_batch_size
        return off is None or running <= off

    def room(self, req: Request) -> int:
        """Guesses `req` may take this step: none past its max_tokens or the model's length (all
        k + 1 tokens of a fully accepted step must fit), none when it may not speculate."""
        if not can_speculate(req):
            return 0
        return max(0, min(self.config.num_speculative_tokens, req.max_tokens - req.num_output_tokens - 1,
                          self.max_model_len - req.num_tokens - 1))

    def propose(self, req: Request, limit: int) -> list[int]:
        """Up to `limit` guesses: the tokens that followed the latest earlier occurrence of the
        longest suffix (prompt_lookup_min to prompt_lookup_max tokens) that occurred before."""
        if limit <= 0:
            return []
        toks = _token_array(req)
        return ngram_draft(toks, self.config.prompt_lookup_min, self.config.prompt_lookup_max, limit)


def _token_array(req: Request) -> np.ndarray:
    """The request's tokens as an int64 array, kept on the request and extended in place (not
    rebuilt from the list each step: a 32k-token prompt is ~1 ms to convert)."""
    buf: np.ndarray | None = req.spec_buffer
    n, have = req.num_tokens, req.spec_buffer_len
    if buf is None or len(buf) < n:
        grown = np.empty(max(2 * n, 64), dtype=np.int64)
        if buf is not None:
            grown[:have] = buf[:have]
        buf = req.spec_buffer = grown
    if have < n:  # (tokens are only ever appended)
        buf[have:n] = req.all_token_ids[have:n]
        req.spec_buffer_len = n
    return buf[:n]


def ngram_draft(toks: np.ndarray, lo: int, hi: int, k: int) -> list[int]:
    """The up to `k` tokens after the latest position where the longest suffix of `toks`, of
    `lo` to `hi` tokens, ended before; [] when no suffix of `lo` tokens occurred before.

    One vectorised scan for the last token, then the candidates (usually few) are extended
    backwards together: O(len) per call, no per-request index to keep."""
    n = len(toks)
    if n < lo + 1 or k <= 0:
        return []
    ends = np.flatnonzero(toks[:n - 1] == toks[n - 1])  # earlier places the last token occurred
    if len(ends) == 0:
        return []
    match = np.ones(len(ends), dtype=np.int64)  # suffix length matched at each candidate
    alive = np.ones(len(ends), dtype=bool)
    for back in range(1, min(hi, n)):  # (a suffix of `back` + 1 tokens must fit in `toks`)
        at = ends - back
        ok = alive & (at >= 0)
        ok[ok] = toks[at[ok]] == toks[n - 1 - back]
        alive = ok
        if not alive.any():
            break
        match += alive
    best = int(match.max())
    if best < lo:
        return []
    end = int(ends[np.flatnonzero(match == best)[-1]])  # the latest of the longest
    return toks[end + 1:end + 1 + k].tolist()
