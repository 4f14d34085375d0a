"""Model hyper-parameters read from a Hugging Face `config.json`, in one flat dataclass.

Transformers 4.x and 5.x spell some fields differently (`rope_scaling` vs `rope_parameters`);
this is the one place that knows both, so model code never looks at raw config dicts.
"""
from __future__ import annotations

import functools
import inspect
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tierlm.errors import ModelLoadError


@dataclass
class ModelArgs:
    architecture: str
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    # RoPE over the first int(head_dim * factor) dims of each query and key head, the rest passed
    # through (Phi-4-mini: 0.75); 1 rotates whole heads.
    partial_rotary_factor: float = 1.0
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    qk_norm: bool = False  # RMSNorm over each query and key head before RoPE (Qwen3)
    # Granite's scalars (1 and None elsewhere): embeddings, residual branches, attention scale,
    # and the divisor of the logits.
    embedding_multiplier: float = 1.0
    residual_multiplier: float = 1.0
    attention_multiplier: float | None = None
    logits_scaling: float = 1.0
    # Gemma 3: (1 + w) norms in float32, norms around both attention and MLP outputs, sliding
    # layers on their own RoPE base, embeddings scaled by sqrt(hidden) rounded to the weights' dtype.
    gemma_norms: bool = False
    sandwich_norms: bool = False
    local_rope_theta: float | None = None
    embedding_multiplier_in_dtype: bool = False
    hidden_act: str = "silu"
    # Per-layer sliding window (None = full attention on that layer).
    sliding_windows: list[int | None] = field(default_factory=list)
    # Per-layer: whether the layer rotates queries and keys (SmolLM3 leaves out every 4th: NoPE).
    rope_layers: list[bool] = field(default_factory=list)
    # Sparse MoE (num_experts == 0 means dense).
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0
    norm_topk_prob: bool = True
    moe_layers: list[bool] = field(default_factory=list)
    shared_expert_gated: bool = True  # Qwen2-MoE's sigmoid gate on its shared expert (GLM-4.5 has none)
    # GLM-4.5: a sigmoid router in float32 whose scores plus a learned correction bias choose the
    # experts (the best `topk_group` of `n_group` groups first, each scored by its top two), the
    # uncorrected scores of those weighting them, times routed_scaling_factor. 0 groups: softmax.
    router_groups: int = 0
    router_topk_groups: int = 0
    routed_scaling_factor: float = 1.0
    # Ministral 3 (rope_parameters.llama_4_scaling_beta): after RoPE, queries are scaled by
    # 1 + beta * log(1 + floor(position / original)); 0 everywhere else.
    query_scale_beta: float = 0.0
    query_scale_original: int = 0
    # GPT-OSS: a learned logit per query head that joins every softmax over keys and takes its
    # share of the attention without a value (an attention sink); its router picks the top-k
    # logits and softmaxes those; its experts have biases and a clamped SwiGLU,
    # (up + 1) * gate * sigmoid(alpha * gate), gate and up interleaved in the checkpoint; its
    # norms multiply by the weight in float32 before rounding.
    attention_sinks: bool = False
    router_topk_then_softmax: bool = False
    moe_bias: bool = False  # biases on the router and on every expert projection
    swiglu_alpha: float = 0.0
    swiglu_limit: float | None = None
    norm_weight_in_fp32: bool = False
    # OLMo 2 and 3: norms only after attention and after the MLP (none before either), and
    # q/k norms over each projection's whole width (all heads at once), not per head.
    post_norms_only: bool = False
    qk_norm_whole: bool = False
    torch_dtype: str | None = None
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def rotary_dim(self) -> int:
        """How many leading dims of each head RoPE rotates (transformers' int(head_dim * factor))."""
        return int(self.head_dim * self.partial_rotary_factor)


def _eos_list(value: Any) -> list[int]:
    if value is None:
        return []
    if isinstance(value, int):
        return [value]
    return [int(v) for v in value]


def _rope(cfg: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    params = cfg.get("rope_parameters")
    if isinstance(params, dict):
        theta = float(params.get("rope_theta", cfg.get("rope_theta", 10000.0)))
        rtype = params.get("rope_type", params.get("type", "default"))
        scaling = None if rtype == "default" else {**params, "rope_type": rtype}
        return theta, scaling
    scaling = cfg.get("rope_scaling")
    if scaling:
        scaling = {**scaling, "rope_type": scaling.get("rope_type", scaling.get("type", "default"))}
        if scaling["rope_type"] == "default":
            scaling = None
    return float(cfg.get("rope_theta", 10000.0)), scaling


def _global_rope(cfg: dict[str, Any], theta: float) -> dict[str, Any]:
    """The full-attention layers' RoPE as a plain config, for models with one set of RoPE
    parameters per layer type in transformers 5 (Gemma 3, OLMo 3); hub configs have rope_theta
    and rope_scaling at the top, which are the full layers' (`theta`: the type's default base)."""
    params = cfg.get("rope_parameters")
    if isinstance(params, dict) and isinstance(params.get("full_attention"), dict):
        return {"rope_parameters": {"rope_theta": theta, **params["full_attention"]}}
    return {"rope_theta": cfg.get("rope_theta", theta), "rope_scaling": cfg.get("rope_scaling")}


def _local_theta(cfg: dict[str, Any], default: float) -> float:
    """The sliding layers' RoPE base (unscaled in Gemma 3 and OLMo 3: scaling there is refused);
    `default` where config.json has no per-type parameters."""
    params = cfg.get("rope_parameters")
    if isinstance(params, dict) and isinstance(params.get("sliding_attention"), dict):
        local = params["sliding_attention"]
        if local.get("rope_type", "default") != "default":
            raise ModelLoadError(f"scaled RoPE on sliding layers ({local['rope_type']}) is not supported")
        return float(local.get("rope_theta", default))
    return default


# Multimodal checkpoints whose language model tierlm serves (text only), and that model's type.
MULTIMODAL_TEXT_MODELS = {"Gemma3ForConditionalGeneration": "gemma3_text", "Mistral3ForConditionalGeneration": "mistral"}


def text_model_config(cfg: dict[str, Any], architecture: str) -> dict[str, Any]:
    """A multimodal checkpoint's language model as a text model's config (Gemma 3 4B and up,
    Mistral Small 3.1 and up keep it under text_config; tierlm loads no vision weights)."""
    if architecture not in MULTIMODAL_TEXT_MODELS:
        return cfg
    text = dict(cfg.get("text_config") or {})
    for key in ("eos_token_id", "bos_token_id", "dtype", "torch_dtype"):
        if text.get(key) is None and cfg.get(key) is not None:
            text[key] = cfg[key]
    if cfg.get("tie_word_embeddings") is not None:  # the wrapper's setting is the one transformers applies
        text["tie_word_embeddings"] = cfg["tie_word_embeddings"]
    return {**text, "model_type": text.get("model_type") or MULTIMODAL_TEXT_MODELS[architecture],
            "architectures": [architecture]}


# Fields a config.json may leave out, which transformers then takes from its config class's
# defaults: those differ by model type (Phi-3's rms_norm_eps is 1e-5, Granite's attention
# multiplier 1.0, Gemma 3's head_dim 256, SmolLM3 ties its embeddings), so a default of tierlm's
# own would compute another model than transformers does on the same checkpoint.
_DEFAULTED = frozenset({
    "rms_norm_eps", "tie_word_embeddings", "head_dim", "intermediate_size", "num_key_value_heads",
    "max_position_embeddings", "hidden_act", "hidden_activation", "attention_bias", "qkv_bias",
    "rope_theta", "sliding_window", "use_sliding_window", "max_window_layers", "sliding_window_pattern",
    "rope_local_base_freq", "query_pre_attn_scalar", "embedding_multiplier", "residual_multiplier",
    "attention_multiplier", "logits_scaling", "no_rope_layer_interval", "norm_topk_prob",
    "decoder_sparse_step", "shared_expert_intermediate_size", "moe_intermediate_size",
    "num_experts_per_tok", "swiglu_alpha", "swiglu_limit", "original_max_position_embeddings", "use_qk_norm",
    "n_shared_experts", "n_group", "topk_group", "routed_scaling_factor", "first_k_dense_replace"})  # not the expert count: one that is missing is refused by name


@functools.cache
def hf_defaults(model_type: str) -> dict[str, Any]:
    """transformers' defaults for `model_type`'s fields in `_DEFAULTED` (empty if it does not know the type)."""
    try:
        from transformers import CONFIG_MAPPING
        cls = CONFIG_MAPPING[model_type]
    except Exception:  # an older transformers without this model type: tierlm's own defaults
        return {}
    found = {k: p.default for k, p in inspect.signature(cls.__init__).parameters.items()
             if k in _DEFAULTED and p.default is not inspect.Parameter.empty and p.default is not None}
    theta = getattr(cls, "default_theta", None)  # transformers 5 keeps RoPE's base out of the signature
    if isinstance(theta, (int, float)) and not isinstance(theta, bool):
        found.setdefault("rope_theta", float(theta))
    return found


def _smollm3_rope_layers(cfg: dict, layers: int) -> list[bool]:
    """Which SmolLM3 layers use RoPE: `no_rope_layers` (despite the name, 1 = uses it), or by
    default all but every `no_rope_layer_interval`-th, as transformers fills it in."""
    interval = int(cfg.get("no_rope_layer_interval", 4))
    flags = cfg.get("no_rope_layers") or [int((i + 1) % interval != 0) for i in range(layers)]
    return [bool(f) for f in flags]


def _qwen_windows(cfg: dict[str, Any], model_type: str, layers: int) -> list[int | None]:
    """Each layer's sliding window, by transformers' rule for that Qwen type (they differ).

    All four window nothing unless use_sliding_window is set. Qwen2 and Qwen3 window the layers
    from max_window_layers on; Qwen2-MoE the even-numbered layers below max_window_layers; both
    follow layer_types when config.json has it. Qwen3-MoE windows every layer and ignores layer_types.
    """
    window = cfg.get("sliding_window")
    if not (cfg.get("use_sliding_window", False) and window):
        return [None] * layers
    if model_type == "qwen3_moe":
        return [int(window)] * layers
    types = cfg.get("layer_types")
    if not types:
        limit = int(cfg.get("max_window_layers", layers))
        if model_type == "qwen2_moe":
            types = ["sliding_attention" if i % 2 == 0 and i < limit else "full_attention" for i in range(layers)]
        else:
            types = ["sliding_attention" if i >= limit else "full_attention" for i in range(layers)]
    return [int(window) if t == "sliding_attention" else None for t in types]


def parse_config(cfg: dict[str, Any], architecture: str) -> ModelArgs:
    """Turn a HF config dict into ModelArgs for a known architecture."""
    cfg = text_model_config(cfg, architecture)
    cfg = {**hf_defaults(str(cfg.get("model_type", ""))), **cfg}  # an explicit null stays (Mistral's window)
    try:
        hidden = int(cfg["hidden_size"])
        heads = int(cfg["num_attention_heads"])
        layers = int(cfg["num_hidden_layers"])
        theta, scaling = _rope(cfg)
        head_dim = int(cfg.get("head_dim") or hidden // heads)
        model_type = cfg.get("model_type", "")
        window = cfg.get("sliding_window")
        if model_type == "gemma3_text":
            types = cfg.get("layer_types") or [
                "sliding_attention" if (i + 1) % int(cfg.get("sliding_window_pattern", 6)) else "full_attention"
                for i in range(layers)]
            windows = [int(window) if t == "sliding_attention" and window else None for t in types]
            theta, scaling = _rope(_global_rope(cfg, 1_000_000.0))
        elif model_type == "olmo3":  # three sliding layers, then a full one, unless layer_types says
            types = cfg.get("layer_types") or [
                "sliding_attention" if (i + 1) % 4 else "full_attention" for i in range(layers)]
            windows = [int(window) if t == "sliding_attention" and window else None for t in types]
            theta, scaling = _rope(_global_rope(cfg, theta))
        elif model_type in ("qwen2", "qwen2_moe", "qwen3", "qwen3_moe"):
            windows = _qwen_windows(cfg, model_type, layers)
        elif model_type in ("mistral", "ministral3", "mixtral", "phi3"):  # one window on every layer, or none
            windows = [int(window) if window else None] * layers
        elif model_type == "ministral":  # per layer, from layer_types (all sliding when there is a window)
            types = cfg.get("layer_types") or ["sliding_attention" if window else "full_attention"] * layers
            windows = [int(window) if t == "sliding_attention" and window else None for t in types]
        elif model_type == "gpt_oss":  # alternating sliding and full layers, by layer_types
            types = cfg.get("layer_types") or [
                "sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(layers)]
            windows = [int(window) if t == "sliding_attention" and window else None for t in types]
        elif model_type == "smollm3":
            use = cfg.get("use_sliding_window", False) and window
            # Without layer_types, transformers windows the layers that do not use RoPE.
            types = cfg.get("layer_types") or [
                "full_attention" if has_rope else "sliding_attention" for has_rope in _smollm3_rope_layers(cfg, layers)]
            windows = [int(window) if use and t == "sliding_attention" else None for t in types]
        else:
            windows = [None] * layers
        args = ModelArgs(
            architecture=architecture,
            model_type=model_type,
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(cfg.get("intermediate_size", 4 * hidden)),
            num_layers=layers,
            num_heads=heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=head_dim,
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=theta,
            rope_scaling=scaling,
            max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            # Qwen2's q/k/v always have biases; Qwen2-MoE's unless qkv_bias says not (transformers 5).
            qkv_bias=(bool(cfg.get("attention_bias", False)) or model_type == "qwen2"
                      or (model_type == "qwen2_moe" and bool(cfg.get("qkv_bias", True)))),
            o_bias=bool(cfg.get("attention_bias", False)) and model_type not in ("qwen2", "qwen2_moe", "glm4_moe"),
            qk_norm=(model_type in ("qwen3", "qwen3_moe", "gemma3_text")
                     or (model_type == "glm4_moe" and bool(cfg.get("use_qk_norm", False)))),
            hidden_act=cfg.get("hidden_act") or cfg.get("hidden_activation") or "silu",
            sliding_windows=windows,
            torch_dtype=cfg.get("dtype") or cfg.get("torch_dtype"),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=_eos_list(cfg.get("eos_token_id")),
        )
        if model_type == "smollm3":
            args.rope_layers = _smollm3_rope_layers(cfg, layers)
        if model_type == "gemma3_text":
            for field_ in ("final_logit_softcapping", "attn_logit_softcapping", "use_bidirectional_attention"):
                if cfg.get(field_):
                    raise ModelLoadError(f"{field_} is not supported ({architecture})")
            args.gemma_norms = args.sandwich_norms = args.embedding_multiplier_in_dtype = True
            args.embedding_multiplier = hidden ** 0.5
            args.attention_multiplier = float(cfg.get("query_pre_attn_scalar", head_dim)) ** -0.5
            args.local_rope_theta = _local_theta(cfg, float(cfg.get("rope_local_base_freq", 10_000.0)))
            args.tie_word_embeddings = bool(cfg.get("tie_word_embeddings", True))
        if model_type in ("olmo2", "olmo3"):
            args.post_norms_only = args.qk_norm_whole = args.norm_weight_in_fp32 = True
            if model_type == "olmo3" and any(windows):
                # Without per-type parameters transformers gives the top-level rope_theta to the
                # full layers and its class default to the sliding ones (equal in OLMo 3's releases).
                default = float(hf_defaults("olmo3").get("rope_theta", 500_000.0))
                args.local_rope_theta = _local_theta(cfg, default)
        if model_type == "granite":
            args.embedding_multiplier = float(cfg.get("embedding_multiplier", 1.0))
            args.residual_multiplier = float(cfg.get("residual_multiplier", 1.0))
            args.attention_multiplier = float(cfg.get("attention_multiplier", head_dim ** -0.5))
            args.logits_scaling = float(cfg.get("logits_scaling", 1.0))
        if model_type == "mixtral":
            args.num_experts = int(cfg["num_local_experts"])
            args.num_experts_per_tok = int(cfg["num_experts_per_tok"])
            args.moe_intermediate_size = args.intermediate_size
            args.norm_topk_prob = True
            args.moe_layers = [True] * layers
        elif model_type == "gpt_oss":
            args.num_experts = int(cfg["num_local_experts"])
            args.num_experts_per_tok = int(cfg["num_experts_per_tok"])
            args.moe_intermediate_size = args.intermediate_size
            args.moe_layers = [True] * layers
            args.o_bias = args.qkv_bias = bool(cfg.get("attention_bias", True))
            args.attention_sinks = args.router_topk_then_softmax = args.moe_bias = True
            args.norm_weight_in_fp32 = True
            args.swiglu_alpha = float(cfg.get("swiglu_alpha", 1.702))
            limit = cfg.get("swiglu_limit", 7.0)
            args.swiglu_limit = None if limit is None else float(limit)
        elif model_type == "glm4_moe":
            _glm4_moe(args, cfg)
        elif model_type in ("qwen2_moe", "qwen3_moe"):
            _routed_experts(args, cfg, "num_experts")
            args.shared_expert_intermediate_size = int(cfg.get("shared_expert_intermediate_size", 0))
            args.norm_topk_prob = bool(cfg.get("norm_topk_prob", False))
            step = int(cfg.get("decoder_sparse_step", 1))
            only = set(cfg.get("mlp_only_layers") or [])
            args.moe_layers = [(i not in only) and (i + 1) % step == 0 for i in range(layers)]
        else:
            args.moe_layers = [False] * layers
    except KeyError as e:
        raise ModelLoadError(f"config.json lacks required field {e} for {architecture}; "
                             "is it a complete Hugging Face config?") from None
    if cfg.get("mlp_bias"):
        raise ModelLoadError(f"mlp_bias is not supported ({architecture} with biases on its MLP projections)")
    _partial_rotary(args, cfg)
    if args.hidden_act not in ("silu", "swish", "gelu_pytorch_tanh"):
        raise ModelLoadError(f"hidden_act '{args.hidden_act}' is not supported (silu, gelu_pytorch_tanh)")
    if args.rope_scaling and model_type == "phi3" and args.rope_scaling["rope_type"] in ("su", "yarn"):
        args.rope_scaling["rope_type"] = "longrope"  # as Phi-3's config class reads these older names
    if args.rope_scaling and args.rope_scaling["rope_type"] not in ("linear", "llama3", "yarn", "longrope"):
        raise ModelLoadError(
            f"rope scaling type '{args.rope_scaling['rope_type']}' is not supported; "
            "supported: default, linear, llama3, yarn, longrope")
    if args.rope_scaling and args.rope_scaling["rope_type"] in ("llama3", "yarn", "longrope"):
        # As transformers reads it: a top-level original_max_position_embeddings wins (Phi-3's
        # config class defaults it to 4096), else the scaling's own, else max_position_embeddings.
        top = cfg.get("original_max_position_embeddings")
        if top is not None:
            args.rope_scaling["original_max_position_embeddings"] = top
        args.rope_scaling.setdefault("original_max_position_embeddings", args.max_position_embeddings)
    if args.rope_scaling and args.rope_scaling["rope_type"] == "longrope":
        _check_longrope(args)
    if args.model_type == "ministral3":
        _ministral3_query_scale(args, cfg)
    return args


# The model types whose transformers code rotates part of each head (the others rotate whole
# heads), and the factor each takes when config.json has none (GLM-4.5's config class sets 0.5).
PARTIAL_ROTARY_TYPES = {"phi3": 1.0, "glm4_moe": 0.5}


def _partial_rotary(args: ModelArgs, cfg: dict[str, Any]) -> None:
    """partial_rotary_factor where transformers 5 reads it: inside rope_parameters, else at the
    top level of config.json (as Phi-4-mini and GLM-4.5 ship it), else the type's default. Other
    model types than those that read it, and a rotated part that cannot be split into two
    halves, are refused by name."""
    params = cfg.get("rope_parameters") if isinstance(cfg.get("rope_parameters"), dict) else {}
    factor = params.get("partial_rotary_factor", cfg.get("partial_rotary_factor"))
    factor = float(PARTIAL_ROTARY_TYPES.get(args.model_type, 1.0) if factor is None else factor)
    if factor == 1.0:
        return
    if args.model_type not in PARTIAL_ROTARY_TYPES:
        raise ModelLoadError(f"partial_rotary_factor {factor} is not supported for model type '{args.model_type}' "
                             f"(tierlm rotates part of each head for {', '.join(PARTIAL_ROTARY_TYPES)} only)")
    args.partial_rotary_factor = factor
    if not 0 < factor < 1 or args.rotary_dim % 2:
        raise ModelLoadError(f"partial_rotary_factor {factor} of head_dim {args.head_dim} rotates {args.rotary_dim} "
                             "dims; RoPE needs a positive even number of them, at most head_dim")


def _routed_experts(args: ModelArgs, cfg: dict[str, Any], count_key: str) -> None:
    """The routed experts' count, top-k and width. Hub checkpoints name the count `count_key`
    (Qwen's num_experts, GLM's n_routed_experts); transformers 5 saves its alias
    num_local_experts. A missing count is refused by name (KeyError, named by parse_config)."""
    count = cfg.get(count_key, cfg.get("num_local_experts"))
    if count is None:
        raise KeyError(count_key)
    args.num_experts = int(count)
    args.num_experts_per_tok = int(cfg["num_experts_per_tok"])
    args.moe_intermediate_size = int(cfg["moe_intermediate_size"])


def _glm4_moe(args: ModelArgs, cfg: dict[str, Any]) -> None:
    """GLM-4.5's MoE as transformers' Glm4MoeConfig reads it: the first `first_k_dense_replace`
    layers dense, then routed experts (n_routed_experts; transformers 5 saves the same number
    as num_local_experts) beside n_shared_experts ungated shared experts, fused into one MLP of
    n_shared_experts x moe_intermediate_size."""
    _routed_experts(args, cfg, "n_routed_experts")
    args.shared_expert_intermediate_size = args.moe_intermediate_size * int(cfg.get("n_shared_experts", 1))
    args.shared_expert_gated = False
    args.norm_topk_prob = bool(cfg.get("norm_topk_prob", True))
    args.router_groups, args.router_topk_groups = int(cfg.get("n_group", 1)), int(cfg.get("topk_group", 1))
    args.routed_scaling_factor = float(cfg.get("routed_scaling_factor", 1.0))
    dense = int(cfg.get("first_k_dense_replace", 1))
    args.moe_layers = [i >= dense for i in range(args.num_layers)]
    groups, per = args.router_groups, args.num_experts // max(args.router_groups, 1)
    if groups < 1 or args.num_experts % groups or per < 2 or not 1 <= args.router_topk_groups <= groups:
        raise ModelLoadError(f"n_group {groups} and topk_group {args.router_topk_groups} do not split "
                             f"{args.num_experts} experts into equal groups of two or more and choose some of them")
    if args.router_topk_groups * per < args.num_experts_per_tok:
        raise ModelLoadError(f"topk_group {args.router_topk_groups} groups of {per} experts hold fewer than "
                             f"num_experts_per_tok {args.num_experts_per_tok}")


def _check_longrope(args: ModelArgs) -> None:
    """LongRoPE needs a factor per rotated frequency in each list (transformers only warns, then
    fails or broadcasts one number over all of them) and an original length to switch at."""
    sc, want = args.rope_scaling, args.rotary_dim // 2
    for key in ("short_factor", "long_factor"):
        factors = sc.get(key)
        if not isinstance(factors, list) or len(factors) != want or not all(
                isinstance(f, (int, float)) and not isinstance(f, bool) for f in factors):
            raise ModelLoadError(f"longrope needs rope_scaling.{key}: a list of {want} numbers (one per rotated "
                                 f"frequency of head_dim {args.head_dim}), got {str(factors)[:80]}")
    original = int(sc["original_max_position_embeddings"])
    if original < 1 or (original == 1 and sc.get("attention_factor") is None):
        raise ModelLoadError(f"longrope's original_max_position_embeddings {original} (the length its long factors "
                             "start at) must be 2 or more, or come with an explicit attention_factor (the default "
                             "one divides by its logarithm)")


def _ministral3_query_scale(args: ModelArgs, cfg: dict[str, Any]) -> None:
    """Ministral 3's long-context query scaling (transformers' get_llama_4_attn_scale), from the
    same rope_parameters transformers reads it from; a beta without the length it divides by is
    refused (transformers fails on it too)."""
    params = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    beta = float(params.get("llama_4_scaling_beta") or 0.0)
    if not beta:
        return
    original = (args.rope_scaling or {}).get("original_max_position_embeddings",
                                             params.get("original_max_position_embeddings"))
    if not original or int(original) < 1:
        raise ModelLoadError(f"rope_parameters.llama_4_scaling_beta {beta} needs "
                             "rope_parameters.original_max_position_embeddings (the length it scales queries "
                             "past); add it to config.json")
    args.query_scale_beta, args.query_scale_original = beta, int(original)


def load_config_dict(model_dir: Path) -> dict[str, Any]:
    path = model_dir / "config.json"
    if not path.is_file():
        raise ModelLoadError(f"{path} not found: a model directory needs a Hugging Face config.json")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ModelLoadError(f"{path} is not valid JSON ({e}); re-export the checkpoint") from None
