"""Find regular-expression detectors (e-mail addresses, card numbers, keys, ...) in a text that
arrives a piece at a time, as a model writes it.

Why beside phrase_scan.py: phrases are fixed strings; personal data and secrets are shapes. A
detector is a pattern of the `regex` module (Perl-like syntax, with partial matching). The
scanner must report exactly the matches `finditer` would find in the whole answer, and hold back
only text that may still be part of one:

- `search(text, pos, partial=True)` finds the leftmost place where a match starts or could
  start if the text went on. Text before it can be shown.
- A complete match there is final only if no longer or different match could start at the
  same place once more text comes: `fullmatch(text, start, partial=True)` says whether the
  text from its start to the end read so far could still be (a prefix of) a match. If it could,
  the match is held (`\\d+` on "12" waits for what follows; "12 " is final).

All the detectors of a request run as one alternation (leftmost first, as `finditer` over it),
so their matches never overlap. A detector may also have a check on its match (a card number's
Luhn digit): a match that fails it is no match, and scanning goes on after it, as a filter over
`finditer`'s matches.

Look-behind sees at most `LOOKBEHIND` characters before the text still held; patterns must not
look further back (none of the built-in ones do).

Time: an operator's pattern that passed the start-up probe may still backtrack for minutes on
some other text (`(?:x|xx)+y` on forty x's), on the server's event loop. So every scan (a whole
prompt, or one piece of an answer) gets `SCAN_TIMEOUT_S` of matching in all; past it the scan
raises PatternTimeout, and the safety layer treats the text as matching (safety.py). Sets of
built-in detectors only run untimed: those are bounded, and a timeout costs every call.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Sequence

import regex

LOOKBEHIND = 64  # characters kept before the held text, for look-behind assertions
_GROUP = "tierlm_detector_"  # the alternation's group names (a pattern's own names must differ)


def luhn(text: str) -> bool:
    """The Luhn check digit of the digits in `text` holds (card numbers)."""
    digits = [int(c) for c in text if c.isdigit()]
    total = sum(d if i % 2 == 0 else (d * 2 - 9 if d > 4 else d * 2) for i, d in enumerate(reversed(digits)))
    return len(digits) > 1 and total % 10 == 0


@dataclass(frozen=True)
class Detector:
    name: str
    pattern: str  # the `regex` module's syntax
    check: Callable[[str], bool] | None = None  # a match failing it is no match


BUILTIN: dict[str, Detector] = {d.name: d for d in (
    Detector("email", r"(?<![\w.%+-])[\w.%+-]{1,64}@[A-Za-z0-9-]{1,63}(?:\.[A-Za-z0-9-]{1,63}){0,6}\.[A-Za-z]{2,24}"
                      r"(?![\w-])"),
    Detector("credit_card", r"(?<![\d-])\d(?:[ -]?\d){12,18}(?![\d-])", luhn),
    Detector("us_ssn", r"(?<![\d-])(?!000|666|9\d\d)\d{3}-(?!00)\d{2}-(?!0000)\d{4}(?![\d-])"),
    Detector("ipv4", r"(?<![\d.])(?:(?:25[0-5]|2[0-4]\d|1\d\d|[1-9]?\d)\.){3}(?:25[0-5]|2[0-4]\d|1\d\d|[1-9]?\d)"
                     r"(?!\.?\d)"),
    Detector("aws_access_key_id", r"(?<![A-Z0-9])(?:AKIA|ASIA)[A-Z0-9]{16}(?![A-Z0-9])"),
)}


_EMPTY_PROBES = ("", " ", "a", "0", "a b.c 1-2 @ x_y")


# Long runs that make a pattern with nested repetition ((a+)+, (\w+\s?)+) backtrack for ever.
_SLOW_PROBES = tuple(unit * (2000 // len(unit)) + "!" for unit in ("a", "1", "a ", "a.", "a-", "a@"))
SLOW_PROBE_S = 0.25
SCAN_TIMEOUT_S = 0.25  # the most matching time one scan (a prompt, one piece of an answer) may take


class PatternTimeout(Exception):
    """A scan ran past its time budget: the patterns could not say whether the text matches."""


def compile_pattern(pattern: str, probe_speed: bool = False) -> "regex.Pattern[str]":
    """`pattern` compiled, or ValueError naming what is wrong: a syntax error, a pattern that
    matches empty text (every position would be a match), or (`probe_speed`: an operator's own
    pattern) one that takes over SLOW_PROBE_S on 2,000 characters of a repeated unit: it would
    hold up every answer it reads, on the server's event loop."""
    try:
        compiled = regex.compile(pattern, regex.VERSION1)
    except regex.error as exc:
        raise ValueError(f"pattern {pattern!r} is not a valid regular expression ({exc})") from None
    if any(m.end() == m.start() for probe in _EMPTY_PROBES for m in compiled.finditer(probe)):
        raise ValueError(f"pattern {pattern!r} can match empty text; make it match at least one character")
    for probe in _SLOW_PROBES if probe_speed else ():
        try:
            compiled.search(probe, timeout=SLOW_PROBE_S)
            compiled.fullmatch(probe, partial=True, timeout=SLOW_PROBE_S)
        except TimeoutError:
            raise ValueError(f"pattern {pattern!r} took over {SLOW_PROBE_S * 1000:.0f} ms on {len(probe) - 1:,} "
                             f"characters ({probe[:6]!r}...): it backtracks badly; rewrite it without nested "
                             "repetition such as (a+)+") from None
    return compiled


@dataclass(frozen=True)
class PatternMatch:
    detector: int  # index in the PatternSet
    start: int
    end: int


class PatternSet:
    """Detectors compiled as one alternation, each its own named group."""

    def __init__(self, detectors: Sequence[Detector], timeout: float | None = SCAN_TIMEOUT_S) -> None:
        if not detectors:
            raise ValueError("a pattern set needs at least one detector")
        # The built-in detectors are bounded (every repetition has a maximum): a set of only
        # those runs untimed, as a timeout costs each regex call about a microsecond.
        builtin = set(BUILTIN.values())
        self.timeout = timeout if any(d not in builtin for d in detectors) else None
        for d in detectors:
            compile_pattern(d.pattern)
        self.detectors = tuple(detectors)
        self.regex = regex.compile("|".join(f"(?P<{_GROUP}{i}>{d.pattern})" for i, d in enumerate(detectors)),
                                   regex.VERSION1)

    def _outer(self, m: "regex.Match[str]") -> int:
        """The detector whose group matched (its own groups may be named too: not lastgroup)."""
        for i in range(len(self.detectors)):
            if m.start(f"{_GROUP}{i}") >= 0:
                return i
        raise AssertionError("a match of no detector")

    def accepts(self, m: "regex.Match[str]") -> PatternMatch | None:
        i = self._outer(m)
        check = self.detectors[i].check
        if check is not None and not check(m.group()):
            return None
        return PatternMatch(i, m.start(), m.end())

    def find_all(self, text: str) -> list[PatternMatch]:
        """Every match in a whole text (the reference the scanner agrees with); PatternTimeout
        past the time budget."""
        try:
            matches = list(self.regex.finditer(text, timeout=self.timeout))  # (None: untimed)
        except TimeoutError:
            raise PatternTimeout(f"matching took over {self.timeout * 1000:.0f} ms on {len(text):,} characters") from None
        return [pm for m in matches if m.end() > m.start() and (pm := self.accepts(m)) is not None]

    def scanner(self) -> "PatternScanner":
        return PatternScanner(self)


class PatternScanner:
    """Matches of a PatternSet in a text fed piece by piece; offsets count every character fed."""

    def __init__(self, patterns: PatternSet) -> None:
        self.patterns = patterns
        self._text = ""  # the characters from `_base` on
        self._base = 0
        self._pos = 0  # where the next search starts (absolute)
        self._held = 0  # the first character that may still be part of a match (absolute)
        self._deadline = 0.0  # perf_counter time the scan under way must end by

    @property
    def fed(self) -> int:
        return self._base + len(self._text)

    @property
    def held_from(self) -> int:
        return self._held

    def feed(self, text: str) -> list[PatternMatch]:
        self._text += text
        found = self._scan(final=False)
        keep_from = max(0, min(self._held, self._pos) - LOOKBEHIND - self._base)
        if keep_from:
            self._text, self._base = self._text[keep_from:], self._base + keep_from
        return found

    def finish(self) -> list[PatternMatch]:
        """The matches left once the text has ended."""
        return self._scan(final=True)

    def _left(self) -> float:
        """Seconds left of this scan's budget (PatternTimeout once none are)."""
        left = self._deadline - time.perf_counter()
        if left <= 0:
            raise PatternTimeout(f"matching took over {self.patterns.timeout * 1000:.0f} ms on "
                                 f"{len(self._text):,} characters held")
        return left

    def _search(self, text: str, pos: int) -> "regex.Match[str] | None":
        if self.patterns.timeout is None:
            return self.patterns.regex.search(text, pos)
        return self.patterns.regex.search(text, pos, timeout=self._left())

    def _open_at(self, text: str, pos: int) -> bool:
        """Whether the text from `pos` could still be (a prefix of) a match."""
        if self.patterns.timeout is None:
            return self.patterns.regex.fullmatch(text, pos, partial=True) is not None
        return self.patterns.regex.fullmatch(text, pos, partial=True, timeout=self._left()) is not None

    def _scan(self, final: bool) -> list[PatternMatch]:
        if self.patterns.timeout is None:
            return self._scan_within(final)
        self._deadline = time.perf_counter() + self.patterns.timeout
        try:
            return self._scan_within(final)
        except TimeoutError:
            raise PatternTimeout(f"matching took over {self.patterns.timeout * 1000:.0f} ms on "
                                 f"{len(self._text):,} characters held") from None

    def _scan_within(self, final: bool) -> list[PatternMatch]:
        text, base = self._text, self._base
        found: list[PatternMatch] = []
        pos = self._pos - base
        hold = self._first_open(max(pos, self._held - base), final)
        while True:
            m = self._search(text, pos)  # a complete match starting before `hold` is final
            if m is None or m.start() >= hold:
                break
            if m.end() == m.start():  # (compile_pattern refuses such patterns; never loop on one)
                pos = m.end() + 1
            else:
                accepted = self.patterns.accepts(m)
                if accepted is not None:
                    found.append(PatternMatch(accepted.detector, base + accepted.start, base + accepted.end))
                pos = m.end()
            if pos > hold:
                hold = self._first_open(pos, final)
        # No match starts in [pos, hold), nor can one: the next search starts at `hold`.
        self._pos, self._held = base + max(pos, hold), base + hold
        return found

    def _first_open(self, start: int, final: bool) -> int:
        """The first position from `start` where the text read so far could still be the start
        of a match (a prefix of one, or one that more text could lengthen or change); the end if
        none. A position that is not, never becomes one: more text only rules out more."""
        text = self._text
        if final:
            return len(text)
        for p in range(start, len(text)):
            if self._open_at(text, p):
                return p
        return len(text)
