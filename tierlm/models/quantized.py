"""Quantized checkpoints: which ones load, and their weights dequantized at load.

FP8 checkpoints (`quant_method: fp8`, as Qwen3-*-FP8 and DeepSeek ship them) store each linear
layer's weight in float8 with a float32 `weight_scale_inv` per block of `weight_block_size`
(rows x columns; one scale for the whole tensor where the grid is 1 x 1). tierlm multiplies
them back to the checkpoint's dtype as it loads, as transformers does where it has no FP8
kernels (`dequantize`): the same weights, so the same tokens; memory and speed are the
unquantized model's (no FP8 GEMMs). Activation scales (`input_scale`, `activation_scheme:
static`) are for FP8 activations, which a dequantized model does not use: skipped, as
transformers skips them. Other methods (GPTQ, AWQ, bitsandbytes, ...) pack integers that
would load as garbage: refused by name rather than read as if they were weights.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from tierlm.errors import ModelLoadError

SCALE_SUFFIX = "_scale_inv"  # `X.weight` -> its scales `X.weight_scale_inv`
_SKIPPED_SUFFIXES = (".input_scale", ".activation_scale")
_FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


@dataclass(frozen=True)
class Fp8Weights:
    """An FP8 checkpoint's layout: the block each scale covers (None: read from the scales' grid)."""

    block: tuple[int, int] | None


def quantization_of(cfg: dict, where: str) -> Fp8Weights | None:
    """The checkpoint's quantization (config.json's `quantization_config`, or its language
    model's), None for plain weights; a ModelLoadError naming any method tierlm cannot load."""
    q = cfg.get("quantization_config")
    if q is None and isinstance(cfg.get("text_config"), dict):
        q = cfg["text_config"].get("quantization_config")
    if q is None:
        return None
    method = q.get("quant_method") if isinstance(q, dict) else None
    if method != "fp8":
        raise ModelLoadError(
            f"{where} holds a quantized checkpoint (quant_method {method!r}), which tierlm cannot load: it loads "
            "unquantized checkpoints and FP8 ones (quant_method 'fp8', dequantized as they load); use the model's "
            "unquantized (bf16) checkpoint")
    block = q.get("weight_block_size")
    if block is None:
        return Fp8Weights(None)
    if not (isinstance(block, list) and len(block) == 2 and all(isinstance(b, int) and b > 0 for b in block)):
        raise ModelLoadError(f"{where}: quantization_config.weight_block_size must be two positive integers "
                             f"(rows, columns), not {block!r}; re-export the checkpoint")
    return Fp8Weights((block[0], block[1]))


def is_scale(name: str) -> bool:
    """A tensor of scales (for a weight, or for activations), not a weight of its own."""
    return name.endswith(SCALE_SUFFIX) or name.endswith(_SKIPPED_SUFFIXES)


def weight_of_scale(name: str) -> str | None:
    """`X.weight` for its scales `X.weight_scale_inv`; None for activation scales (not used)."""
    return name[:-len(SCALE_SUFFIX)] if name.endswith(SCALE_SUFFIX) else None


def is_fp8(tensor: torch.Tensor) -> bool:
    return tensor.dtype in _FP8_DTYPES


def dequantize(weight: torch.Tensor, scales: torch.Tensor, fmt: Fp8Weights, label: str) -> torch.Tensor:
    """float32 `weight` x its scales, each scale over its block of the last two dims (leading
    dims: stacked experts); `label` names the tensor in errors."""
    w = weight.to(torch.float32)
    s = scales.to(torch.float32)
    if s.numel() == 1:
        return w * s.reshape(())
    rows, cols = w.shape[-2:]
    if s.dim() < 2 or s.shape[:-2] != w.shape[:-2]:
        raise ModelLoadError(f"{label}: its scales' shape {list(s.shape)} does not fit the weight's "
                             f"{list(w.shape)}; re-export the checkpoint")
    grid_rows, grid_cols = s.shape[-2:]
    if fmt.block is not None:
        block_rows, block_cols = fmt.block
    elif rows % grid_rows == 0 and cols % grid_cols == 0:
        block_rows, block_cols = rows // grid_rows, cols // grid_cols
    else:
        block_rows = block_cols = 0
    if (block_rows == 0 or -(-rows // block_rows) != grid_rows or -(-cols // block_cols) != grid_cols):
        raise ModelLoadError(f"{label}: {grid_rows} x {grid_cols} scales do not cover a {rows} x {cols} weight in "
                             f"blocks of {fmt.block or 'equal size'}; re-export the checkpoint")
    # each scale over its block; a grid that overhangs the weight (ceil division) is cut to it
    full = s.repeat_interleave(block_rows, dim=-2)[..., :rows, :].repeat_interleave(block_cols, dim=-1)[..., :cols]
    return w * full
