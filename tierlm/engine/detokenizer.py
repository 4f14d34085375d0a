"""Incremental detokenization with stop strings.

Each new token is decoded inside a small window of preceding tokens, so leading spaces and
multi-token characters come out right; text ending in U+FFFD (an unfinished UTF-8 sequence)
is held until the rest arrives. Stop strings are searched across token boundaries, and the
last len(longest stop)-1 characters are held back while streaming, so a stop string is never
half-sent before it is recognised.
"""
from __future__ import annotations

import bisect
import os
import weakref
from collections.abc import Callable

_CONTEXT = 6  # prompt tokens used as decoding context for the first output tokens
_MAX_UNFINISHED = 3  # bytes of a UTF-8 character a prompt can end with (so tokens, at most)
_MAX_HELD = 8  # tokens held for an unfinished character before the settled ones are read anyway
# A kept special token's text (IncrementalDetokenizer's `keep`) comes wrapped in these, so that
# it can be told from the same text written in ordinary tokens (a Mistral answer may spell
# "[ARGS]" in prose; only the special token is the tool-call syntax's, to be hidden from the
# client). They are Unicode noncharacters, which the standard reserves for a program's internal
# use and says are not to be interchanged: no tokenizer learns them from text, so a decode can
# only produce one from a model sampling exactly its three UTF-8 bytes. The serving layer reads
# a wrapped marker as the marker and takes it (and any lone sentinel) out of the text it returns.
KEPT_OPEN = "\ufdd0"
KEPT_CLOSE = "\ufdd1"
_SENTINELS = KEPT_OPEN + KEPT_CLOSE
_skipped: "weakref.WeakKeyDictionary[object, tuple[int, frozenset[int]]]" = weakref.WeakKeyDictionary()


def decoder_of(tokenizer) -> Callable[[list[int], bool], str]:
    """`decode(ids, skip_special_tokens)`: the tokenizer's text of `ids`, no clean-up. For a
    transformers fast tokenizer whose decoding is the stock one, that is its `tokenizers`
    backend's own decode, which is all transformers' `decode` ends in: called directly, it skips
    transformers' argument handling (~4 µs of ~5.5 per call here; the detokenizer decodes twice
    per generated token, on the engine's thread). Any other tokenizer (a subclass that decodes
    its own way, a slow one) goes through its `decode`."""
    try:
        from transformers.tokenization_utils_base import PreTrainedTokenizerBase
        from transformers.tokenization_utils_tokenizers import TokenizersBackend as Stock
    except ImportError:  # transformers before 5 named the class PreTrainedTokenizerFast
        try:
            from transformers import PreTrainedTokenizerBase, PreTrainedTokenizerFast as Stock
        except ImportError:
            Stock = PreTrainedTokenizerBase = None
    backend = getattr(tokenizer, "_tokenizer", None)
    cls = type(tokenizer)
    if (Stock is not None and isinstance(tokenizer, Stock) and cls.decode is PreTrainedTokenizerBase.decode
            and cls._decode is Stock._decode and hasattr(backend, "decode")):
        return lambda ids, skip: backend.decode(ids, skip_special_tokens=skip)
    return lambda ids, skip: tokenizer.decode(ids, skip_special_tokens=skip, clean_up_tokenization_spaces=False)


def skipped_ids(tokenizer) -> frozenset[int]:
    """The ids a decode with skip_special_tokens leaves out: of the special ones (named, or added
    tokens marked special: a chat template's <|im_start|>, Llama 3's reserved tokens), those it
    really drops (a named one that is an ordinary vocabulary token keeps its text). Kept per
    tokenizer and its size (tokens added later are looked at again)."""
    try:
        size = len(tokenizer)
    except TypeError:
        size = 0
    try:
        cached = _skipped.get(tokenizer)
    except TypeError:  # not weakly referable: worked out each time
        cached = None
    if cached is not None and cached[0] == size:
        return cached[1]
    candidates = set(getattr(tokenizer, "all_special_ids", ()))
    candidates.update(i for i, t in getattr(tokenizer, "added_tokens_decoder", {}).items()
                      if getattr(t, "special", False))
    found = frozenset(i for i in candidates
                      if tokenizer.decode([i], skip_special_tokens=True, clean_up_tokenization_spaces=False) == "")
    try:
        _skipped[tokenizer] = (size, found)
    except TypeError:
        pass
    return found


class IncrementalDetokenizer:
    def __init__(self, tokenizer, prompt_ids: list[int], stop: list[str], skip_special_tokens: bool = True,
                 include_stop: bool = False, positions: bool = False, keep: frozenset[int] = frozenset()) -> None:
        self.tok = tokenizer
        self.skip = skip_special_tokens
        self._decoder = decoder_of(tokenizer)
        # With `positions`: where each output token's text begins in `text` (for logprobs: which
        # tokens lie in a text cut at a stop string). A token held for the rest of a character
        # is placed when the text it is part of is read: `starts[placed_from:]` changed last.
        self.positions = positions
        self.starts: list[int] = []
        self.placed_from = 0
        # Tokens a decode skips add no text: never put in the window (a run of them, EOS under
        # ignore_eos, made every later decode, and placing, longer and longer).
        self._skipped = skipped_ids(tokenizer) if skip_special_tokens else frozenset()
        # Of those, the ones whose text is wanted all the same (a tool-call marker), wrapped in
        # KEPT_OPEN and KEPT_CLOSE: see _add_kept.
        self._kept = {i: KEPT_OPEN + tokenizer.decode([i], skip_special_tokens=False,
                                                      clean_up_tokenization_spaces=False) + KEPT_CLOSE
                      for i in keep & self._skipped}
        self._kept_texts = frozenset(self._kept.values())
        self._out: list[int] = []  # the output index of each token in the window after the prompt's
        self._n_out = 0
        self._late: list[int] = []  # skipped tokens that came while text was held
        ctx = list(prompt_ids[-_CONTEXT:])
        self.prefix_offset = 0
        self.read_offset = len(ctx)
        # A prompt of token ids can end part-way through a character (a reply cut by max_tokens,
        # continued): its last bytes and the output's first make one. Its unfinished tail decodes
        # to U+FFFD, one per byte with a byte-fallback decoder (which also blanks the finished
        # characters of the same run of bytes), so text was cut by those characters' count: whole
        # characters of the output were lost. The tail is read with the output instead (the
        # character it finishes is the output's), less what the output leaves of the tail's own
        # text; the window then starts on a character too, or a byte-fallback decoder blanks it
        # whole (a CJK prompt: three byte tokens a character).
        self._echo = ""
        whole = self._decode(ctx)
        if whole.startswith("\ufffd") or whole.endswith("\ufffd"):
            cut = self._clean_cut(ctx) or self._tail_cut(ctx)
            if cut is not None:
                j, k, head = cut
                ctx = ctx[j:]
                self.read_offset, self._echo = k - j, self._decode(ctx)[len(head):]
        self._n_ctx = len(ctx)
        self.ids: list[int] = ctx
        self.text = ""
        self.sent = 0
        self.stop = stop
        self.include_stop = include_stop
        self.hold = max((len(s) for s in stop), default=1) - 1
        if self._kept:  # a stop string matches across the sentinels (see _check_stop): at most two
            self.hold *= 3  # a character it spans, so that many more are held back
        self.matched_stop: str | None = None

    def _clean_cut(self, ctx: list[int]) -> tuple[int, int, str] | None:
        """(j, k, text of ctx[j:k]): the longest run of the context's tokens that starts after at
        most a character's worth of leading tokens and stops before at most as many at the end,
        whose text (possibly empty) neither starts nor ends in U+FFFD; None if there is none (a
        literal U+FFFD there)."""
        n = len(ctx)
        for j in range(min(_MAX_UNFINISHED, n) + 1):
            for k in range(n, max(j, n - _MAX_UNFINISHED) - 1, -1):
                head = self._decode(ctx[j:k])
                if not head.startswith("\ufffd") and not head.endswith("\ufffd"):
                    return j, k, head
        return None

    def _tail_cut(self, ctx: list[int]) -> tuple[int, int, str] | None:
        """(0, k, text of ctx[:k]): without the unfinished tail alone, where no cut starts on a
        character too (a literal U+FFFD early in the window)."""
        n = len(ctx)
        for k in range(n - 1, max(0, n - _MAX_UNFINISHED) - 1, -1):
            head = self._decode(ctx[:k])
            if not head.endswith("\ufffd"):
                return 0, k, head
        return None

    def _decode(self, ids: list[int]) -> str:
        return self._decoder(ids, self.skip)

    def add(self, token_id: int, find_stop: bool = True) -> str | None:
        """Add one generated token; returns the stop string if one just completed (looked for only
        with `find_stop`: not before a request's min_tokens)."""
        self._n_out += 1
        if self.positions:
            self.starts.append(len(self.text))
            self.placed_from = len(self.starts) - 1
        if token_id in self._kept:
            return self._add_kept(token_id, find_stop)
        if token_id in self._skipped:
            if self.positions and self.read_offset < len(self.ids):
                self._late.append(self._n_out - 1)  # inside text not read yet: placed with it
            return None
        self.ids.append(token_id)
        self._out.append(self._n_out - 1)
        prefix = self._decode(self.ids[self.prefix_offset:self.read_offset])
        full = self._decode(self.ids[self.prefix_offset:])
        end = len(self.ids)
        if full.endswith("\ufffd"):
            end, full = self._settled(prefix, full)
        if len(full) > len(prefix) and end > self.read_offset:
            start = self._read(prefix, full, end)
            self.prefix_offset, self.read_offset = self.read_offset, end
            return self._check_stop(start) if find_stop else None
        return None

    def _add_kept(self, token_id: int, find_stop: bool) -> str | None:
        """A skipped token whose text is kept: it ends what the tokens before it hold (a character
        they left unfinished stays so) and its text, between KEPT_OPEN and KEPT_CLOSE, follows
        theirs. Like the skipped ones it stays out of the window, so the text around it decodes as
        without it."""
        self.flush(find_stop)
        if self.matched_stop is not None:
            return self.matched_stop
        start = len(self.text)
        self.text += self._kept[token_id]
        if self.positions:
            self.starts[-1] = start
        return self._check_stop(start) if find_stop else None

    def _settled(self, prefix: str, full: str) -> tuple[int, str]:
        """(end, its text): the tokens held for an unfinished character that can be read all the
        same. A character is at most 4 bytes and a token adds at least one, so of a long held run
        (garbage bytes, a model repeating U+FFFD) all but the last 3 tokens are final: they are read
        up to where their text agrees with the whole (not in a character that straddles the cut).
        Else every new token decoded the whole run again, its cost growing with the square of its
        length, on the engine's thread. (read_offset, prefix) while the run is short."""
        n = len(self.ids)
        if n - self.read_offset <= _MAX_HELD:
            return self.read_offset, prefix
        after = self._decode(self.ids[self.prefix_offset:n - _MAX_UNFINISHED + 1])
        for end in range(n - _MAX_UNFINISHED, n - _MAX_UNFINISHED - 4, -1):
            if end <= self.read_offset:
                break
            text = self._decode(self.ids[self.prefix_offset:end])
            # a cut between characters: the token after it adds one (not a cut after f0 of an
            # invalid f0 9f 80, one U+FFFD, whose later bytes would be placed as characters)
            if len(text) > len(prefix) and full.startswith(text) and len(after) > len(text):
                return end, text
            after = text
        # A decoder whose text of a run of bytes changes with what follows (byte fallback blanks
        # a whole run that holds an invalid byte): the reference text is garbage there anyway.
        end = n - _MAX_UNFINISHED
        return end, self._decode(self.ids[self.prefix_offset:end])

    def _read(self, prefix: str, full: str, end: int | None = None) -> int:
        """Append the text the tokens from `read_offset` to `end` (all) add (`full` past
        `prefix`), place them, and return where that text starts."""
        before = len(self.text)
        new, cut = full[len(prefix):], 0
        if self._echo:  # the first text read with a prompt's unfinished tail: less what is left of the
            echo, self._echo = self._echo, ""  # tail's own text (all of it, if the output did not finish it)
            cut = len(os.path.commonprefix([new, echo]))
            new = new[cut:]
        self.text += new
        if self.positions:
            self._place(prefix, full, before, cut, len(self.ids) if end is None else end)
        return before

    def _place(self, prefix: str, full: str, before: int, cut: int, end: int) -> None:
        """Where each token just read begins: where the text read before it stops agreeing with
        the whole (a token finishing a character begins with it), or, where that text ends in a
        U+FFFD the whole keeps, in that U+FFFD if the token added no character to it (one more
        byte of a sequence that stays broken), else after it."""
        first = max(self.read_offset, self._n_ctx)
        ms = range(first, end)
        texts = [self._decode(self.ids[self.prefix_offset:m]) for m in ms] + [full]
        for j, m in enumerate(ms):
            if m == self.read_offset:  # the first token read begins the new text (placed when it
                self.starts[self._out[m - self._n_ctx]] = before  # came, before a read of what came
                continue  # ahead of it, if that was read while it was held)
            text = texts[j]
            agreed = len(os.path.commonprefix([text, full]))
            if agreed == len(text) and text.endswith("\ufffd") and texts[j + 1] == text:
                agreed -= 1
            self.starts[self._out[m - self._n_ctx]] = before + max(0, agreed - len(prefix) - cut)
        if first < len(self.ids):
            self.placed_from = min(self.placed_from, self._out[first - self._n_ctx])
        for m in range(max(end, self._n_ctx), len(self.ids)):  # still held: after the text read (their
            self.starts[self._out[m - self._n_ctx]] = len(self.text)  # place when they came is in it now)
        # A skipped token that came while text was held begins where the token after it does, or
        # after the text read; one that came after the first token still held stays for later.
        held = self._out[end - self._n_ctx] if end < len(self.ids) else None
        read = self._out[max(0, first - self._n_ctx):end - self._n_ctx]
        for i in self._late:
            if held is None or i < held:
                after = [self.starts[o] for o in read if o > i]
                self.starts[i] = after[0] if after else len(self.text)
                self.placed_from = min(self.placed_from, i)
        self._late = [i for i in self._late if held is not None and i > held]
        starts = self.starts  # never before the token ahead (a literal U+FFFD spelled in byte tokens)
        for i in range(max(self.placed_from, 1), len(starts)):
            if starts[i] < starts[i - 1]:
                starts[i] = starts[i - 1]

    def flush(self, find_stop: bool = True) -> None:
        """At the end, emit whatever is still pending (even an unfinished character), looking for
        stop strings in it only with `find_stop`."""
        if self.matched_stop is None and self.read_offset < len(self.ids):
            prefix = self._decode(self.ids[self.prefix_offset:self.read_offset])
            full = self._decode(self.ids[self.prefix_offset:])
            if len(full) > len(prefix):
                start = self._read(prefix, full)
                if find_stop:
                    self._check_stop(start)
            self.read_offset = len(self.ids)

    def _check_stop(self, start: int) -> str | None:
        """The stop string that ends first in the text from `start` on (the new text): where
        generation would have stopped had each character been a token of its own, so the match
        does not depend on how the text was split into tokens (of two ending together, the one
        that starts first). One that lies wholly in earlier text was not looked for there
        (before min_tokens), so it is not a match now either, whatever other stops are given."""
        if not self.stop:
            return None
        if self._kept:
            return self._check_stop_kept(start)
        found = self._earliest_stop(self.text, start)
        if found is None:
            return None
        i, s = found
        self.text = self.text[: i + len(s)] if self.include_stop else self.text[:i]
        self.matched_stop = s
        return s

    def _earliest_stop(self, text: str, start: int, skip=None) -> tuple[int, str] | None:
        """(where it starts, which) of the stop string that ends first in `text` from `start` on
        (of two ending together, the one that starts first), passing over the matches at places
        `skip` rejects; None if there is none."""
        best: tuple[int, int, str] | None = None
        for s in self.stop:
            i = text.find(s, max(0, start - len(s) + 1))
            while i >= 0 and skip is not None and skip(i):
                i = text.find(s, i + 1)
            if i >= 0 and (best is None or (i + len(s), i) < best[:2]):
                best = (i + len(s), i, s)
        return None if best is None else (best[1], best[2])

    def _check_stop_kept(self, start: int) -> str | None:
        """_check_stop where kept tokens' text is wrapped in sentinels: stop strings are matched in
        the text as if they were not there (as where the marker's text is plain), but none that
        starts inside a marker (see _inside_kept). A cut at a wrapped marker's edge takes its
        sentinel with it, and one that would fall inside it (include_stop, a stop string
        ending there) takes the whole marker: the client never sees part of one."""
        text, longest = self.text, max(map(len, self.stop))
        base, seen = start, 0  # from longest - 1 characters before the new text on
        while base > 0 and seen < longest - 1:
            base -= 1
            seen += text[base] not in _SENTINELS
        at = [j for j in range(base, len(text)) if text[j] not in _SENTINELS]
        view = "".join(text[j] for j in at)
        new = bisect.bisect_left(at, start)  # where the new text starts in `view`
        found = self._earliest_stop(view, new, skip=lambda i: self._inside_kept(at[i]))
        if found is None:
            return None
        i, s = found
        end = i + len(s)
        if self.include_stop:
            cut = at[end - 1] + 1
            span = self._kept_span(at[end - 1])
            if span is not None:  # ends in a marker: the marker goes whole
                cut = span[1] + 1
        else:
            cut = at[i]
            if cut > 0 and text[cut - 1] == KEPT_OPEN:
                cut -= 1
        self.text = text[:cut]
        self.matched_stop = s
        return s

    def _kept_span(self, j: int) -> tuple[int, int] | None:
        """(its KEPT_OPEN, its KEPT_CLOSE) where `text[j]` lies in a wrapped marker, else None."""
        text = self.text
        o = text.rfind(KEPT_OPEN, 0, j)
        if o < 0:
            return None
        c = text.find(KEPT_CLOSE, o)
        if c < j or text[o:c + 1] not in self._kept_texts:
            return None
        return o, c

    def _inside_kept(self, j: int) -> bool:
        """Whether `text[j]` lies in a wrapped marker past its first character. A stop string
        starting there does not match: without tools the marker is skipped, so it never
        matched there; and where it ends after the marker, the marker's head may already have
        been sent while streaming (held back only by the stop's length), so no cut could
        leave the streamed and the whole text alike (a cut inside it showed part of it)."""
        span = self._kept_span(j)
        return span is not None and j > span[0] + 1

    def delta(self, finished: bool) -> str:
        """Text not yet sent; while running, keep back what could still become a stop string."""
        end = len(self.text) if finished or self.matched_stop else max(self.sent, len(self.text) - self.hold)
        out = self.text[self.sent:end]
        self.sent = end
        return out
