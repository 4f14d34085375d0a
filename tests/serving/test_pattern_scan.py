"""The streaming detector scanner (tierlm/serving/pattern_scan.py) against `finditer` over the
whole text, for any text and any way of cutting it into pieces: the same matches, each
reported before any of it could be shown, and held text released as soon as it cannot be part
of one; the built-in detectors on examples of what they must and must not find."""
from __future__ import annotations

import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tierlm.serving.pattern_scan import BUILTIN, Detector, PatternSet, PatternTimeout, compile_pattern, luhn

# Patterns whose matches can grow, change alternative or be undone by what follows.
TRICKY = [Detector("opt", r"a(?:bc)?"), Detector("ahead", r"\d{3}(?!\d)"), Detector("alt", r"ab|a"),
          Detector("plus", r"x+y"), Detector("behind", r"(?<=q)zz")]
ALPHABET = "abcxyqz0123456789 .-@_AKIS\n"


def _scan(patterns: PatternSet, pieces: list[str]) -> list:
    """Feed `pieces`; check at every step that no match of the final text starts in what may be
    shown and has not been reported yet."""
    text = "".join(pieces)
    want = patterns.find_all(text)
    scanner, found = patterns.scanner(), []
    for piece in pieces:
        found += scanner.feed(piece)
        assert scanner.held_from <= scanner.fed
        for m in want:
            if m.start < scanner.held_from:
                assert m in found, (m, text, pieces)  # shown text holds no unreported match
    found += scanner.finish()
    return found


def _pieces(draw, text: str) -> list[str]:
    cuts = sorted(draw(st.sets(st.integers(1, max(1, len(text) - 1)), max_size=len(text))))
    bounds = [0, *[c for c in cuts if c < len(text)], len(text)]
    return [text[a:b] for a, b in zip(bounds, bounds[1:]) if b > a] or [""]


@st.composite
def _texts_and_pieces(draw, alphabet: str = ALPHABET, max_size: int = 80):
    text = draw(st.text(alphabet=alphabet, max_size=max_size))
    return text, _pieces(draw, text)


@settings(max_examples=400, deadline=None)
@given(_texts_and_pieces())
def test_tricky_patterns_match_as_finditer_over_the_whole_text(case):
    text, pieces = case
    patterns = PatternSet(TRICKY)
    assert _scan(patterns, pieces) == patterns.find_all(text)


@st.composite
def _pii_texts(draw):
    """Texts made of words, numbers and things close to the built-in detectors' shapes."""
    parts = st.one_of(
        st.sampled_from(["john.doe@example.com", "a@b.co", "x@y", "4111 1111 1111 1111", "4111-1111-1111-1112",
                         "123-45-6789", "000-12-3456", "10.0.0.1", "256.1.1.1", "1.2.3.4.5", "AKIAABCDEFGHIJKLMNOP",
                         "AKIA123", "ssn", "card", "mail", "ip", ".", ",", " ", "-", "@", "\n"]),
        st.text(alphabet="0123456789 .-@abcAKI", max_size=6))
    text = "".join(draw(st.lists(parts, max_size=16)))
    return text, _pieces(draw, text)


@settings(max_examples=400, deadline=None)
@given(_pii_texts())
def test_builtin_detectors_match_as_finditer_over_the_whole_text(case):
    text, pieces = case
    patterns = PatternSet(list(BUILTIN.values()))
    assert _scan(patterns, pieces) == patterns.find_all(text)


def test_what_cannot_be_part_of_a_match_is_released_at_once():
    patterns = PatternSet([BUILTIN["email"], BUILTIN["credit_card"]])
    s = patterns.scanner()
    assert s.feed("Hello there, ") == [] and s.held_from == s.fed  # nothing like a match
    s.feed("write to bob")
    assert s.held_from == len("Hello there, write to ")  # "bob" may become bob@...
    s.feed("@example.com")
    assert s.held_from == len("Hello there, write to ")  # ... .community?
    (m,) = s.feed(" now")
    assert s.held_from == s.fed - len("now")  # "now" may be the start of another address
    assert s.feed("!") == []
    assert (m.start, m.end) == (len("Hello there, write to "), len("Hello there, write to bob@example.com"))
    assert s.held_from == s.fed


@pytest.mark.parametrize("name, hits, misses", [
    ("email", ["jane.doe+tag@mail.example.org", "a_b@c-d.io"], ["a@b", "@example.com", "x@y.z"]),
    ("credit_card", ["4111 1111 1111 1111", "5500-0000-0000-0004", "4012888888881881"],
     ["4111 1111 1111 1112", "1234 5678", "41111111111111111111111"]),
    ("us_ssn", ["123-45-6789"], ["000-45-6789", "123-00-6789", "123-45-0000", "1234-56-789", "123-45-67890"]),
    ("ipv4", ["192.168.1.20", "8.8.8.8"], ["256.1.1.1", "1.2.3", "1.2.3.4.5"]),
    ("aws_access_key_id", ["AKIAIOSFODNN7EXAMPLE"], ["AKIAIOSFODNN7EXAMPL", "XAKIAIOSFODNN7EXAMPLE"]),
])
def test_builtin_detectors_on_examples(name, hits, misses):
    patterns = PatternSet([BUILTIN[name]])
    for text in hits:
        assert [(m.start, m.end) for m in patterns.find_all(f"see {text}, ok")] == [(4, 4 + len(text))], text
    for text in misses:
        assert patterns.find_all(f"see {text}, ok") == [], text


def test_luhn_and_pattern_errors():
    assert luhn("4111 1111 1111 1111") and not luhn("4111 1111 1111 1112") and not luhn("7")
    compile_pattern(r"(?i)acct-\d{6}")
    for bad, says in ((r"a(", "not a valid regular expression"), (r"a*", "can match empty text"),
                      (r"\b", "can match empty text")):
        with pytest.raises(ValueError, match=says):
            compile_pattern(bad)
    for slow in (r"(a+)+$", r"(\w+\s?)+$"):
        compile_pattern(slow)  # (the speed probe is for operators' patterns)
        with pytest.raises(ValueError, match="took over 250 ms on 2,000 characters .*backtracks badly"):
            compile_pattern(slow, probe_speed=True)
    for name, detector in BUILTIN.items():
        compile_pattern(detector.pattern, probe_speed=True)


# Passes the start-up probe (no probe text holds an x), yet backtracks exponentially on x's:
# forty of them would take about a minute.
EVADES_THE_PROBE = r"(?:x|xx)+y"


def test_a_pattern_that_backtracks_for_ever_runs_out_of_time_instead():
    compile_pattern(EVADES_THE_PROBE, probe_speed=True)
    patterns = PatternSet([BUILTIN["email"], Detector("slow", EVADES_THE_PROBE)], timeout=0.05)
    assert PatternSet(list(BUILTIN.values())).timeout is None  # bounded: untimed, as timing costs every call
    assert [m.detector for m in patterns.find_all("xxxy and a@b.co")] == [1, 0]  # it still matches
    for scan in (lambda: patterns.find_all("x" * 40),
                 lambda: patterns.scanner().feed("x" * 40),
                 lambda: [s := patterns.scanner(), *[s.feed("x") for _ in range(20)], s.feed("x" * 20), s.finish()]):
        started = time.perf_counter()
        with pytest.raises(PatternTimeout, match="matching took over 50 ms"):
            scan()
        assert time.perf_counter() - started < 1.0
    # the budget is per scan: pieces that each finish in time never add up to a timeout
    scanner = patterns.scanner()
    found = [m for _ in range(200) for m in scanner.feed("a@b.co xxxxxxxxxxxx ")] + scanner.finish()
    assert len(found) == 200 and found == patterns.find_all("a@b.co xxxxxxxxxxxx " * 200)
