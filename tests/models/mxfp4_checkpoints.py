"""MXFP4 checkpoints as OpenAI ships gpt-oss's, made from a bf16 one: for tests that compare
tierlm with transformers loading the same files (`Mxfp4Config(dequantize=True)`).

`tiny_gpt_oss(path)` saves a random-weight GptOssForCausalLM; `mxfp4_checkpoint(bf16_dir,
out_dir)` rewrites a checkpoint's expert projections as MXFP4 blocks and scales;
`tierlm_tensors(model_dir, dtype)` is what tierlm's loader reads from one, by name.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from tierlm.models.config import load_config_dict
from tierlm.models.loader import _quantized_index, checkpoint_tensors, weight_files
from tierlm.models.quantized import FP4_VALUES, MXFP4_BLOCK, quantization_of

EXPERT_PROJECTIONS = (".mlp.experts.gate_up_proj", ".mlp.experts.down_proj")
# gpt-oss's own: attention, router, embeddings and lm_head stay bf16
MODULES_TO_NOT_CONVERT = ["model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]


def tiny_gpt_oss(path: Path, seed: int = 0, **config) -> Path:
    """A random-weight GptOssForCausalLM saved in bf16 at `path` (2 layers, 4 experts, 2 a token;
    `config` overrides GptOssConfig's fields)."""
    from transformers import GptOssConfig, GptOssForCausalLM
    fields = dict(vocab_size=128, hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, num_local_experts=4, num_experts_per_tok=2,
                  max_position_embeddings=256, sliding_window=16, layer_types=["sliding_attention", "full_attention"],
                  rope_scaling=None, tie_word_embeddings=False, pad_token_id=0, eos_token_id=1, bos_token_id=2)
    fields.update(config)
    torch.manual_seed(seed)
    model = GptOssForCausalLM(GptOssConfig(**fields)).to(torch.bfloat16)
    with torch.no_grad():  # the init's zero biases and sinks would leave those loads untested
        for name, p in model.named_parameters():
            if name.endswith(("_bias", ".bias", ".sinks")):
                p.normal_(0, 0.02)
    model.save_pretrained(path)
    return path


def quantize_mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(blocks, scales) of expert weights `w` [E, cols, rows] (transformers' dequantized layout),
    as gpt-oss stores them: blocks uint8 [E, rows, cols / 32, 16], two FP4 values a byte (low
    nibble first), scales uint8 [E, rows, cols / 32], each block's E8M0 exponent + 127, chosen so
    its largest magnitude fits FP4's 6. Each value rounds to the nearest FP4 value."""
    experts, cols, rows = w.shape
    x = w.float().transpose(1, 2).reshape(experts, rows, cols // MXFP4_BLOCK, MXFP4_BLOCK)
    amax = x.abs().amax(-1).clamp(min=2.0 ** -100)
    exp = torch.ceil(torch.log2(amax / 6.0)).clamp(-127, 127)
    lut = torch.tensor(FP4_VALUES[:8])
    codes = ((x / torch.exp2(exp)[..., None]).abs().unsqueeze(-1) - lut).abs().argmin(-1)
    codes = (codes + 8 * (x < 0)).to(torch.uint8)  # sign bit
    blocks = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return blocks.contiguous(), (exp + 127).to(torch.uint8)


def mxfp4_checkpoint(bf16_dir: Path, out_dir: Path, shards: bool = False, random_bytes: bool = False,
                     seed: int = 0) -> Path:
    """A copy of checkpoint `bf16_dir` at `out_dir` with its MoE experts' `gate_up_proj` and
    `down_proj` stored as gpt-oss's MXFP4 (`X_blocks`, `X_scales`), `quantization_config` in
    config.json; everything else as it was. The blocks and scales quantize the bf16 weights
    (`random_bytes`: random blocks, scales near 2^-7, values that no quantizer would round to).
    `shards`: blocks in one file, scales and the rest in another (an index names both)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    for f in bf16_dir.iterdir():
        if f.is_file() and not f.name.startswith("model") and f.suffix != ".safetensors":
            shutil.copy(f, out_dir / f.name)
    tensors: dict[str, torch.Tensor] = {}
    for f in weight_files(bf16_dir):
        tensors.update(load_file(f))
    gen = torch.Generator().manual_seed(seed)
    blocks, rest = {}, {}
    for name, t in tensors.items():
        if not name.endswith(EXPERT_PROJECTIONS):
            rest[name] = t
            continue
        if random_bytes:
            experts, cols, rows = t.shape
            b = torch.randint(0, 256, (experts, rows, cols // MXFP4_BLOCK, MXFP4_BLOCK // 2), generator=gen,
                              dtype=torch.uint8)
            s = torch.randint(118, 124, b.shape[:-1], generator=gen, dtype=torch.uint8)
        else:
            b, s = quantize_mxfp4(t)
        blocks[name + "_blocks"], rest[name + "_scales"] = b, s
    files = {"model-00001-of-00002.safetensors": blocks, "model-00002-of-00002.safetensors": rest} if shards \
        else {"model.safetensors": {**rest, **blocks}}
    for file, part in files.items():
        save_file(part, out_dir / file, metadata={"format": "pt"})
    if shards:
        index = {"metadata": {}, "weight_map": {n: f for f, part in files.items() for n in part}}
        (out_dir / "model.safetensors.index.json").write_text(json.dumps(index))
    cfg = json.loads((out_dir / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": MODULES_TO_NOT_CONVERT}
    (out_dir / "config.json").write_text(json.dumps(cfg, indent=2))
    return out_dir


def tierlm_tensors(model_dir: Path, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Every weight tierlm's loader reads from `model_dir`, by transformers' parameter name,
    dequantized to `dtype` (what load_model copies into the model)."""
    quant = quantization_of(load_config_dict(model_dir), str(model_dir))
    files = weight_files(model_dir)
    parts = _quantized_index(files, quant, dtype)[0] if quant is not None else {}
    return {name: t for name, t, _ in checkpoint_tensors(files, quant, parts, dtype)}
