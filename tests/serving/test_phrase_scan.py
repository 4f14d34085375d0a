"""The streaming phrase scanner (tierlm/serving/phrase_scan.py) against Python's `re` as the
reference: the same matches whatever the text's chunking, nothing later found before
`held_from`, and `held_from` no earlier than it must be."""
from __future__ import annotations

import random
import re

import pytest
from hypothesis import given, settings, strategies as st

from tierlm.serving.phrase_scan import BOUNDARY, Match, PhraseSet, compile_phrases, normalise


def reference(phrases: list[tuple[str, bool]], text: str) -> set[tuple[int, int, int]]:
    """(phrase, start, end) of every match by regex: case-insensitive, a run of white space for
    each space, not inside a word at a whole-word phrase's word edges (ASCII text)."""
    found = set()
    for index, (phrase, whole) in enumerate(phrases):
        body = r"\s+".join(re.escape(word) for word in phrase.split())
        if whole and re.match(r"\w", phrase.strip()):
            body = r"(?<!\w)" + body
        if whole and re.search(r"\w$", phrase.strip()):
            body += r"(?!\w)"
        for m in re.finditer(f"(?=({body}))", text, re.IGNORECASE):
            found.add((index, m.start(1), m.end(1)))
    return found


def scanned(ps: PhraseSet, pieces: list[str]) -> set[tuple[int, int, int]]:
    scanner = ps.scanner()
    matches: list[Match] = []
    for piece in pieces:
        matches += scanner.feed(piece)
    matches += scanner.finish()
    return {(m.phrase, m.start, m.end) for m in matches}


def chunks(text: str, cuts: list[int]) -> list[str]:
    points = sorted({c % (len(text) + 1) for c in cuts} | {0, len(text)})
    return [text[a:b] for a, b in zip(points, points[1:])] or [""]


ALPHABET = "abAB _.\n\t-"
word = st.text("abAB_", min_size=1, max_size=4)
phrase = st.lists(word, min_size=1, max_size=3).map(" ".join) | st.text("ab.-", min_size=1, max_size=4)


@settings(max_examples=400, deadline=None)
@given(st.lists(st.tuples(phrase, st.booleans()), min_size=1, max_size=6), st.text(ALPHABET, max_size=60),
       st.lists(st.integers(0, 100), max_size=12))
def test_matches_equal_the_regex_reference_for_any_chunking(phrases, text, cuts):
    phrases = [(p, w) for p, w in phrases if p.strip()]
    if not phrases:
        return
    ps = compile_phrases(phrases)
    assert scanned(ps, chunks(text, cuts)) == reference(phrases, text)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(phrase, st.booleans()), min_size=1, max_size=6), st.text(ALPHABET, max_size=60),
       st.lists(st.integers(0, 100), max_size=12))
def test_nothing_later_found_starts_before_held_from(phrases, text, cuts):
    phrases = [(p, w) for p, w in phrases if p.strip()]
    if not phrases:
        return
    ps = compile_phrases(phrases)
    everything = set(ps.find_all(text))
    scanner = ps.scanner()
    found: set[Match] = set()
    for piece in chunks(text, cuts):
        found |= set(scanner.feed(piece))
        later = everything - found
        assert all(m.start >= scanner.held_from for m in later), (scanner.held_from, later)
    assert found | set(scanner.finish()) == everything


def test_held_from_is_the_longest_suffix_that_may_become_a_phrase():
    scanner = compile_phrases([("sk-live-", False), ("password", True)]).scanner()
    scanner.feed("the key is sk-li")
    assert scanner.held_from == len("the key is ")  # "sk-li" waits; everything before is shown
    scanner.feed("ght")
    assert scanner.held_from == scanner.fed  # "sk-light" can become nothing: all shown
    scanner.feed(" my pass")
    assert scanner.held_from == len("the key is sk-light my ")
    scanner.feed("port")
    assert scanner.held_from == scanner.fed
    scanner.feed(" password")  # whole word: its end is known only at the next character
    assert scanner.held_from == len("the key is sk-light my passport ")
    assert [(m.start, m.end) for m in scanner.finish()] == [(len("the key is sk-light my passport "), scanner.fed)]


def test_case_spacing_and_folding_do_not_matter():
    ps = compile_phrases([("Straße", False), ("drop  TABLE", False)])
    text = "STRASSE and\ndrop \t table users"
    assert sorted((m.phrase, text[m.start:m.end]) for m in ps.find_all(text)) == [
        (0, "STRASSE"), (1, "drop \t table")]


def test_whole_word_phrases_skip_words_that_contain_them():
    ps = compile_phrases([("ass", True), ("x_1", True)])
    assert ps.find_all("class bass x_12 ass_ ass") == [Match(0, 21, 24)]
    assert ps.find_all("Ass.") == [Match(0, 0, 3)]
    assert ps.find_all("(x_1)") == [Match(1, 1, 4)]


def test_normalised_phrases_and_their_errors():
    assert normalise("  Foo   bar ") == f"foo{BOUNDARY} {BOUNDARY}bar"
    assert normalise("foo", whole_word=True) == f"{BOUNDARY}foo{BOUNDARY}"
    assert normalise("$$", whole_word=True) == "$$"  # no word edge: nothing to bound
    assert normalise(" \n ") == ""
    with pytest.raises(ValueError, match="empty"):
        PhraseSet(["a", ""])


def test_many_phrases_long_text_against_the_reference():
    rng = random.Random(7)
    words = ["".join(rng.choice("abcde") for _ in range(rng.randint(1, 4))) for _ in range(60)]
    phrases = [(" ".join(rng.sample(words, rng.randint(1, 2))), rng.random() < 0.5) for _ in range(200)]
    text = "".join(rng.choice(words) + rng.choice([" ", "  ", "\n", ".", ""]) for _ in range(3000))
    ps = compile_phrases(phrases)
    pieces = []
    at = 0
    while at < len(text):
        n = rng.randint(1, 6)
        pieces.append(text[at:at + n])
        at += n
    found = scanned(ps, pieces)
    assert found == reference(phrases, text)
    assert len(found) > 1000
