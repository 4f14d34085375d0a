"""Find many phrases in a text that arrives a piece at a time, as a model writes it.

Why a scanner of its own: the safety layer (safety.py) must stop a phrase before any of it
reaches a client, yet show everything else as soon as possible. An Aho–Corasick automaton read
one character at a time gives both: each character costs O(1) whatever the number of phrases
(a regex alternation re-scanned per token costs O(phrases × window)), and the automaton's
state says exactly how much of the text read so far could still become a phrase (its depth):
only that much is held back. `tierlm bench safety` measures it against the regex peer.

Phrases and text are compared after the same normalisation, so case, spacing and where a
tokenizer split the text do not matter:
- case folded (`str.casefold`: "Straße" matches "STRASSE");
- every run of white space is one space;
- a *boundary* symbol stands between a word character (letters, digits, `_`) and anything
  else, and at the text's two ends next to a word character. A whole-word phrase carries the
  boundary at its ends, so "ass" whole-word never matches inside "class"; a phrase that is not
  whole-word has them stripped from its ends and matches anywhere.

A match reports the span of the *original* text it covers, so the caller can cut or mask it.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Iterable, Sequence

BOUNDARY = "\x00"  # never in normalised text otherwise: NUL counts as white space
SPACE = " "


def normalise(phrase: str, whole_word: bool = False) -> str:
    """`phrase` as the scanner compares it (see the module docstring); "" if nothing is left."""
    symbols: list[str] = []
    state = 0  # (_WORD | _SPACE bits) a text starts after a non-word character
    for ch in phrase.strip():
        written, state = _steps(ch)[state]
        symbols.append(written)
    if state & _WORD:
        symbols.append(BOUNDARY)
    text = "".join(symbols)
    return text if whole_word else text.strip(BOUNDARY)


_WORD, _SPACE = 2, 1  # the state between characters: whether the last symbol was a word character, a space
_STEPS: dict[str, tuple[tuple[str, int], ...]] = {}
_STEPS_MAX = 1 << 16  # characters remembered (a text of every code point must not grow it forever)


def _steps(ch: str) -> tuple[tuple[str, int], ...]:
    """For each state before `ch` (indexed by _WORD | _SPACE bits): the symbols `ch` writes and
    the state after it. Case folded, white space collapsed, a boundary at each word edge."""
    found = _STEPS.get(ch)
    if found is not None:
        return found
    if ch.isspace() or ch == BOUNDARY:
        folded = [(SPACE, False)]
    else:
        folded = [(c, c.isalnum() or c == "_") for c in ch.casefold()]
    steps = []
    for before in range(4):
        state, written = before, []
        for sym, word in folded:
            if sym == SPACE and state & _SPACE:
                continue
            if word != bool(state & _WORD):
                written.append(BOUNDARY)
            state = (_WORD if word else 0) | (_SPACE if sym == SPACE else 0)
            written.append(sym)
        steps.append(("".join(written), state))
    if len(_STEPS) >= _STEPS_MAX:
        _STEPS.clear()
    found = _STEPS[ch] = tuple(steps)
    return found


@dataclass(frozen=True)
class Match:
    """Phrase number `phrase` (its index in the PhraseSet) covers original text[start:end]."""

    phrase: int
    start: int
    end: int


class PhraseSet:
    """Compiled phrases (each already `normalise`d, non-empty): an Aho–Corasick automaton."""

    def __init__(self, patterns: Sequence[str]) -> None:
        if any(not p for p in patterns):
            raise ValueError("phrases must not be empty once normalised")
        self.patterns = list(patterns)
        goto: list[dict[str, int]] = [{}]
        depth = [0]
        ends: list[list[int]] = [[]]
        for index, pattern in enumerate(self.patterns):
            state = 0
            for sym in pattern:
                nxt = goto[state].get(sym)
                if nxt is None:
                    nxt = goto[state][sym] = len(goto)
                    goto.append({})
                    depth.append(depth[state] + 1)
                    ends.append([])
                state = nxt
            ends[state].append(index)
        fail = [0] * len(goto)
        out: list[tuple[int, ...]] = [()] * len(goto)
        order = deque(goto[0].values())
        while order:  # breadth first: a state's fail link is shallower, so already complete
            state = order.popleft()
            out[state] = tuple(ends[state]) + out[fail[state]]
            for sym, nxt in goto[state].items():
                back = fail[state]
                while back and sym not in goto[back]:
                    back = fail[back]
                fail[nxt] = goto[back].get(sym, 0) if state else 0  # (the root's children fail to the root)
                order.append(nxt)
        self.goto, self.fail, self.depth, self.out = goto, fail, depth, out
        self.lengths = [len(p) for p in self.patterns]
        self.longest = max(self.lengths, default=0)

    def __len__(self) -> int:
        return len(self.patterns)

    def scanner(self) -> "Scanner":
        return Scanner(self)

    def find_all(self, text: str) -> list[Match]:
        """Every match in a whole text (a scanner fed it in one piece, then ended)."""
        scanner = self.scanner()
        return scanner.feed(text) + scanner.finish()


class Scanner:
    """One text's pass through a PhraseSet, fed piece by piece.

    `held_from` is the original offset from which the text read so far may still be the start
    of a phrase: everything before it can be shown; what is after it waits for more text (or
    `finish`)."""

    __slots__ = ("_set", "_state", "_between", "_starts", "_fed")

    def __init__(self, phrases: PhraseSet) -> None:
        self._set = phrases
        self._state = 0  # the automaton's
        self._between = 0  # the normaliser's (_WORD | _SPACE bits; a text starts after a non-word)
        # the original start offset of each of the last `longest` symbols (a boundary's is that
        # of the character after it)
        self._starts: deque[int] = deque(maxlen=max(1, phrases.longest))
        self._fed = 0

    @property
    def fed(self) -> int:
        """Original characters read so far."""
        return self._fed

    @property
    def held_from(self) -> int:
        depth = self._set.depth[self._state]
        return self._starts[-depth] if depth else self._fed

    def feed(self, text: str) -> list[Match]:
        """Read `text`; the matches that end in it."""
        found: list[Match] = []
        steps = _STEPS.get
        between, offset = self._between, self._fed
        for ch in text:
            written, between = (steps(ch) or _steps(ch))[between]
            for sym in written:
                self._read(sym, offset, offset if sym == BOUNDARY else offset + 1, found)
            offset += 1
        self._between, self._fed = between, offset
        return found

    def finish(self) -> list[Match]:
        """The text ended: the matches its end completes (a whole-word phrase as its last word)."""
        found: list[Match] = []
        if self._between & _WORD:
            self._read(BOUNDARY, self._fed, self._fed, found)
        self._state, self._between = 0, 0
        return found

    def _read(self, sym: str, start: int, end: int, found: list[Match]) -> None:
        """One symbol through the automaton, from original text [start, end)."""
        ps = self._set
        goto, fail = ps.goto, ps.fail
        state = self._state
        nxt = goto[state].get(sym)
        while nxt is None and state:
            state = fail[state]
            nxt = goto[state].get(sym)
        self._state = state = nxt or 0
        starts = self._starts
        starts.append(start)
        if ps.out[state]:
            found += [Match(i, starts[-ps.lengths[i]], end) for i in ps.out[state]]


def compile_phrases(phrases: Iterable[tuple[str, bool]]) -> PhraseSet:
    """A PhraseSet of (phrase, whole_word) pairs, in order."""
    return PhraseSet([normalise(p, whole_word) for p, whole_word in phrases])
