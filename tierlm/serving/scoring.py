"""A prompt's own logprobs as the OpenAI routes return them: echoed with the Completions API's
`logprobs` (the legacy columns, the first token's entries null) and as vLLM's `prompt_logprobs`
(one dict per prompt token, keyed by token id). Scoring a text this way is what evaluation
harnesses do (lm-evaluation-harness' loglikelihood: `echo`, `logprobs`, a batch of prompts).
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

from tierlm.engine.detokenizer import IncrementalDetokenizer
from tierlm.engine.outputs import TokenLogprob
from tierlm.serving.vocab import vocabulary

if TYPE_CHECKING:
    from tierlm.engine.async_engine import AsyncEngine


def token_text(engine: "AsyncEngine", token_id: int, as_id: bool = False) -> str:
    """How a logprobs entry names a token (vocab.Vocabulary.name: the text its `bytes` spell)."""
    return vocabulary(engine.tokenizer).name(token_id, as_id)


def legacy_top(engine: "AsyncEngine", lp: TokenLogprob, top_n: int, as_id: bool = False) -> dict[str, float]:
    """One `top_logprobs` entry of the Completions API: the token itself first, then the top
    `top_n` (up to top_n + 1 entries; the token alone for logprobs=0), as OpenAI and vLLM."""
    vocab = vocabulary(engine.tokenizer)
    top = {vocab.name(lp.token_id, as_id): lp.logprob}
    for t, v in lp.top[:top_n]:
        top.setdefault(vocab.name(t, as_id), v)
    return top


def prompt_offsets(engine: "AsyncEngine", ids: list[int], echo: str) -> list[int]:
    """Where each prompt token's text begins in `echo`, the prompt as echoed. Read by the
    detokenizer (a token finishing a character begun by earlier ones starts where they do) when
    the prompt decodes to `echo`, or to `echo` after tokens of its own (a BOS the tokenizer
    added: those start at 0); otherwise (a tokenizer that normalises text) each token starts
    where the previous tokens' own texts end, vLLM's reckoning, within `echo`."""
    detok = IncrementalDetokenizer(engine.tokenizer, [], [], skip_special_tokens=False, positions=True)
    for t in ids:
        detok.add(t, find_stop=False)
    detok.flush(find_stop=False)
    text, starts = detok.text, detok.starts
    if len(starts) == len(ids) and text.endswith(echo):
        shift = len(text) - len(echo)
        return [max(0, s - shift) for s in starts]
    offsets, at = [], 0
    for t in ids:
        offsets.append(min(at, len(echo)))
        at += len(token_text(engine, t))
    return offsets


def echoed_legacy_logprobs(engine: "AsyncEngine", ids: list[int], lps: list[TokenLogprob | None], top_n: int,
                           echo: str, as_id: bool = False) -> dict[str, list[Any]]:
    """The prompt's columns of the Completions API's `logprobs` (with echo): its tokens, their
    logprobs and top entries (null for the first, which nothing predicts), their offsets in `echo`.
    A prompt never scored (`lps` empty: an input policy refused it) has null ones, every column as
    long as the prompt."""
    lps = [*lps, *[None] * (len(ids) - len(lps))]
    return {"tokens": [token_text(engine, t, as_id) for t in ids],
            "token_logprobs": [None if lp is None else lp.logprob for lp in lps],
            "top_logprobs": [None if lp is None else legacy_top(engine, lp, top_n, as_id) for lp in lps],
            "text_offset": prompt_offsets(engine, ids, echo)}


def vllm_prompt_logprobs(engine: "AsyncEngine", lps: list[TokenLogprob | None], top_n: int
                         ) -> list[dict[str, dict[str, Any]] | None]:
    """vLLM's `prompt_logprobs`: per prompt token, null for the first, else a dict keyed by
    token id (a string in JSON) of {logprob, rank, decoded_token}: the prompt token's own entry
    and the top `top_n`, the i-th of those at rank i + 1."""
    out: list[dict[str, dict[str, Any]] | None] = []
    for lp in lps:
        if lp is None:
            out.append(None)
            continue
        entry = {str(lp.token_id): {"logprob": lp.logprob, "rank": lp.rank,
                                    "decoded_token": token_text(engine, lp.token_id)}}
        for rank, (t, v) in enumerate(lp.top[:top_n], start=1):
            entry.setdefault(str(t), {"logprob": v, "rank": rank, "decoded_token": token_text(engine, t)})
        out.append(entry)
    return out
