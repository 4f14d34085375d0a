"""Structured output: which tokens keep an answer on its grammar, step by step.

A request's StructuredOutputsParams (a JSON schema, any JSON object, a regular expression, a choice)
is compiled by llguidance (the Rust library behind vLLM's `guidance` backend: an Earley parser
over the tokenizer's byte-level vocabulary) into a matcher that, fed the tokens sampled so far,
says which tokens may come next. The sampler lets only those be drawn; EOS only once the answer
is complete, and nothing but EOS once the grammar can go no further, so a complete answer ends
there. Each token is fed to the matcher once (preemption only ever appends tokens).
"""
from __future__ import annotations

import json
import logging
import re
from typing import Any

import torch

from tierlm.errors import InvalidRequestError
from tierlm.sampling_params import StructuredOutputsParams

logger = logging.getLogger("tierlm.engine")


def _llguidance() -> Any:
    try:
        import llguidance
        import llguidance.hf
    except ImportError:
        raise InvalidRequestError("structured output needs the llguidance package, which is not installed here; "
                                  "pip install llguidance (tierlm's install pulls it in)",
                                  param="structured_outputs") from None
    return llguidance


# JSON written as json.dumps writes it (", " and ": ", no other blank space between tokens): with
# blank space free, as the JSON grammar allows it, weak models fill their answers with newlines.
# A schema's own "x-guidance" settings win.
COMPACT_JSON = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def grammar_of(spec: StructuredOutputsParams) -> str:
    """`spec` as an llguidance grammar (its JSON text)."""
    matcher = _llguidance().LLMatcher
    if spec.json is not None or spec.json_object:
        schema = {"type": "object"} if spec.json is None else spec.json
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except ValueError as exc:
                raise ValueError(f"the JSON schema is not JSON: {exc}") from None
        if isinstance(schema, dict) and "x-guidance" not in schema:
            schema = {**schema, "x-guidance": COMPACT_JSON}
        return matcher.grammar_from_json_schema(schema)
    if spec.regex is not None:
        return matcher.grammar_from_regex(spec.regex)
    return matcher.grammar_from_regex("|".join(re.escape(c) for c in spec.choice or ()))


class GrammarCompiler:
    """An engine's tokenizer in llguidance's form (built on first use: a 150k-token vocabulary
    takes about a second) and the grammars its requests ask for."""

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: frozenset[int]) -> None:
        self._hf = tokenizer
        self._tokenizer: Any = None
        self.vocab_size = vocab_size
        self.eos_token_ids = eos_token_ids

    def follower(self, spec: StructuredOutputsParams) -> "GrammarFollower":
        """A new request's matcher, or InvalidRequestError naming what is wrong with `spec`."""
        ll = _llguidance()
        if self._tokenizer is None:
            self._tokenizer = ll.hf.from_tokenizer(self._hf)
        try:
            grammar = grammar_of(spec)
        except (ValueError, TypeError) as exc:
            raise InvalidRequestError(f"structured_outputs: {_first_line(exc)}", param="structured_outputs") from None
        problem = ll.LLMatcher.validate_grammar(grammar, self._tokenizer)
        if problem:
            what = "json" if spec.json is not None or spec.json_object else "regex" if spec.regex else "choice"
            raise InvalidRequestError(f"structured_outputs: this {what} cannot be followed: {_first_line(problem)}",
                                      param="structured_outputs")
        return GrammarFollower(ll.LLMatcher(self._tokenizer, grammar), self.vocab_size, self.eos_token_ids,
                               int(self._tokenizer.eos_token))


def _first_line(problem: Any) -> str:
    text = str(problem).strip()
    return text.splitlines()[0] if text else "invalid"


class GrammarFollower:
    """One request's place in its grammar, and the tokens it may sample next."""

    def __init__(self, matcher: Any, vocab_size: int, eos_token_ids: frozenset[int], grammar_eos: int) -> None:
        self._matcher = matcher
        self._vocab = vocab_size
        # The model's EOS tokens (chat models end on <|im_end|>, not the tokenizer's eos) all end
        # a complete answer, as the tokenizer's EOS does for the matcher.
        self._eos = sorted(t for t in eos_token_ids if 0 <= t < vocab_size)
        self._grammar_eos = grammar_eos
        self._seen = 0
        self.lost = False  # a token off the grammar came in (forced by a thinking budget): constraint dropped

    def allowed(self, output_token_ids: list[int]) -> torch.Tensor | None:
        """A bool mask over the vocabulary (CPU) of the next tokens that stay on the grammar;
        None once the constraint no longer holds."""
        m = self._matcher
        for token in output_token_ids[self._seen:]:
            if not self.lost and not m.is_stopped():
                token = self._grammar_eos if token in self._eos else token
                if not m.consume_token(token):
                    self.lost = True
                    logger.warning("a token off the request's grammar was sampled (%s); its structured output is "
                                   "no longer constrained", _first_line(m.get_error()))
        self._seen = len(output_token_ids)
        if self.lost:
            return None
        mask = torch.zeros(self._vocab, dtype=torch.bool)
        if m.is_stopped():
            mask[self._eos] = True
            return mask
        bias = torch.frombuffer(bytearray(m.compute_logit_bias()), dtype=torch.uint8)
        n = min(len(bias), self._vocab)
        mask[:n] = bias[:n] > 0
        if self._grammar_eos < self._vocab and self._grammar_eos not in self._eos:
            mask[self._grammar_eos] = False  # (the tokenizer's EOS, which does not end this model's answers)
        if m.is_accepting():
            mask[self._eos] = True
        return mask
