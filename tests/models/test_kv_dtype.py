"""KV cache storage dtypes (`kv_cache_dtype`): fp8 against transformers whose attention reads K/V
rounded to the same format, on every architecture; pool sizes; prefix-cache hits and KV tiers
holding fp8 blocks; engines of different KV dtypes never sharing blocks; bad names refused."""
from __future__ import annotations

import math

import pytest
import torch

from tests.conftest import ARCHS, has_sinks, rounded_kv_attention
from tests.models.test_parity import _hf_greedy, _prompts
from tierlm import LLM, SamplingParams
from tierlm.config import EngineConfig
from tierlm.models.kv_dtype import KV_CACHE_DTYPES, to_storage

FP8 = {"fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}
GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)


def _fp8_refs(hf, llm: LLM, prompts: list[list[int]], n: int) -> list[list[int]]:
    """transformers' greedy tokens reading K/V rounded as `llm` stores them: its fp8 format and
    its per-layer scales."""
    before = hf.config._attn_implementation
    hf.set_attn_implementation(rounded_kv_attention(llm.engine.runner.kv_caches[0].dtype, llm.engine.kv_scales,
                                                    eager=has_sinks(hf)))
    try:
        return [_hf_greedy(hf, p, n) for p in prompts]
    finally:
        hf.set_attn_implementation(before)  # the model is shared by the whole session


# Every architecture with the default scales (calibrated at load); unscaled (the checkpoints
# have no scales: kv_cache_scales=checkpoint stores K/V as they are, vLLM's default) and e5m2 on three.
CASES = ([(arch, "fp8_e4m3", "auto") for arch in ARCHS] + [(arch, "fp8_e4m3", "checkpoint") for arch in
                                                           ("llama", "gemma3", "qwen2_moe")]
         + [(arch, "fp8_e5m2", "auto") for arch in ("llama", "gemma3", "qwen2_moe")])


@pytest.mark.parametrize("arch,kv_cache_dtype,scales", CASES)
def test_fp8_kv_cache_greedy_tokens_match_transformers_reading_the_same_rounded_kv(
        arch, kv_cache_dtype, scales, checkpoints, hf_models):
    """Nine prompts of 1-64 tokens in one batch, prefilled in chunks of 24 (later chunks and
    every decode read earlier keys back from the fp8 pool; on this CPU decodes read them in
    place with tierlm's kernel): token-identical to the reference for 12 tokens each."""
    hf = hf_models[arch]
    prompts = _prompts(9, hf.config.get_text_config().vocab_size)
    llm = LLM(str(checkpoints[arch]), dtype="float32", kv_cache_memory=8 << 20, max_num_batched_tokens=24,
              kv_cache_dtype=kv_cache_dtype, kv_cache_scales=scales, load_progress=False)
    assert all(c.dtype == FP8[kv_cache_dtype] for c in llm.engine.runner.kv_caches)
    got = llm.engine.kv_scales
    if scales == "checkpoint":
        assert got is None
    else:  # one power of two per layer and side
        assert len(got) == hf.config.get_text_config().num_hidden_layers
        assert all(math.log2(s).is_integer() for pair in got for s in pair)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY)
    assert [o.outputs[0].token_ids for o in outs] == _fp8_refs(hf, llm, prompts, 12)
    assert llm.engine.pool.num_used == 0


def test_fp8_rounding_is_in_effect_and_both_attention_paths_agree(llama_dir, hf_models):
    """The fp8 answers are not the float32 cache's (so the comparison above tests the rounding),
    and tierlm's CPU kernel reading fp8 in place gives the PyTorch path's tokens and logits."""
    hf = hf_models["llama"]
    prompts = _prompts(9, hf.config.get_text_config().vocab_size)
    plain = [_hf_greedy(hf, p, 12) for p in prompts]
    rows = {}
    for kernels in (True, False):
        llm = LLM(str(llama_dir), dtype="float32", kv_cache_memory=8 << 20, kv_cache_dtype="fp8",
                  cpu_kernels=kernels, load_progress=False, device="cpu")
        sampler, captured = llm.engine.sampler, []
        llm.engine.sampler = lambda logits, reqs, s=sampler, c=captured: c.append(logits.clone()) or s(logits, reqs)
        got = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY)]
        assert got != plain
        rows[kernels] = (got, torch.cat(captured))
    assert rows[True][0] == rows[False][0]
    assert (rows[True][1] - rows[False][1]).abs().max().item() < 1e-4


def _tokens_and_logits(llm: LLM, prompt: list[int]) -> tuple[list[int], torch.Tensor, int]:
    sampler, captured = llm.engine.sampler, []
    llm.engine.sampler = lambda logits, reqs: captured.append(logits.clone()) or sampler(logits, reqs)
    try:
        out = llm.generate({"prompt_token_ids": prompt}, GREEDY)[0]
    finally:
        llm.engine.sampler = sampler
    return out.outputs[0].token_ids, torch.cat(captured), out.num_cached_tokens


@pytest.mark.parametrize("chunk", [16, 40])
def test_fp8_answers_do_not_depend_on_how_the_prompt_was_chunked_or_cached(llama_dir, chunk):
    """A chunk attends to its own keys as stored (rounded), not as computed, so one prefill,
    several chunks and a prefix-cache hit all see the same values: the same tokens, and logits
    equal up to float32 summation order (fp8 rounding moves them by ~1e-2)."""
    prompt = _prompts(7, 600)[6] + _prompts(3, 600, seed=5)[2]  # 64 + 31 tokens
    kw = dict(dtype="float32", kv_cache_memory=4 << 20, kv_cache_dtype="fp8", load_progress=False)
    ref, ref_logits, _ = _tokens_and_logits(LLM(str(llama_dir), max_num_batched_tokens=128, **kw), prompt)
    llm = LLM(str(llama_dir), max_num_batched_tokens=chunk, block_size=8, **kw)
    for cached in (0, 88):  # cold in chunks, then the same prompt from the prefix cache
        tokens, logits, hit = _tokens_and_logits(llm, prompt)
        assert hit == cached and tokens == ref
        assert (logits - ref_logits).abs().max().item() < 1e-4


def test_pool_holds_four_times_the_float32_blocks_in_the_same_memory(llama_dir):
    sizes = {}
    for name in ("auto", "bfloat16", "fp8", "fp8_e5m2"):
        llm = LLM(str(llama_dir), dtype="float32", kv_cache_memory=2 << 20, kv_cache_dtype=name, load_progress=False)
        sizes[name] = llm.engine.pool.num_blocks
        assert llm.engine.runner.kv_caches[0].dtype == (KV_CACHE_DTYPES[name] or torch.float32)
        assert sum(c.nbytes for c in llm.engine.runner.kv_caches) <= 2 << 20
    assert sizes["bfloat16"] == 2 * sizes["auto"] and sizes["fp8"] == sizes["fp8_e5m2"] == 4 * sizes["auto"]


def test_fp8_blocks_round_trip_between_the_device_and_host_bitwise(llama_dir):
    llm = LLM(str(llama_dir), dtype="float32", kv_cache_memory=4 << 20, block_size=8, kv_cache_dtype="fp8",
              load_progress=False)
    llm.generate({"prompt_token_ids": _prompts(7, 600)[6]}, GREEDY)
    runner = llm.engine.runner
    assert runner.block_layout[0] == torch.float8_e4m3fn
    ids = [b.block_id for b in llm.engine.pool.cached.values()]
    before = [b.view(torch.uint8).clone() for b in runner.read_blocks(ids)]
    assert len(ids) >= 8 and any(b.any() for b in before)
    free = [i for i in range(runner.num_blocks) if i not in ids][:len(ids)]
    runner.write_blocks(free, runner.read_blocks(ids))  # into other blocks, then read back from there
    assert all(torch.equal(a, b.view(torch.uint8)) for a, b in zip(before, runner.read_blocks(free)))


@pytest.mark.parametrize("tier", ["host", "disk", "redis"])
def test_fp8_prefix_demoted_to_a_lower_tier_and_promoted_back_gives_the_cold_tokens(tier, llama_dir, tmp_path,
                                                                                   request):
    """Each block comes back byte for byte, and the prefix hit answers as a cold run does, with
    speculation checking its guesses over the promoted fp8 keys too."""
    shared = _prompts(7, 600)[6]
    tail = _prompts(2, 600, seed=9)[1]
    kw = dict(dtype="float32", kv_cache_memory=4 << 20, block_size=8, max_num_batched_tokens=64,
              kv_cache_dtype="fp8", load_progress=False)
    cold = LLM(str(llama_dir), enable_prefix_caching=False, **kw).generate(
        {"prompt_token_ids": shared + tail}, GREEDY)[0].outputs[0].token_ids
    lower = {"host": dict(kv_host_capacity="16 blocks"),
             "disk": dict(kv_disk_dir=str(tmp_path / "kv"), kv_disk_capacity="16 blocks"),
             "redis": dict(kv_remote=request.getfixturevalue("redis_server").url) if tier == "redis" else {}}[tier]
    llm = LLM(str(llama_dir), speculative_config={"num_speculative_tokens": 3, "prompt_lookup_min": 1}, **lower, **kw)
    llm.generate({"prompt_token_ids": shared}, GREEDY)
    pool, runner = llm.engine.pool, llm.engine.runner
    before = {h: b.view(torch.uint8).clone() for h, b in zip(pool.cached, runner.read_blocks(
        [b.block_id for b in pool.cached.values()]))}
    assert llm.engine.offload_prefix_cache() > 0 and pool.cached == {}
    llm.engine.store.flush()
    out = llm.generate({"prompt_token_ids": shared + tail}, GREEDY)[0]
    assert out.outputs[0].token_ids == cold and out.num_cached_tokens == 64
    stats = llm.engine.stats()
    assert stats.kv_tiers[tier]["hits"] == 8 and stats.spec_draft_tokens > 0
    back = [h for h in before if h in pool.cached]
    assert len(back) == 8 and all(torch.equal(before[h], b.view(torch.uint8)) for h, b in zip(
        back, runner.read_blocks([pool.cached[h].block_id for h in back])))
    llm.close()


def test_engines_with_other_kv_dtypes_never_share_blocks(llama_dir, redis_server):
    """Block keys name the KV dtype and an fp8 cache's scales: an fp8 engine's blocks in Redis
    are hits for another fp8 engine with the same scales only (the same bytes read as float32,
    or times other scales, would be other numbers)."""
    prompt = _prompts(7, 600)[6] + [5, 6, 7]
    kw = dict(dtype="float32", kv_cache_memory=4 << 20, block_size=8, load_progress=False, kv_remote=redis_server.url)
    first = LLM(str(llama_dir), kv_cache_dtype="fp8", **kw)
    ref = first.generate({"prompt_token_ids": prompt}, GREEDY)[0].outputs[0].token_ids
    first.engine.store.flush()
    for name, scales, hits in (("auto", "auto", 0), ("fp8_e5m2", "auto", 0), ("fp8", "checkpoint", 0),
                               ("fp8", "calibrate", 64)):
        out = LLM(str(llama_dir), kv_cache_dtype=name, kv_cache_scales=scales, **kw).generate(
            {"prompt_token_ids": prompt}, GREEDY)[0]
        assert out.num_cached_tokens == hits, (name, scales)
    assert out.outputs[0].token_ids == ref


def test_storage_saturates_and_never_keeps_nan_or_inf():
    x = torch.tensor([1e6, -1e6, float("inf"), float("-inf"), float("nan"), 3.3, 1e-3])
    for dtype in FP8.values():
        top = torch.finfo(dtype).max
        got = to_storage(x, dtype).float()
        assert got[:4].tolist() == [top, -top, top, -top]
        assert torch.isfinite(got).all()
        assert got[5:].tolist() == x[5:].to(dtype).float().tolist()


@pytest.mark.parametrize("bad", ["fp4", "int8", "FP8", "", None])
def test_unknown_kv_cache_dtypes_are_refused_before_loading(bad):
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of auto, float32, bfloat16, float16, fp8"):
        EngineConfig(model="/nonexistent", kv_cache_dtype=bad).validate()


@pytest.mark.parametrize("arch", ["llama", "gemma3", "qwen2_moe"])
@pytest.mark.parametrize("setting", [
    # Every step through the fixed-shape path a CUDA graph records (on CPU run eagerly): it reads
    # all keys, the step's own too, back from the pool.
    dict(cuda_graphs=True, max_num_seqs=16, max_num_batched_tokens=40),
    # Guesses checked as short chunks over fp8 keys; only accepted tokens' blocks are kept.
    dict(block_size=4, max_num_batched_tokens=48, speculative_config={"num_speculative_tokens": 3,
                                                                      "prompt_lookup_min": 1}),
], ids=["graphs", "speculative"])
def test_fp8_kv_cache_with_fixed_shape_steps_or_speculation_matches_transformers_too(
        arch, setting, checkpoints, hf_models):
    hf = hf_models[arch]
    prompts = _prompts(9, hf.config.get_text_config().vocab_size)
    llm = LLM(str(checkpoints[arch]), dtype="float32", kv_cache_memory=8 << 20, kv_cache_dtype="fp8",
              load_progress=False, **setting)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY)
    assert [o.outputs[0].token_ids for o in outs] == _fp8_refs(hf, llm, prompts, 12)
    stats = llm.engine.stats()
    if "speculative_config" in setting:
        assert 0 < stats.spec_accepted_tokens <= stats.spec_draft_tokens
    else:
        assert llm.engine.runner.graphs.steps > 0


def test_metrics_name_the_kv_cache_dtype(llama_dir):
    from tests.serving.test_telemetry import value
    from tierlm.serving.telemetry import Telemetry

    llm = LLM(str(llama_dir), dtype="float32", kv_cache_memory=1 << 20, block_size=8, kv_cache_dtype="fp8_e5m2",
              load_progress=False)
    stats = llm.engine.stats()
    assert (stats.kv_cache_dtype, stats.block_size) == ("float8_e5m2", 8)
    text = Telemetry({"m": llm.engine}, log_requests=False).render().decode()
    assert value(text, "tierlm:cache_config_info", model="m", cache_dtype="float8_e5m2", block_size="8",
                 num_blocks=str(stats.kv_blocks_total)) == 1
