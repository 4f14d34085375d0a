"""Reasoning in an answer: the think block a reasoning model writes before it answers.

Qwen3, DeepSeek-R1, SmolLM3 and their kin think first, inside `<think>` ... `</think>`, then
answer. Shown as text, that block is the model's scratch work mixed into its answer; both APIs
have a place for it instead: Anthropic's `thinking` content blocks and the OpenAI chat fields
vLLM's reasoning parsers fill (`reasoning_content`, and `reasoning` under its newer name).
`ReasoningSplitter` separates the two as the text streams in (`tierlm serve --reasoning-parser`;
by default on for a model whose chat template writes think markers).

What counts as reasoning: one think block at the very start of the answer, opened by the model
(its first non-blank text is `<think>`) or by the prompt (the generation prompt ends inside an
open `<think>`, as DeepSeek-R1's and Qwen3-Thinking's do). The block ends at `</think>`, or with
the answer (cut off while thinking: everything is reasoning). Blank space around the reasoning
and between it and the answer is dropped (Qwen3 writes `<think>\n...\n</think>\n\n`). A think
tag anywhere else is text: the parser never moves text the model wrote as its answer.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tierlm.engine.detokenizer import KEPT_CLOSE, KEPT_OPEN, skipped_ids

THINK_START = "<think>"
THINK_END = "</think>"
# What --reasoning-parser takes; vLLM's names for the same syntax are accepted too.
PARSERS = ("auto", "none", "think", "qwen3", "deepseek_r1")


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

    def opens_in_reasoning(self, prompt_text: str, prefill: str | None = None) -> bool:
        """Whether the answer to `prompt_text` starts inside a think block: the prompt's last
        `<think>` is still open and nothing but blank space follows it (the generation prompt
        opened it), or it lies in the assistant `prefill` the answer continues."""
        at = prompt_text.rfind(self.start)
        if at < 0 or prompt_text.rfind(self.end) > at:
            return False
        if not prompt_text[at + len(self.start):].strip():
            return True
        return prefill is not None and prefill.rfind(self.start) > prefill.rfind(self.end)


def reasoning_format(parser: str, tokenizer: Any) -> ReasoningFormat | None:
    """`parser` (one of PARSERS) for a model with this tokenizer; None: its answers are text.
    "auto" is "think" for a chat template that writes `<think>` or `</think>` (it shows the
    model think blocks, in its generation prompt or in past turns), "none" otherwise."""
    if parser not in PARSERS:
        raise ValueError(f"unknown reasoning parser '{parser}'; use one of {', '.join(PARSERS)}")
    if parser == "none":
        return None
    if parser == "auto" and not any(marker in _template_text(tokenizer) for marker in (THINK_START, THINK_END)):
        return None

    added = tokenizer.get_added_vocab() if hasattr(tokenizer, "get_added_vocab") else {}
    skipped = skipped_ids(tokenizer)
    kept = {m: added[m] for m in (THINK_START, THINK_END) if added.get(m) in skipped}

    def in_answer(marker: str) -> str:
        return KEPT_OPEN + marker + KEPT_CLOSE if marker in kept else marker
    return ReasoningFormat(keep_token_ids=tuple(kept.values()), answer_start=in_answer(THINK_START),
                           answer_end=in_answer(THINK_END))


def _template_text(tokenizer: Any) -> str:
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):  # named templates (default, tool_use, ...)
        return "\n".join(str(v) for v in template.values())
    return template if isinstance(template, str) else ""


class ReasoningSplitter:
    """An answer's text, fed as it streams, as (reasoning, text) pieces ready to show.

    Text that may still turn out to be a marker, or blank space that is dropped if the block
    ends after it, is held back until it is known; `finish` releases what is left. Fed the
    whole answer at once and finished, it gives the same split as fed piece by piece (the
    non-streamed answer is split this way too)."""

    def __init__(self, fmt: ReasoningFormat, in_reasoning: bool = False) -> None:
        self._start, self._end = fmt.answer_start, fmt.answer_end
        # kept marker tokens anywhere else are taken out (and held while they may be one)
        self._wrapped = tuple(m for m in (self._start, self._end) if m.startswith(KEPT_OPEN))
        self._state = "thinking_lead" if in_reasoning else "lead"
        self._held = ""

    @property
    def in_reasoning(self) -> bool:
        return self._state in ("thinking_lead", "thinking")

    def feed(self, text: str) -> tuple[str, str]:
        self._held += text
        return self._drain(final=False)

    def finish(self) -> tuple[str, str]:
        return self._drain(final=True)

    def _drain(self, final: bool) -> tuple[str, str]:
        reasoning, content = [], []
        start, end = self._start, self._end
        while True:
            held = self._held
            if self._state == "lead":  # the answer's start: does it open a think block?
                body = held.lstrip()
                if body.startswith(start):
                    self._held = body[len(start):]
                    self._state = "thinking_lead"
                    continue
                if not final and start.startswith(body):  # blank, or a start marker so far
                    break
                self._state = "text"
                continue
            if self._state in ("thinking_lead", "after"):  # blank space dropped
                self._held = held.lstrip()
                if not self._held:
                    break
                self._state = "thinking" if self._state == "thinking_lead" else "text"
                continue
            if self._state == "thinking":
                at = held.find(end)
                if at >= 0:
                    reasoning.append(held[:at].rstrip())
                    self._held = held[at + len(end):]
                    self._state = "after"
                    continue
                if final:
                    reasoning.append(held.rstrip())
                    self._held = ""
                    break
                cut = _partial_marker_at(held, (end, *self._wrapped))
                while cut > 0 and held[cut - 1].isspace():
                    cut -= 1
                reasoning.append(held[:cut])
                self._held = held[cut:]
                break
            # "text": everything shows as it comes
            cut = len(held) if final else _partial_marker_at(held, self._wrapped)
            content.append(held[:cut])
            self._held = held[cut:]
            break
        return self._unwrapped("".join(reasoning)), self._unwrapped("".join(content))

    def _unwrapped(self, text: str) -> str:
        for marker in self._wrapped:
            text = text.replace(marker, "")
        return text


def _partial_marker_at(text: str, markers: tuple[str, ...]) -> int:
    """Where the longest tail of `text` that begins one of `markers` starts (len(text) if none)."""
    longest = max((len(m) for m in markers), default=1)
    for n in range(min(longest - 1, len(text)), 0, -1):
        if any(m.startswith(text[-n:]) for m in markers):
            return len(text) - n
    return len(text)


def split_reasoning(text: str, fmt: ReasoningFormat, in_reasoning: bool = False) -> tuple[str, str]:
    """A whole answer as (reasoning, text): the streamed split, in one go."""
    splitter = ReasoningSplitter(fmt, in_reasoning)
    r1, c1 = splitter.feed(text)
    r2, c2 = splitter.finish()
    return r1 + r2, c1 + c2
