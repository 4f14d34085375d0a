"""`tierlm bench safety` runs end to end at tiny scale, its systems agree on every match, and a
system that misses one is caught (exit status 1, `agree: false`, the difference named)."""
from __future__ import annotations

import json
import re

from tierlm.bench.safety import first_difference, make_phrases, regex_source, run_regex, run_tierlm
from tierlm.cli import main
from tierlm.serving.phrase_scan import Scanner, compile_phrases


def test_bench_safety_tiny(tmp_path):
    out, png = tmp_path / "safety.json", tmp_path / "safety.png"
    rc = main(["bench", "safety", "--phrases", "10,50", "--tokens", "1000", "--repeats", "1",
               "--full-max-phrases", "10", "--json", str(out), "--plot", str(png)])
    assert rc == 0
    res = json.loads(out.read_text())
    assert res["phrases"] == [10, 50] and res["tokens"] == 1000 and res["target_us_per_token"] == 20
    assert res["agree"] is True and res["differences"] == []
    rows = {(r["system"], r["phrases"]): r for r in res["results"]}
    assert set(rows) == {(s, n) for s in ("tierlm", "regex_window", "regex_full") for n in (10, 50)}
    for n in (10, 50):
        text = next(t for t in res["texts"] if t["phrases"] == n)
        assert text["tokens"] == 1000 and text["planted"] >= 3
        ours = rows[("tierlm", n)]
        assert ours["matches"] >= text["planted"]  # every planted phrase, and any that occur by chance
        assert ours["meets_target"] == (ours["us_per_token"] <= 20)
        for system in ("tierlm", "regex_window"):
            r = rows[(system, n)]
            assert r["us_per_token"] > 0 and r["compile_s"] > 0 and r["matches"] == ours["matches"]
            assert r["us_per_token"] == r["samples_us_per_token"][0]
        ratio = next(r for r in res["ratios"] if r["phrases"] == n)
        assert ratio["regex_window_over_tierlm"] == rows[("regex_window", n)]["us_per_token"] / ours["us_per_token"]
        check = next(c for c in res["input_check"] if c["phrases"] == n)
        assert check["tierlm_matches"] == check["regex_matches"] == ours["matches"]
        assert check["tierlm_us_per_1k_chars"] > 0 and check["regex_us_per_1k_chars"] > 0
        assert check["first_difference"] is None
    # regex_full ran where allowed (10 phrases) and agreed; above --full-max-phrases it says why not.
    assert rows[("regex_full", 10)]["matches"] == rows[("tierlm", 10)]["matches"]
    assert rows[("regex_full", 50)]["us_per_token"] is None and "full-max-phrases" in rows[("regex_full", 50)]["skipped"]
    assert res["tierlm_meets_target"] == all(rows[("tierlm", n)]["meets_target"] for n in (10, 50))
    # the detectors, streamed: both filters find every planted item (and agree with finditer over
    # the whole text), the scanner holding back less than the window filter's fixed window
    d = res["detectors"]
    assert d["agree"] is True and d["tokens"] == 1000 and d["planted"] >= 3
    det = {r["system"]: r for r in d["results"]}
    assert det["tierlm"]["matches"] == det["regex_window"]["matches"] >= d["planted"]
    assert det["tierlm"]["mean_held_chars"] < det["regex_window"]["mean_held_chars"] <= d["window_chars"]
    assert d["regex_window_over_tierlm"] == det["regex_window"]["us_per_token"] / det["tierlm"]["us_per_token"]
    assert png.stat().st_size > 1000


def test_bench_safety_reports_a_missed_match(tmp_path, monkeypatch, capsys):
    feed = Scanner.feed
    dropped: list = []

    def lossy(self, text):  # the scanner forgets the first match it finds
        found = feed(self, text)
        if found and not dropped:
            dropped.append(found.pop(0))
        return found

    monkeypatch.setattr(Scanner, "feed", lossy)
    out = tmp_path / "safety.json"
    rc = main(["bench", "safety", "--phrases", "10", "--tokens", "600", "--repeats", "1",
               "--full-max-phrases", "0", "--json", str(out)])
    assert rc == 1 and dropped
    res = json.loads(out.read_text())
    assert res["agree"] is False
    m = dropped[0]
    assert f"regex_window found phrase {m.phrase} " in res["differences"][0]
    assert f"at [{m.start}, {m.end})" in res["differences"][0]
    assert "first difference: 10 phrases: regex_window found" in capsys.readouterr().out


def test_first_difference():
    phrases = [("abc", True), ("de fg", False)]
    a = {(0, 5, 8), (1, 10, 15)}
    assert first_difference("x", a, "y", set(a), phrases) is None
    msg = first_difference("x", a, "y", {(1, 10, 15), (1, 20, 25)}, phrases)
    assert msg == "x found phrase 0 'abc' (whole word) at [5, 8) and y did not (2 vs 2 matches, 2 differ)"


def test_streaming_peers_decide_whole_words_at_token_edges():
    """A whole word is decided by the character after it, which may come in the next token (or
    never: the stream's end); a match is counted once although later windows see it again."""
    phrases = [("abc", True), ("de fg", False), ("bcd", False)]
    tokens = ["xabc", " ab", "c", "d", " abc", ",", " de", " f", "g", "\nAB", "C"]
    text = "".join(tokens)
    assert text == "xabc abcd abc, de fg\nABC"
    # "bcd" inside "abcd"; "abc" whole before "," and at the end (not in "xabc", "abcd"); "de fg"
    expected = {(2, 6, 9), (0, 10, 13), (1, 15, 20), (0, 21, 24)}
    assert all(text[s:e].lower().split() == phrases[i][0].split() for i, s, e in expected)
    pattern = re.compile(regex_source(phrases), re.IGNORECASE)
    assert run_tierlm(compile_phrases(phrases), tokens)[1] == expected
    assert run_regex(pattern, phrases, tokens, window=True)[1] == expected
    assert run_regex(pattern, phrases, tokens, window=False)[1] == expected


def test_phrases_are_prefix_free_and_nested():
    phrases = make_phrases(300, seed=1)
    assert phrases[:40] == make_phrases(40, seed=1)
    texts = [p for p, _ in phrases]
    assert len(set(texts)) == 300 and sum(w for _, w in phrases) == 150
    assert not any(a != b and b.startswith(a) for a in texts for b in texts)
