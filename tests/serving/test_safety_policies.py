"""The safety layer's parts without a server (tierlm/serving/safety.py): the policies file and
its refusals, which policies a request gets, and OutputGuard over engine deltas (what is held,
what is shown, redactions across deltas, logprobs, a block), for phrases and for detectors."""
from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tierlm.engine.outputs import StreamDelta, TokenLogprob
from tierlm.serving.safety import (FINISH_REASON, OutputGuard, PolicyFileError, Rules, SafetyPolicies,
                                   blocked_delta)


def policies(tmp_path: Path, text: str, **names) -> SafetyPolicies:
    path = tmp_path / "policies.toml"
    path.write_text(text)
    return SafetyPolicies.from_file(path, **names)


FILE = """
[policies.secrets]
phrases = ["sk-live-", "BEGIN RSA PRIVATE KEY"]

[policies.names]
phrases = ["Project Falcon"]
check = "output"
action = "redact"
replacement = "[codename]"

[policies.bronze_words]
phrases = ["darn"]
whole_word = true
check = "input"
tiers = ["bronze"]
tenants = ["acme"]
"""


def test_a_file_is_read_and_each_request_gets_its_tiers_and_tenants_policies(tmp_path):
    ps = policies(tmp_path, FILE, tiers={"gold", "bronze"}, tenants={"acme", "zeta"})
    assert [p.name for p in ps.policies] == ["secrets", "names", "bronze_words"]
    gold = ps.for_request("gold", "zeta")
    assert gold.check_prompt("my key is SK-LIVE-123").name == "secrets"
    assert gold.check_prompt("darn it") is None  # bronze's and acme's only
    assert gold.check_prompt("Project Falcon") is None  # output only
    for tier, tenant in (("bronze", "zeta"), ("gold", "acme")):
        assert ps.for_request(tier, tenant).check_prompt("Darn it").name == "bronze_words"
    assert ps.for_request("bronze", "zeta").check_prompt("darned") is None  # whole word
    assert ps.for_request("gold", "zeta") is gold  # compiled once per selection


def test_phrases_file_beside_the_policies_file(tmp_path):
    (tmp_path / "words.txt").write_text("# one per line\nalpha beta\n\n  gamma  \n")
    ps = policies(tmp_path, '[policies.listed]\nphrases_file = "words.txt"\n')
    assert ps.policies[0].phrases == ("alpha beta", "gamma")


@pytest.mark.parametrize("text, names, message", [
    ("", {}, "no \\[policies.NAME\\] table"),
    ("x = 1\n[policies.a]\nphrases=['a']\n", {}, "unknown key\\(s\\) \\['x'\\]"),
    ("[policies.a]\nphrases=['a']\ncolour='red'\n", {}, "policy 'a': unknown key\\(s\\) \\['colour'\\]"),
    ("[policies.a]\n", {}, "policy 'a': nothing to look for; give 'phrases', 'phrases_file', 'detect' or 'patterns'"),
    ("[policies.a]\ndetect=['email', 'passport']\n", {}, "unknown detector\\(s\\) \\['passport'\\]; the built-in"),
    ("[policies.a]\npatterns=['a(']\n", {}, "policy 'a': patterns\\[0\\]: pattern 'a\\(' is not a valid regular"),
    ("[policies.a]\npatterns=['x*']\n", {}, "patterns\\[0\\]: .* can match empty text"),
    ("[policies.a]\ndetect=['email']\naction='redact'\nreplacement='<a@b.com>'\n", {}, "matches the policy itself"),
    ("[policies.a]\nphrases=['  ']\n", {}, "only white space"),
    ("[policies.a]\nphrases='a'\n", {}, "phrases must be a list of strings"),
    ("[policies.a]\nphrases=['a']\naction='warn'\n", {}, "action must be 'block' or 'redact'"),
    ("[policies.a]\nphrases=['a']\ncheck='prompt'\n", {}, "check must be 'input', 'output' or 'both'"),
    ("[policies.a]\nphrases=['a']\naction='redact'\ncheck='input'\n", {}, "'redact' applies to answers"),
    ("[policies.a]\nphrases=['secret']\naction='redact'\nreplacement='no secret'\n", {}, "matches the policy itself"),
    ("[policies.a]\nphrases=['a']\ntiers=['gold']\n", {}, "lists tiers, which come from a tenants file"),
    ("[policies.a]\nphrases=['a']\ntenants=['acme']\n", {"tiers": {"gold"}, "tenants": {"zeta"}},
     "unknown tenant\\(s\\) \\['acme'\\]"),
    ("[policies.a]\nphrases=['a']\nphrases_file='missing.txt'\n", {}, "phrases_file .*missing.txt cannot be read"),
    ("[policies.a\n", {}, "not valid TOML"),
    ("[policies.a]\nphrases=['" + "x" * 1001 + "']\n", {}, "a phrase of 1001 characters"),
])
def test_a_bad_file_is_refused_naming_the_policy_and_key(tmp_path, text, names, message):
    with pytest.raises(PolicyFileError, match=message):
        policies(tmp_path, text, **names)


def test_an_unreadable_file_is_refused(tmp_path):
    with pytest.raises(PolicyFileError, match="cannot be read"):
        SafetyPolicies.from_file(tmp_path / "nope.toml")


def _rules(tmp_path: Path, text: str) -> Rules:
    rules = policies(tmp_path, text).for_request(None, None).output
    assert rules is not None
    return rules


def deltas(pieces: list[str], finish: bool = True) -> list[StreamDelta]:
    """Engine deltas of `pieces`, one token each, with logprobs whose text_start are exact."""
    out, at = [], 0
    for i, piece in enumerate(pieces):
        last = finish and i == len(pieces) - 1
        out.append(StreamDelta("r", piece, [i], finished=last, finish_reason="stop" if last else None,
                               logprobs=[TokenLogprob(i, -0.5, text_start=at)], num_output_tokens=i + 1))
        at += len(piece)
    return out


def test_only_what_may_become_a_phrase_is_held_and_everything_is_shown_at_the_end(tmp_path):
    guard = OutputGuard(_rules(tmp_path, "[policies.s]\nphrases=['sk-live-']\n"))
    pieces = ["Your", " key", " sk", "-li", "ght", " ok", "!"]
    shown_after = []
    for d in deltas(pieces):
        shown, blocked = guard.feed(d)
        assert blocked is None
        shown_after.append("".join(x.text for x in shown))
    # " sk" and "-li" wait for "ght", which shows they were no key; the rest goes at once
    assert shown_after == ["Your", " key", "", "", " sk-light", " ok", "!"]


def test_a_block_shows_nothing_of_the_phrase_and_ends_with_the_policy(tmp_path):
    guard = OutputGuard(_rules(tmp_path, "[policies.s]\nphrases=['sk-live-']\n"))
    shown_text = ""
    ds = deltas(["Key:", " sk-", "live", "-abc", " more"])
    for d in ds:
        shown, blocked = guard.feed(d)
        shown_text += "".join(x.text for x in shown)
        if blocked is not None:
            break
    assert blocked.name == "s" and shown_text == "Key:"
    last = blocked_delta(d, blocked)
    assert (last.finished, last.finish_reason, last.stop_reason, last.text, last.num_output_tokens) == \
        (True, FINISH_REASON, "s", "", 4)


def test_a_whole_word_phrase_at_the_very_end_is_found_when_the_answer_ends(tmp_path):
    guard = OutputGuard(_rules(tmp_path, "[policies.w]\nphrases=['darn']\nwhole_word=true\n"))
    shown, blocked = guard.feed(deltas(["oh darn"], finish=False)[0])
    assert blocked is None and shown == []  # "darn" may be "darned": held
    final = StreamDelta("r", "", [], finished=True, finish_reason="stop")
    assert guard.feed(final)[1].name == "w"


def test_redactions_across_deltas_keep_the_rest_and_drop_only_touched_logprobs(tmp_path):
    guard = OutputGuard(_rules(tmp_path, "[policies.n]\nphrases=['Project Falcon']\naction='redact'\n"
                                         "replacement='[x]'\n"))
    pieces = ["About", " Proj", "ect Fal", "con:", " it", " works"]
    out: list[StreamDelta] = []
    for d in deltas(pieces):
        shown, blocked = guard.feed(d)
        assert blocked is None
        out += shown
    assert "".join(d.text for d in out) == "About [x]: it works"
    assert [d.logprobs is None for d in out] == [False, True, True, True, False, False]
    assert [d.token_ids for d in out] == [[0], [], [], [], [4], [5]]  # the ids would spell it too
    # later tokens' text_start follow the redacted text, as the APIs read them
    text = "".join(d.text for d in out)
    for d in out[4:]:
        lp = d.logprobs[0]
        assert text[lp.text_start:lp.text_start + len(d.text)] == d.text
    assert [p.name for p in guard.redacted] == ["n"]


def test_overlapping_redactions_become_one(tmp_path):
    guard = OutputGuard(_rules(tmp_path, "[policies.n]\nphrases=['ab', 'bc', 'abcd e']\naction='redact'\n"
                                         "replacement='#'\n"))
    out = []
    for d in deltas(["x ab", "cd e", "f abc"]):
        out += guard.feed(d)[0]
    assert "".join(d.text for d in out) == "x #f #"


def test_block_wins_over_redact_on_the_same_text(tmp_path):
    rules = _rules(tmp_path, "[policies.r]\nphrases=['secret']\naction='redact'\n"
                             "[policies.b]\nphrases=['top secret']\n")
    guard = OutputGuard(rules)
    results = [guard.feed(d) for d in deltas(["a top", " secret", " plan"])]
    assert results[1][1].name == "b"


# ---- detectors and patterns -----------------------------------------------------------

PII = """
[policies.pii]
detect = ["email", "credit_card"]
patterns = ['(?i)acct-\\d{6}']
check = "output"
action = "redact"
replacement = "[pii]"

[policies.keys]
detect = ["aws_access_key_id"]
"""


def test_detected_personal_data_is_redacted_across_deltas_and_only_it(tmp_path):
    guard = OutputGuard(_rules(tmp_path, PII))
    pieces = ["Mail jane", ".doe@exam", "ple.com or pay 4111 ", "1111 1111 1111", " from ACCT-12", "3456; card",
              " 4111 1111 1111 1112 is not one."]
    out: list[StreamDelta] = []
    for d in deltas(pieces):
        shown, blocked = guard.feed(d)
        assert blocked is None
        out += shown
    assert "".join(d.text for d in out) == "Mail [pii] or pay [pii] from [pii]; card 4111 1111 1111 1112 is not one."
    assert [p.name for p in guard.redacted] == ["pii"] * 3


def test_a_detected_key_blocks_before_any_of_it_is_shown(tmp_path):
    guard = OutputGuard(_rules(tmp_path, PII))
    shown_text = ""
    for d in deltas(["The key is AKIA", "IOSFODNN7", "EXAMPLE and", " more"]):
        shown, blocked = guard.feed(d)
        shown_text += "".join(x.text for x in shown)
        if blocked is not None:
            break
    assert blocked.name == "keys" and "AKIA" not in shown_text


def test_a_prompt_with_a_detected_key_is_refused(tmp_path):
    safety = policies(tmp_path, PII).for_request(None, None)
    assert safety.check_prompt("use AKIAIOSFODNN7EXAMPLE please").name == "keys"
    assert safety.check_prompt("mail jane.doe@example.com") is None  # 'pii' checks answers only


@settings(max_examples=150, deadline=None)
@given(st.lists(st.sampled_from(["jane.doe@example.com", "4111 1111 1111 1111", "ACCT-123456", "acct-12345",
                                 " ", ".", "a", "1", "-", "@", "x@y", "4111", "ok "]), max_size=14),
       st.data())
def test_the_guard_shows_what_redacting_the_whole_answer_gives(tmp_path_factory, parts, data):
    """For any answer and any cutting of it into deltas: the text shown is the whole answer with
    every match replaced, and what is shown at any moment is the start of that (no delta ever
    shows a character of a match)."""
    rules = _rules(tmp_path_factory.mktemp("pii"), PII)
    text = "".join(parts)
    cuts = sorted(data.draw(st.sets(st.integers(1, max(1, len(text) - 1)))))
    bounds = [0, *[c for c in cuts if c < len(text)], len(text)]
    pieces = [text[a:b] for a, b in zip(bounds, bounds[1:]) if b > a] or [""]
    hits = rules.find_all(text)
    want, at = [], 0
    for h in hits:
        want += [text[at:h.start], "[pii]"]
        at = h.end
    want.append(text[at:])
    guard, out = OutputGuard(rules), []
    for d in deltas(pieces):
        shown, blocked = guard.feed(d)
        assert blocked is None
        out += shown
        # what was shown so far is the start of the redacted answer: no character of a match
        assert "".join(want).startswith("".join(x.text for x in out))
    assert "".join(d.text for d in out) == "".join(want)


SLOW = """
[policies.slow_redact]
patterns = ['(?:x|xx)+y']    # passes the start-up probe; exponential on a run of x's
action = "redact"

[policies.names]
phrases = ["Project Falcon"]
"""


def test_patterns_out_of_time_count_as_a_match_and_say_which(tmp_path, caplog):
    """A prompt or an answer the patterns cannot finish in time: refused or stopped (a redact
    policy cannot redact a span it never found, so it blocks too), logged naming the policy,
    within about the time budget; text they finish in time goes on as before."""
    import logging
    import time

    safety = policies(tmp_path, SLOW).for_request(None, None)
    with caplog.at_level(logging.WARNING, logger="tierlm.serving"):
        started = time.perf_counter()
        assert safety.check_prompt("say " + "x" * 60).name == "slow_redact"
        guard = safety.output_guard()
        shown, blocked = guard.feed(deltas(["ok. ", "x" * 60], finish=False)[0])
        assert blocked is None and "".join(d.text for d in shown) == "ok. "
        shown, blocked = guard.feed(deltas(["ok. ", "x" * 60], finish=False)[1])
        assert shown == [] and blocked.name == "slow_redact"
        assert time.perf_counter() - started < 3
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 2 and all("safety patterns of 'slow_redact'" in m and "rewrite the slow pattern" in m
                                  for m in said)
    assert "in a prompt" in said[0] and "refused" in said[0] and "in an answer" in said[1]
    assert safety.check_prompt("xxxxxxxxxxxxxxxxxxxx, done in time") is None
    guard = safety.output_guard()
    out = [d for piece in deltas(["a xxy b ", "xxxxy"]) for d in guard.feed(piece)[0]]
    assert "".join(d.text for d in out) == "a [redacted] b [redacted]"


def test_tool_calls_are_screened_as_decoded_at_any_depth(tmp_path):
    """Parsed calls are read as their client decodes them: keys and strings at any depth
    (arguments nest as deep as the model wrote them: no recursion to overflow), a redaction
    masks inside the string it is in, a block drops every call."""
    from tierlm.serving.tools import ParsedToolCall

    rules = _rules(tmp_path, "[policies.r]\nphrases=['secret plan']\naction='redact'\nreplacement='[x]'\n"
                             "[policies.b]\nphrases=['zürich']\n")
    deep: object = {"note": "the secret plan"}
    for _ in range(5000):
        deep = [deep]
    call = ParsedToolCall("c1", "f", {"secret plan": 1, "deep": deep, "n": 3})
    screened, blocked = OutputGuard(rules).screen_calls([call])
    assert blocked is None
    (got,) = screened
    assert set(got.arguments) == {"[x]", "deep", "n"} and got.arguments["n"] == 3
    inner = got.arguments["deep"]
    for _ in range(5000):
        (inner,) = inner
    assert inner == {"note": "the [x]"}
    assert call.arguments["deep"] is deep  # the parsed call itself is left as it was
    guard = OutputGuard(rules)
    screened, blocked = guard.screen_calls([call, ParsedToolCall("c2", "g", {"city": ["Zürich"]})])
    assert screened == [] and blocked is not None and blocked.name == "b"
    # A name is one the client offered: a redaction there would only break the call, a block holds.
    guard = OutputGuard(rules)
    named = ParsedToolCall("c3", "secret plan", {"x": "secret plan"})
    screened, blocked = guard.screen_calls([named])
    assert blocked is None and screened == [replace(named, arguments={"x": "[x]"})]
    screened, blocked = guard.screen_calls([ParsedToolCall("c4", "Zürich", {})])
    assert screened == [] and blocked is not None and blocked.name == "b"
