"""config.json as published checkpoints spell it (not only as the test fixtures' transformers
version saves it) becomes the right ModelArgs."""
from __future__ import annotations

import pytest
import torch

from tierlm.errors import ModelLoadError
from tierlm.models.config import parse_config
from tierlm.models.registry import resolve_architecture

# The fields of Qwen/Qwen3-30B-A3B's config.json that matter here.
QWEN3_MOE_HUB = {
    "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "vocab_size": 151936,
    "hidden_size": 2048, "intermediate_size": 6144, "num_hidden_layers": 48, "num_attention_heads": 32,
    "num_key_value_heads": 4, "head_dim": 128, "moe_intermediate_size": 768, "num_experts": 128,
    "num_experts_per_tok": 8, "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": [],
    "use_sliding_window": False, "sliding_window": None, "max_window_layers": 48, "attention_bias": False,
    "rope_theta": 1000000.0, "rms_norm_eps": 1e-6, "tie_word_embeddings": False, "hidden_act": "silu",
    "eos_token_id": 151645,
}


def test_a_published_qwen3_moe_config():
    args = parse_config(QWEN3_MOE_HUB, resolve_architecture(QWEN3_MOE_HUB))
    assert args.qk_norm and not args.qkv_bias and not args.o_bias
    assert (args.head_dim, args.num_heads, args.num_kv_heads) == (128, 32, 4)  # head_dim != hidden / heads
    assert (args.num_experts, args.num_experts_per_tok, args.moe_intermediate_size) == (128, 8, 768)
    assert args.norm_topk_prob and args.shared_expert_intermediate_size == 0
    assert args.moe_layers == [True] * 48 and args.sliding_windows == [None] * 48
    assert args.eos_token_ids == [151645]


def test_transformers_5_alias_and_dense_layers_between_sparse_ones():
    cfg = {**QWEN3_MOE_HUB, "num_local_experts": 16, "mlp_only_layers": [0, 5], "decoder_sparse_step": 2,
           "num_hidden_layers": 6}
    del cfg["num_experts"]
    args = parse_config(cfg, "Qwen3MoeForCausalLM")
    assert args.num_experts == 16
    assert args.moe_layers == [False, True, False, True, False, False]


def test_dense_qwen3_with_sliding_window_layers():
    cfg = {**QWEN3_MOE_HUB, "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "num_hidden_layers": 4,
           "use_sliding_window": True, "sliding_window": 4096, "max_window_layers": 2, "attention_bias": True}
    for key in ("num_experts", "num_experts_per_tok", "moe_intermediate_size"):
        del cfg[key]
    args = parse_config(cfg, resolve_architecture(cfg))
    assert args.qk_norm and not args.is_moe and args.moe_layers == [False] * 4
    assert args.qkv_bias and args.o_bias  # Qwen3's attention_bias covers the output projection too
    assert args.sliding_windows == [None, None, 4096, 4096]


def test_a_moe_config_without_its_expert_count_is_refused_by_name():
    cfg = dict(QWEN3_MOE_HUB)
    del cfg["num_experts"]
    with pytest.raises(ModelLoadError, match="num_experts"):
        parse_config(cfg, "Qwen3MoeForCausalLM")


PHI4_HUB = {
    "architectures": ["Phi3ForCausalLM"], "model_type": "phi3", "vocab_size": 100352, "hidden_size": 5120,
    "intermediate_size": 17920, "num_hidden_layers": 40, "num_attention_heads": 40, "num_key_value_heads": 10,
    "max_position_embeddings": 16384, "rope_theta": 250000, "rope_scaling": None, "sliding_window": None,
    "rms_norm_eps": 1e-5, "hidden_act": "silu", "tie_word_embeddings": False, "eos_token_id": 100265,
}


def test_phi4_and_the_phi_variants():
    args = parse_config(PHI4_HUB, resolve_architecture(PHI4_HUB))
    assert (args.head_dim, args.num_kv_heads, args.rope_theta) == (128, 10, 250000.0)
    assert args.sliding_windows == [None] * 40 and not args.qkv_bias and not args.qk_norm
    assert args.rotary_dim == 128
    windowed = parse_config({**PHI4_HUB, "sliding_window": 2047}, "Phi3ForCausalLM")  # Phi-3-mini
    assert windowed.sliding_windows == [2047] * 40


def test_longrope_configs_as_the_phi_models_ship_them():
    """Phi-3-mini-128k: rope_scaling type longrope, the original length at the top of config.json;
    Phi-3's config class reads the older 'su' and 'yarn' as longrope and defaults the original
    length to 4096. Factor lists of the wrong length, and an original length of 1 without an
    explicit attention factor, are refused by name."""
    factors = {"short_factor": [1.0] * 64, "long_factor": [2.0] * 64}
    mini = {**PHI4_HUB, "max_position_embeddings": 131072, "original_max_position_embeddings": 4096,
            "rope_scaling": {"type": "longrope", **factors}}
    args = parse_config(mini, "Phi3ForCausalLM")
    assert args.rope_scaling["rope_type"] == "longrope"
    assert args.rope_scaling["original_max_position_embeddings"] == 4096
    for old in ("su", "yarn"):
        older = {**PHI4_HUB, "max_position_embeddings": 131072, "rope_scaling": {"type": old, **factors}}
        args = parse_config(older, "Phi3ForCausalLM")
        assert args.rope_scaling["rope_type"] == "longrope"
        assert args.rope_scaling["original_max_position_embeddings"] == 4096
    partial = {**mini, "partial_rotary_factor": 0.75}  # Phi-4-mini: a factor per rotated frequency, 48 of them
    with pytest.raises(ModelLoadError, match="rope_scaling.short_factor: a list of 48 numbers"):
        parse_config(partial, "Phi3ForCausalLM")
    with pytest.raises(ModelLoadError, match="original_max_position_embeddings 1"):
        parse_config({**mini, "original_max_position_embeddings": 1}, "Phi3ForCausalLM")


def test_partial_rotary_factor_where_transformers_reads_it():
    """Phi-4-mini ships partial_rotary_factor at the top of config.json; transformers 5 saves it
    in rope_parameters (which wins over the top level). Model types whose transformers code
    rotates whole heads, and a rotated part of odd width, are refused by name."""
    mini = parse_config({**PHI4_HUB, "hidden_size": 3072, "num_attention_heads": 24, "num_key_value_heads": 8,
                         "partial_rotary_factor": 0.75}, "Phi3ForCausalLM")
    assert (mini.head_dim, mini.rotary_dim, mini.partial_rotary_factor) == (128, 96, 0.75)
    saved = {**PHI4_HUB, "partial_rotary_factor": 0.25,
             "rope_parameters": {"rope_type": "default", "rope_theta": 250000.0, "partial_rotary_factor": 0.5}}
    assert parse_config(saved, "Phi3ForCausalLM").rotary_dim == 64
    with pytest.raises(ModelLoadError, match="partial_rotary_factor 0.5 is not supported for model type 'qwen3_moe'"):
        parse_config({**QWEN3_MOE_HUB, "partial_rotary_factor": 0.5}, "Qwen3MoeForCausalLM")
    with pytest.raises(ModelLoadError, match="rotates 45 dims"):
        parse_config({**PHI4_HUB, "partial_rotary_factor": 45 / 128}, "Phi3ForCausalLM")


def test_partial_rotary_tables_equal_transformers():
    """cos/sin over the rotated dims only (bit for bit), and the rotation of those dims,
    against Phi-3's rotary embedding and apply_rotary_pos_emb in transformers."""
    from transformers import Phi3Config
    from transformers.models.phi3.modeling_phi3 import Phi3RotaryEmbedding, apply_rotary_pos_emb

    from tierlm.models.layers import RotaryEmbedding
    hf_cfg = Phi3Config(hidden_size=256, num_attention_heads=8, num_key_value_heads=2, partial_rotary_factor=0.75,
                        max_position_embeddings=64)
    args = parse_config(hf_cfg.to_dict() | {"architectures": ["Phi3ForCausalLM"]}, "Phi3ForCausalLM")
    assert args.rotary_dim == 24
    positions = torch.arange(40)
    cos, sin = Phi3RotaryEmbedding(hf_cfg)(torch.zeros(1), positions[None])
    q, k = torch.randn(1, 8, 40, 32), torch.randn(1, 2, 40, 32)
    want_q, want_k = apply_rotary_pos_emb(q, k, cos, sin)
    rope = RotaryEmbedding(args, 64)
    qk = torch.cat((q[0], k[0])).transpose(0, 1)  # [T, Hq + Hkv, D], as the fused projection lays them out
    cos_ours, sin_ours = rope.tables(positions, torch.float32)
    assert torch.equal(cos_ours[:, 0], cos[0]) and torch.equal(sin_ours[:, 0, 12:], sin[0, :, 12:])
    got = RotaryEmbedding.rotate((cos_ours, sin_ours), qk).transpose(0, 1)
    want = torch.cat((want_q[0], want_k[0]))
    assert torch.equal(got[..., 24:], want[..., 24:])  # passed through untouched
    assert (got - want).abs().max().item() < 1e-6  # (one fused multiply-add: an ulp's rounding)


@pytest.mark.parametrize("scaling", [
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768},  # Qwen2.5/Qwen3 model cards
    {"rope_type": "yarn", "factor": 40.0, "original_max_position_embeddings": 4096, "mscale": 1.0,
     "mscale_all_dim": 0.707, "beta_fast": 32, "beta_slow": 1},
    {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 2048, "attention_factor": 1.3,
     "truncate": False},
    {"rope_type": "yarn", "factor": None, "original_max_position_embeddings": 16384},  # factor from the lengths
])
def test_yarn_frequencies_and_scale_equal_transformers(scaling):
    """The YaRN frequencies and cos/sin scale, bit for bit against transformers' own, for the
    variants checkpoints publish."""
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from tierlm.models.layers import rope_inv_freq
    hf = LlamaConfig(hidden_size=1024, num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=131072,
                     rope_theta=1000000.0, rope_scaling=dict(scaling))
    want_inv, want_scale = ROPE_INIT_FUNCTIONS["yarn"](hf, "cpu")
    cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 100, "hidden_size": 1024,
           "num_attention_heads": 8, "num_key_value_heads": 2, "num_hidden_layers": 2, "max_position_embeddings": 131072,
           "rope_theta": 1000000.0, "rope_scaling": dict(scaling)}
    inv, scale = rope_inv_freq(parse_config(cfg, "LlamaForCausalLM"))
    assert torch.equal(inv, want_inv.float()) and scale == pytest.approx(want_scale, rel=0, abs=0)


def test_granite_scalars_and_mlp_biases_refused_by_name():
    cfg = {"architectures": ["GraniteForCausalLM"], "model_type": "granite", "vocab_size": 49155, "hidden_size": 2048,
           "intermediate_size": 8192, "num_hidden_layers": 40, "num_attention_heads": 32, "num_key_value_heads": 8,
           "embedding_multiplier": 12.0, "residual_multiplier": 0.22, "attention_multiplier": 0.015625,
           "logits_scaling": 8.0, "rope_theta": 10000000.0, "tie_word_embeddings": True}  # Granite-3.x-2B
    args = parse_config(cfg, resolve_architecture(cfg))
    assert (args.embedding_multiplier, args.residual_multiplier, args.attention_multiplier, args.logits_scaling) == \
        (12.0, 0.22, 0.015625, 8.0)
    plain = parse_config({**QWEN3_MOE_HUB}, "Qwen3MoeForCausalLM")  # everyone else: no scalars
    assert (plain.embedding_multiplier, plain.residual_multiplier, plain.attention_multiplier, plain.logits_scaling) \
        == (1.0, 1.0, None, 1.0)
    with pytest.raises(ModelLoadError, match="mlp_bias"):
        parse_config({**cfg, "mlp_bias": True}, "GraniteForCausalLM")


GEMMA3_1B_HUB = {
    "architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text", "vocab_size": 262144, "hidden_size": 1152,
    "intermediate_size": 6912, "num_hidden_layers": 26, "num_attention_heads": 4, "num_key_value_heads": 1,
    "head_dim": 256, "hidden_activation": "gelu_pytorch_tanh", "query_pre_attn_scalar": 256, "rope_theta": 1000000,
    "rope_local_base_freq": 10000, "rope_scaling": None, "sliding_window": 512, "sliding_window_pattern": 6,
    "final_logit_softcapping": None, "attn_logit_softcapping": None, "max_position_embeddings": 32768,
    "rms_norm_eps": 1e-6, "eos_token_id": [1, 106],
}


def test_a_published_gemma3_text_config():
    args = parse_config(GEMMA3_1B_HUB, resolve_architecture(GEMMA3_1B_HUB))
    assert args.gemma_norms and args.sandwich_norms and args.qk_norm and args.tie_word_embeddings
    assert args.hidden_act == "gelu_pytorch_tanh" and args.attention_multiplier == 256 ** -0.5
    assert args.embedding_multiplier == 1152 ** 0.5 and args.embedding_multiplier_in_dtype
    assert (args.rope_theta, args.local_rope_theta, args.rope_scaling) == (1000000.0, 10000.0, None)
    assert args.sliding_windows == [None if (i + 1) % 6 == 0 else 512 for i in range(26)]  # every 6th layer is global
    scaled = parse_config({**GEMMA3_1B_HUB, "rope_scaling": {"rope_type": "linear", "factor": 8.0}}, "Gemma3ForCausalLM")
    assert scaled.rope_scaling["factor"] == 8.0 and scaled.local_rope_theta == 10000.0  # 4B+: global layers scaled
    with pytest.raises(ModelLoadError, match="attn_logit_softcapping"):
        parse_config({**GEMMA3_1B_HUB, "attn_logit_softcapping": 50.0}, "Gemma3ForCausalLM")


def test_a_published_multimodal_gemma3_config_serves_its_language_model():
    """Gemma 3 4B's config.json: the language model under text_config, eos at the top level."""
    text = {k: v for k, v in GEMMA3_1B_HUB.items() if k not in ("architectures", "eos_token_id")}
    text.update(hidden_size=2560, num_attention_heads=8, num_key_value_heads=4, num_hidden_layers=34,
                rope_scaling={"rope_type": "linear", "factor": 8.0})
    cfg = {"architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3", "text_config": text,
           "vision_config": {"model_type": "siglip_vision_model"}, "eos_token_id": [1, 106], "mm_tokens_per_image": 256}
    args = parse_config(cfg, resolve_architecture(cfg))
    assert args.model_type == "gemma3_text" and args.architecture == "Gemma3ForConditionalGeneration"
    assert (args.hidden_size, args.num_layers, args.eos_token_ids) == (2560, 34, [1, 106])
    assert args.rope_scaling["factor"] == 8.0 and args.local_rope_theta == 10000.0 and args.tie_word_embeddings


def test_a_published_mistral_small_3_1_config_serves_its_language_model():
    text = {"model_type": "mistral", "vocab_size": 131072, "hidden_size": 5120, "intermediate_size": 32768,
            "num_hidden_layers": 40, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
            "rope_theta": 1000000000.0, "sliding_window": None, "max_position_embeddings": 131072,
            "rms_norm_eps": 1e-5, "hidden_act": "silu"}
    cfg = {"architectures": ["Mistral3ForConditionalGeneration"], "model_type": "mistral3", "text_config": text,
           "vision_config": {"model_type": "pixtral"}, "image_token_index": 10, "tie_word_embeddings": False}
    args = parse_config(cfg, resolve_architecture(cfg))
    assert args.model_type == "mistral" and (args.head_dim, args.num_kv_heads, args.num_layers) == (128, 8, 40)
    assert args.rope_theta == 1e9 and args.sliding_windows == [None] * 40 and not args.tie_word_embeddings


def test_a_ministral_3_config_scales_queries_and_a_beta_without_its_length_is_refused():
    """Ministral 3's text config (transformers' defaults: YaRN over 16,384 positions, beta 0.1):
    the beta and its length reach ModelArgs; a beta with no original length to divide by is
    refused at load (transformers fails on it at the first forward)."""
    rope = {"rope_type": "yarn", "rope_theta": 1e6, "factor": 16.0, "original_max_position_embeddings": 16384,
            "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0, "llama_4_scaling_beta": 0.1}
    text = {"model_type": "ministral3", "vocab_size": 131072, "hidden_size": 3072, "intermediate_size": 9216,
            "num_hidden_layers": 26, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
            "max_position_embeddings": 262144, "rope_parameters": rope}
    cfg = {"architectures": ["Mistral3ForConditionalGeneration"], "model_type": "mistral3", "text_config": text}
    args = parse_config(cfg, resolve_architecture(cfg))
    assert (args.query_scale_beta, args.query_scale_original) == (0.1, 16384)
    assert args.sliding_windows == [None] * 26
    windowed = parse_config({**cfg, "text_config": {**text, "sliding_window": 4096}}, "Mistral3ForConditionalGeneration")
    assert windowed.sliding_windows == [4096] * 26  # every layer, as transformers' mask does
    plain = {k: v for k, v in rope.items() if k != "original_max_position_embeddings"}
    plain["rope_type"] = "default"
    with pytest.raises(ModelLoadError, match="llama_4_scaling_beta 0.1 needs rope_parameters.original_max_pos"):
        parse_config({**cfg, "text_config": {**text, "rope_parameters": plain}}, "Mistral3ForConditionalGeneration")


def test_smollm3_nope_layers_and_ministral_layer_windows():
    smol = {"architectures": ["SmolLM3ForCausalLM"], "model_type": "smollm3", "vocab_size": 128256, "hidden_size": 2048,
            "intermediate_size": 11008, "num_hidden_layers": 8, "num_attention_heads": 16, "num_key_value_heads": 4,
            "rope_theta": 5000000.0, "use_sliding_window": False, "sliding_window": None, "no_rope_layer_interval": 4}
    args = parse_config(smol, resolve_architecture(smol))  # no_rope_layers left out: every 4th layer is NoPE
    assert args.rope_layers == [True, True, True, False] * 2 and args.sliding_windows == [None] * 8
    listed = parse_config({**smol, "no_rope_layers": [1, 0, 1, 1, 1, 1, 0, 1]}, "SmolLM3ForCausalLM")
    assert listed.rope_layers == [True, False, True, True, True, True, False, True]
    ministral = {**smol, "architectures": ["MinistralForCausalLM"], "model_type": "ministral", "sliding_window": 32768,
                 "layer_types": ["full_attention", "sliding_attention"] * 4}
    del ministral["no_rope_layer_interval"]
    args = parse_config(ministral, resolve_architecture(ministral))
    assert args.sliding_windows == [None, 32768] * 4 and args.rope_layers == []


@pytest.mark.parametrize("extra", [{}, {"no_rope_layers": [1, 0, 1, 1, 0, 1, 1, 1]}, {"no_rope_layer_interval": 3}])
def test_smollm3_without_layer_types_windows_the_layers_transformers_does(extra):
    """transformers fills in a SmolLM3 config's missing `layer_types`: with `use_sliding_window`
    on, the layers without RoPE are sliding. tierlm read all-full, so such a checkpoint ran with
    no window at all (wrong output past the window; a long-context tester's find)."""
    smol = {"architectures": ["SmolLM3ForCausalLM"], "model_type": "smollm3", **SMALL, "num_hidden_layers": 8,
            "use_sliding_window": True, "sliding_window": 8, **extra}
    hf = _hf_config(smol)
    want = [8 if t == "sliding_attention" else None for t in hf.layer_types]
    assert 8 in want and None in want  # the case is one that windows some layers, not all
    args = parse_config(smol, resolve_architecture(smol))
    assert args.sliding_windows == want
    assert args.rope_layers == [bool(f) for f in hf.no_rope_layers]


def _hf_config(cfg: dict):
    from transformers import CONFIG_MAPPING
    return CONFIG_MAPPING[cfg["model_type"]](**{k: v for k, v in cfg.items() if k != "model_type"})


def _hf_theta(hf) -> float:
    params = getattr(hf, "rope_parameters", None)
    return float(params["rope_theta"] if isinstance(params, dict) and "rope_theta" in params else hf.rope_theta)


SMALL = {"vocab_size": 100, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2}


# (architecture, model_type, field left out, tierlm's value, transformers' value): each field's
# default differs between model types, so tierlm must take transformers' own.
@pytest.mark.parametrize("arch,model_type,field,ours,theirs", [
    ("GraniteForCausalLM", "granite", "attention_multiplier",
     lambda a: a.attention_multiplier, lambda h: h.attention_multiplier),
    ("Phi3ForCausalLM", "phi3", "rms_norm_eps", lambda a: a.rms_norm_eps, lambda h: h.rms_norm_eps),
    ("MixtralForCausalLM", "mixtral", "rms_norm_eps", lambda a: a.rms_norm_eps, lambda h: h.rms_norm_eps),
    ("SmolLM3ForCausalLM", "smollm3", "tie_word_embeddings",
     lambda a: a.tie_word_embeddings, lambda h: h.tie_word_embeddings),
    ("Gemma3ForCausalLM", "gemma3_text", "head_dim", lambda a: a.head_dim, lambda h: h.head_dim),
    ("Qwen3ForCausalLM", "qwen3", "head_dim", lambda a: a.head_dim, lambda h: h.head_dim),
    ("SmolLM3ForCausalLM", "smollm3", "rope_theta", lambda a: a.rope_theta, _hf_theta),
    ("MixtralForCausalLM", "mixtral", "rope_theta", lambda a: a.rope_theta, _hf_theta),
    ("MistralForCausalLM", "mistral", "sliding_window", lambda a: a.sliding_windows[0], lambda h: h.sliding_window),
])
def test_a_field_left_out_of_config_json_takes_transformers_default(arch, model_type, field, ours, theirs):
    cfg = {**SMALL, "architectures": [arch], "model_type": model_type}
    if model_type == "mixtral":
        cfg.update(num_local_experts=4, num_experts_per_tok=2)
    hf = _hf_config(cfg)
    assert field not in cfg
    assert ours(parse_config(cfg, arch)) == pytest.approx(theirs(hf))


def test_qwen2_moe_without_qkv_biases():
    """transformers 5's qkv_bias=False leaves Qwen2-MoE's q/k/v without biases (a checkpoint then
    has none; tierlm used to ask for them, calling the weights incomplete)."""
    cfg = {**SMALL, "architectures": ["Qwen2MoeForCausalLM"], "model_type": "qwen2_moe", "num_experts": 4,
           "num_experts_per_tok": 2, "moe_intermediate_size": 32}
    assert parse_config(cfg, "Qwen2MoeForCausalLM").qkv_bias  # the default: biases, as ever
    assert not parse_config({**cfg, "qkv_bias": False}, "Qwen2MoeForCausalLM").qkv_bias
    assert parse_config({**cfg, "model_type": "qwen2", "qkv_bias": False}, "Qwen2ForCausalLM").qkv_bias  # dense: always
