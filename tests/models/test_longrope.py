"""LongRoPE (Phi-3-128k, Phi-3.5-mini, Phi-4-mini) against transformers: its tables bit for bit, and
greedy tokens on both sides of original_max_position_embeddings.

transformers rotates a sequence with the short factors while it fits in the original length and
with the long ones past it (Phi-3's generate() recomputes the cache when a sequence crosses);
tierlm picks one set for the engine's life, as vLLM does: the long one when max_model_len is past
the original length (layers.py: _longrope). So tierlm matches transformers on every sequence when
max_model_len is within the original length, and on sequences whose prompt is already past it.
"""
from __future__ import annotations

import json

import pytest
import torch

from tests.conftest import _auto, build_checkpoint
from tests.models.test_parity import _hf_greedy, _prompts
from tierlm import LLM, SamplingParams
from tierlm.models.config import parse_config
from tierlm.models.layers import rope_inv_freq

SHORT = [1.0, 1.02, 1.11, 1.35, 1.9, 2.4, 3.3, 4.1]
LONG = [1.0, 1.3, 2.2, 4.9, 9.5, 17.0, 33.0, 60.0]


@pytest.mark.parametrize("extra,scaling", [
    ({}, {}),  # Phi-3-mini-128k's layout: the attention factor from max_position_embeddings / original
    ({"partial_rotary_factor": 0.5, "hidden_size": 256}, {}),  # Phi-4-mini's: over part of each head
    ({}, {"factor": 8.0}),
    ({}, {"attention_factor": 1.07}),
], ids=["lengths", "partial", "factor", "attention_factor"])
def test_longrope_frequencies_and_scale_equal_transformers(extra, scaling):
    from transformers import Phi3Config
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    fields = {**dict(hidden_size=128, num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=131072,
                     original_max_position_embeddings=4096), **extra}
    hf = Phi3Config(**fields, rope_scaling={"type": "longrope", "short_factor": SHORT, "long_factor": LONG, **scaling})
    cfg = {"architectures": ["Phi3ForCausalLM"], "model_type": "phi3", "vocab_size": 100, "num_hidden_layers": 2,
           **fields, "rope_scaling": {"type": "longrope", "short_factor": SHORT, "long_factor": LONG, **scaling}}
    args = parse_config(cfg, "Phi3ForCausalLM")
    for served, seq_len in ((4096, None), (4097, 4097), (131072, 4097)):  # short within the original length
        want_inv, want_scale = ROPE_INIT_FUNCTIONS["longrope"](hf, "cpu", seq_len=seq_len)
        inv, scale = rope_inv_freq(args, served)
        assert torch.equal(inv, want_inv) and scale == want_scale


def _checkpoint(tmp_path, original: int):
    """Phi-4-mini's RoPE with an original length of `original` and the attention factor computed
    from the lengths (sqrt(1 + ln 32 / ln 32) for 32 of 1024)."""
    path = build_checkpoint("phi4_mini_longrope", tmp_path / f"longrope{original}")
    cfg = json.loads((path / "config.json").read_text())
    cfg["original_max_position_embeddings"] = original
    for params in ("rope_parameters", "rope_scaling"):
        if isinstance(cfg.get(params), dict):
            cfg[params].pop("attention_factor", None)
            cfg[params]["original_max_position_embeddings"] = original
    (path / "config.json").write_text(json.dumps(cfg))
    return path, _auto("phi4_mini_longrope").from_pretrained(str(path), dtype=torch.float32).eval()


@pytest.mark.slow
def test_greedy_tokens_on_both_sides_of_the_original_length(tmp_path):
    path, hf = _checkpoint(tmp_path, 32)
    assert hf.model.rotary_emb.attention_scaling == pytest.approx(2 ** 0.5)
    greedy = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    kw = dict(dtype="float32", kv_cache_memory=4 << 20, block_size=8, max_num_batched_tokens=24, load_progress=False)

    # Within it: an engine for sequences of up to 32 tokens, the short factors (as transformers uses them there).
    short = [p for p in _prompts(9, hf.config.vocab_size, seed=3) if len(p) <= 22]
    llm = LLM(str(path), max_model_len=32, **kw)
    outs = llm.generate([{"prompt_token_ids": p} for p in short], greedy)
    assert [o.outputs[0].token_ids for o in outs] == [_hf_greedy(hf, p, 10) for p in short]

    # Past it: prompts longer than 32 tokens, prefilled in chunks of 24 (the first one all within
    # the original length, rotated long as transformers rotates the whole prompt).
    long = [p for p in _prompts(9, hf.config.vocab_size, seed=4) if len(p) > 32]
    llm = LLM(str(path), **kw)
    outs = llm.generate([{"prompt_token_ids": p} for p in long], greedy)
    assert [o.outputs[0].token_ids for o in outs] == [_hf_greedy(hf, p, 10) for p in long]

    # The two engines' tables differ (the short factors would not have given the long side's tokens).
    assert not torch.equal(LLM(str(path), max_model_len=32, **kw).engine.runner.model.rope.cos[:32],
                           llm.engine.runner.model.rope.cos[:32])

    # Across it (the documented difference): a short prompt that grows past 32 tokens is rotated
    # with the long factors from its first token, which is transformers with every sequence past
    # the original length (an original length of 1, the same attention factor).
    crossing = [p for p in _prompts(9, hf.config.vocab_size, seed=5) if len(p) <= 17]
    long_hf = _auto("phi4_mini_longrope").from_pretrained(
        str(path), dtype=torch.float32, original_max_position_embeddings=1,
        rope_parameters={**hf.config.rope_parameters, "original_max_position_embeddings": 1,
                         "attention_factor": hf.model.rotary_emb.attention_scaling}).eval()
    crossing_greedy = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in crossing], crossing_greedy)
    got = [o.outputs[0].token_ids for o in outs]
    assert got == [_hf_greedy(long_hf, p, 24) for p in crossing]
    assert got != [_hf_greedy(hf, p, 24) for p in crossing]  # transformers' own: short factors first, then recomputed


def test_engines_rotating_with_different_factor_sets_share_no_cached_blocks(tmp_path):
    """The factor set is the engine's (its max_model_len), not the checkpoint's, so it is part of
    the KV blocks' identity: an engine rotating with the long factors was served the keys that
    one with max_model_len within the original length had written to a shared disk tier (a
    restart with another --max-model-len), short-rotated, and computed other logits than cold."""
    path, _ = _checkpoint(tmp_path, 32)
    prompt = _prompts(9, 300, seed=3)[4][:30]
    kw = dict(dtype="float32", kv_cache_memory=4 << 20, block_size=8, load_progress=False,
              kv_disk_dir=str(tmp_path / "disk"), kv_disk_write_through=True)

    def run(llm: LLM) -> int:
        llm.generate({"prompt_token_ids": prompt}, SamplingParams(max_tokens=2, temperature=0, ignore_eos=True))
        return llm.engine.stats().prefix_cache_hits

    with LLM(str(path), max_model_len=32, **kw) as short:  # the short factors' blocks, written to disk
        run(short)
    with LLM(str(path), **kw) as long:  # the long factors: none of those blocks
        assert run(long) == 0
    with LLM(str(path), **kw) as again:  # an engine like it reads its blocks (the tier works across engines)
        assert run(again) == 24
