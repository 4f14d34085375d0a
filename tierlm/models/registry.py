"""Which Hugging Face architectures tierlm serves, and the module class for each."""
from __future__ import annotations

from tierlm.errors import ModelLoadError
from tierlm.models.llama import CausalLM

ARCHITECTURES: dict[str, type] = {
    "LlamaForCausalLM": CausalLM,
    "MistralForCausalLM": CausalLM,
    "MinistralForCausalLM": CausalLM,
    "Qwen2ForCausalLM": CausalLM,
    "MixtralForCausalLM": CausalLM,
    "Qwen2MoeForCausalLM": CausalLM,
    "Qwen3ForCausalLM": CausalLM,
    "Qwen3MoeForCausalLM": CausalLM,
    "Glm4MoeForCausalLM": CausalLM,  # GLM-4.5 and GLM-4.5-Air (grouped sigmoid router, half-rotary heads)
    "GptOssForCausalLM": CausalLM,  # gpt-oss-20b and -120b (attention sinks, biased clamped-SwiGLU experts)
    "Olmo2ForCausalLM": CausalLM,  # post-norms only, q/k norms over whole projections
    "Olmo3ForCausalLM": CausalLM,  # and three sliding layers to a full one
    "Phi3ForCausalLM": CausalLM,  # Phi-3 and Phi-4: checkpoints already hold fused qkv and gate+up
    "GraniteForCausalLM": CausalLM,
    "SmolLM3ForCausalLM": CausalLM,  # every 4th layer without RoPE
    "Gemma3ForCausalLM": CausalLM,  # Gemma 3 1B and 270M
    "Gemma3ForConditionalGeneration": CausalLM,  # Gemma 3 4B-27B: their language model, text only
    "Mistral3ForConditionalGeneration": CausalLM,  # Mistral Small 3.1+: likewise
}


def resolve_architecture(cfg: dict) -> str:
    archs = cfg.get("architectures") or []
    for a in archs:
        if a in ARCHITECTURES:
            return a
    raise ModelLoadError(
        f"unsupported model architecture {archs or '(none listed in config.json)'}; "
        f"tierlm supports: {', '.join(sorted(ARCHITECTURES))}")
