"""The sampler's draws against the distributions they must follow, computed here independently
(numpy, from the definitions of temperature, top-k, top-p and min-p)."""
from __future__ import annotations

import re

import numpy as np
import pytest
import torch

from tierlm.engine.request import Request
from tierlm.engine.sampler import Sampler, seeded_generator
from tierlm.errors import InvalidRequestError
from tierlm.sampling_params import BadWords, SamplingParams

VOCAB = 40


def _req(i: int, **params) -> Request:
    seed = params.get("seed")
    return Request(f"r{i}", [1, 2, 3], SamplingParams(max_tokens=8, **params), 8, frozenset(),
                   generator=seeded_generator(seed) if seed is not None else None)


def _expected(logits: np.ndarray, temperature: float, top_k: int = 0, top_p: float = 1.0,
              min_p: float = 0.0) -> np.ndarray:
    """The filters in turn, in vLLM's order: top-k, then min-p, then top-p over what is left
    (renormalised). Hugging Face's warpers apply min-p after top-p, which can keep more."""
    z = logits.astype(np.float64) / temperature
    p = np.exp(z - z.max())
    p /= p.sum()
    keep = np.ones(len(p), dtype=bool)
    if 0 < top_k < len(z):  # a k at or past the vocabulary keeps everything
        keep &= z >= np.sort(z)[-top_k]
    if min_p > 0:
        keep &= p >= min_p * p[keep].max()
    if top_p < 1.0:  # the smallest set of most likely tokens whose (renormalised) mass reaches top_p
        q = np.where(keep, p, 0.0) / p[keep].sum()
        order = np.argsort(-q, kind="stable")
        before = np.cumsum(q[order]) - q[order]
        nucleus = np.zeros(len(p), dtype=bool)
        nucleus[order[before < top_p]] = True  # a set that reaches top_p exactly takes nothing more
        keep &= nucleus
    q = np.where(keep, p, 0.0)
    return q / q.sum()


CONFIGS = [dict(temperature=1.0), dict(temperature=0.5), dict(temperature=1.7, top_k=5),
           dict(temperature=1.0, top_p=0.6), dict(temperature=0.9, min_p=0.2)]


def test_draws_follow_the_filtered_tempered_distribution():
    """~19,000 draws per setting, all settings sharing each step's batch: every draw is a token
    the settings allow, and the frequencies are the distribution's (total variation < 0.025)."""
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(VOCAB, generator=gen) * 2.5
    per_config, steps = 64, 300
    reqs = [_req(i, **CONFIGS[i // per_config]) for i in range(per_config * len(CONFIGS))]
    sampler = Sampler(seed=1)
    counts = np.zeros((len(CONFIGS), VOCAB))
    for _ in range(steps):
        tokens, _ = sampler(logits.expand(len(reqs), VOCAB).clone(), reqs)
        np.add.at(counts, (np.arange(len(reqs)) // per_config, tokens), 1)
    for c, cfg in enumerate(CONFIGS):
        want = _expected(logits.numpy(), **cfg)
        got = counts[c] / counts[c].sum()
        assert not got[want == 0].any(), f"{cfg}: drew a token its filters exclude"
        assert 0.5 * np.abs(got - want).sum() < 0.025, cfg


def test_a_seeded_request_draws_the_same_tokens_whatever_shares_its_batch():
    logits = torch.randn(6, VOCAB, generator=torch.Generator().manual_seed(2))

    def run(batch_with_others: bool) -> list[int]:
        sampler = Sampler(seed=0)
        mine = _req(0, temperature=1.0, seed=1234)
        others = [_req(1, temperature=0.7), _req(2, temperature=0.0), _req(3, temperature=1.0, top_k=3, seed=9)]
        out = []
        for step in range(30):
            reqs = (others[: 1 + step % 3] + [mine]) if batch_with_others else [mine]
            rows = logits[: len(reqs)].clone()
            rows[-1] = logits[5]
            out.append(sampler(rows, reqs)[0][-1])
        return out

    alone, shared = run(False), run(True)
    assert alone == shared
    assert len(set(alone)) > 3  # it does sample (not a constant)


def test_greedy_rows_take_the_argmax_next_to_sampled_rows():
    logits = torch.randn(4, VOCAB, generator=torch.Generator().manual_seed(3))
    reqs = [_req(0, temperature=0.0), _req(1, temperature=1.0, seed=5), _req(2, temperature=0.0),
            _req(3, temperature=2.0)]
    tokens, _ = Sampler()(logits.clone(), reqs)
    assert tokens[0] == int(logits[0].argmax()) and tokens[2] == int(logits[2].argmax())
    assert all(0 <= t < VOCAB for t in tokens)


@pytest.mark.parametrize("top_k", [1, 2])
def test_a_single_allowed_token_is_always_drawn(top_k):
    """top_k=1 (and a row where one token holds all the mass) leaves no choice, at any temperature."""
    logits = torch.full((3, VOCAB), -30.0)
    logits[:, 7] = 30.0
    logits[:, 3] = 29.0 if top_k == 2 else -30.0
    reqs = [_req(i, temperature=t, top_k=1, seed=i) for i, t in enumerate((0.3, 1.0, 5.0))]
    sampler = Sampler()
    for _ in range(200):
        assert sampler(logits.clone(), reqs)[0] == [7, 7, 7]


def test_filters_keep_exactly_the_tokens_their_definitions_allow_row_by_row():
    """Rows with different filters (and rows with none) in one batch: each keeps exactly the
    tokens the numpy reference keeps for its own settings."""
    from tierlm.engine.sampler import _filter_rows
    rng = np.random.default_rng(4)
    settings = [dict(), dict(top_k=1), dict(top_k=7), dict(top_k=VOCAB + 5), dict(top_p=0.3), dict(top_p=0.95),
                dict(min_p=0.05), dict(top_k=10, top_p=0.5), dict(top_k=12, min_p=0.1, top_p=0.8), dict(top_p=1.0)]
    for trial in range(20):
        logits = torch.from_numpy(rng.normal(scale=3.0, size=(len(settings), VOCAB)).astype(np.float32))
        params = [SamplingParams(max_tokens=1, temperature=1.0, **s) for s in settings]
        kept = torch.isfinite(_filter_rows(logits.clone(), params)).numpy()
        for row, s in enumerate(settings):
            want = _expected(logits[row].numpy(), 1.0, **s) > 0
            assert (kept[row] == want).all(), (trial, s)


def test_a_row_of_nan_logits_still_gives_a_token_in_the_vocabulary():
    """A broken model's NaN row must not index past the vocabulary (the detokenizer would fail
    on it); the other rows of the batch are drawn as usual."""
    logits = torch.randn(3, VOCAB, generator=torch.Generator().manual_seed(6))
    logits[1] = float("nan")
    reqs = [_req(i, temperature=1.0, seed=i) for i in range(3)]
    tokens, _ = Sampler()(logits, reqs)
    assert all(0 <= t < VOCAB for t in tokens)


def test_every_bit_of_a_64_bit_seed_counts():
    """Seeds equal in their low 32 bits (all a CPU generator keeps) draw different tokens; the
    same seed draws the same ones."""
    logits = torch.zeros(1, VOCAB)  # uniform: every draw shows the generator's state
    seeds = [5, 5 + 2**32, 5 + 2**63, 5 - 2**32, -(2**63) + 5, 2**64 - 2**32 + 5]
    draws = {}
    for seed in seeds + [5]:
        sampler = Sampler(seed=0)
        req = _req(0, temperature=1.0, seed=seed)
        draws.setdefault(seed, []).append(tuple(sampler(logits, [req])[0][0] for _ in range(12)))
    assert draws[5][0] == draws[5][1]
    assert len({d[0] for d in draws.values()}) == len(seeds)


def test_top_k_below_minus_one_is_refused_by_name():
    from tierlm.errors import InvalidRequestError
    for ok in (-1, 0, 1, 2**70):
        SamplingParams(top_k=ok)  # validated on construction
    with pytest.raises(InvalidRequestError, match="'top_k' must be -1 or 0"):
        SamplingParams(top_k=-2)


@pytest.mark.parametrize("top_p", [1e-9, 1e-46, 5e-324])
def test_a_top_p_below_float32s_least_keeps_the_top_token(top_p):
    """In float32 a top_p under 1.4e-45 is 0: every token was dropped, the top one included, and
    the draw came from a row of -inf (the same wrong token whatever the seed)."""
    from tierlm.engine.sampler import _filter_rows
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(1))
    kept = torch.isfinite(_filter_rows(logits.clone(), [SamplingParams(top_p=top_p)] * 3))
    assert kept.sum(dim=-1).tolist() == [1, 1, 1]
    assert kept.float().argmax(dim=-1).tolist() == logits.argmax(dim=-1).tolist()


def test_sampling_params_take_numpys_numbers_and_refuse_strings_for_flags():
    from tierlm.errors import InvalidRequestError
    p = SamplingParams(seed=np.int64(7), max_tokens=np.int32(5), temperature=np.float32(0.5), top_k=np.int64(3))
    assert (p.seed, p.max_tokens, p.top_k) == (7, 5, 3) and type(p.seed) is int and type(p.temperature) is float
    assert seeded_generator(p.seed).initial_seed() == seeded_generator(7).initial_seed()
    for flag in ("ignore_eos", "skip_special_tokens", "include_stop_str_in_output"):
        with pytest.raises(InvalidRequestError, match=f"'{flag}' must be true or false"):
            SamplingParams(**{flag: "false"})  # truthy: it ignored EOS


@pytest.mark.parametrize("stop, says", [(["x"] * 65, "at most 64 strings"), (["x" * 1025], "at most 1024 characters"),
                                        ([""], "must not hold empty strings")])
def test_stop_strings_are_bounded(stop, says):
    from tierlm.errors import InvalidRequestError
    with pytest.raises(InvalidRequestError, match=says):
        SamplingParams(stop=stop)
    SamplingParams(stop=["y" * 1024] * 64)


def test_a_repetition_penalty_float32_cannot_hold_is_refused():
    from tierlm.errors import InvalidRequestError
    with pytest.raises(InvalidRequestError, match=r"'repetition_penalty' must be in \[0.01, 10\]"):
        SamplingParams(repetition_penalty=5e-324)
    SamplingParams(repetition_penalty=0.01)


def test_top_p_on_exact_ties_keeps_what_transformers_keeps():
    """Uniform rows: the mass reaches p exactly at a token boundary, and nothing past it is kept."""
    from transformers.generation.logits_process import TopPLogitsWarper
    from tierlm.engine.sampler import _filter_rows
    for vocab, p in [(4, 0.5), (4, 0.25), (8, 0.75), (2, 0.5), (10, 0.3)]:
        x = torch.zeros(1, vocab)
        ours = torch.isfinite(_filter_rows(x.clone(), [SamplingParams(top_p=p)])).sum().item()
        hf = torch.isfinite(TopPLogitsWarper(p)(None, x.clone())).sum().item()
        assert ours == hf, (vocab, p, ours, hf)


def _penalised(logits: np.ndarray, prompt: list[int], output: list[int], rep: float = 1.0,
               presence: float = 0.0, frequency: float = 0.0, bias: dict[int, float] | None = None) -> np.ndarray:
    """The logit bias, then the penalties' definitions, one token at a time: repetition (HF's) over
    every token seen, presence and frequency (OpenAI's) over the output."""
    z = logits.astype(np.float64).copy()
    for t, b in (bias or {}).items():
        z[t] += b
    for t in set(prompt) | set(output):
        if rep != 1.0:
            z[t] = z[t] / rep if z[t] > 0 else z[t] * rep
    for t in set(output):
        z[t] -= frequency * output.count(t) + presence
    return z


def test_batched_penalties_stop_holds_and_logprobs_equal_their_definitions_row_by_row():
    """Rows with and without penalties, logit biases, min_tokens holds and logprobs of different N
    share one step (the sampler batches each over the rows that ask): every row's greedy token, logprob,
    rank and top-N equal what its own settings give on its own logits, computed here in numpy."""
    rng = np.random.default_rng(8)
    settings = [dict(), dict(repetition_penalty=1.8, logprobs=3), dict(presence_penalty=1.5, logprobs=0),
                dict(frequency_penalty=-0.7, repetition_penalty=0.5), dict(logprobs=5),
                dict(min_tokens=4, stop_token_ids=[2, 9], logprobs=1), dict(presence_penalty=0.4, frequency_penalty=2.0,
                                                                            repetition_penalty=1.3, logprobs=20),
                dict(min_tokens=2, repetition_penalty=2.0),
                dict(logit_bias={3: 6.0, 7: -4.5, 30: 2.5}, repetition_penalty=1.6, logprobs=4),
                dict(logit_bias={i: -100.0 for i in range(0, VOCAB, 2)}), dict(logit_bias={5: 100.0}, logprobs=1)]
    for trial in range(10):
        reqs = []
        for i, s in enumerate(settings):
            prompt = rng.integers(0, VOCAB, size=int(rng.integers(1, 9))).tolist()
            r = Request(f"r{i}", prompt, SamplingParams(max_tokens=16, temperature=0, **s), 16,
                        frozenset({0, 31}))
            for t in rng.integers(0, VOCAB, size=int(rng.integers(0, 6))).tolist():
                r.append_token(t)
            reqs.append(r)
        logits = torch.from_numpy(rng.normal(scale=3.0, size=(len(reqs), VOCAB)).astype(np.float32))
        tokens, lps = Sampler()(logits.clone(), reqs)
        for i, (r, s) in enumerate(zip(reqs, settings)):
            z = _penalised(logits[i].numpy(), r.prompt_token_ids, r.output_token_ids,
                           s.get("repetition_penalty", 1.0), s.get("presence_penalty", 0.0),
                           s.get("frequency_penalty", 0.0), s.get("logit_bias"))
            if r.num_output_tokens < s.get("min_tokens", 0):
                z[[0, 31, *s.get("stop_token_ids", [])]] = -np.inf
            assert tokens[i] == int(np.argmax(z)), (trial, s)
            raw = torch.log_softmax(logits[i].double(), dim=-1).numpy()
            if "logprobs" not in s:
                assert lps[i] is None
                continue
            lp = lps[i]
            assert lp.token_id == tokens[i] and abs(lp.logprob - raw[tokens[i]]) < 1e-5, (trial, s)
            assert lp.rank == 1 + int((raw > raw[tokens[i]] + 1e-6).sum()), (trial, s)
            assert [t for t, _ in lp.top] == np.argsort(-raw, kind="stable")[: s["logprobs"]].tolist(), (trial, s)
            assert np.allclose([v for _, v in lp.top], np.sort(raw)[::-1][: s["logprobs"]], atol=1e-5)


def test_logit_bias_holds_for_sampled_rows_and_seeded_neighbours_draw_as_alone():
    """+100 on a token makes a sampled row draw it (whatever its temperature); -100 on all but a
    few leaves those few; a seeded row with no bias draws the same tokens alone as next to them."""
    logits = torch.randn(4, VOCAB, generator=torch.Generator().manual_seed(3)) * 2.0
    keep = {4, 17, 33}

    def run(with_biased_rows: bool) -> list[list[int]]:
        sampler = Sampler(seed=0)
        mine = _req(0, temperature=1.0, seed=77)
        others = [_req(1, temperature=1.3, logit_bias={11: 100.0}),
                  _req(2, temperature=1.0, logit_bias={t: -100.0 for t in range(VOCAB) if t not in keep}),
                  _req(3, temperature=0.8, seed=5, logit_bias={int(logits[3].argmax()): -100.0})]
        reqs = [*others, mine] if with_biased_rows else [mine]
        out = []
        for _ in range(200):
            rows = logits[[1, 2, 3, 0]] if with_biased_rows else logits[:1].clone()
            out.append(sampler(rows, reqs)[0])
        return out

    together, alone = run(True), run(False)
    assert [t[3] for t in together] == [t[0] for t in alone]
    assert all(t[0] == 11 for t in together)
    assert {t[1] for t in together} <= keep and len({t[1] for t in together}) > 1
    assert int(logits[3].argmax()) not in {t[2] for t in together}


def _masked(r: Request, s: dict) -> Request:
    """`r` with `s`'s allowed tokens and bad words as the engine makes them (a CPU tensor; token ids)."""
    if "allowed" in s:
        r.allowed_token_ids = torch.tensor(sorted(set(s["allowed"])))
    if "bad" in s:
        r.bad_words = BadWords(s["bad"])
    return r


def test_allowed_tokens_and_bad_words_batched_equal_their_definitions_row_by_row():
    """Rows with allowed_token_ids, bad words (one token; two and three tokens, banned only after
    their first tokens end the output), logit biases and penalties share a step with plain rows:
    each row's greedy token is the best its own masks leave, computed here row by row, and its
    logprobs are the model's raw ones."""
    rng = np.random.default_rng(5)
    settings = [dict(), dict(allowed=[3, 8, 21]), dict(allowed=[8, 8, 39], repetition_penalty=1.5, logprobs=2),
                dict(bad=[[4], [6, 7], [1, 2, 5]], logit_bias={7: 30.0, 5: 25.0}),
                dict(bad=[[9]], allowed=[9, 10, 11], logit_bias={9: 50.0}),
                dict(allowed=list(range(0, VOCAB, 3)), bad=[[12], [30, 31]], presence_penalty=1.0,
                     logit_bias={31: 40.0}),
                dict(bad=[[1, 2, 5]], logit_bias={5: 30.0}, logprobs=1)]
    for trial in range(20):
        reqs, outputs = [], []
        for i, s in enumerate(settings):
            r = Request(f"r{i}", [1, 2], SamplingParams(max_tokens=16, temperature=0, **{
                k: v for k, v in s.items() if k not in ("allowed", "bad")}), 16, frozenset())
            out = rng.integers(0, VOCAB, size=int(rng.integers(0, 4))).tolist()
            if trial % 2 and i in (3, 5, 6):  # end the output with a bad word's first tokens
                out += ([30] if i == 5 else [1, 2]) if trial % 4 == 1 else [6]
            for t in out:
                r.append_token(t)
            reqs.append(_masked(r, s))
            outputs.append(out)
        logits = torch.from_numpy(rng.normal(scale=3.0, size=(len(reqs), VOCAB)).astype(np.float32))
        tokens, lps = Sampler()(logits.clone(), reqs)
        for i, (r, s) in enumerate(zip(reqs, settings)):
            z = _penalised(logits[i].numpy(), r.prompt_token_ids, r.output_token_ids,
                           s.get("repetition_penalty", 1.0), s.get("presence_penalty", 0.0), 0.0, s.get("logit_bias"))
            if "allowed" in s:
                z[[t for t in range(VOCAB) if t not in s["allowed"]]] = -np.inf
            for bad in s.get("bad", []):
                if outputs[i][len(outputs[i]) - len(bad) + 1:] == bad[:-1] and len(outputs[i]) >= len(bad) - 1:
                    z[bad[-1]] = -np.inf
            assert tokens[i] == int(np.argmax(z)), (trial, s, outputs[i])
            if "logprobs" in s:
                raw = torch.log_softmax(logits[i].double(), dim=-1).numpy()
                assert [t for t, _ in lps[i].top] == np.argsort(-raw, kind="stable")[: s["logprobs"]].tolist()


def test_sampled_rows_keep_to_their_allowed_tokens_and_seeded_neighbours_draw_as_alone():
    logits = torch.randn(3, VOCAB, generator=torch.Generator().manual_seed(4)) * 2.0
    keep = [int(logits[1].argsort()[0]), 17, 33]  # the least likely token among them

    def run(with_masked_rows: bool) -> list[list[int]]:
        sampler = Sampler(seed=0)
        mine = _req(0, temperature=1.0, seed=78)
        others = [_masked(_req(1, temperature=1.3), dict(allowed=keep)),
                  _masked(_req(2, temperature=1.0, seed=6), dict(bad=[[int(logits[2].argmax())]]))]
        reqs = [*others, mine] if with_masked_rows else [mine]
        return [sampler(logits[[1, 2, 0]] if with_masked_rows else logits[:1].clone(), reqs)[0] for _ in range(200)]

    together, alone = run(True), run(False)
    assert [t[2] for t in together] == [t[0] for t in alone]
    assert {t[0] for t in together} <= set(keep) and len({t[0] for t in together}) > 1
    assert int(logits[2].argmax()) not in {t[1] for t in together}


@pytest.mark.parametrize("bias, says", [({5: 101}, "[-100, 100]"), ({5: float("nan")}, "[-100, 100]"),
                                        ({-1: 1.0}, "non-negative token ids"), ({"5": 1.0}, "non-negative token ids"),
                                        ({i: 1.0 for i in range(1025)}, "at most 1024"), ([5], "dict")])
def test_bad_logit_bias_is_refused_by_name(bias, says):
    with pytest.raises(InvalidRequestError, match=re.escape(says)) as info:
        SamplingParams(logit_bias=bias)
    assert info.value.param == "logit_bias"


def test_a_rows_top_logprobs_among_ties_do_not_depend_on_its_neighbours():
    """Which of several tied tokens a top-k returns depends on k; one top-k at the batch's largest
    N gave a row asking for 3 different ids next to a row asking for 20 than alone."""
    logits = torch.zeros(2, VOCAB)
    logits[:, 5] = 2.0  # one clear top token, then 39 tied ones
    alone = Sampler()(logits[:1].clone(), [_req(0, temperature=0.0, logprobs=3)])[1][0]
    beside = Sampler()(logits.clone(), [_req(0, temperature=0.0, logprobs=3), _req(1, temperature=0.0, logprobs=20)])
    assert beside[1][0].top == alone.top and alone.top[0][0] == 5
    assert len(beside[1][1].top) == 20
