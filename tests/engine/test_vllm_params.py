"""vLLM's SamplingParams and outputs as the offline `LLM` meets them: logit_bias,
allowed_token_ids, bad_words, prompt truncation, vLLM keywords tierlm refuses, cumulative
logprobs, n samples per prompt."""
from __future__ import annotations

import re

import pytest

from tierlm import LLM, SamplingParams
from tierlm.errors import InvalidRequestError, RequestTooLongError

PROMPT = [5, 6, 7, 8]


@pytest.fixture(scope="module")
def llm(llama_dir):
    return LLM(str(llama_dir), dtype="float32", kv_cache_memory=2 << 20, max_model_len=128,
               max_num_batched_tokens=64, block_size=8, load_progress=False)


def first(llm, **params):
    return llm.generate([PROMPT], SamplingParams(max_tokens=4, **params))[0].outputs[0]


# ---- logit_bias ------------------------------------------------------------------------------


def test_logit_bias_forces_a_token_or_takes_the_greedy_one_away(llm):
    plain = first(llm, temperature=0, logprobs=2)
    top, second = (t for t, _ in plain.logprobs[0].top)
    assert plain.token_ids[0] == top
    assert first(llm, temperature=0, logit_bias={9: 100.0}).token_ids == [9] * 4
    assert first(llm, temperature=0, logit_bias={top: -100.0}).token_ids[0] == second
    sampled = llm.generate([PROMPT] * 3, [SamplingParams(max_tokens=4, temperature=1.0, seed=s, logit_bias={9: 100.0})
                                          for s in (1, 2, 3)])
    assert all(o.outputs[0].token_ids == [9] * 4 for o in sampled)


def test_logprobs_under_a_logit_bias_are_the_models_own(llm):
    plain = first(llm, temperature=0, logprobs=2)
    biased = first(llm, temperature=0, logprobs=2, logit_bias={9: 100.0})
    assert biased.logprobs[0].token_id == 9
    assert biased.logprobs[0].top == plain.logprobs[0].top  # the raw distribution's top 2, not 9's 0.0


def test_a_logit_bias_token_outside_the_vocabulary_is_refused_by_id(llm):
    vocab = llm.engine.args.vocab_size
    with pytest.raises(InvalidRequestError, match=f"token id {vocab}, outside") as info:
        llm.generate([PROMPT], SamplingParams(logit_bias={3: 1.0, vocab: 1.0}))
    assert info.value.param == "logit_bias"
    assert not llm.engine.has_unfinished()


# ---- allowed_token_ids ---------------------------------------------------------------------


def test_allowed_token_ids_restrict_greedy_and_sampled_outputs_to_the_set(llm):
    plain = first(llm, temperature=0, logprobs=2)
    top, second = (t for t, _ in plain.logprobs[0].top)
    allowed = [second, 9, 10, 11]  # not the greedy token: the best of the rest comes first
    out = first(llm, temperature=0, logprobs=2, allowed_token_ids=allowed)
    assert out.token_ids[0] == second and set(out.token_ids) <= set(allowed)
    assert out.logprobs[0].top == plain.logprobs[0].top  # the model's own distribution, as vLLM's
    assert first(llm, temperature=0, allowed_token_ids=[top, 9]).token_ids[0] == top
    sampled = llm.generate([PROMPT] * 4, [SamplingParams(max_tokens=8, temperature=1.5, seed=s,
                                                         allowed_token_ids=[9, 10, 11]) for s in range(4)])
    drawn = [t for o in sampled for t in o.outputs[0].token_ids]
    assert set(drawn) <= {9, 10, 11} and len(set(drawn)) > 1


@pytest.mark.parametrize("allowed, says", [([], "must not be empty"), ([3, -1], "non-negative"),
                                           ("3", "must be a list"), ([3, 2.5], "non-negative integers")])
def test_bad_allowed_token_ids_are_refused_by_name(allowed, says):
    with pytest.raises(InvalidRequestError, match=says) as info:
        SamplingParams(allowed_token_ids=allowed)
    assert info.value.param == "allowed_token_ids"


def test_an_allowed_token_outside_the_vocabulary_is_refused_by_id(llm):
    vocab = llm.engine.args.vocab_size
    with pytest.raises(InvalidRequestError, match=f"token id {vocab + 2}, outside") as info:
        llm.generate([PROMPT], SamplingParams(allowed_token_ids=[3, vocab + 2]))
    assert info.value.param == "allowed_token_ids"
    assert not llm.engine.has_unfinished()


def test_allowed_tokens_that_leave_nothing_to_sample_are_refused(llm):
    """Allowed only EOS under min_tokens, or only a one-token bad word: every logit was -inf and
    the sampler drew token 0 (greedy) or the vocabulary's last (sampled), outside the set."""
    eos = sorted(llm.engine.eos_token_ids)[0]
    with pytest.raises(InvalidRequestError, match="every allowed token ends the request") as info:
        llm.generate([PROMPT], SamplingParams(allowed_token_ids=[eos], min_tokens=3, max_tokens=4, temperature=1.0))
    assert info.value.param == "allowed_token_ids"
    word = next(w for w in ("a", "b", "c", "x") if len(llm.engine.bad_words([w]).always) == 2)
    banned = llm.engine.bad_words([word]).always
    with pytest.raises(InvalidRequestError, match="every allowed token is a one-token bad word"):
        llm.generate([PROMPT], SamplingParams(allowed_token_ids=banned, bad_words=[word], max_tokens=4))
    ok = llm.generate([PROMPT], SamplingParams(allowed_token_ids=[eos, 7], min_tokens=3, max_tokens=4,
                                               temperature=0))[0].outputs[0].token_ids
    assert ok[:3] == [7, 7, 7]  # EOS held back: the one other token allowed
    assert not llm.engine.has_unfinished()


def test_a_step_that_bad_words_would_leave_without_an_allowed_token_keeps_to_the_allowed_set(llm):
    """Only "d" allowed and "dd" a bad word: after one "d" every allowed token was banned, and the
    sampler drew token 0 or the vocabulary's last, outside the set. The ban lapses for that step."""
    tok = llm.engine.tokenizer
    d = next(c for c in "defghk" if len(tok.encode(c, add_special_tokens=False)) == 1
             and len(tok.encode(c + c, add_special_tokens=False)) == 2)
    only = tok.encode(d, add_special_tokens=False)
    assert llm.engine.bad_words([d + d]).after  # a two-token word: banned only after its first token
    for temperature in (0.0, 1.0):
        out = llm.generate([PROMPT], SamplingParams(allowed_token_ids=only, bad_words=[d + d], max_tokens=4,
                                                    temperature=temperature, seed=3, ignore_eos=True))[0]
        assert out.outputs[0].token_ids == only * 4, temperature


# ---- bad_words ---------------------------------------------------------------------------------

LETTERS = "dfgjqvwx"  # one token each in the test tokenizer, and no two of them merge


def letters(llm, prompt=PROMPT, **params) -> list[int]:
    """The greedy output when only single letters may be sampled, so any two make a two-token word."""
    allowed = [llm.engine.tokenizer.encode(c, add_special_tokens=False)[0] for c in LETTERS]
    return llm.generate([prompt], SamplingParams(max_tokens=6, temperature=0, allowed_token_ids=allowed,
                                                 **params))[0].outputs[0].token_ids


def word(llm, ids: list[int]) -> str:
    text = llm.engine.tokenizer.decode(ids)
    assert llm.engine.tokenizer.encode(text, add_special_tokens=False) == ids  # the word is these tokens
    return text


def test_a_one_token_bad_word_is_never_generated(llm):
    plain = letters(llm)
    banned = letters(llm, bad_words=[word(llm, plain[:1])])
    assert plain[0] not in banned and banned != plain
    tok = llm.engine.tokenizer
    hello = tok.encode("hello", add_special_tokens=False)
    assert len(hello) == 1  # forced by a bias, banned by the word: the ban wins (-inf)
    forced = first(llm, temperature=0, logit_bias={hello[0]: 100.0}, bad_words=["hello"])
    assert hello[0] not in forced.token_ids


def test_a_two_token_bad_word_bans_its_last_token_only_after_its_first(llm):
    plain = letters(llm)
    banned = letters(llm, bad_words=[word(llm, plain[:2])])
    assert banned[0] == plain[0] and banned[1] != plain[1]  # the first token alone is no bad word
    for i in range(len(banned) - 1):
        assert banned[i:i + 2] != plain[:2]
    absent = next(c for c in LETTERS if llm.engine.tokenizer.encode(c, add_special_tokens=False)[0] not in plain)
    unused = word(llm, llm.engine.tokenizer.encode(absent, add_special_tokens=False) + plain[1:2])
    assert letters(llm, bad_words=[unused]) == plain  # its first token never comes: nothing banned


def test_a_bad_words_prefix_in_the_prompt_does_not_count_as_vllm(llm):
    """vLLM matches a word's first tokens against the output only."""
    plain = letters(llm)
    prompt = PROMPT + plain[:1]
    after = letters(llm, prompt)
    assert letters(llm, prompt, bad_words=[word(llm, plain[:1] + after[:1])])[0] == after[0]


def test_bad_words_are_tokenized_as_vllm_as_is_and_after_a_space(llm):
    """vLLM's update_from_tokenizer: the word without leading whitespace, and " word" too where
    that is as many tokens and starts with another one (not where the space is a token of its own)."""
    from tierlm.sampling_params import bad_words_token_ids
    tok = llm.engine.tokenizer
    enc = lambda text: tok.encode(text, add_special_tokens=False)  # noqa: E731
    assert len(enc("of")) == len(enc(" of")) == 2 and enc("of")[0] != enc(" of")[0]
    assert len(enc(" the")) != len(enc("the"))
    assert bad_words_token_ids(tok, ["of", "  the"]) == [enc("of"), enc(" of"), enc("the")]


def test_a_bad_word_with_a_token_outside_the_models_vocabulary_is_refused_by_name(llm, monkeypatch):
    """A tokenizer may hold more tokens than the model's logits have columns."""
    ids = llm.engine.tokenizer.encode("tokenized", add_special_tokens=False)
    monkeypatch.setattr(llm.engine.args, "vocab_size", max(ids))
    with pytest.raises(InvalidRequestError, match="bad_words' 'tokenized' has a token id outside") as info:
        llm.generate([[5, 6]], SamplingParams(max_tokens=2, bad_words=["tokenized"]))
    assert info.value.param == "bad_words" and not llm.engine.has_unfinished()


def test_seeded_rows_draw_as_alone_beside_allowed_tokens_and_bad_words(llm):
    seeded = SamplingParams(max_tokens=8, temperature=1.0, seed=7)
    alone = llm.generate([PROMPT], seeded)[0].outputs[0].token_ids
    hello = llm.engine.tokenizer.encode("hello", add_special_tokens=False)[0]
    batch = llm.generate([PROMPT] * 3, [
        SamplingParams(max_tokens=8, temperature=1.0, seed=8, allowed_token_ids=[9, 10]), seeded,
        SamplingParams(max_tokens=8, temperature=1.0, seed=9, bad_words=["hello"], logit_bias={hello: 100.0})])
    assert batch[1].outputs[0].token_ids == alone
    assert set(batch[0].outputs[0].token_ids) <= {9, 10} and hello not in batch[2].outputs[0].token_ids


@pytest.mark.parametrize("words, says", [
    ([""], "empty or whitespace-only"), (["ok", "  "], "empty or whitespace-only"), ("word", "must be a list"),
    ([3], "must be a list of strings"), (["x"] * 1025, "at most 1024 words"), (["x" * 257], "at most 256 characters")])
def test_bad_bad_words_are_refused_by_name(words, says):
    with pytest.raises(InvalidRequestError, match=says) as info:
        SamplingParams(bad_words=words)
    assert info.value.param == "bad_words"


# ---- truncate_prompt_tokens ----------------------------------------------------------------


def test_truncate_prompt_tokens_keeps_the_last_n_as_vllm(llm):
    prompt = [11, 12, 13, 14, 15, 16, 17, 18]
    cut = llm.generate([prompt], SamplingParams(max_tokens=4, temperature=0, truncate_prompt_tokens=3))[0]
    tail = llm.generate([prompt[-3:]], SamplingParams(max_tokens=4, temperature=0))[0]
    assert cut.prompt_token_ids == prompt[-3:]
    assert cut.outputs[0].token_ids == tail.outputs[0].token_ids
    whole = llm.generate([prompt], SamplingParams(max_tokens=4, truncate_prompt_tokens=-1))[0]
    assert whole.prompt_token_ids == prompt
    long = llm.generate([list(range(3, 203))], SamplingParams(max_tokens=4, truncate_prompt_tokens=100))[0]
    assert long.prompt_token_ids == list(range(103, 203)) and len(long.outputs[0].token_ids) == 4


def test_truncate_prompt_tokens_minus_one_keeps_as_many_as_fit_beside_the_output(llm):
    """-1 was max_model_len (vLLM's literal meaning), which leaves no room for one output token:
    every prompt it truncated was refused, telling the client to shorten it."""
    context = llm.engine.max_model_len
    prompt = [3 + i % 200 for i in range(context + 50)]
    fit = llm.generate([prompt], SamplingParams(max_tokens=6, temperature=0, ignore_eos=True,
                                                truncate_prompt_tokens=-1))[0]
    assert fit.prompt_token_ids == prompt[-(context - 6):] and len(fit.outputs[0].token_ids) == 6
    one = llm.generate([prompt], SamplingParams(max_tokens=None, ignore_eos=True, truncate_prompt_tokens=-1))[0]
    assert len(one.prompt_token_ids) == context - 1 and len(one.outputs[0].token_ids) == 1
    with pytest.raises(RequestTooLongError, match="lower truncate_prompt_tokens"):
        llm.generate([prompt], SamplingParams(max_tokens=6, truncate_prompt_tokens=context))


@pytest.mark.parametrize("keep, says", [(0, "at least 1, or -1"), (-2, "at least 1, or -1"),
                                        (129, "greater than max_model_len (128)")])
def test_a_bad_truncate_prompt_tokens_is_refused_by_name(llm, keep, says):
    with pytest.raises(InvalidRequestError, match=re.escape(says)) as info:
        llm.generate([PROMPT], SamplingParams(truncate_prompt_tokens=keep))
    assert info.value.param == "truncate_prompt_tokens"


# ---- vLLM keywords tierlm lacks ----------------------------------------------------------------


@pytest.mark.parametrize("field, value", [
    ("spaces_between_special_tokens", False),
    ("guided_decoding", {"json": {}}),
    ("output_kind", 2), ("best_of", 2), ("logits_processors", [print]),
    ("detokenize", False)])
def test_vllm_keywords_tierlm_lacks_are_refused_by_name(field, value):
    with pytest.raises(InvalidRequestError, match=f"'{field}' .*not supported by tierlm") as info:
        SamplingParams(max_tokens=4, **{field: value})
    assert info.value.param == field


def test_vllm_keywords_at_their_neutral_values_pass_and_a_typo_is_a_type_error():
    p = SamplingParams(max_tokens=4, prompt_logprobs=None, spaces_between_special_tokens=True, detokenize=True,
                       guided_decoding=None, best_of=None)
    assert p.max_tokens == 4
    # best_of equal to n and an empty bad_words change nothing either (they were refused).
    assert SamplingParams(best_of=1, bad_words=[], logits_processors=[]).n == 1
    assert SamplingParams(n=2, best_of=2, temperature=1.0).n == 2
    with pytest.raises(InvalidRequestError, match="best_of"):
        SamplingParams(n=2, best_of=3, temperature=1.0)
    with pytest.raises(TypeError, match="tempreature"):
        SamplingParams(tempreature=0.5)


# ---- outputs ------------------------------------------------------------------------------------


def test_cumulative_logprob_sums_the_sampled_tokens_logprobs_and_prompt_logprobs_is_none(llm):
    out = llm.generate([PROMPT], SamplingParams(max_tokens=6, temperature=1.0, seed=4, logprobs=0))[0]
    seq = out.outputs[0]
    assert len(seq.logprobs) == 6 and seq.cumulative_logprob == pytest.approx(sum(lp.logprob for lp in seq.logprobs))
    assert seq.cumulative_logprob < 0 and out.prompt_logprobs is None
    assert first(llm).cumulative_logprob is None  # no logprobs asked for: None, as vLLM


# ---- n samples per prompt -------------------------------------------------------------------


def test_n_samples_are_seeded_seed_plus_i_and_come_back_as_one_output(llm):
    sp = SamplingParams(max_tokens=6, temperature=1.0, seed=1, n=3, logprobs=0)
    out = llm.generate([PROMPT, [9, 10, 11]], [sp, SamplingParams(max_tokens=3, temperature=0)])
    assert [len(o.outputs) for o in out] == [3, 1]
    samples = out[0].outputs
    assert [s.index for s in samples] == [0, 1, 2]
    assert len({tuple(s.token_ids) for s in samples}) > 1  # three requests seeded 1 drew one sample three times
    for i, s in enumerate(samples):  # sample i is what n = 1 with seed 1 + i draws, as vLLM's
        alone = llm.generate([PROMPT], SamplingParams(max_tokens=6, temperature=1.0, seed=1 + i))[0].outputs[0]
        assert s.token_ids == alone.token_ids and s.cumulative_logprob is not None
    assert out[0].prompt_token_ids == PROMPT and out[0].request_id != out[1].request_id
    unseeded = llm.generate([PROMPT], SamplingParams(max_tokens=6, temperature=1.0, n=2))[0]
    assert len(unseeded.outputs) == 2 and not llm.engine.has_unfinished()



def test_only_the_first_of_n_samples_scores_the_prompt_and_the_others_take_it_from_the_cache(llama_dir):
    """n samples asking for prompt logprobs: the output's are sample 0's, so the others do not
    score the prompt, and (prefilled after it in chunks) take its blocks from the prefix cache:
    about one prompt computed, not n, and each sample what it is alone."""
    llm = LLM(str(llama_dir), dtype="float32", kv_cache_memory=2 << 20, max_num_batched_tokens=16, block_size=8,
              load_progress=False)
    prompt = list(range(20, 68))
    sp = SamplingParams(max_tokens=4, temperature=1.0, seed=3, n=3, prompt_logprobs=1)
    out = llm.generate([prompt], sp)[0]
    assert llm.engine.stats().prompt_tokens < 2 * len(prompt)
    assert len(out.prompt_logprobs) == len(prompt) and out.prompt_logprobs[0] is None
    alone = llm.generate([prompt], SamplingParams(max_tokens=4, temperature=1.0, seed=3, prompt_logprobs=1))[0]
    assert [lp.logprob for lp in out.prompt_logprobs[1:]] == pytest.approx(
        [lp.logprob for lp in alone.prompt_logprobs[1:]], abs=1e-5)
    for i, s in enumerate(out.outputs):
        assert s.token_ids == llm.generate([prompt], SamplingParams(max_tokens=4, temperature=1.0,
                                                                    seed=3 + i))[0].outputs[0].token_ids

def test_n_is_at_least_one_and_the_async_engines_refusal_says_to_seed_each_copy(llm):
    with pytest.raises(InvalidRequestError, match="at least 1"):
        SamplingParams(n=0)
    with pytest.raises(InvalidRequestError, match=re.escape("seed + i")) as info:
        llm.engine.make_request(PROMPT, SamplingParams(n=2, seed=3))  # what AsyncEngine.generate makes
    assert info.value.param == "n"


# ---- thinking budget (vLLM's thinking_token_budget, Anthropic's budget_tokens) ---------------------

END = (11, 12)  # a two-token end marker


def run(llm, **params):
    return llm.generate([PROMPT], SamplingParams(max_tokens=8, temperature=0, logprobs=2, **params))[0].outputs[0]


def test_a_spent_thinking_budget_forces_the_end_marker_then_lets_the_model_go_on(llm):
    from tierlm.sampling_params import ThinkingBudget

    plain = run(llm)
    capped = run(llm, thinking_budget=ThinkingBudget(3, END, starts_inside=True))
    assert capped.token_ids[:3] == plain.token_ids[:3] and tuple(capped.token_ids[3:5]) == END
    assert capped.logprobs[3].top == plain.logprobs[3].top  # forced, with the model's own logprobs
    own = llm.generate([PROMPT + plain.token_ids[:3]], SamplingParams(max_tokens=1, temperature=0, logprobs=0,
                                                                     allowed_token_ids=[END[0]]))[0].outputs[0]
    assert capped.logprobs[3].logprob == pytest.approx(own.logprobs[0].logprob, abs=1e-4)
    # the end marker overrides every other mask (a budget ends the block whatever else was asked)
    sampled = llm.generate([PROMPT], SamplingParams(max_tokens=8, temperature=1.0, seed=3, allowed_token_ids=[5, 6],
                                                    thinking_budget=ThinkingBudget(2, END, starts_inside=True)))
    assert sampled[0].outputs[0].token_ids[2:4] == list(END) and set(sampled[0].outputs[0].token_ids[4:]) <= {5, 6}
    assert tuple(run(llm, thinking_budget=ThinkingBudget(0, END, starts_inside=True)).token_ids[:2]) == END
    # a block the answer opens: counted from its start marker (here the model's own first token)
    opened = run(llm, thinking_budget=ThinkingBudget(2, END, start_token_ids=(plain.token_ids[0],)))
    assert opened.token_ids[:3] == plain.token_ids[:3] and tuple(opened.token_ids[3:5]) == END
    # ids in any sequence (a list, numpy's) are the same budget: a list never matched the block's end
    import numpy as np
    assert run(llm, thinking_budget=ThinkingBudget(3, list(END), starts_inside=True)).token_ids == capped.token_ids
    assert run(llm, thinking_budget=ThinkingBudget(3, np.array(END), starts_inside=True)).token_ids == capped.token_ids
    # an answer that does not open one is never cut
    other = (plain.token_ids[0] + 1) % 32
    assert run(llm, thinking_budget=ThinkingBudget(2, END, start_token_ids=(other,))).token_ids == plain.token_ids


def test_the_tracker_follows_the_block_and_finishes_a_marker_the_model_began():
    from tierlm.sampling_params import ThinkingBudget, ThinkingTracker

    inside = ThinkingTracker(ThinkingBudget(3, END, starts_inside=True))
    assert [inside.forced(out) for out in ([], [1], [1, 2], [1, 2, 11])] == [None, None, None, 12]
    assert inside.forced([1, 2, 11, 12]) is None and inside.forced([1, 2, 11, 12, 4, 4, 4, 4]) is None
    early = ThinkingTracker(ThinkingBudget(3, END, starts_inside=True))
    assert early.forced([11, 12]) is None and early.forced([11, 12, 1, 1, 1]) is None  # it ended the block itself
    opened = ThinkingTracker(ThinkingBudget(1, END, start_token_ids=(7, 8)))
    assert [opened.forced(out) for out in ([7], [7, 8], [7, 8, 1])] == [None, None, 11]
    never = ThinkingTracker(ThinkingBudget(0, END, start_token_ids=(7, 8)))
    assert never.forced([7, 9]) is None and never.forced([7, 9, 7, 8]) is None  # not the answer's start


@pytest.mark.parametrize("budget, says", [
    ("ThinkingBudget(-1, (1,))", "budget must be an integer of at least 0 (got -1)"),
    ("ThinkingBudget(4, ())", "end_token_ids must name the end marker's tokens"),
    ("ThinkingBudget(4, (1, -2))", "token ids must be non-negative integers"),
    ("4", "must be a ThinkingBudget (got 4)"),
    ("ThinkingBudget(4, 11)", "token ids must be sequences of token ids"),
    ("ThinkingBudget(4, (1.5,))", "token ids must be non-negative integers"),
])
def test_a_bad_thinking_budget_is_refused_by_name(budget, says):
    from tierlm.sampling_params import ThinkingBudget  # noqa: F401 (eval'd)

    with pytest.raises(InvalidRequestError, match=re.escape(f"sampling parameter 'thinking_budget' {says}")):
        SamplingParams(thinking_budget=eval(budget))


def test_a_thinking_budget_token_outside_the_vocabulary_is_refused_by_id(llm):
    from tierlm.sampling_params import ThinkingBudget

    with pytest.raises(InvalidRequestError, match=r"thinking_budget names token id 99999, outside the model's"):
        run(llm, thinking_budget=ThinkingBudget(2, (99999,), starts_inside=True))
