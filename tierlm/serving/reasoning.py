"""Reasoning in an answer: the think block a reasoning model writes before it answers.

Qwen3, DeepSeek-R1, SmolLM3 and their kin think first, inside `<think>` ... `</think>`, then
answer. Shown as text, that block is the model's scratch work mixed into its answer; both APIs
have a place for it instead: Anthropic's `thinking` content blocks and the OpenAI chat fields
vLLM's reasoning parsers fill (`reasoning_content`, and `reasoning` under its newer name).
`ReasoningSplitter` separates the two as the text streams in (`tierlm serve --reasoning-parser`;
by default on for a model whose chat template writes think markers).

What counts as reasoning: one think block at the very start of the answer, opened by the model
(its first non-blank text is `<think>`) or by the prompt (the generation prompt ends inside an
open `<think>`, as DeepSeek-R1's and Qwen3-Thinking's do; or an assistant prefill left one open:
the answer continues its reasoning as written). A `<think>` written again at the block's start is
dropped (the model repeating the prompt's).
The block ends at `</think>`, or with the answer (cut off while thinking: everything is
reasoning). Blank space around the reasoning and between it and the answer is dropped (Qwen3
writes `<think>\n...\n</think>\n\n`). A think tag anywhere else is text: the parser never moves
text the model wrote as its answer.

gpt-oss writes OpenAI's harmony format instead (channels, not a think block: harmony.py); the
`harmony` parser (vLLM's `openai_gptoss`) reads its analysis channel as the reasoning.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, replace
from typing import Any

from tierlm.engine.detokenizer import KEPT_CLOSE, KEPT_OPEN, skipped_ids

THINK_START = "<think>"
THINK_END = "</think>"
# What --reasoning-parser takes; vLLM's names for the same syntax are accepted too.
PARSERS = ("auto", "none", "think", "qwen3", "deepseek_r1", "harmony", "openai_gptoss")


def check_parser(parser: str) -> None:
    if parser not in PARSERS:
        raise ValueError(f"unknown reasoning parser '{parser}'; use one of {', '.join(PARSERS)}")


def both_names(reasoning: str) -> dict[str, str]:
    """Reasoning under the two names vLLM uses (`reasoning_content`, and `reasoning` since it was
    renamed): templates read one or the other, clients of either vintage look for theirs."""
    return {"reasoning_content": reasoning, "reasoning": reasoning}


@dataclass(frozen=True)
class ReasoningFormat:
    """A served model's think markers: as its chat template writes them (`start`, `end`), and
    as they come in a decoded answer. A marker the tokenizer makes a special token is dropped by
    a decode that skips special tokens, so its id is kept (`keep_token_ids`) and the detokenizer
    wraps its text in KEPT_OPEN ... KEPT_CLOSE: only that token marks reasoning, and the wrapped
    text never reaches the client (a plain decode would not show it either)."""

    start: str = THINK_START
    end: str = THINK_END
    keep_token_ids: tuple[int, ...] = ()
    answer_start: str = THINK_START
    answer_end: str = THINK_END
    # vLLM's deepseek_r1: every answer starts inside the block (R1 templates that do not write
    # the `<think>` the model no longer writes either)
    always_opens: bool = False
    # The markers' tokens, for a thinking budget to follow the block and force its end, and for
    # a structured answer's grammar to start after it: only where each marker is one token of its
    # own (Qwen3's, R1's, SmolLM3's). Spelled in several ordinary tokens, a marker the model wrote
    # another way would go unseen: the budget would force `</think>` into the answer, the grammar
    # would never start. No budget is kept then, and a structured answer does not think first.
    start_token_ids: tuple[int, ...] = ()
    end_token_ids: tuple[int, ...] = ()
    # OpenAI's harmony (gpt-oss): reasoning is a channel, not a block (harmony.py). `start` and
    # `end` are then `<|channel|>` and `<|end|>` (in `answer_*` wrapped where their tokens are
    # kept: how the splitter tells kept markers from plain ones); no answer opens inside a block.
    harmony: bool = False

    def opens_in_reasoning(self, prompt_text: str, prefill: str | None = None) -> bool:
        """Whether the answer to `prompt_text` starts inside a think block: the prompt's last
        `<think>` is still open and nothing but blank space follows it (the generation prompt
        opened it), or it lies in the assistant `prefill` the answer continues."""
        if self.harmony:
            return False
        at = prompt_text.rfind(self.start)
        if self.always_opens:  # unless the prompt itself wrote a whole block last (thinking switched off)
            return not self.closed_in_prompt(prompt_text)
        if at < 0 or prompt_text.rfind(self.end) > at:
            return False
        if not prompt_text[at + len(self.start):].strip():
            return True
        return self._open_in(prefill)

    def closed_in_prompt(self, prompt_text: str) -> bool:
        """Whether the prompt ends with a whole think block (and blank space): thinking switched
        off (Qwen3's `enable_thinking: false`, R1's closed block), so the answer opens none."""
        if self.harmony:
            return False
        closed = prompt_text.rfind(self.end)
        return closed >= 0 and closed > prompt_text.rfind(self.start) and not prompt_text[closed + len(self.end):].strip()

    def continues_reasoning(self, prefill: str | None) -> bool:
        """Whether an assistant `prefill` ends inside a think block it has begun writing: the
        answer then continues that reasoning as written (its first blank space is the model's)."""
        return self._open_in(prefill) and bool(prefill[prefill.rfind(self.start) + len(self.start):].strip())

    def _open_in(self, prefill: str | None) -> bool:
        return not self.harmony and prefill is not None and prefill.rfind(self.start) > prefill.rfind(self.end)

    @property
    def budget_kept(self) -> bool:
        """Whether the engine can follow the block by its tokens (both markers are tokens of their
        own): to keep a thinking budget, and to start a structured answer's grammar after it."""
        return bool(self.start_token_ids and self.end_token_ids)

    def decoded(self, skip_special_tokens: bool) -> "ReasoningFormat":
        """The format for answers decoded this way: without skipping special tokens, a special
        marker comes as its plain text (the detokenizer wraps only tokens it would skip)."""
        return self if skip_special_tokens else replace(self, answer_start=self.start, answer_end=self.end)


def reasoning_format(parser: str, tokenizer: Any) -> ReasoningFormat | None:
    """`parser` (one of PARSERS) for a model with this tokenizer; None: its answers are text.
    "auto" is "harmony" for a tokenizer whose chat template or vocabulary has harmony's
    `<|channel|>` and `<|message|>` (gpt-oss), "think" for a chat template that writes `<think>`
    or `</think>` (it shows the model think blocks, in its generation prompt or in past turns),
    "none" otherwise."""
    check_parser(parser)
    if parser == "none":
        return None
    from tierlm.serving import harmony  # (harmony's splitter builds on AnswerSplitter below)

    if parser in ("harmony", "openai_gptoss") or (parser == "auto" and harmony.is_harmony(tokenizer)):
        return harmony_format(tokenizer)
    if parser == "deepseek_r1":
        return replace(_think_format(tokenizer), always_opens=True)
    if parser == "auto" and not any(marker in _template_text(tokenizer) for marker in (THINK_START, THINK_END)):
        return None
    return _think_format(tokenizer)


def _think_format(tokenizer: Any) -> ReasoningFormat:
    added = tokenizer.get_added_vocab() if hasattr(tokenizer, "get_added_vocab") else {}
    skipped = skipped_ids(tokenizer)
    kept = {m: added[m] for m in (THINK_START, THINK_END) if added.get(m) in skipped}

    def in_answer(marker: str) -> str:
        return KEPT_OPEN + marker + KEPT_CLOSE if marker in kept else marker
    return ReasoningFormat(keep_token_ids=tuple(kept.values()), answer_start=in_answer(THINK_START),
                           answer_end=in_answer(THINK_END), start_token_ids=_one_token(tokenizer, THINK_START),
                           end_token_ids=_one_token(tokenizer, THINK_END))


def harmony_format(tokenizer: Any) -> ReasoningFormat:
    """Harmony's format for this tokenizer: its markers' ids kept where a decode would skip them."""
    from tierlm.serving import harmony

    added = tokenizer.get_added_vocab() if hasattr(tokenizer, "get_added_vocab") else {}
    skipped = skipped_ids(tokenizer)
    kept = tuple(added[m] for m in harmony.MARKERS if added.get(m) in skipped)
    # (`start` and `end` as a message's: what the Responses API counts reasoning tokens by)
    wrap = harmony.wrapped if added.get(harmony.CHANNEL) in skipped else str
    return ReasoningFormat(start=harmony.CHANNEL, end=harmony.END, keep_token_ids=kept,
                           answer_start=wrap(harmony.CHANNEL), answer_end=wrap(harmony.END), harmony=True)


def reasoning_splitter(fmt: ReasoningFormat, in_reasoning: bool = False, continuing: bool = False,
                       calls: bool = False) -> AnswerSplitter:
    """The splitter that reads answers in `fmt`. `calls`: a harmony answer's tool calls go into
    the text for the tool parser (see harmony.py); a think block's calls are in the text anyway."""
    from tierlm.serving.harmony import HarmonySplitter

    if fmt.harmony:
        return HarmonySplitter(wrapped=fmt.answer_start.startswith(KEPT_OPEN), calls=calls)
    return ReasoningSplitter(fmt, in_reasoning, continuing)


def _one_token(tokenizer: Any, marker: str) -> tuple[int, ...]:
    """(`marker`'s token id,) where the tokenizer has it as one token of its own, else ()."""
    ids = tokenizer.encode(marker, add_special_tokens=False)
    return (int(ids[0]),) if len(ids) == 1 else ()


def _template_text(tokenizer: Any) -> str:
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):  # named templates (default, tool_use, ...)
        return "\n".join(str(v) for v in template.values())
    return template if isinstance(template, str) else ""


class AnswerSplitter:
    """An answer's text, fed as it streams, as (reasoning, text) pieces ready to show (`_drain`
    says how a syntax reads it): what is held back is released by `finish`.

    Once `record` is called, it also says which characters of the answer a client never sees
    (`markup`: markers, headers, blank space dropped around them), for the safety layer to read
    only what a client can (safety.OutputGuard)."""

    _held = ""
    _fed = 0  # characters fed
    _decided = 0  # characters known to be shown or not
    # Once `record` is called: spans of the answer never shown ("hidden"), and, where a syntax
    # notes them, of text shown as text ("text"); taken by `markup` (and `text_spans`)
    _spans: dict[str, list[tuple[int, int]]] | None = None

    def feed(self, text: str) -> tuple[str, str]:
        self._fed += len(text)
        self._held += text
        return self._drain(final=False)

    def record(self) -> "AnswerSplitter":
        """Keep the spans `markup` gives (from here on; a splitter that only splits keeps none)."""
        self._spans = {"hidden": [], "text": []}
        return self

    def markup(self) -> tuple[int, list[tuple[int, int]]]:
        """(how many characters of the answer fed so far are decided, the spans of them never
        shown since the last call): what the safety layer may read of it."""
        return max(0, self._decided), [(max(0, s), e) for s, e in self._take("hidden") if e > 0]

    def _take(self, kind: str) -> list[tuple[int, int]]:
        assert self._spans is not None, "call record() first"
        spans, self._spans[kind] = self._spans[kind], []
        return spans

    def _note(self, kind: str, start: int, end: int) -> None:
        """A span of `kind` (recorded only once `record` is called; one span with the last where
        it goes on from it)."""
        if self._spans is None or end <= start:
            return
        spans = self._spans[kind]
        if spans and spans[-1][1] == start:
            start = spans.pop()[0]
        spans.append((start, end))

    def finish(self) -> tuple[str, str]:
        return self._drain(final=True)

    def split(self, text: str) -> tuple[str, str]:
        """A whole answer (fed, then finished) as (reasoning, text)."""
        r1, c1 = self.feed(text)
        r2, c2 = self.finish()
        return r1 + r2, c1 + c2

    def _drain(self, final: bool) -> tuple[str, str]:
        raise NotImplementedError


class ReasoningSplitter(AnswerSplitter):
    """An answer's think block and its text, as (reasoning, text) pieces ready to show.

    Text that may still turn out to be a marker, or blank space that is dropped if the block
    ends after it, is held back until it is known; `finish` releases what is left. Fed the
    whole answer at once and finished, it gives the same split as fed piece by piece (the
    non-streamed answer is split this way too). Each feed costs time in its own length (held
    blank space is kept aside, never searched again: a model writing newline after newline
    while it thinks must not slow the event loop down quadratically).

    Recording (`record`), its markup is what it takes out: the markers, the blank space dropped
    around the block, kept tokens in the reasoning; blank space held back is undecided."""

    def __init__(self, fmt: ReasoningFormat, in_reasoning: bool = False, continuing: bool = False) -> None:
        self._start, self._end = fmt.answer_start, fmt.answer_end
        # Kept think-marker tokens anywhere else are taken out of the text (held while a piece
        # may be one); in the reasoning, every kept token is (a tool-call marker too).
        self._wrapped = tuple(m for m in (self._start, self._end) if m.startswith(KEPT_OPEN))
        self._wrapped_markers = re.compile("|".join(map(re.escape, self._wrapped))) if self._wrapped else None
        # `continuing`: the prompt's reasoning goes on (a prefill inside a think block)
        self._state = ("thinking" if continuing else "thinking_lead") if in_reasoning else "lead"
        self._held = ""  # undecided text: at most a possible marker, plus the newest feed
        self._space: list[str] = []  # blank text held back: dropped, or shown once text follows
        self._spaced = 0  # its length (it lies just before `_held`)

    def _drain(self, final: bool) -> tuple[str, str]:
        reasoning: list[str] = []
        content: list[str] = []
        start, end = self._start, self._end
        while True:
            held = self._held
            at_held = self._fed - len(held)  # where `held` starts in the answer
            if self._state == "lead":  # the answer's start: does it open a think block?
                body = held.lstrip()
                if len(body) < len(held):
                    self._space.append(held[:len(held) - len(body)])
                    self._spaced += len(held) - len(body)
                    self._held = held = body
                if held.startswith(start):  # (the blank space before it and the marker: never shown)
                    self._hide(self._fed - len(held) - self._spaced, self._fed - len(held) + len(start))
                    self._held, self._space, self._spaced = held[len(start):], [], 0
                    self._state = "thinking_lead"
                    continue
                if not final and start.startswith(held):  # nothing yet, or a start marker so far
                    break
                self._held, self._space, self._spaced = "".join(self._space) + held, [], 0
                self._state = "text"
                continue
            if self._state == "thinking_lead":  # blank space, and a start marker written again, dropped
                body = held.lstrip()
                again = body.startswith(start)
                body = body[len(start):] if again else body
                self._hide(at_held, self._fed - len(body))
                self._held = held = body
                if again:
                    continue
                if not held or (not final and start.startswith(held)):
                    break
                self._state = "thinking"
                continue
            if self._state == "thinking":
                at = held.find(end)
                if at >= 0 or final:
                    self._think(held[:at] if at >= 0 else held, reasoning, at_held, ends=True)
                    self._held = held[at + len(end):] if at >= 0 else ""
                    self._hide(at_held + at if at >= 0 else self._fed, self._fed - len(self._held))
                    self._state = "after"
                    continue
                cut = min(_partial_marker_at(held, (end,)), _unclosed_kept_at(held))
                self._think(held[:cut], reasoning, at_held, ends=False)
                self._held = held[cut:]
                break
            if self._state == "after":  # blank space between the block and the answer: dropped
                self._held = held = held.lstrip()
                self._hide(at_held, self._fed - len(held))
                if not held:
                    break
                self._state = "text"
                continue
            # "text": everything shows as it comes
            cut = len(held) if final else _partial_marker_at(held, self._wrapped)
            content.append(held[:cut])
            self._hide_all(held[:cut], at_held, self._wrapped_markers)
            self._held = held[cut:]
            break
        self._decided = self._fed - len(self._held) - self._spaced
        return _without_kept_tokens("".join(reasoning)), self._without_wrapped_markers("".join(content))

    def _think(self, piece: str, reasoning: list[str], at: int, ends: bool) -> None:
        """Show `piece` of reasoning (at `at` in the answer), but its trailing blank space: that
        waits for more text (`ends`: the block ended, and it is dropped)."""
        said = piece.rstrip()
        if said:
            reasoning.append("".join(self._space) + said)
            self._hide_all(said, at, _KEPT_TOKEN)
            self._space, self._spaced = [], 0
        if ends:
            self._hide(at + len(said) - self._spaced, at + len(piece))
            self._space, self._spaced = [], 0
        elif len(said) < len(piece):
            self._space.append(piece[len(said):])
            self._spaced += len(piece) - len(said)

    def _hide(self, start: int, end: int) -> None:
        self._note("hidden", start, end)

    def _hide_all(self, piece: str, at: int, pattern: "re.Pattern[str] | None") -> None:
        """Note what `pattern` finds in `piece` (at `at` in the answer): taken out, never shown."""
        if self._spans is not None and pattern is not None:
            for m in pattern.finditer(piece):
                self._hide(at + m.start(), at + m.end())

    def _without_wrapped_markers(self, text: str) -> str:
        return self._wrapped_markers.sub("", text) if self._wrapped_markers is not None else text


def _partial_marker_at(text: str, markers: tuple[str, ...]) -> int:
    """Where the longest tail of `text` that begins one of `markers` starts (len(text) if none)."""
    longest = max((len(m) for m in markers), default=1)
    for n in range(min(longest - 1, len(text)), 0, -1):
        if any(m.startswith(text[-n:]) for m in markers):
            return len(text) - n
    return len(text)


# A kept token's text is a special token's: short. A KEPT_OPEN with no KEPT_CLOSE this far after
# it is no kept token (a model wrote the character itself) and is not held back any longer.
_MAX_KEPT_TEXT = 256


def _unclosed_kept_at(text: str) -> int:
    """Where a kept token's text that has not ended yet (KEPT_OPEN without its KEPT_CLOSE) starts."""
    at = text.rfind(KEPT_OPEN)
    if at < 0 or len(text) - at > _MAX_KEPT_TEXT or KEPT_CLOSE in text[at:]:
        return len(text)
    return at


_KEPT_TOKEN = re.compile(f"{KEPT_OPEN}[^{KEPT_OPEN}{KEPT_CLOSE}]*{KEPT_CLOSE}|[{KEPT_OPEN}{KEPT_CLOSE}]")


def _without_kept_tokens(text: str) -> str:
    """Reasoning without the special tokens kept for parsing (a decode would not show them)."""
    return _KEPT_TOKEN.sub("", text) if KEPT_OPEN in text or KEPT_CLOSE in text else text


def split_reasoning(text: str, fmt: ReasoningFormat, in_reasoning: bool = False,
                    continuing: bool = False) -> tuple[str, str]:
    """A whole answer as (reasoning, text): the streamed split, in one go."""
    return ReasoningSplitter(fmt, in_reasoning, continuing).split(text)
