"""Per-request sampling settings, shaped like vLLM's so its users feel at home."""
from __future__ import annotations

import dataclasses
import functools
import json as _json
import numbers
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from tierlm.errors import InvalidRequestError

# Stop strings are looked for after every token, on the loop all requests share: an unbounded
# list (200,000 of them) slowed every other stream ninefold. vLLM sets no limit, OpenAI's is 4.
MAX_STOP_STRINGS = 64
MAX_STOP_CHARS = 1024
# logit_bias entries: each step scatters every asking row's entries, so one request cannot make
# every step of its batch build a vocabulary-sized list. OpenAI documents no bound; vLLM sets none.
MAX_LOGIT_BIAS = 1024
MAX_LOGPROBS = 20  # top log-probabilities per token, OpenAI's bound
# bad_words are tokenized when the request is made, twice each (as-is and after a space, as vLLM;
# the server does it on a worker thread) and looked up after every token: bounded, so one request
# cannot hold a CPU for seconds (1,024 words of 1,024 random characters took 1 s). Words are short;
# vLLM sets no bound.
MAX_BAD_WORDS = 1024
MAX_BAD_WORD_CHARS = 256
# allowed_token_ids on the OpenAI routes: more than any vocabulary (Gemma 3's is 262,144); the
# engine refuses ids outside its own vocabulary.
MAX_ALLOWED_TOKEN_IDS = 262_144


# vLLM's request fields tierlm cannot honour, and why: one table for SamplingParams' keywords and
# the OpenAI routes' body fields. A refusal reads "'<field>' <why>; remove it". Each is accepted at
# its neutral value (None unless listed in VLLM_NEUTRAL), as it changes nothing then.
UNSUPPORTED_VLLM_FIELDS = {
    "guided_grammar": "(a grammar to follow) is not supported by tierlm: use structured outputs' json, regex or choice",
    "guided_decoding": "(vLLM's older guided decoding) is not supported by tierlm: use structured_outputs",
    "use_beam_search": "(beam search) is not supported by tierlm",
    "spaces_between_special_tokens": "other than true (vLLM's default) is not supported by tierlm",
    "best_of": "is not supported by tierlm (every sample is returned: set n)",
    "output_kind": "is not supported by tierlm (LLM.generate returns finished outputs, AsyncEngine.generate "
                   "yields deltas)",
    "logits_processors": "is not supported by tierlm",
    "detokenize": "other than true (vLLM's default) is not supported by tierlm",
}
VLLM_NEUTRAL = {"use_beam_search": False, "spaces_between_special_tokens": True, "detokenize": True}


def unsupported_vllm_field(name: str, value: object) -> str | None:
    """Why tierlm refuses vLLM's field `name` at `value` ("'name' ...; remove it"), or None (not
    one of vLLM's fields tierlm lacks, or its neutral value)."""
    if name not in UNSUPPORTED_VLLM_FIELDS or value is None or value is VLLM_NEUTRAL.get(name):
        return None
    if name == "logits_processors" and isinstance(value, (list, tuple)) and not value:
        return None  # none given
    return f"'{name}' {UNSUPPORTED_VLLM_FIELDS[name]}; remove it"


_SEED_SPAN = 2**64  # seeds lie in [-2**63, 2**64)


def choice_seed(seed: int | None, index: int) -> int | None:
    """Sample `index`'s seed among n: the request's plus the index, as vLLM derives them (so
    sample 0 draws what n=1 would); wrapped to stay a valid seed. Used by `LLM.generate` and the
    OpenAI routes' `n`."""
    if seed is None:
        return None
    child = seed + index
    return child - _SEED_SPAN if child >= _SEED_SPAN else child


def truncation_kept(truncate: int, max_model_len: int, max_tokens: int | None) -> int:
    """How many prompt tokens `truncate_prompt_tokens` keeps. N keeps the last N (vLLM's); -1
    keeps as many as fit beside the output: max_model_len less max_tokens (less 1 without it).
    vLLM's -1 keeps max_model_len, which no request can then run with: no room for one token."""
    if truncate != -1:
        return truncate
    return max(1, max_model_len - (max_tokens if max_tokens is not None else 1))


def truncate_prompt(ids: list[int], truncate: int, max_model_len: int, max_tokens: int | None) -> list[int]:
    """vLLM's truncate_prompt_tokens applied: the prompt's last `truncation_kept` tokens. One that
    keeps more than the context is refused (for the engine and the server alike)."""
    keep = truncation_kept(truncate, max_model_len, max_tokens)
    if keep > max_model_len:
        raise InvalidRequestError(f"truncate_prompt_tokens ({keep}) is greater than max_model_len ({max_model_len}); "
                                  "give a smaller one, or -1 for as many as fit", param="truncate_prompt_tokens")
    return ids[-keep:]


def truncate_prompt_tokens_problem(value: int) -> str | None:
    """Why this truncate_prompt_tokens is refused (vLLM's rule: at least 1, or -1), or None."""
    if value < 1 and value != -1:
        return f"must be at least 1, or -1 for max_model_len (got {value})"
    return None


def allowed_token_ids_problem(ids: object) -> str | None:
    """Why these allowed_token_ids are refused (not a list, empty, not token ids), or None. The
    vocabulary's bound is the engine's to check, when the request is made."""
    if not isinstance(ids, (list, tuple)):
        return f"must be a list of token ids (got {ids!r})"
    if not ids:  # vLLM refuses it too: nothing could be sampled
        return "must not be empty (leave it out to allow every token)"
    if any(not _is_int(t) or t < 0 for t in ids):
        return "entries must be non-negative integers (token ids)"
    return None


def bad_words_problem(words: object) -> str | None:
    """Why these bad_words are refused (not a list of strings, too many, too long, no word), or None."""
    if not isinstance(words, (list, tuple)) or any(not isinstance(w, str) for w in words):
        return f"must be a list of strings (got {words!r})"
    if len(words) > MAX_BAD_WORDS:
        return f"may hold at most {MAX_BAD_WORDS} words (got {len(words)})"
    longest = max(map(len, words), default=0)
    if longest > MAX_BAD_WORD_CHARS:
        return f"may hold words of at most {MAX_BAD_WORD_CHARS} characters (got one of {longest})"
    if any(not w.lstrip() for w in words):  # (vLLM strips leading whitespace, then fails on nothing)
        return "must not hold empty or whitespace-only words"
    return None


def bad_words_token_ids(tokenizer, words: Sequence[str]) -> list[list[int]]:
    """Each bad word's token ids as vLLM's SamplingParams.update_from_tokenizer finds them: the
    word without its leading whitespace, tokenized without special tokens; and again after a
    space, kept when that spelling's first token differs and the length is the same (so " word"
    is banned mid-text as well as "word" at the start)."""
    texts = [prefix + w.lstrip() for w in words for prefix in ("", " ")]
    encoded = tokenizer(texts, add_special_tokens=False)["input_ids"] if texts else []
    found: list[list[int]] = []
    for plain, spaced in zip(encoded[::2], encoded[1::2]):
        found.append(list(plain))
        if spaced and plain and spaced[0] != plain[0] and len(spaced) == len(plain):
            found.append(list(spaced))
    return [ids for ids in found if ids]


class BadWords:
    """A request's bad words as token ids, indexed for each step: a word's last token is banned when
    the output so far ends with the word's other tokens (a one-token word's token always), as
    vLLM's. vLLM looks at the output only, not the prompt: a prompt ending with a word's first
    tokens does not ban its last one. A step costs one look-up per distinct word length."""

    def __init__(self, token_ids: Sequence[Sequence[int]]) -> None:
        self.always: list[int] = sorted({ids[0] for ids in token_ids if len(ids) == 1})
        self.after: dict[int, dict[tuple[int, ...], set[int]]] = {}  # prefix length -> prefix -> last tokens
        for ids in token_ids:
            if len(ids) > 1:
                self.after.setdefault(len(ids) - 1, {}).setdefault(tuple(ids[:-1]), set()).add(ids[-1])

    def banned(self, output_token_ids: Sequence[int]) -> list[int]:
        """The tokens the next step may not sample, after `output_token_ids`."""
        out = list(self.always)
        n = len(output_token_ids)
        for length, prefixes in self.after.items():
            if length <= n and (last := prefixes.get(tuple(output_token_ids[n - length:]))):
                out += last
        return out


@dataclass(frozen=True)
class ThinkBlock:
    """A reasoning model's think block, which a structured output starts after (vLLM applies the
    grammar once its reasoning parser sees the reasoning end; Anthropic's output_config.format
    with thinking on thinks first): the block the answer opens with its very first token
    (`start_token_id`; None: the answer never opens one), or, `starts_inside`, the one the prompt
    opened. It ends at `end_token_id`. Each marker is one token of its own: spelled in several,
    a marker the model wrote another way would go unseen, and the grammar would never start."""

    end_token_id: int
    start_token_id: int | None = None
    starts_inside: bool = False

    def __post_init__(self) -> None:
        for name in ("end_token_id", "start_token_id"):  # numpy's ints as Python's
            if _is_int(value := getattr(self, name)):
                object.__setattr__(self, name, int(value))

    @classmethod
    def of(cls, budget: "ThinkingBudget") -> "ThinkBlock | None":
        """The block `budget` caps, or None where its markers are not one token each."""
        if len(budget.end_token_ids) != 1 or len(budget.start_token_ids) > 1:
            return None
        return cls(budget.end_token_ids[0], budget.start_token_ids[0] if budget.start_token_ids else None,
                   budget.starts_inside)

    def token_ids(self) -> tuple[int, ...]:
        return (self.end_token_id,) + (() if self.start_token_id is None else (self.start_token_id,))

    def problem(self) -> str | None:
        """Why this block is refused, or None."""
        if any(not _is_int(t) or t < 0 for t in self.token_ids()):
            return "after_reasoning's marker token ids must be non-negative integers (one token each)"
        if not isinstance(self.starts_inside, bool):
            return f"after_reasoning's starts_inside must be true or false (got {self.starts_inside!r})"
        return None


@dataclass(frozen=True)
class StructuredOutputsParams:
    """vLLM's structured outputs: the answer follows a JSON schema (`json`, a dict or its JSON
    text), is any JSON object (`json_object`), matches a regular expression (`regex`) or is one
    of some strings (`choice`); or, tierlm's own, it follows a grammar in llguidance's Lark
    dialect (`lark`, whose `%json {...}` embeds a schema: the server composes one for a required
    tool call, see serving/tool_grammar.py; the HTTP APIs take none from clients). Exactly one is
    given. Decoding is constrained token by token (engine/grammar.py): only tokens that keep the
    answer on the grammar can be sampled, and EOS only once it is complete.

    `after_reasoning` (tierlm's; the server sets it for a reasoning model whose markers are
    tokens of their own) lets the model think first: until the block's end marker the answer is
    unconstrained, the marker is not the grammar's, and the grammar holds from the next token.
    An answer that does not open the block with its first token (its first token may be the
    start marker or the grammar's) follows the grammar from that first token. Beside a
    `thinking_budget` the grammar starts after the budget's block without it."""

    json: Any = None
    json_object: bool = False
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    lark: str | None = None
    after_reasoning: ThinkBlock | None = None

    def __post_init__(self) -> None:
        if isinstance(self.choice, list):
            object.__setattr__(self, "choice", tuple(self.choice))

    def grammar_key(self) -> str:
        """What the compiled grammar depends on (not `after_reasoning`), as text: its cache key.
        Key order is kept: llguidance writes an object's properties in the schema's order."""
        return _json.dumps([self.json, self.json_object, self.regex, self.choice, self.lark], default=str)

    def problem(self) -> str | None:
        """Why this is refused (before the grammar is compiled), or None."""
        given = [n for n in ("json", "regex", "choice", "lark") if getattr(self, n) is not None] + \
            (["json_object"] if self.json_object else [])
        if len(given) != 1:
            return f"must set exactly one of json, json_object, regex, choice, lark (got {', '.join(given) or 'none'})"
        if self.json is not None and not isinstance(self.json, (dict, str)):
            return f"json must be a JSON schema (an object, or its JSON text) (got {type(self.json).__name__})"
        if self.regex is not None and not isinstance(self.regex, str):
            return "regex must be a string"
        if self.lark is not None and not isinstance(self.lark, str):
            return "lark must be a string (a grammar in llguidance's Lark dialect)"
        if self.choice is not None and (not self.choice or any(not isinstance(c, str) or not c for c in self.choice)):
            return "choice must be a non-empty list of non-empty strings"
        if self.after_reasoning is not None:
            if not isinstance(self.after_reasoning, ThinkBlock):
                return f"after_reasoning must be a ThinkBlock (got {self.after_reasoning!r})"
            return self.after_reasoning.problem()
        return None


@dataclass(frozen=True)
class ThinkingBudget:
    """A cap on a reasoning model's think block (vLLM's thinking_token_budget, Anthropic's
    budget_tokens): once `budget` tokens are inside the block, the tokens of its end marker are
    forced, one a step, and the model goes on to its answer. The block is the one the answer
    opens with (`start_token_ids` as its first tokens), or, `starts_inside`, the one the prompt
    opened. The server builds it from the model's think markers (serving/reasoning.py)."""

    budget: int
    end_token_ids: tuple[int, ...]
    start_token_ids: tuple[int, ...] = ()
    starts_inside: bool = False

    def __post_init__(self) -> None:
        # Ids as plain ints in tuples, whatever sequence they came in (a list never equals the
        # tuple of the tokens the tracker compares it with: the block was never seen to end).
        for name in ("end_token_ids", "start_token_ids"):
            ids = getattr(self, name)
            if hasattr(ids, "tolist"):  # numpy's, torch's
                ids = ids.tolist()
            if isinstance(ids, (list, tuple)):
                object.__setattr__(self, name, tuple(int(t) if _is_int(t) else t for t in ids))

    def problem(self) -> str | None:
        """Why this budget is refused, or None."""
        if not _is_int(self.budget) or self.budget < 0:
            return f"budget must be an integer of at least 0 (got {self.budget!r})"
        if not isinstance(self.end_token_ids, tuple) or not isinstance(self.start_token_ids, tuple):
            return "token ids must be sequences of token ids"
        if not self.end_token_ids:
            return "end_token_ids must name the end marker's tokens"
        if any(not _is_int(t) or t < 0 for t in (*self.end_token_ids, *self.start_token_ids)):
            return "token ids must be non-negative integers"
        if not isinstance(self.starts_inside, bool):
            return f"starts_inside must be true or false (got {self.starts_inside!r})"
        return None


class ThinkingTracker:
    """Where a request's output stands against its ThinkingBudget, read from the tokens as they
    come (each looked at once): before the block, inside it (how many tokens), or past it."""

    def __init__(self, limit: ThinkingBudget) -> None:
        self.limit = limit
        self._state = "inside" if limit.starts_inside else "before"
        self._seen = 0
        self._inside = 0

    def forced(self, output_token_ids: Sequence[int]) -> int | None:
        """The token the next step must take (the end marker's next one), or None."""
        if self._state == "past":  # (nothing more to follow)
            return None
        out, end, start = output_token_ids, self.limit.end_token_ids, self.limit.start_token_ids
        for i in range(self._seen, len(out)):
            if self._state == "before":
                if i < len(start) and out[i] == start[i]:
                    self._state = "inside" if i + 1 == len(start) else "before"
                else:
                    self._state = "past"
            elif self._state == "inside":
                self._inside += 1
                if i + 1 >= len(end) and tuple(out[i + 1 - len(end):i + 1]) == end:
                    self._state = "past"
        self._seen = len(out)
        if self._state != "inside" or self._inside < self.limit.budget:
            return None
        for k in range(min(len(end) - 1, len(out)), 0, -1):  # the marker's next token, where it began
            if tuple(out[-k:]) == end[:k]:
                return end[k]
        return end[0]


def stop_strings_problem(stops: Sequence[str]) -> str | None:
    """Why these stop strings are refused (empty, too many, too long), or None."""
    if any(s == "" for s in stops):
        return "must not hold empty strings"
    if len(stops) > MAX_STOP_STRINGS:
        return f"may hold at most {MAX_STOP_STRINGS} strings (got {len(stops)})"
    longest = max(map(len, stops), default=0)
    if longest > MAX_STOP_CHARS:
        return f"may hold strings of at most {MAX_STOP_CHARS} characters (got one of {longest})"
    return None


@dataclass
class SamplingParams:
    """How to pick each next token and when to stop.

    `n` samples per prompt are `LLM.generate`'s (sample i seeded with `seed + i`, as vLLM's);
    `AsyncEngine.generate` takes n = 1. `top_k <= 0` and `top_p == 1` disable those filters; `temperature == 0` is greedy.
    `stop` strings are excluded from the returned text; `stop_token_ids` end the request
    like EOS does. `logprobs=N` returns the top-N log-probabilities of every sampled token;
    `prompt_logprobs=N` those of every prompt token after the first (the model's distribution
    there, raw, with the prompt token's own logprob and rank: scoring a text). A request asking
    for them computes its whole prompt: a cached prefix would skip the positions they come from.
    `min_tokens`: until this many tokens are out, EOS and `stop_token_ids` cannot be sampled,
    and stop strings are looked for only in text that later tokens make (vLLM's meaning).
    `truncate_prompt_tokens=N` keeps only the prompt's last N tokens (-1: as many as fit beside
    max_tokens, see `truncation_kept`); the output's `prompt_token_ids` are the kept ones.
    `logit_bias` maps token ids to a bias in [-100, 100] added to their logits before penalties
    and filters (OpenAI's meaning); reported logprobs stay the model's own distribution.
    `allowed_token_ids`: only these tokens may be sampled; `bad_words`: these words may not be
    generated (see `BadWords`); both vLLM's, and logprobs stay the model's own distribution there too.
    `thinking_budget` caps a reasoning model's think block (see `ThinkingBudget`); the tokens it
    forces keep the model's own logprobs. `structured_outputs` constrains the answer to a JSON
    schema, a regular expression or a choice (see `StructuredOutputsParams`); logprobs stay the model's own.
    Both together: the model thinks, within its budget, and the grammar holds from the block's end.
    """

    n: int = 1
    max_tokens: int | None = 16
    min_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    logit_bias: dict[int, float] | None = None
    truncate_prompt_tokens: int | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    # Special tokens whose text stays in the output though skip_special_tokens drops the others,
    # between detokenizer.KEPT_OPEN and KEPT_CLOSE (two Unicode noncharacters), so it is not taken
    # for the same text in ordinary tokens: the server keeps a tool-call syntax's markers
    # (`[TOOL_CALLS]`) to find the calls, then takes them out of what the client sees.
    keep_special_token_ids: list[int] | None = None
    thinking_budget: ThinkingBudget | None = None
    structured_outputs: StructuredOutputsParams | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        for name in ("stop", "stop_token_ids", "keep_special_token_ids"):  # list(5) raised a bare TypeError
            if not isinstance(getattr(self, name), (list, tuple, type(None))):
                raise InvalidRequestError(f"sampling parameter '{name}' must be a list (got "
                                          f"{getattr(self, name)!r})", param=name)
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.logit_bias is not None and not isinstance(self.logit_bias, dict):
            raise InvalidRequestError(f"sampling parameter 'logit_bias' must be a dict of token id to bias (got "
                                      f"{self.logit_bias!r})", param="logit_bias")
        self.logit_bias = dict(self.logit_bias) if self.logit_bias else None  # (a copy: the caller's may change)
        self.keep_special_token_ids = list(self.keep_special_token_ids or [])
        if isinstance(self.bad_words, (list, tuple)):  # (a copy: the caller's may change; none given is None)
            self.bad_words = list(self.bad_words) or None
        self.validate()

    def checked_copy(self) -> "SamplingParams":
        """A validated copy, taken when a request is made: fields changed after construction
        were trusted (logprobs=10**6 failed the whole batch's step; max_tokens=0 made one token)."""
        return dataclasses.replace(self)

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5

    def validate(self) -> None:
        """Reject nonsense early, naming the field, so nothing half-runs."""

        def bad(field_name: str, why: str) -> None:
            raise InvalidRequestError(f"sampling parameter '{field_name}' {why}", param=field_name)

        # Types first: a bool is an int to Python, and a string would fail as a TypeError mid-step.
        # numpy's numbers pass (they are Real or Integral) and are kept as Python's own, which the
        # sampler and the seed hashing take.
        for name in ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty",
                     "frequency_penalty"):
            value = getattr(self, name)
            if not _is_number(value):
                bad(name, f"must be a number (got {value!r})")
            if type(value) not in (int, float):
                setattr(self, name, float(value))
        for name in ("n", "max_tokens", "min_tokens", "logprobs", "prompt_logprobs", "top_k", "seed",
                     "truncate_prompt_tokens"):
            value = getattr(self, name)
            if value is not None and not _is_int(value):
                bad(name, f"must be an integer (got {value!r})")
            if value is not None and type(value) is not int:
                setattr(self, name, int(value))
        for name in ("ignore_eos", "skip_special_tokens", "include_stop_str_in_output"):
            if not isinstance(getattr(self, name), bool):  # "false" is true to Python
                bad(name, f"must be true or false (got {getattr(self, name)!r})")
        if self.n < 1:
            bad("n", f"must be at least 1 (got {self.n})")
        if self.max_tokens is not None and self.max_tokens < 1:
            bad("max_tokens", f"must be at least 1 (got {self.max_tokens})")
        if self.min_tokens < 0 or (self.max_tokens is not None and self.min_tokens > self.max_tokens):
            bad("min_tokens", f"must be in [0, max_tokens] (got {self.min_tokens}, max_tokens {self.max_tokens})")
        if not 0.0 <= self.temperature <= 100.0:
            bad("temperature", f"must be in [0, 100] (got {self.temperature})")
        if not 0.0 < self.top_p <= 1.0:
            bad("top_p", f"must be in (0, 1] (got {self.top_p})")
        if self.top_k < -1:  # vLLM's rule: -1 or 0 mean no limit
            bad("top_k", f"must be -1 or 0 (no limit) or at least 1 (got {self.top_k})")
        if not 0.0 <= self.min_p <= 1.0:
            bad("min_p", f"must be in [0, 1] (got {self.min_p})")
        if not 0.01 <= self.repetition_penalty <= 10.0:  # (a tiny one is 0 in float32: infinite logits)
            bad("repetition_penalty", f"must be in [0.01, 10] (got {self.repetition_penalty}); 1 is no penalty")
        if not -2.0 <= self.presence_penalty <= 2.0:
            bad("presence_penalty", f"must be in [-2, 2] (got {self.presence_penalty})")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            bad("frequency_penalty", f"must be in [-2, 2] (got {self.frequency_penalty})")
        if any(not isinstance(s, str) for s in self.stop):
            bad("stop", "entries must be strings")
        if (problem := stop_strings_problem(self.stop)) is not None:
            bad("stop", problem)
        if any(not _is_int(t) or t < 0 for t in self.stop_token_ids):
            bad("stop_token_ids", "entries must be non-negative integers")
        if any(not _is_int(t) or t < 0 for t in self.keep_special_token_ids):
            bad("keep_special_token_ids", "entries must be non-negative integers")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            bad("logprobs", f"must be between 0 and {MAX_LOGPROBS} (got {self.logprobs})")
        if self.prompt_logprobs is not None and not 0 <= self.prompt_logprobs <= MAX_LOGPROBS:
            # (vLLM's -1, the whole vocabulary per prompt token, is refused: one 2,000-token
            # prompt on a 150k vocabulary would be 300 million entries)
            bad("prompt_logprobs", f"must be between 0 and {MAX_LOGPROBS} (got {self.prompt_logprobs})")
        if self.truncate_prompt_tokens is not None and \
                (problem := truncate_prompt_tokens_problem(self.truncate_prompt_tokens)) is not None:
            bad("truncate_prompt_tokens", problem)
        if self.logit_bias:
            if len(self.logit_bias) > MAX_LOGIT_BIAS:
                bad("logit_bias", f"may hold at most {MAX_LOGIT_BIAS} entries (got {len(self.logit_bias)})")
            bias: dict[int, float] = {}
            for token, value in self.logit_bias.items():
                if not _is_int(token) or token < 0:
                    bad("logit_bias", f"keys must be non-negative token ids (got {token!r})")
                if not _is_number(value) or not -100.0 <= value <= 100.0:  # (NaN fails too)
                    bad("logit_bias", f"values must be numbers in [-100, 100] (got {value!r} for token {token})")
                bias[int(token)] = float(value)
            self.logit_bias = bias
        if self.allowed_token_ids is not None:
            if (problem := allowed_token_ids_problem(self.allowed_token_ids)) is not None:
                bad("allowed_token_ids", problem)
            self.allowed_token_ids = [int(t) for t in self.allowed_token_ids]
        if self.bad_words is not None and (problem := bad_words_problem(self.bad_words)) is not None:
            bad("bad_words", problem)
        if self.thinking_budget is not None:
            if not isinstance(self.thinking_budget, ThinkingBudget):
                bad("thinking_budget", f"must be a ThinkingBudget (got {self.thinking_budget!r})")
            if (problem := self.thinking_budget.problem()) is not None:
                bad("thinking_budget", problem)
        if self.structured_outputs is not None:
            if not isinstance(self.structured_outputs, StructuredOutputsParams):
                bad("structured_outputs", f"must be a StructuredOutputsParams (got {self.structured_outputs!r})")
            if (problem := self.structured_outputs.problem()) is not None:
                bad("structured_outputs", problem)
            if self.thinking_budget is not None and (problem := self._budget_block_problem()) is not None:
                bad("structured_outputs", problem)
        if self.seed is not None and not -(2**63) <= self.seed < 2**64:
            bad("seed", f"must be an integer in [-2**63, 2**64) (got {self.seed!r})")

    def _budget_block_problem(self) -> str | None:
        """Why this thinking_budget cannot stand beside this structured output, or None: the
        grammar starts after the budget's block, which must be one a grammar can wait for."""
        block = ThinkBlock.of(self.thinking_budget)
        if block is None:  # (its forced marker tokens would be off the grammar)
            return ("beside a thinking_budget needs the budget's think markers to be one token each (the grammar "
                    "starts after the block's end marker token); give one-token markers, or drop one of them")
        given = self.structured_outputs.after_reasoning
        if given is not None and given != block:
            return (f"after_reasoning ({given}) is not the thinking_budget's think block ({block}); give the same "
                    "markers, or leave after_reasoning out")
        return None

    def think_block(self) -> ThinkBlock | None:
        """The think block the structured output starts after (its own, else the thinking
        budget's), or None: the grammar holds from the first token."""
        spec = self.structured_outputs
        if spec is None:
            return None
        if spec.after_reasoning is None and self.thinking_budget is not None:
            return ThinkBlock.of(self.thinking_budget)
        return spec.after_reasoning

    @property
    def uses_penalties(self) -> bool:
        return (
            self.repetition_penalty != 1.0
            or self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
        )


@dataclass
class PoolingParams:
    """A request for the prompt's embedding instead of an answer (vLLM's PoolingParams, as
    `LLM.embed` and `/v1/embeddings` take it): the final hidden state (after the model's last
    norm) at the prompt's last token, as decoder embedding models (Qwen3-Embedding, e5-mistral)
    pool, L2-normalised unless `normalize` is false. Last-token pooling needs only the last
    position computed, so a cached prefix serves the rest. `dimensions` keeps the first N
    entries (then normalises), for models trained to allow it (Matryoshka representation
    learning: the engine checks the model says so)."""

    normalize: bool = True
    dimensions: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.normalize, bool):
            raise InvalidRequestError(f"pooling parameter 'normalize' must be true or false (got {self.normalize!r})",
                                      param="normalize")
        if self.dimensions is not None and (isinstance(self.dimensions, bool) or not isinstance(self.dimensions, int)
                                            or self.dimensions < 1):
            raise InvalidRequestError(f"pooling parameter 'dimensions' must be a whole number >= 1 (got "
                                      f"{self.dimensions!r})", param="dimensions")


def _refusing_vllm_keywords(init):
    """SamplingParams' __init__, refusing vLLM's keywords tierlm lacks by name (they were a bare
    TypeError) and taking them at their neutral values; a keyword that is no field of vLLM's
    either (a typo) is still Python's TypeError."""

    @functools.wraps(init)
    def __init__(self, *args, **kwargs) -> None:
        for name in [k for k in kwargs if k in UNSUPPORTED_VLLM_FIELDS]:
            value = kwargs.pop(name)
            if name == "best_of" and _is_int(value) and value == kwargs.get("n", 1):
                continue  # best_of == n picks nothing: the n samples themselves (as the OpenAI routes take it)
            if (why := unsupported_vllm_field(name, value)) is not None:
                raise InvalidRequestError(f"sampling parameter {why}", param=name)
        init(self, *args, **kwargs)

    return __init__


SamplingParams.__init__ = _refusing_vllm_keywords(SamplingParams.__init__)


def _is_int(value: object) -> bool:
    """An integer of Python's or numpy's; not a bool."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    """A real number, finite or not, of Python's or numpy's; not a bool, not a string."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool)
