"""OpenAI's harmony format: how gpt-oss writes its reasoning, its answer and its tool calls.

A gpt-oss answer is a run of messages, each a header and a body between special tokens:

    <|channel|>analysis<|message|>REASONING<|end|>
    <|start|>assistant<|channel|>final<|message|>ANSWER<|return|>

(the prompt's `<|start|>assistant` opens the first). The header's channel says who reads the
body: `analysis` is the model's reasoning, `final` its answer, `commentary` a preamble shown to
the user, unless the header names a recipient (`to=functions.NAME`, before or after the
channel; `<|constrain|>json` may say the body is JSON): the body is then a call to that tool, and
`<|call|>` ends the answer. `<|return|>` and `<|call|>` are EOS tokens (gpt-oss's
generation_config), so a decoded answer usually ends without them.

`HarmonySplitter` reads the messages as the text streams in, as `ReasoningSplitter` does a think
block: analysis bodies are reasoning, final and recipient-less commentary bodies are text, and a
call is written into the text in one fixed form (`call_text`) that `tools.HarmonySyntax` parses
like any other syntax's calls (so that the tool-call machinery, streaming included, needs no
case of its own). Headers never reach the client.

The markers are special tokens in gpt-oss's tokenizer: a decode that skips special tokens drops
them, so their ids are kept (`keep_token_ids`) and the detokenizer wraps their text in KEPT_OPEN
... KEPT_CLOSE; only a wrapped marker is read as one (marker text the model wrote in ordinary
tokens is its own and stays). Decoded without skipping special tokens, the plain texts are read.

A cut-off answer degrades as the think parser does: cut inside the analysis, everything is
reasoning; a header that never got its `<|message|>` is dropped; a call cut off or whose body is
not a JSON object is text (its body, without the header).
"""
from __future__ import annotations

import re
from typing import Any

from tierlm.engine.detokenizer import KEPT_CLOSE, KEPT_OPEN
from tierlm.serving.reasoning import AnswerSplitter

START, END, MESSAGE, CHANNEL = "<|start|>", "<|end|>", "<|message|>", "<|channel|>"
CONSTRAIN, RETURN, CALL = "<|constrain|>", "<|return|>", "<|call|>"
MARKERS = (START, END, MESSAGE, CHANNEL, CONSTRAIN, RETURN, CALL)
# What auto-detection looks for, in the chat template or the tokenizer's added vocabulary
SIGNATURE = (CHANNEL, MESSAGE)
FUNCTIONS = "functions."  # the namespace of the request's tools in a recipient


def wrapped(marker: str) -> str:
    """`marker` as the detokenizer writes it where its special token is kept."""
    return KEPT_OPEN + marker + KEPT_CLOSE


# A call in the splitter's text: CALL_OPEN + tool name + CALL_ARGS + body + CALL_CLOSE. Wrapped
# markers, so nothing the model wrote in ordinary tokens can spell one.
CALL_OPEN, CALL_ARGS, CALL_CLOSE = wrapped(START), wrapped(MESSAGE), wrapped(CALL)


def call_text(name: str, body: str) -> str:
    return CALL_OPEN + name + CALL_ARGS + body + CALL_CLOSE


def is_harmony(tokenizer: Any) -> bool:
    """Whether `tokenizer` (its chat template, or its added vocabulary) writes harmony."""
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):
        template = "\n".join(map(str, template.values()))
    if isinstance(template, str) and all(m in template for m in SIGNATURE):
        return True
    added = tokenizer.get_added_vocab() if hasattr(tokenizer, "get_added_vocab") else {}
    return all(m in added for m in SIGNATURE)


def analysis_tokens(token_ids: list[int], tokenizer: Any) -> int | None:
    """How many of an answer's tokens are its analysis messages', header to `<|end|>` (all of a
    message cut off): the Responses API's reasoning_tokens. None where harmony's markers are not
    tokens of their own in `tokenizer` (the count would be a guess)."""
    added = tokenizer.get_added_vocab() if hasattr(tokenizer, "get_added_vocab") else {}
    if any(m not in added for m in MARKERS):
        return None
    ends = {added[END], added[RETURN], added[CALL]}
    count, begun, header, body = 0, 0, [], False  # (the prompt's <|start|>assistant opens the first)
    analysis = False
    for i, token in enumerate(token_ids):
        if token == added[START] or (body and token == added[CHANNEL]):
            if body and analysis:  # (a body ended by a new header: counted to here)
                count += i - begun
            begun, header, body = i, [token], False
        elif token in ends:
            if analysis and body:
                count += i + 1 - begun
            begun, header, body, analysis = i + 1, [], False, False
        elif token == added[MESSAGE] and not body:
            text = tokenizer.decode(header, skip_special_tokens=False)
            channel = text.partition(CHANNEL)[2].split()
            analysis, body = bool(channel) and channel[0] == "analysis" and _RECIPIENT.search(text) is None, True
        elif not body:
            header.append(token)
    return count + (len(token_ids) - begun if body and analysis else 0)


_WRAPPED_TOKEN = re.compile(f"{KEPT_OPEN}([^{KEPT_OPEN}{KEPT_CLOSE}]*){KEPT_CLOSE}")
_PLAIN_MARKER = re.compile("|".join(re.escape(m) for m in MARKERS))
# What an answer may start with before its first marker: blank space, and a recipient where the
# prompt's `<|start|>assistant` is followed by one (` to=functions.get_weather<|channel|>...`),
# or the start of one still arriving
_LEAD = re.compile(r"\s*(?:t|to|to=\S*)?\s*")
_RECIPIENT = re.compile(r"\bto=([^\s\x00]+)")
# A header is a role, a channel, a recipient and a content type: this much text without its
# `<|message|>` is not one (the model writes text out of format), and is shown as text.
_MAX_HEADER = 256
# A kept token's text is short: a KEPT_OPEN with no KEPT_CLOSE this far after it is no kept token
_MAX_KEPT_TEXT = 256


class HarmonySplitter(AnswerSplitter):
    """A harmony answer's text, fed as it streams, as (reasoning, text) pieces ready to show:
    the same interface and the same promise as ReasoningSplitter (fed whole or piece by piece,
    the same split; each feed costs time in its own length).

    `wrapped`: markers come as kept special tokens (else as their plain text). `calls`: calls
    go into the text as `call_text` for the tool parser (the request offered tools), else their
    bodies are text. `reasoning_as_text`: analysis bodies are text too (reasoning not parsed).
    """

    def __init__(self, wrapped: bool = True, calls: bool = False, reasoning_as_text: bool = False) -> None:
        self._wrapped = wrapped
        self._calls = calls
        self._reasoning_as_text = reasoning_as_text
        self._state = "lead"  # lead | header | body | plain (out of format: all text)
        self._held = ""  # what may still be the start of a marker
        self._header = ""  # the current message's header so far (a channel marker as \x00)
        self._kind = ""  # the current body's: reasoning | text | call
        self._name = ""  # the current call's tool
        self._body_shown = False  # the current body showed something (its separator went out)
        self._said = {"reasoning": False, "text": False}  # shown so far: the next message is set apart
        self._primed: dict[str, list[str]] = {"reasoning": [], "text": []}  # what prime() wrote, not shown yet
        # Where the answer's characters went, for the safety layer to read only what a client can
        # (`markup`): offsets in the answer as fed (prime's text at negative ones)
        self._fed = 0  # characters fed, less prime's
        self._header_from: int | None = None  # where the text in `_header` began
        self._decided = 0  # characters known to be shown or not
        # Once `record` is called: spans of markers and headers (never shown) and of text shown
        # as text (not reasoning, not a call's body), taken by `markup` and `text_spans`
        self._spans: dict[str, list[tuple[int, int]]] | None = None

    def prime(self, text: str) -> None:
        """Read `text` (plain markers: tierlm wrote it as tokens after the prompt, a forced call's
        start) as the answer's beginning, shown with the first piece fed: the call it opens."""
        if self._wrapped:
            text = _PLAIN_MARKER.sub(lambda m: wrapped(m.group(0)), text)
        reasoning, shown = self.feed(text)
        self._primed["reasoning"].append(reasoning)
        self._primed["text"].append(shown)
        self._fed -= len(text)
        self._header_from = None if self._header_from is None else self._header_from - len(text)
        self._decided = 0
        if self._spans is not None:
            self._spans = {"hidden": [], "text": []}

    def record(self) -> "HarmonySplitter":
        """Keep the spans `markup` and `text_spans` give (from here on; a splitter that only
        splits keeps none)."""
        super().record()
        return self

    def text_spans(self) -> list[tuple[int, int]]:
        """The spans of the answer fed so far shown as text (not reasoning, nor a call's body
        read as a call), new since the last call: where its message's tokens lie."""
        return self._take("text")

    def _drain(self, final: bool) -> tuple[str, str]:
        out, self._primed = self._primed, {"reasoning": [], "text": []}
        held, pos = self._held, 0
        base = self._fed - len(held)  # where `held` starts in the answer
        while True:
            found = self._next_marker(held, pos)
            if found is None:
                cut = len(held) if final else self._hold_at(held, pos)
                self._plain(held[pos:cut], out, base + pos)
                self._held = held[cut:]
                break
            at, end, marker = found
            self._plain(held[pos:at], out, base + pos)
            if marker is not None:  # (another kept token: not harmony's, never shown)
                self._marker(marker, out, base + at)
            self._note("hidden", base + at, base + end)
            pos = end
        if final:
            self._held = ""
            self._end_of_answer(out)
        self._decided = min(self._fed - len(self._held), self._fed if self._header_from is None else self._header_from)
        return "".join(out["reasoning"]), "".join(out["text"])

    def _next_marker(self, text: str, pos: int) -> tuple[int, int, str | None] | None:
        if self._wrapped:
            m = _WRAPPED_TOKEN.search(text, pos)
            return None if m is None else (m.start(), m.end(), m.group(1) if m.group(1) in MARKERS else None)
        m = _PLAIN_MARKER.search(text, pos)
        return None if m is None else (m.start(), m.end(), m.group(0))

    def _hold_at(self, text: str, pos: int) -> int:
        """Where the text that may still become a marker starts (len(text): none)."""
        if self._wrapped:
            at = text.rfind(KEPT_OPEN, pos)
            return at if at >= 0 and len(text) - at <= _MAX_KEPT_TEXT and KEPT_CLOSE not in text[at:] else len(text)
        for n in range(min(max(map(len, MARKERS)) - 1, len(text) - pos), 0, -1):
            if any(m.startswith(text[-n:]) for m in MARKERS):
                return len(text) - n
        return len(text)

    def _plain(self, piece: str, out: dict[str, list[str]], at: int) -> None:
        """Text between markers (at `at` in the answer), as the state reads it."""
        if not piece:
            return
        if self._wrapped and (KEPT_OPEN in piece or KEPT_CLOSE in piece):  # a lone sentinel: no token's
            piece = piece.replace(KEPT_OPEN, "").replace(KEPT_CLOSE, "")
            if not piece:
                return
        if self._state == "body":
            self._show_body(piece, out, at)
        elif self._state == "plain":
            out["text"].append(piece)
            self._note("text", at, at + len(piece))
        else:
            self._header += piece
            self._header_from = at if self._header_from is None else self._header_from
            if (self._state == "lead" and not _LEAD.fullmatch(self._header)) or len(self._header) > _MAX_HEADER:
                self._out_of_format(out, at + len(piece))

    def _out_of_format(self, out: dict[str, list[str]], end: int) -> None:
        """Text where a header should be (up to `end`): not harmony, shown as text from here on."""
        self._state = "plain"
        header, self._header = self._header.replace("\x00", ""), ""
        if self._header_from is not None:  # (shown)
            self._note("text", self._header_from, end)
            self._header_from = None
        if header:
            self._show("text", header, out)

    def _marker(self, marker: str, out: dict[str, list[str]], at: int) -> None:
        if self._state == "plain":
            return
        if marker not in (CHANNEL, CONSTRAIN):  # the header so far is dropped or read: never shown
            self._drop_header(at)
        if self._state == "body":
            if marker in (MESSAGE, CONSTRAIN):  # not a body's end: dropped
                return
            self._end_body(out)
            self._state, self._header = "header", ""
            if marker == CHANNEL:  # (a new message's header, its <|start|> not written)
                self._header = "\x00"
            return
        self._state = "header"
        if marker == START:
            self._header = ""
        elif marker == CHANNEL:
            self._header += "\x00"
        elif marker == CONSTRAIN:
            self._header += " "
        elif marker == MESSAGE:
            self._open_body(out)
        else:  # END, RETURN, CALL: a message without a body
            self._header = ""

    def _open_body(self, out: dict[str, list[str]]) -> None:
        header, self._header = self._header, ""
        recipient = _RECIPIENT.search(header)
        channel = header.partition("\x00")[2].split()
        self._state, self._body_shown = "body", False
        if recipient is not None:
            self._kind, self._name = "call", recipient.group(1).removeprefix(FUNCTIONS)
            if self._calls:
                self._show("text", CALL_OPEN + self._name + CALL_ARGS, out)
        elif channel and channel[0] == "analysis" and not self._reasoning_as_text:
            self._kind = "reasoning"
        else:  # final, commentary without a recipient (a preamble), or a header without a channel
            self._kind = "text"

    def _show_body(self, piece: str, out: dict[str, list[str]], at: int) -> None:
        if self._kind == "call" and self._calls:
            out["text"].append(piece)
            return
        where = "text" if self._kind == "call" else self._kind
        if where == "text":
            self._note("text", at, at + len(piece))
        self._show(where, piece, out, separate=not self._body_shown)
        self._body_shown = True

    def _show(self, where: str, piece: str, out: dict[str, list[str]], separate: bool = True) -> None:
        """`piece` as reasoning or text; the first piece of a message after another one's is set
        apart from it by a blank line."""
        if separate and self._said[where]:
            out[where].append("\n\n")
        out[where].append(piece)
        self._said[where] = True

    def _end_body(self, out: dict[str, list[str]]) -> None:
        if self._kind == "call" and self._calls:
            out["text"].append(CALL_CLOSE)
        self._kind = ""

    def _end_of_answer(self, out: dict[str, list[str]]) -> None:
        """The answer ended: a body open is ended (a call cut off is told apart by the parser,
        which knows how the answer ended); an unfinished header is dropped, unless it is the text
        of an answer that never began a message."""
        if self._state == "body":
            self._end_body(out)
        elif self._state == "lead":
            self._out_of_format(out, self._fed)
        self._drop_header(self._fed)
        self._state, self._header = "header", ""

    def _drop_header(self, end: int) -> None:
        if self._header_from is not None:
            self._note("hidden", self._header_from, end)
            self._header_from = None
