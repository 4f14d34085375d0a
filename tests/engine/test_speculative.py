"""Speculative decoding by n-gram lookup: same tokens as without it, fewer steps when guesses hold.

(Token-for-token parity with transformers for every architecture, with and without preemption,
is in tests/models/test_parity.py: its "speculative" and "spec_preempt" settings.)
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from tierlm import LLM, SamplingParams
from tierlm.config import EngineConfig
from tierlm.engine.request import Request
from tierlm.engine.sampler import Sampler
from tierlm.engine.speculative import SpeculativeConfig, can_speculate, ngram_draft

SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1}
# A prompt that repeats itself: guesses from it are right wherever the model repeats it too.
LOOP = [7, 8, 9, 10, 11] * 6


@pytest.fixture(scope="module")
def plain(llama_dir):
    return LLM(str(llama_dir), dtype="float32", kv_cache_memory=2 << 20, max_model_len=256,
               max_num_batched_tokens=64, block_size=4, load_progress=False)


@pytest.fixture(scope="module")
def spec(llama_dir):
    return LLM(str(llama_dir), dtype="float32", kv_cache_memory=2 << 20, max_model_len=256,
               max_num_batched_tokens=64, block_size=4, load_progress=False, speculative_config=SPEC)


def _prompts(n: int = 6) -> list[list[int]]:
    rng = np.random.default_rng(3)
    out = [LOOP]
    for i in range(n - 1):
        base = rng.integers(5, 60, size=int(rng.integers(4, 12))).tolist()
        out.append(base * int(rng.integers(1, 4)))
    return out


# ---- the proposer --------------------------------------------------------------------------


@pytest.mark.parametrize("toks, lo, hi, k, expect", [
    ([1, 2, 3, 9, 1, 2, 3], 1, 3, 2, [9, 1]),  # "1 2 3" occurred before: what followed it
    ([1, 2, 3, 9, 4, 2, 3], 1, 3, 3, [9, 4, 2]),  # only "2 3" matches: still the longest that does
    ([1, 2, 3, 9, 4, 2, 3], 3, 3, 3, []),  # ... but 3 tokens are asked for
    ([5, 1, 6, 1, 7, 1], 1, 2, 1, [7]),  # several one-token matches: the latest
    ([5, 1, 2, 6, 0, 1, 2, 7, 1, 2], 2, 2, 4, [7, 1, 2]),  # latest of the longest; cut at the end
    ([4, 4, 4, 4], 1, 4, 3, [4]),  # a run: the match may overlap the suffix
    ([1, 2, 3], 1, 3, 2, []),  # nothing occurred before
    ([3], 1, 1, 2, []),
    ([3, 3], 1, 4, 5, [3]),
    ([1, 2, 1, 2], 1, 4, 0, []),  # no room for guesses
])
def test_ngram_draft_takes_what_followed_the_latest_longest_earlier_match(toks, lo, hi, k, expect):
    assert ngram_draft(np.array(toks, dtype=np.int64), lo, hi, k) == expect


def test_ngram_draft_agrees_with_a_brute_force_search():
    rng = np.random.default_rng(0)
    for _ in range(300):
        toks = rng.integers(0, 4, size=int(rng.integers(1, 30)))
        lo = int(rng.integers(1, 4))
        hi = int(rng.integers(lo, 6))
        k = int(rng.integers(1, 6))
        n, best, at = len(toks), 0, -1
        for end in range(n - 1):  # an earlier end with at least one token after it
            m = 0
            while m < hi and end - m >= 0 and toks[end - m] == toks[n - 1 - m]:
                m += 1
            if m >= best and m > 0:
                best, at = m, end
        expect = toks[at + 1:at + 1 + k].tolist() if best >= lo else []
        assert ngram_draft(toks, lo, hi, k) == expect, (toks.tolist(), lo, hi, k)


@pytest.mark.parametrize("given, says", [
    ({"method": "eagle"}, "method 'eagle' is not supported"),
    ({"num_speculative_tokens": 0}, "num_speculative_tokens must be a whole number from 1 to 64"),
    ({"num_speculative_tokens": True}, "num_speculative_tokens"),
    ({"prompt_lookup_min": 5, "prompt_lookup_max": 3}, "prompt_lookup_min \\(5\\) is above prompt_lookup_max \\(3\\)"),
    ({"speculative_model": "x"}, "unknown field\\(s\\) speculative_model"),
    ("{not json", "not valid JSON"),
    ([1], "must be a dict"),
    ({"disable_by_batch_size": 0}, "disable_by_batch_size must be a whole number of requests"),
])
def test_bad_speculative_configs_are_refused_by_name_before_loading(given, says):
    with pytest.raises(ValueError, match=says):
        EngineConfig(speculative_config=given).validate()


def test_speculative_config_defaults_follow_what_is_given():
    assert SpeculativeConfig.parse({"method": "ngram"}) == SpeculativeConfig("ngram", 4, 4, 2)
    assert SpeculativeConfig.parse('{"prompt_lookup_max": 1}') == SpeculativeConfig("ngram", 4, 1, 1)
    assert SpeculativeConfig.parse({"prompt_lookup_min": 6}) == SpeculativeConfig("ngram", 4, 6, 6)
    assert SpeculativeConfig.parse(None) is None
    assert SpeculativeConfig.parse({"disable_by_batch_size": 8}).disable_by_batch_size == 8


def test_no_guesses_while_more_requests_run_than_disable_by_batch_size(llama_dir):
    llm = LLM(str(llama_dir), dtype="float32", kv_cache_memory=2 << 20, max_model_len=256, block_size=4,
              load_progress=False, speculative_config={**SPEC, "disable_by_batch_size": 2})
    params = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)
    running = []
    schedule = llm.engine.scheduler.schedule

    def observed():
        out = schedule()
        running.append((len(llm.engine.scheduler.running), any(n > 1 and r.spec_token_ids for r, n in out.scheduled)))
        return out
    llm.engine.scheduler.schedule = observed
    llm.generate([{"prompt_token_ids": LOOP}] * 3, params)  # three at once, all the way: no guesses
    assert running and not any(guessed for _, guessed in running)
    assert llm.engine.stats().spec_draft_tokens == 0
    running.clear()
    llm.generate([{"prompt_token_ids": LOOP}] * 2, params)
    assert any(guessed for _, guessed in running) and all(n <= 2 for n, _ in running)


# ---- the engine ----------------------------------------------------------------------------


def _run(llm, prompts, params):
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    return [(o.outputs[0].token_ids, o.outputs[0].text, o.outputs[0].finish_reason) for o in outs]


def test_greedy_output_is_the_same_with_guesses_and_steps_are_fewer(plain, spec):
    prompts = _prompts()
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    before = spec.engine.stats()
    assert _run(spec, prompts, params) == _run(plain, prompts, params)
    after = spec.engine.stats()
    accepted = after.spec_accepted_tokens - before.spec_accepted_tokens
    assert 0 < accepted <= after.spec_draft_tokens - before.spec_draft_tokens
    assert after.spec_drafts > before.spec_drafts
    # Alone, every accepted guess is a token without a step of its own, and what the model
    # computes is the prompt, one token a step and the guesses (accepted ones are not run again).
    steps = []
    for llm in (plain, spec):
        s0, a0, d0 = llm.engine.steps, llm.engine.spec_accepted_tokens, llm.engine.spec_draft_tokens
        computed = []
        schedule = llm.engine.scheduler.schedule

        def observed():
            out = schedule()
            computed.append(out.num_tokens)
            return out
        llm.engine.scheduler.schedule = observed
        try:
            cached = llm.generate({"prompt_token_ids": LOOP}, params)[0].num_cached_tokens
        finally:
            del llm.engine.scheduler.schedule
        n = llm.engine.steps - s0
        steps.append((n, llm.engine.spec_accepted_tokens - a0))
        assert sum(computed) == len(LOOP) - cached + (n - 1) + llm.engine.spec_draft_tokens - d0
    assert steps[0] == (40, 0)
    assert steps[1][1] > 0 and steps[1][0] == 40 - steps[1][1]
    assert spec.engine.pool.num_used == 0 and not spec.engine.has_unfinished()


@pytest.mark.parametrize("kw", [
    dict(max_tokens=1), dict(max_tokens=2), dict(max_tokens=3),  # no guess may run past max_tokens
    dict(max_tokens=30, logprobs=3),  # each accepted token's own logprobs
    dict(max_tokens=30, stop_token_ids=[9]),  # a stop inside an accepted run ends it there
    dict(max_tokens=30, logit_bias={8: 5.0}),
    dict(max_tokens=30, repetition_penalty=1.3),  # depends on the tokens before: decodes one at a time
    dict(max_tokens=30, min_tokens=10, stop_token_ids=[9]),
])
def test_every_greedy_option_gives_what_it_gives_without_guesses(plain, spec, kw):
    prompts = _prompts(4)
    params = SamplingParams(temperature=0, **kw)
    ref = plain.generate([{"prompt_token_ids": p} for p in prompts], params)
    got = spec.generate([{"prompt_token_ids": p} for p in prompts], params)
    for r, g in zip(ref, got):
        a, b = r.outputs[0], g.outputs[0]
        assert (b.token_ids, b.text, b.finish_reason, b.stop_reason) == (a.token_ids, a.text, a.finish_reason,
                                                                           a.stop_reason)
        if kw.get("logprobs"):
            assert [lp.token_id for lp in b.logprobs] == [lp.token_id for lp in a.logprobs]
            assert np.allclose([lp.logprob for lp in b.logprobs], [lp.logprob for lp in a.logprobs], atol=1e-4)
            assert [[t for t, _ in lp.top] for lp in b.logprobs] == [[t for t, _ in lp.top] for lp in a.logprobs]
    assert spec.engine.pool.num_used == 0


def test_stop_strings_inside_an_accepted_run_end_the_answer_where_they_would_without(plain, spec):
    """A stop string completed by a token of an accepted run ends the answer at that token, as
    one token a step would: the same text, tokens, reason and logprobs (and their places)."""
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    text = plain.generate({"prompt_token_ids": LOOP}, params)[0].outputs[0].text
    drafts, checked = spec.engine.spec_accepted_tokens, 0
    for at in range(4, len(text) - 3, 7):
        for stop, include in ((text[at:at + 2], False), (text[at:at + 3], True)):
            p = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True, stop=[stop], logprobs=2,
                               include_stop_str_in_output=include)
            a = plain.generate({"prompt_token_ids": LOOP}, p)[0].outputs[0]
            b = spec.generate({"prompt_token_ids": LOOP}, p)[0].outputs[0]
            assert (b.token_ids, b.text, b.finish_reason, b.stop_reason) == (a.token_ids, a.text, a.finish_reason,
                                                                               a.stop_reason)
            assert [(lp.token_id, lp.text_start) for lp in b.logprobs] == [(lp.token_id, lp.text_start)
                                                                           for lp in a.logprobs]
            checked += a.finish_reason == "stop"
    assert checked >= 4 and spec.engine.spec_accepted_tokens > drafts
    assert spec.engine.pool.num_used == 0


def test_allowed_token_ids_hold_for_every_guessed_row(plain, spec):
    allowed = list(range(5, 30))
    params = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True, allowed_token_ids=allowed)
    prompts = _prompts(4)
    drafts = spec.engine.spec_accepted_tokens
    got = _run(spec, prompts, params)
    assert got == _run(plain, prompts, params)
    assert all(set(ids) <= set(allowed) for ids, _, _ in got)
    assert spec.engine.spec_accepted_tokens > drafts


def test_a_request_near_max_model_len_guesses_no_further(llama_dir):
    llm = LLM(str(llama_dir), dtype="float32", kv_cache_memory=2 << 20, max_model_len=40, block_size=4,
              load_progress=False, speculative_config=SPEC)
    plain = LLM(str(llama_dir), dtype="float32", kv_cache_memory=2 << 20, max_model_len=40, block_size=4,
                load_progress=False)
    params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    assert _run(llm, [LOOP], params) == _run(plain, [LOOP], params)  # 30 + 10 = exactly max_model_len


def test_accepted_guesses_fill_the_prefix_cache_with_the_right_blocks(plain, spec):
    """Blocks finished by accepted guesses are registered under their tokens: a later request
    whose prompt runs through them hits them and continues as a cold run does."""
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    first = spec.generate({"prompt_token_ids": LOOP}, params)[0].outputs[0].token_ids
    follow = LOOP + first[:30]
    plain.engine.pool.evict_all()
    cold = plain.generate({"prompt_token_ids": follow}, SamplingParams(max_tokens=12, temperature=0,
                                                                      ignore_eos=True))[0]
    warm = spec.generate({"prompt_token_ids": follow}, SamplingParams(max_tokens=12, temperature=0,
                                                                     ignore_eos=True))[0]
    assert warm.num_cached_tokens >= 56  # 60 tokens: all full blocks but the last
    assert warm.outputs[0].token_ids == cold.outputs[0].token_ids


def test_seeded_samples_do_not_speculate_and_stay_what_they_are_without(plain, spec):
    prompts = _prompts(3)
    params = SamplingParams(max_tokens=20, temperature=0.8, seed=11)
    drafts = spec.engine.stats().spec_draft_tokens
    assert _run(spec, prompts, params) == _run(plain, prompts, params)
    assert spec.engine.stats().spec_draft_tokens == drafts


def test_unseeded_samples_speculate(spec):
    drafts = spec.engine.stats().spec_draft_tokens
    outs = spec.generate([{"prompt_token_ids": LOOP}] * 3, SamplingParams(max_tokens=30, temperature=0.3,
                                                                          ignore_eos=True))
    assert all(len(o.outputs[0].token_ids) == 30 for o in outs)
    assert spec.engine.stats().spec_draft_tokens > drafts
    assert spec.engine.pool.num_used == 0


def test_only_position_wise_sampling_may_speculate():
    def req(**kw):
        p = SamplingParams(**kw)
        r = Request("r", [1, 2], p, p.max_tokens or 16, frozenset())
        if p.seed is not None:
            r.generator = torch.Generator()
        return r
    assert can_speculate(req(temperature=0))
    assert can_speculate(req(temperature=0.7, top_p=0.9, top_k=5, logit_bias={1: 1.0}))
    assert can_speculate(req(temperature=0, seed=3))  # greedy: a seed draws nothing
    assert not can_speculate(req(temperature=0.7, seed=3))
    assert not can_speculate(req(temperature=0, repetition_penalty=1.1))
    assert not can_speculate(req(temperature=0, presence_penalty=0.5))
    assert not can_speculate(req(temperature=0, frequency_penalty=0.5))
    assert not can_speculate(req(temperature=0, min_tokens=2))


# ---- the sampler's check of a guess --------------------------------------------------------


def test_a_checked_guess_leaves_each_rows_distribution_as_it_was():
    """Rows with a guess keep it with its probability, else draw from the rest: the tokens
    drawn have the row's own distribution, whatever the guess (one likely, one unlikely, one
    filtered out by top-k)."""
    torch.manual_seed(0)
    vocab, n = 6, 30000
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, 0.3])
    params = SamplingParams(temperature=0.9, top_k=5)
    probs = torch.softmax(logits / 0.9, dim=-1)
    probs[probs.argmin()] = 0.0  # top-k 5 drops the least likely
    probs /= probs.sum()
    sampler = Sampler(seed=5)
    for guess in (0, 3, 4):
        reqs = [Request(f"r{i}", [1], params, 16, frozenset()) for i in range(n)]
        tokens, _ = sampler(logits.repeat(n, 1), reqs, [guess] * n)
        freq = torch.bincount(torch.tensor(tokens), minlength=vocab).double() / n
        sigma = (probs * (1 - probs) / n).sqrt()
        assert ((freq - probs).abs() <= 5 * sigma + 1e-9).all(), (guess, freq, probs)


def test_greedy_rows_ignore_guesses_and_rows_without_one_draw_as_before():
    logits = torch.tensor([[0.0, 3.0, 1.0], [0.5, 0.2, 0.1], [0.5, 0.2, 0.1]])
    greedy = Request("g", [1], SamplingParams(temperature=0), 4, frozenset())
    a = Request("a", [1], SamplingParams(temperature=1.0), 4, frozenset())
    b = Request("b", [1], SamplingParams(temperature=1.0), 4, frozenset())
    s1, s2 = Sampler(seed=9), Sampler(seed=9)
    with_guess, _ = s1(logits.clone(), [greedy, a, b], [2, -1, -1])
    without, _ = s2(logits.clone(), [greedy, a, b])
    assert with_guess == without and with_guess[0] == 1


# ---- metrics -------------------------------------------------------------------------------


def test_speculation_counters_reach_prometheus(spec):
    from tierlm.serving.telemetry import Telemetry
    spec.generate({"prompt_token_ids": LOOP}, SamplingParams(max_tokens=20, temperature=0, ignore_eos=True))
    stats = spec.engine.stats()
    text = Telemetry({"m": spec.engine}, log_requests=False).render().decode()
    for name, value in (("tierlm:spec_decode_num_drafts_total", stats.spec_drafts),
                        ("tierlm:spec_decode_num_draft_tokens_total", stats.spec_draft_tokens),
                        ("tierlm:spec_decode_num_accepted_tokens_total", stats.spec_accepted_tokens)):
        assert f'{name}{{model="m"}} {float(value)}' in text
    assert stats.spec_accepted_tokens > 0


def test_lora_requests_guess_too_and_answer_as_without(llama_dir, tmp_path):
    from tests.lora_adapters import standard_adapters
    ads = standard_adapters(llama_dir, "llama", tmp_path)
    kw = dict(dtype="float32", kv_cache_memory=2 << 20, max_model_len=256, block_size=4, load_progress=False,
              lora_modules={"a1": str(ads["a1"])})
    with_spec = LLM(str(llama_dir), speculative_config=SPEC, **kw)
    without = LLM(str(llama_dir), **kw)
    prompts = [{"prompt_token_ids": p} for p in _prompts(3)]
    params = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)
    loras = ["a1", None, "a1"]  # an adapter's rows and the base's in one step
    got = [o.outputs[0].token_ids for o in with_spec.generate(prompts, params, lora_request=loras)]
    ref = [o.outputs[0].token_ids for o in without.generate(prompts, params, lora_request=loras)]
    assert got == ref
    assert with_spec.engine.stats().spec_accepted_tokens > 0
