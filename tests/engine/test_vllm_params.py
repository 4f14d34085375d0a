"""vLLM's SamplingParams and outputs as the offline `LLM` meets them: logit_bias, prompt
truncation, vLLM keywords tierlm refuses, cumulative logprobs, n samples per prompt."""
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
    ("prompt_logprobs", 1), ("prompt_logprobs", 0), ("spaces_between_special_tokens", False),
    ("guided_decoding", {"json": {}}), ("structured_outputs", {"choice": ["a"]}), ("bad_words", ["x"]),
    ("allowed_token_ids", [1, 2]), ("output_kind", 2), ("best_of", 2), ("logits_processors", [print]),
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


def test_n_is_at_least_one_and_the_async_engines_refusal_says_to_seed_each_copy(llm):
    with pytest.raises(InvalidRequestError, match="at least 1"):
        SamplingParams(n=0)
    with pytest.raises(InvalidRequestError, match=re.escape("seed + i")) as info:
        llm.engine.make_request(PROMPT, SamplingParams(n=2, seed=3))  # what AsyncEngine.generate makes
    assert info.value.param == "n"
