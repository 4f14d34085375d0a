"""Prompt logprobs (vLLM's `prompt_logprobs`): every prompt token's logprob, rank and top-N under
the model, checked against transformers' own forward pass on the same weights, through chunked
prefill, mixed batches, fixed-shape steps, the prefix cache and preemption."""
from __future__ import annotations

import asyncio

import pytest
import torch

from tests.conftest import ref_tol

from tierlm.engine.async_engine import AsyncEngine
from tierlm.engine.llm import LLM
from tierlm.errors import InvalidRequestError
from tierlm.sampling_params import SamplingParams


def _prompt(n: int, seed: int, vocab: int = 500) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (n,), generator=g).tolist()


def _reference(hf_model, ids: list[int]) -> torch.Tensor:
    """transformers' log-softmax over the vocabulary at every prompt position (row i predicts token i + 1)."""
    with torch.no_grad():
        return torch.log_softmax(hf_model(torch.tensor([ids])).logits[0].float(), dim=-1)


def _check_against(ref: torch.Tensor, ids: list[int], scored, n: int) -> None:
    tol = ref_tol(2e-4, 1e-2)
    assert len(scored) == len(ids) and scored[0] is None  # one per prompt token; nothing predicts the first
    for i in range(1, len(ids)):
        lp, row = scored[i], ref[i - 1]
        assert lp.token_id == ids[i]
        assert lp.logprob == pytest.approx(row[ids[i]].item(), abs=tol)
        assert lp.rank == int((row > row[ids[i]]).sum()) + 1 or abs(row.sort(descending=True).values[lp.rank - 1]
                                                                      - row[ids[i]]) < tol  # (a near-tie may swap)
        assert len(lp.top) == n
        want = torch.topk(row, n)
        for (tok, val), ref_tok, ref_val in zip(lp.top, want.indices.tolist(), want.values.tolist()):
            assert val == pytest.approx(ref_val, abs=tol)
            assert tok == ref_tok or abs(row[tok].item() - ref_val) < tol


@pytest.mark.parametrize("arch", ["llama", "gemma3", "granite", "qwen2_moe"])
def test_prompt_logprobs_match_transformers_through_chunked_prefill(arch, checkpoints, hf_models):
    """A 70-token prompt prefilled 16 tokens a step beside another request: every position's
    logprob, rank and top 5 are transformers'. gemma3 has sliding layers, granite scales its
    logits, qwen2_moe routes to experts."""
    llm = LLM(str(checkpoints[arch]), dtype="float32", block_size=8, max_num_batched_tokens=16, load_progress=False)
    ids, other = _prompt(70, seed=1), _prompt(30, seed=2)
    outs = llm.generate([{"prompt_token_ids": ids}, {"prompt_token_ids": other}],
                        [SamplingParams(max_tokens=3, temperature=0, prompt_logprobs=5), SamplingParams(max_tokens=3)])
    _check_against(_reference(hf_models[arch], ids), ids, outs[0].prompt_logprobs, 5)
    assert outs[1].prompt_logprobs is None  # not asked for
    # The answer is unchanged by the scoring: the same greedy tokens as without it.
    plain = llm.generate({"prompt_token_ids": ids}, SamplingParams(max_tokens=3, temperature=0))[0]
    assert outs[0].outputs[0].token_ids == plain.outputs[0].token_ids


def test_prompt_logprobs_zero_gives_each_tokens_own_logprob_and_fixed_shape_steps_stay_out(llama_dir, hf_models):
    """prompt_logprobs=0: no top list, the token's own entry. With fixed-shape steps on
    (`cuda_graphs`, run eagerly on CPU) a scoring step runs eagerly, and the values are the same."""
    ids = _prompt(40, seed=3)
    ref = _reference(hf_models["llama"], ids)
    for graphs in (False, True):
        llm = LLM(str(llama_dir), dtype="float32", block_size=8, cuda_graphs=graphs, load_progress=False)
        out = llm.generate({"prompt_token_ids": ids}, SamplingParams(max_tokens=2, prompt_logprobs=0))[0]
        _check_against(ref, ids, out.prompt_logprobs, 0)


def test_a_scored_prompt_computes_its_cached_prefix_and_still_fills_the_cache(llama_dir):
    """The prefix cache serves no position a request must score (its logits are not kept): a
    scored request after a cached one computes the whole prompt, with the cold run's values;
    what it computes is cached for the next unscored request. Scored prompts are not looked up,
    so the cache's queries (vLLM's) count the unscored one only, not two misses besides."""
    llm = LLM(str(llama_dir), dtype="float32", block_size=8, load_progress=False)
    ids = _prompt(50, seed=4)
    cold = llm.generate({"prompt_token_ids": ids}, SamplingParams(max_tokens=2, prompt_logprobs=2))[0]
    again = llm.generate({"prompt_token_ids": ids}, SamplingParams(max_tokens=2, prompt_logprobs=2))[0]
    assert cold.num_cached_tokens == again.num_cached_tokens == 0
    assert [(lp.logprob, lp.top) for lp in cold.prompt_logprobs[1:]] == \
           [(lp.logprob, lp.top) for lp in again.prompt_logprobs[1:]]
    plain = llm.generate({"prompt_token_ids": ids}, SamplingParams(max_tokens=2))[0]
    assert plain.num_cached_tokens == 48 and plain.prompt_logprobs is None
    stats = llm.engine.stats()
    assert (stats.prefix_cache_queries, stats.prefix_cache_hits) == (50, 48)



@pytest.mark.parametrize("tier", ["host", "disk", "redis"])
def test_a_prefix_cached_in_a_lower_tier_leaves_a_scored_prompts_logprobs_as_transformers(tier, llama_dir, hf_models,
                                                                                         tmp_path, request):
    """A scored request whose prefix waits in host memory, on disk or in Redis reads none of it:
    every position (the first, the block boundaries) is transformers' and the cold run's."""
    lower = {"host": dict(kv_host_capacity="64 blocks"),
             "disk": dict(kv_disk_dir=str(tmp_path / "kv"), kv_disk_capacity="64 blocks"),
             "redis": dict(kv_remote=request.getfixturevalue("redis_server").url) if tier == "redis" else {}}[tier]
    llm = LLM(str(llama_dir), dtype="float32", block_size=8, load_progress=False, **lower)
    ids = _prompt(50, seed=10)
    llm.generate({"prompt_token_ids": ids[:42]}, SamplingParams(max_tokens=1))
    assert llm.engine.offload_prefix_cache() > 0
    llm.engine.store.flush()
    out = llm.generate({"prompt_token_ids": ids}, SamplingParams(max_tokens=2, prompt_logprobs=2))[0]
    assert out.num_cached_tokens == 0 and llm.engine.stats().kv_tiers[tier]["hits"] == 0
    _check_against(_reference(hf_models["llama"], ids), ids, out.prompt_logprobs, 2)
    assert llm.generate({"prompt_token_ids": ids}, SamplingParams(max_tokens=1))[0].num_cached_tokens == 48

def test_prompt_logprobs_survive_preemption_mid_prefill(llama_dir):
    """A scored request preempted part-way through its prompt (a small pool, a higher-priority
    request growing) comes back through the prefix cache only as far as it has scored, and ends
    with exactly one entry per prompt token, equal to an undisturbed run's."""
    ids = _prompt(60, seed=5)
    alone = LLM(str(llama_dir), dtype="float32", block_size=8, load_progress=False)
    want = alone.generate({"prompt_token_ids": ids}, SamplingParams(max_tokens=2, prompt_logprobs=3))[0].prompt_logprobs
    small = LLM(str(llama_dir), dtype="float32", kv_cache_memory="10 blocks", block_size=8,
                max_num_batched_tokens=16, load_progress=False)
    eng = small.engine
    eng.add_request({"prompt_token_ids": _prompt(20, seed=6)}, SamplingParams(max_tokens=20, ignore_eos=True),
                    priority=0)
    scored = eng.add_request({"prompt_token_ids": ids}, SamplingParams(max_tokens=2, temperature=0, prompt_logprobs=3),
                             priority=1)
    firsts, resumed_at = [], []
    while eng.has_unfinished():
        before = scored.num_computed_tokens
        for delta in eng.step():
            if delta.request_id == scored.request_id and delta.prompt_logprobs is not None:
                firsts.append(delta.prompt_logprobs)
        if before == 0 and scored.num_computed_tokens > 16:  # resumed with part of its prompt from the cache
            resumed_at.append((scored.num_computed_tokens, len(scored.prompt_logprobs)))
    assert scored.num_preemptions >= 1 and resumed_at
    assert len(firsts) == 1  # they come once, with the first token
    got = firsts[0]
    assert len(got) == len(ids) == len(want)
    for a, b in zip(got[1:], want[1:]):
        assert a.token_id == b.token_id and a.logprob == pytest.approx(b.logprob, abs=1e-5)
        assert [t for t, _ in a.top] == [t for t, _ in b.top]



def test_a_request_preempted_after_its_prompt_was_scored_takes_its_cached_blocks_back_as_any(llama_dir):
    """Preempted while decoding, with every prompt position scored, a scored request comes back
    through the prefix cache as far as an unscored one (its output's blocks too: it recomputed
    all past the prompt), with the answer and prompt logprobs of an undisturbed run."""
    ids = _prompt(17, seed=8)
    want = LLM(str(llama_dir), dtype="float32", block_size=8, load_progress=False).generate(
        {"prompt_token_ids": ids}, SamplingParams(max_tokens=40, temperature=0, ignore_eos=True, prompt_logprobs=1))[0]
    hits = {}
    for scored in (None, 1):
        llm = LLM(str(llama_dir), dtype="float32", kv_cache_memory="12 blocks", block_size=8, load_progress=False)
        eng = llm.engine
        req = eng.add_request({"prompt_token_ids": ids}, SamplingParams(max_tokens=40, temperature=0, ignore_eos=True,
                                                                        prompt_logprobs=scored), priority=1)
        deltas = [d for _ in range(30) for d in eng.step()]  # the prompt and 29 tokens
        before = eng.stats().kv_device_hit_blocks
        eng.add_request({"prompt_token_ids": _prompt(40, seed=9)}, SamplingParams(max_tokens=30, ignore_eos=True),
                        priority=0)  # grows until it preempts `req`
        while eng.has_unfinished():
            deltas += eng.step()
        assert req.num_preemptions == 1
        hits[scored] = eng.stats().kv_device_hit_blocks - before
        assert req.output_token_ids == want.outputs[0].token_ids
    assert hits[1] == hits[None] > 17 // 8
    got = next(d.prompt_logprobs for d in deltas if d.prompt_logprobs is not None)
    assert [lp.logprob for lp in got[1:]] == pytest.approx([lp.logprob for lp in want.prompt_logprobs[1:]], abs=1e-5)

def test_prompt_logprobs_are_validated_and_come_with_the_first_delta(llama_dir):
    with pytest.raises(InvalidRequestError) as info:
        SamplingParams(prompt_logprobs=21)
    assert info.value.param == "prompt_logprobs"
    with pytest.raises(InvalidRequestError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=-1)  # vLLM's whole vocabulary: refused, not run
    engine = AsyncEngine.from_model(str(llama_dir), dtype="float32", load_progress=False)
    ids = _prompt(12, seed=7)

    async def run() -> list:
        try:
            return [d async for d in engine.generate(ids, SamplingParams(max_tokens=4, ignore_eos=True,
                                                                          prompt_logprobs=1))]
        finally:
            await engine.shutdown()

    deltas = asyncio.run(run())
    assert deltas[0].prompt_logprobs is not None and len(deltas[0].prompt_logprobs) == len(ids)
    assert all(d.prompt_logprobs is None for d in deltas[1:])
