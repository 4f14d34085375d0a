"""Structured output: which tokens keep an answer on its grammar, step by step.

A request's StructuredOutputsParams (a JSON schema, any JSON object, a regular expression, a choice,
a Lark grammar) is compiled by llguidance (the Rust library behind vLLM's `guidance` backend: an Earley parser
over the tokenizer's byte-level vocabulary) into a matcher that, fed the tokens sampled so far,
says which tokens may come next. The sampler lets only those be drawn; EOS only once the answer
is complete, and nothing but EOS once the grammar can go no further, so a complete answer ends
there. Each token is fed to the matcher once (preemption only ever appends tokens: a recompute
keeps the output, and with it where the follower stands).

A reasoning model may think first (StructuredOutputsParams.after_reasoning, or a thinking
budget's block): the grammar then starts after the think block's end marker, as vLLM's does once
its reasoning parser sees the reasoning end. Until then the follower's row is left alone.
"""
from __future__ import annotations

import json
import logging
import re
import threading
from collections import OrderedDict
from typing import Any

import numpy as np
import torch

from tierlm.errors import InvalidRequestError
from tierlm.sampling_params import StructuredOutputsParams, ThinkBlock

logger = logging.getLogger("tierlm.engine")
_CACHED_GRAMMARS = 256  # compiled grammars kept per engine


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


# llguidance reads a schema's numbers as float64, so integers past 2**53 round: a `const` of
# 2**53 + 1 was written as 2**53, a `maximum` of 2**53 + 7 let 2**53 + 8 through.
EXACT_INTEGERS = 2 ** 53
_ANNOTATIONS = frozenset({"default", "examples", "description", "title", "$comment"})  # (no constraint)
_SCHEMA_MAPS = frozenset({"properties", "patternProperties", "$defs", "definitions", "dependentSchemas"})


def inexact_integer(schema: Any, where: str = "") -> str | None:
    """Where `schema` holds an integer llguidance cannot keep exactly (past +-2**53), as a dotted
    path with what to do, or None: refused, as the answer would silently break the schema.
    Iterative: a schema is nested as deep as the request's JSON allows."""
    stack: list[tuple[str, Any]] = [(where, schema)]
    while stack:
        path, node = stack.pop()
        if isinstance(node, int) and not isinstance(node, bool) and abs(node) > EXACT_INTEGERS:
            return (f"{path or 'the schema'}: {node} is past +-2**53 (9007199254740992), which the grammar "
                    "cannot keep exactly (its numbers are float64); use an integer within it, or a string")
        if isinstance(node, dict):
            names = path.rsplit(".", 1)[-1] in _SCHEMA_MAPS  # (keys here are property names, not keywords)
            items = [(k, v) for k, v in node.items() if names or k not in _ANNOTATIONS]
        elif isinstance(node, list):
            items = list(enumerate(node))
        else:
            continue
        stack.extend((f"{path}.{k}" if path else str(k), v) for k, v in reversed(items))
    return None


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
        if problem := inexact_integer(schema):
            raise ValueError(problem)
        if isinstance(schema, dict) and "x-guidance" not in schema:
            schema = {**schema, "x-guidance": COMPACT_JSON}
        return matcher.grammar_from_json_schema(schema)
    if spec.regex is not None:
        return matcher.grammar_from_regex(spec.regex)
    if spec.lark is not None:
        return matcher.grammar_from_lark(spec.lark)
    return matcher.grammar_from_regex("|".join(re.escape(c) for c in spec.choice or ()))


class GrammarCompiler:
    """An engine's tokenizer in llguidance's form (built once, under a lock, on first use: a
    150k-token vocabulary takes about a second) and the grammars its requests ask for, each
    compiled and checked once (n samples, or a client repeating its schema, share it)."""

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: frozenset[int]) -> None:
        self._hf = tokenizer
        self._tokenizer: Any = None
        self._unusable: str | None = None  # why llguidance cannot take this tokenizer
        self._lock = threading.Lock()
        self._grammars: OrderedDict[str, Any] = OrderedDict()  # spec -> its pristine matcher
        self._failures: OrderedDict[str, str] = OrderedDict()  # spec -> why it cannot be followed
        self.vocab_size = vocab_size
        self.eos_token_ids = eos_token_ids

    def _ll_tokenizer(self) -> Any:
        with self._lock:
            if self._tokenizer is None and self._unusable is None:
                try:
                    self._tokenizer = _llguidance().hf.from_tokenizer(self._hf)
                except InvalidRequestError:
                    raise
                except Exception as exc:  # a slow (Python) tokenizer, a vocabulary it cannot read
                    self._unusable = _first_line(exc)
            if self._unusable is not None:
                raise InvalidRequestError(f"structured_outputs: this model's tokenizer cannot be used for structured "
                                          f"outputs ({self._unusable}); serve it with a fast tokenizer "
                                          "(tokenizer.json)", param="structured_outputs")
            return self._tokenizer

    def available(self) -> bool:
        """Whether grammars can be followed here at all (llguidance is installed and takes this
        tokenizer: a slow, Python-only one it cannot). The server constrains a required tool call
        only then, and starts it unconstrained otherwise. The first call converts the tokenizer."""
        try:
            self._ll_tokenizer()
        except InvalidRequestError:
            return False
        return True

    def grammar(self, spec: StructuredOutputsParams, cache: bool = True) -> Any:
        """`spec` compiled against the tokenizer into a pristine matcher (cached: followers are
        copies of it, so a schema is compiled once, however many requests and samples use it),
        or InvalidRequestError naming what is wrong with it (remembered too: a grammar that
        failed is not compiled again). Without `cache`, neither is kept: a one-off check.
        Thread-safe: the server and AsyncEngine call it on worker threads before the request is made."""
        tokenizer = self._ll_tokenizer()
        key = spec.grammar_key()
        with self._lock:
            if key in self._grammars:
                self._grammars.move_to_end(key)
                return self._grammars[key]
            if (failed := self._failures.get(key)) is not None:
                raise InvalidRequestError(failed, param="structured_outputs")
        try:
            text = grammar_of(spec)
        except (ValueError, TypeError) as exc:
            raise InvalidRequestError(f"structured_outputs: {_first_line(exc)}", param="structured_outputs") from None
        matcher = _llguidance().LLMatcher(tokenizer, text)
        if problem := (matcher.get_error() if matcher.is_error() else "") or _first_step_problem(matcher):
            what = ("json" if spec.json is not None or spec.json_object else "regex" if spec.regex is not None
                    else "grammar" if spec.lark is not None else "choice")
            message = f"structured_outputs: this {what} cannot be followed: {_first_line(problem)}"
            if cache:
                with self._lock:
                    self._failures[key] = message
                    while len(self._failures) > _CACHED_GRAMMARS:
                        self._failures.popitem(last=False)
            raise InvalidRequestError(message, param="structured_outputs")
        if not cache:
            return matcher
        with self._lock:
            self._grammars[key] = matcher
            while len(self._grammars) > _CACHED_GRAMMARS:
                self._grammars.popitem(last=False)
        return matcher

    def follower(self, spec: StructuredOutputsParams, block: ThinkBlock | None = None) -> "GrammarFollower":
        """A new request's matcher, from after `block` when the model may think first
        (InvalidRequestError if `spec` cannot be followed)."""
        pristine = self.grammar(spec)
        tokenizer = self._ll_tokenizer()
        return GrammarFollower(pristine.deep_copy(), self.vocab_size, self.eos_token_ids,
                               int(tokenizer.eos_token), int(tokenizer.vocab_size), block)


def _first_step_problem(matcher: Any) -> str:
    """What stops a compiled grammar at its first step (it matches nothing: no answer, not even
    an empty one, can follow it), or "". Found on a copy: `matcher` stays pristine."""
    probe = matcher.deep_copy()
    probe.compute_logit_bias()
    if probe.is_stopped() and not probe.is_accepting():  # (llguidance's "NoExtensionBias")
        return "nothing can follow it (it matches no text)"
    if probe.is_error():
        return probe.get_error() or "it cannot be followed"
    return ""


def _first_line(problem: Any) -> str:
    """llguidance's message in one line: its first, and where that only opens a regex's error
    ("regex parse error:"), the line below that says what is wrong."""
    lines = [line.strip() for line in str(problem).strip().splitlines()]
    if not lines:
        return "invalid"
    if lines[0].endswith(":") and (why := next((x for x in lines[1:] if x.startswith("error:")), None)):
        return lines[0] + " " + why.removeprefix("error:").strip()
    return lines[0]


class GrammarFollower:
    """One request's place in its grammar, and the tokens it may sample next, as a bitmask (bit
    t of word t // 32 set: token t may come next; 32 times smaller than a bool mask to build and
    to copy to the device each step).

    With a think `block`, the answer's tokens reach the grammar only after it: while the model
    thinks, nothing constrains it (`constrains` is False, and the sampler builds no mask); its
    end marker is not the grammar's; the grammar holds from the next token. An answer that
    does not open the block with its first token is all the grammar's, and so may that first
    token be: it may be the block's start marker or one the grammar allows."""

    def __init__(self, matcher: Any, vocab_size: int, eos_token_ids: frozenset[int], grammar_eos: int,
                 grammar_vocab: int, block: ThinkBlock | None = None) -> None:
        self._matcher = matcher
        self._block = block
        # Where the grammar's part of the output begins; None until the think block is over (or
        # the answer's first token shows it never opens one).
        self._start: int | None = 0 if block is None else None
        self._thinking = block is not None and block.starts_inside
        # The model's EOS tokens (chat models end on <|im_end|>, not the tokenizer's eos) all end
        # a complete answer, as the tokenizer's EOS does for the matcher.
        self._eos = sorted(t for t in eos_token_ids if 0 <= t < vocab_size)
        self._grammar_eos = grammar_eos
        self._grammar_words = (grammar_vocab + 31) // 32  # what llguidance writes
        self.words = max(self._grammar_words, (vocab_size + 31) // 32)
        self._seen = 0
        # Why the grammar could not be followed further (a token off it; llguidance giving up
        # mid-answer on a grammar past its limits, when that step samples EOS). The engine ends the
        # request with this error rather than hand out text the constraint no longer holds for.
        self.failed: str | None = None
        self.followed = 0  # (once failed: how many tokens kept to it)

    def advance(self, output_token_ids: list[int]) -> None:
        """Feed the matcher the tokens it has not seen (the engine calls this as each token comes,
        so a token off the grammar ends the request before it is shown); a think block's tokens
        only move the follower towards the grammar's start."""
        m = self._matcher
        for i in range(self._seen, len(output_token_ids)):
            token = output_token_ids[i]
            if self._start is None:  # (a block: the prompt's, or one the first token may open)
                if self._thinking:
                    if token == self._block.end_token_id:
                        self._start = i + 1
                    continue
                if token == self._block.start_token_id:  # (the answer's first token: after it, thinking or started)
                    self._thinking = True
                    continue
                self._start = i  # the model chose not to think: its answer is the grammar's
            if self.failed is None and not m.is_stopped():
                token = self._grammar_eos if token in self._eos else token
                if not m.consume_token(token):
                    self._fail(m, f"token {token} is off it", i - self._start)
        self._seen = len(output_token_ids)

    def constrains(self, output_token_ids: list[int]) -> bool:
        """Whether the grammar holds over the next token (not while the model thinks)."""
        self.advance(output_token_ids)
        return not self._thinking or self._start is not None

    def fill(self, output_token_ids: list[int], row: torch.Tensor) -> None:
        """Write the next tokens that stay on the grammar into `row` (int32, CPU, contiguous, at
        least `words` long, zeroed): EOS alone once it failed (see `failed`); and, at an answer's
        first token, the think block's start marker (the model may open the block). Called only
        where `constrains`."""
        m = self._matcher
        self.advance(output_token_ids)
        bits = row.numpy().view(np.uint32)
        if self.failed is None and not m.is_stopped():
            m.unsafe_compute_mask_ptr(row.data_ptr(), self._grammar_words * 4)
            if m.is_error():
                self._fail(m, "llguidance gave up", self._seen - (self._start or 0))
                row.zero_()
            elif self._grammar_eos not in self._eos:  # (the tokenizer's EOS, which does not end this model's answers)
                bits[self._grammar_eos >> 5] &= ~np.uint32(1 << (self._grammar_eos & 31))
        if self.failed is not None or m.is_stopped() or m.is_accepting():
            for t in self._eos or [self._grammar_eos]:
                bits[t >> 5] |= np.uint32(1 << (t & 31))
        if self._start is None and self.failed is None and (t := self._block.start_token_id) is not None:
            bits[t >> 5] |= np.uint32(1 << (t & 31))

    def _fail(self, m: Any, fallback: str, followed: int) -> None:
        """`followed`: how many of the answer's tokens kept to the grammar."""
        self.failed = _first_line(m.get_error() or fallback)
        self.followed = followed
        logger.warning("a structured output could not be followed past %d tokens (%s); the request ends with "
                       "an error", followed, self.failed)


def unpack_bitmask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[rows, words] int32 bitmasks (on the logits' device) as [rows, vocab_size] bools, through
    bytes (a byte per token in between, not four: 256 rows of a 152k vocabulary)."""
    as_bytes = bitmask.contiguous().view(torch.uint8)  # little-endian: token t is bit t % 8 of byte t // 8
    shifts = torch.arange(8, device=bitmask.device, dtype=torch.uint8)
    bits = (as_bytes.unsqueeze(-1) >> shifts) & 1
    return bits.flatten(1)[:, :vocab_size].bool()
