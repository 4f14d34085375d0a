"""GPT-OSS's own parts against transformers' modules, and its checkpoints as the hub ships them.

Every test of tests/models/test_parity.py runs on the `gpt_oss` checkpoint too (logits and
greedy tokens on every path: chunked prefill, odd blocks, preemption, fixed-shape steps,
speculation). These check what a float32 comparison cannot see (bf16 arithmetic in the order
the reference uses) and the configs gpt-oss-20b/120b come with.
"""
from __future__ import annotations

import json
import random

import pytest
import torch

from tests.conftest import build_checkpoint
from tests.models.test_parity import _hf_greedy
from tierlm import LLM, SamplingParams
from tierlm.models.config import parse_config
from tierlm.models.layers import RMSNorm
from tierlm.models.moe import SparseMoE


def _hf_config(**extra):
    from transformers import GptOssConfig
    return GptOssConfig(vocab_size=100, hidden_size=64, intermediate_size=48, num_hidden_layers=4,
                        num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=4,
                        num_experts_per_tok=2, swiglu_limit=1.0, initializer_range=0.1, **extra)


def test_norm_scales_in_float32_as_gpt_oss_does():
    """GPT-OSS multiplies the float32 normed states by the weight before rounding (Llama rounds
    first): in bf16 the two differ, and tierlm's matches the reference bit for bit."""
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssRMSNorm
    torch.manual_seed(0)
    ref = GptOssRMSNorm(64, eps=1e-5).to(torch.bfloat16)
    with torch.no_grad():
        ref.weight.copy_(1 + 0.5 * torch.randn(64))
    ours = RMSNorm(64, 1e-5, weight_in_fp32=True).to(torch.bfloat16)
    llama_style = RMSNorm(64, 1e-5).to(torch.bfloat16)
    with torch.no_grad():
        ours.weight.copy_(ref.weight)
        llama_style.weight.copy_(ref.weight)
    x = torch.randn(256, 64, dtype=torch.bfloat16) * 3
    assert torch.equal(ours(x), ref(x))
    assert not torch.equal(llama_style(x), ref(x))


def _moe_pair(dtype: torch.dtype):
    """transformers' GptOssMLP and tierlm's SparseMoE holding the same weights."""
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssMLP
    cfg = _hf_config()
    torch.manual_seed(1)
    ref = GptOssMLP(cfg)
    with torch.no_grad():
        for p in ref.parameters():
            p.copy_(0.3 * torch.randn_like(p))
    ref = ref.to(dtype).eval()
    args = parse_config({**cfg.to_dict(), "architectures": ["GptOssForCausalLM"]}, "GptOssForCausalLM")
    ours = SparseMoE(args).to(dtype)
    e = ref.experts
    with torch.no_grad():  # the loader's rearrangement: gate/up de-interleaved, [E, out, in]
        gu = e.gate_up_proj.transpose(1, 2)
        ours.w13.copy_(torch.cat((gu[:, 0::2], gu[:, 1::2]), dim=1))
        ours.b13.copy_(torch.cat((e.gate_up_proj_bias[:, 0::2], e.gate_up_proj_bias[:, 1::2]), dim=1))
        ours.w2.copy_(e.down_proj.transpose(1, 2))
        ours.b2.copy_(e.down_proj_bias)
        ours.gate.weight.copy_(ref.router.weight)
        ours.gate.bias.copy_(ref.router.bias)
    return ref, ours


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_router_picks_and_weighs_experts_as_gpt_oss_does(dtype):
    """Top-k of the biased router logits, softmaxed among themselves in the activations' dtype
    (Mixtral and Qwen softmax over every expert first, in float32): equal to the reference's."""
    ref, ours = _moe_pair(dtype)
    x = torch.randn(64, 64, dtype=dtype)
    _, ref_w, ref_e = ref.router(x)
    w, e = ours._route(x)
    assert torch.equal(e, ref_e) and torch.equal(w, ref_w) and w.dtype == dtype


@pytest.mark.parametrize("static", [False, True], ids=["grouped", "every_expert"])
def test_experts_match_gpt_oss_clamped_swiglu_with_biases(static):
    """Both expert paths (tokens grouped by expert; every expert on every token, as a recorded
    CUDA graph runs them) against GptOssMLP, with the SwiGLU limit low enough that a quarter
    of the gate and up values clamp."""
    ref, ours = _moe_pair(torch.float32)
    x = torch.randn(40, 64)
    with torch.no_grad():
        expect, _ = ref(x[None])
        ours.static_shapes = static
        got = ours(x)
    assert (got - expect[0]).abs().max().item() < 1e-5
    h = torch.cat([torch.nn.functional.linear(x, ours.w13[i], ours.b13[i]) for i in range(4)])
    clamped = (h.abs() > 1.0).float().mean().item()
    assert 0.1 < clamped < 0.9  # the clamp is in play, on both sides


def _hub_style(path) -> dict:
    """The config.json layout gpt-oss-20b and -120b ship: rope_scaling and rope_theta at the top
    (transformers 4.55), no layer_types (sliding first, then alternating), experts_per_token."""
    cfg = json.loads((path / "config.json").read_text())
    rope = cfg.pop("rope_parameters")
    cfg["rope_theta"] = rope.pop("rope_theta")
    cfg["rope_scaling"] = rope
    cfg.pop("layer_types")
    cfg["experts_per_token"] = cfg["num_experts_per_tok"]
    cfg["initial_context_length"] = rope["original_max_position_embeddings"]
    return cfg


def test_hub_config_layout_loads_and_matches_transformers(tmp_path):
    """A checkpoint with the hub's config.json gives transformers' greedy tokens, its layers
    windowed as transformers windows them (even layers sliding), with YaRN untruncated."""
    from transformers import AutoModelForCausalLM
    path = build_checkpoint("gpt_oss", tmp_path / "gpt_oss", num_hidden_layers=3)
    (path / "config.json").write_text(json.dumps(_hub_style(path)))
    hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    assert hf.config.layer_types == ["sliding_attention", "full_attention", "sliding_attention"]
    llm = LLM(str(path), dtype="float32", kv_cache_memory=4 << 20, block_size=4, load_progress=False)
    args = llm.engine.args
    assert args.sliding_windows == [12, None, 12]
    assert args.rope_scaling["rope_type"] == "yarn" and args.rope_scaling["truncate"] is False
    rng = random.Random(3)
    prompts = [[rng.randrange(hf.config.vocab_size - 10) for _ in range(n)] for n in (5, 30, 47)]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
    assert [o.outputs[0].token_ids for o in outs] == [_hf_greedy(hf, p, 8) for p in prompts]


def test_interleaved_expert_tensor_of_the_wrong_width_is_named(tmp_path):
    """A gate_up_proj whose width is not the config's 2 x intermediate_size is refused by name."""
    from safetensors.torch import load_file, save_file
    from tierlm.errors import ModelLoadError
    path = build_checkpoint("gpt_oss", tmp_path / "gpt_oss")
    tensors = load_file(path / "model.safetensors")
    name = "model.layers.1.mlp.experts.gate_up_proj"
    tensors[name] = tensors[name][..., :-2].contiguous()
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ModelLoadError, match=r"shape mismatch: tensor 'model\.layers\.1\.mlp\.experts\.gate_up_proj'"):
        LLM(str(path), dtype="float32", kv_cache_memory=1 << 20, load_progress=False)


@pytest.mark.parametrize("shards", [False, True], ids=["one_file", "sharded"])
def test_mxfp4_checkpoint_as_openai_ships_it_matches_transformers(shards, tmp_path):
    """gpt-oss's experts stored as MXFP4 blocks and scales (quantized from the float32 weights),
    everything else as it was: the experts' weights bit for bit those transformers dequantizes
    (Mxfp4Config(dequantize=True)), not the float32 ones they were rounded from, and the same
    greedy tokens."""
    from transformers import AutoModelForCausalLM, Mxfp4Config

    from tests.models.mxfp4_checkpoints import mxfp4_checkpoint
    dense = build_checkpoint("gpt_oss", tmp_path / "dense", intermediate_size=64)  # MXFP4 blocks of 32
    path = mxfp4_checkpoint(dense, tmp_path / "mxfp4", shards=shards)
    hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32,
                                              quantization_config=Mxfp4Config(dequantize=True)).eval()
    llm = LLM(str(path), dtype="float32", kv_cache_memory=4 << 20, load_progress=False)
    rng = random.Random(5)
    prompts = [[rng.randrange(hf.config.vocab_size - 10) for _ in range(n)] for n in (9, 40)]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(max_tokens=10, temperature=0, ignore_eos=True))
    ours = llm.engine.runner.model.layers[0].mlp.w2.detach()
    ref = hf.model.layers[0].mlp.experts.down_proj.detach().transpose(1, 2)
    assert torch.equal(ours, ref)  # the dequantized weights themselves, bit for bit
    dense_w2 = AutoModelForCausalLM.from_pretrained(str(dense), dtype=torch.float32).model.layers[0].mlp.experts.down_proj
    assert not torch.equal(ref, dense_w2.detach().transpose(1, 2))  # rounded to FP4: not the float32 weights
    assert [o.outputs[0].token_ids for o in outs] == [_hf_greedy(hf, p, 10) for p in prompts]


@pytest.mark.parametrize("graphs", [False, True], ids=["decode_groups", "fixed_shape"])
def test_every_attention_path_keeps_a_bool_mask_with_sinks(graphs, checkpoints, hf_models, sdpa_masks):
    """Decodes (gathered, without tierlm's kernel) and fixed-shape steps (what a CUDA graph
    records) take the sinks as the prefill does, as one more key the dot product scores: a bool
    mask shared by every head (a float one per head was ~1 GB for 256 decodes of gpt-oss's 64
    heads over 32k keys), with transformers' logits."""
    hf = hf_models["gpt_oss"]
    llm = LLM(str(checkpoints["gpt_oss"]), dtype="float32", kv_cache_memory=4 << 20, load_progress=False,
              cpu_kernels=False, cuda_graphs=graphs)
    rng = random.Random(7)
    prompts = [[rng.randrange(hf.config.vocab_size - 10) for _ in range(n)] for n in (5, 23, 40)]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))
    assert [o.outputs[0].token_ids for o in outs] == [_hf_greedy(hf, p, 6) for p in prompts]
    assert sdpa_masks and all(m is None or m.dtype == torch.bool for m in sdpa_masks)
    if graphs:
        assert llm.engine.runner.graphs.steps > 0
