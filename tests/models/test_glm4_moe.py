"""GLM-4.5's own parts against transformers' modules, and its checkpoints as the hub ships them.

Every test of tests/models/test_parity.py runs on the `glm4_moe` checkpoint too (logits and
greedy tokens on every path). These check its router alone (choices and weights, with ties
and groups that a greedy comparison might not reach), its float32 router in a bf16 model, the
configs GLM-4.5 and GLM-4.5-Air come with, and the multi-token-prediction layer their
checkpoints hold after the last layer.
"""
from __future__ import annotations

import json

import pytest
import torch

from tests.conftest import _auto, build_checkpoint
from tests.models.test_parity import _hf_greedy, _prompts
from tierlm import LLM, SamplingParams
from tierlm.errors import ModelLoadError
from tierlm.models.config import parse_config
from tierlm.models.moe import SparseMoE
from tierlm.models.registry import resolve_architecture

# The fields of zai-org/GLM-4.5-Air's config.json that matter here.
GLM45_AIR_HUB = {
    "architectures": ["Glm4MoeForCausalLM"], "model_type": "glm4_moe", "vocab_size": 151552, "hidden_size": 4096,
    "intermediate_size": 10944, "num_hidden_layers": 46, "num_attention_heads": 96, "num_key_value_heads": 8,
    "head_dim": 128, "partial_rotary_factor": 0.5, "attention_bias": True, "moe_intermediate_size": 1408,
    "n_routed_experts": 128, "n_shared_experts": 1, "num_experts_per_tok": 8, "n_group": 1, "topk_group": 1,
    "first_k_dense_replace": 1, "norm_topk_prob": True, "routed_scaling_factor": 1.0, "use_qk_norm": False,
    "num_nextn_predict_layers": 1, "rope_theta": 1000000, "rope_scaling": None, "max_position_embeddings": 131072,
    "rms_norm_eps": 1e-5, "tie_word_embeddings": False, "eos_token_id": [151329, 151336, 151338],
    "torch_dtype": "bfloat16",
}
# GLM-4.5 (355B) differs in these.
GLM45_HUB = {**GLM45_AIR_HUB, "hidden_size": 5120, "intermediate_size": 12288, "num_hidden_layers": 92,
             "n_routed_experts": 160, "first_k_dense_replace": 3, "routed_scaling_factor": 2.5, "use_qk_norm": True}


def test_published_glm_4_5_configs():
    air = parse_config(GLM45_AIR_HUB, resolve_architecture(GLM45_AIR_HUB))
    assert (air.head_dim, air.rotary_dim, air.num_heads, air.num_kv_heads) == (128, 64, 96, 8)
    assert air.qkv_bias and not air.o_bias and not air.qk_norm
    assert (air.num_experts, air.num_experts_per_tok, air.moe_intermediate_size) == (128, 8, 1408)
    assert air.shared_expert_intermediate_size == 1408 and not air.shared_expert_gated
    assert (air.router_groups, air.router_topk_groups, air.routed_scaling_factor) == (1, 1, 1.0)
    assert air.moe_layers == [False] + [True] * 45 and air.eos_token_ids == [151329, 151336, 151338]
    big = parse_config(GLM45_HUB, "Glm4MoeForCausalLM")
    assert big.qk_norm and big.routed_scaling_factor == 2.5 and big.moe_layers == [False] * 3 + [True] * 89
    saved = {k: v for k, v in GLM45_AIR_HUB.items() if k not in ("partial_rotary_factor", "n_routed_experts")}
    saved["num_local_experts"] = 128  # transformers 5 saves the expert count under its alias; no factor: 0.5
    args = parse_config(saved, "Glm4MoeForCausalLM")
    assert (args.num_experts, args.rotary_dim) == (128, 64)


@pytest.mark.parametrize("edit,match", [
    ({"n_group": 3}, "do not split 128 experts"),
    ({"n_group": 8, "topk_group": 9}, "do not split"),
    ({"n_group": 64, "topk_group": 2, "num_experts_per_tok": 8}, "hold fewer than num_experts_per_tok 8"),
    ({"n_routed_experts": None}, "n_routed_experts"),
])
def test_glm_router_configs_tierlm_cannot_run_are_refused_by_name(edit, match):
    cfg = {k: v for k, v in {**GLM45_AIR_HUB, **edit}.items() if v is not None}
    with pytest.raises(ModelLoadError, match=match):
        parse_config(cfg, "Glm4MoeForCausalLM")


def test_router_chooses_and_weighs_as_transformers_does():
    """Glm4MoeTopkRouter and tierlm's router on the same weights and correction bias: the same
    experts for every token, and their weights bit for bit (groups that the bias reorders)."""
    from transformers import Glm4MoeConfig
    from transformers.models.glm4_moe.modeling_glm4_moe import Glm4MoeTopkRouter
    hf_cfg = Glm4MoeConfig(hidden_size=64, n_routed_experts=16, num_experts_per_tok=4, n_group=4, topk_group=2,
                           routed_scaling_factor=2.5, norm_topk_prob=True, moe_intermediate_size=32)
    torch.manual_seed(0)
    ref = Glm4MoeTopkRouter(hf_cfg)
    with torch.no_grad():
        ref.weight.copy_(0.3 * torch.randn_like(ref.weight))
        ref.e_score_correction_bias.copy_(0.3 * torch.randn(16))
    args = parse_config({**hf_cfg.to_dict(), "architectures": ["Glm4MoeForCausalLM"], "num_hidden_layers": 2},
                        "Glm4MoeForCausalLM")
    ours = SparseMoE(args)
    with torch.no_grad():
        ours.gate.weight.copy_(ref.weight)
        ours.e_score_correction_bias.copy_(ref.e_score_correction_bias)
    x = torch.randn(300, 64)
    _, want_w, want_e = ref(x)
    got_w, got_e = ours._route(x)
    want_order, got_order = want_e.sort(dim=-1), got_e.sort(dim=-1)
    assert torch.equal(want_order.values, got_order.values)
    assert torch.equal(want_w.gather(1, want_order.indices), got_w.gather(1, got_order.indices))
    assert got_w.dtype == torch.float32


@pytest.mark.slow
def test_hub_checkpoint_with_its_mtp_layer_and_a_bf16_model_keeping_its_router_in_float32(tmp_path):
    """GLM-4.5's checkpoints hold a multi-token-prediction layer after the last one
    (model.layers.{num_hidden_layers}.*), which transformers skips and so does tierlm; loaded
    as bf16, the routers' weights and correction biases stay float32 and unrounded, as
    transformers keeps them."""
    from safetensors.torch import load_file, save_file
    path = build_checkpoint("glm4_moe", tmp_path / "glm")
    tensors = load_file(path / "model.safetensors")
    n = json.loads((path / "config.json").read_text())["num_hidden_layers"]
    mtp = {f"model.layers.{n}.{name}": torch.randn(shape) for name, shape in (
        ("eh_proj.weight", (64, 128)), ("enorm.weight", (64,)), ("hnorm.weight", (64,)),
        ("shared_head.norm.weight", (64,)), ("self_attn.q_proj.weight", (64, 64)),
        ("mlp.experts.0.gate_proj.weight", (32, 64)), ("mlp.gate.e_score_correction_bias", (8,)))}
    save_file({**tensors, **mtp}, path / "model.safetensors", metadata={"format": "pt"})
    hf = _auto("glm4_moe").from_pretrained(str(path), dtype=torch.float32).eval()
    prompts = _prompts(3, hf.config.vocab_size)
    llm = LLM(str(path), dtype="float32", kv_cache_memory=4 << 20, load_progress=False)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
    assert [o.outputs[0].token_ids for o in outs] == [_hf_greedy(hf, p, 8) for p in prompts]

    bf16 = LLM(str(path), dtype="bfloat16", compute_dtype="bfloat16", kv_cache_memory=4 << 20, load_progress=False)
    moe = bf16.engine.runner.model.layers[1].mlp
    assert moe.w13.dtype == torch.bfloat16
    assert moe.gate.weight.dtype == moe.e_score_correction_bias.dtype == torch.float32
    assert torch.equal(moe.gate.weight.detach().cpu(), tensors["model.layers.1.mlp.gate.weight"])
    assert torch.equal(moe.e_score_correction_bias.detach().cpu(), tensors["model.layers.1.mlp.gate.e_score_correction_bias"])
    ref = _auto("glm4_moe").from_pretrained(str(path), dtype=torch.bfloat16).eval()
    assert ref.model.layers[1].mlp.gate.weight.dtype == torch.float32  # (transformers keeps it so too)
    assert len(bf16.generate({"prompt_token_ids": prompts[1]}, SamplingParams(max_tokens=3, ignore_eos=True))[0]
               .outputs[0].token_ids) == 3
