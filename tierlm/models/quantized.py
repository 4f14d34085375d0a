"""Quantized checkpoints: which ones load, and their weights dequantized at load.

Two layouts are read, each linear layer's weight multiplied back to the checkpoint's dtype as it
loads, as transformers does where it has no kernels for them (`dequantize`): the same weights,
so the same tokens; memory and speed are the unquantized model's (no low-precision GEMMs).
- `quant_method: fp8` (Qwen3's `-FP8` models, DeepSeek): float8 weights, a float32
  `weight_scale_inv` per block of `weight_block_size` (one for the whole tensor where the grid
  is 1 x 1; uint8 ones are MXFP8's E8M0 exponents).
- `quant_method: compressed-tensors` (what llm-compressor writes; RedHat's `-FP8-dynamic`,
  `-quantized.w8a8`, `-quantized.w4a16` models): formats `float-quantized` (float8 weights),
  `int-quantized` / `naive-quantized` (ints of 1-8 bits, an int8 each: W8A8, and W4A8 too) and
  `pack-quantized` (ints of 1-8 bits packed into int32 `weight_packed`, with `weight_shape`),
  each with a `weight_scale` per tensor, output channel, group of input columns or block, and a
  `weight_zero_point` where asymmetric (packed along the output dimension when the weights are).
  Products are rounded to the scales' dtype, as compressed-tensors' decompressor rounds them.
  `mixed-precision`: config groups of these formats, each weight read as what it is stored as.
- `quant_method: mxfp4` (OpenAI's gpt-oss): MoE experts' `experts.gate_up_proj` and
  `experts.down_proj` stored as `X_blocks` (uint8 [E, rows, cols/32, 16]: 32 FP4 e2m1 values per
  block, two per byte, low nibble first) and `X_scales` (uint8 [E, rows, cols/32]: one E8M0
  exponent per block, 2^(scale - 127)); everything else unquantized. Read as one tensor `X`
  [E, cols, rows] in the model's dtype, bit for bit what transformers' `Mxfp4Config(dequantize=True)`
  loads (the layout of gpt-oss's unquantized `gate_up_proj` [E, H, 2I] and `down_proj` [E, I, H]).
Activation scales (`input_scale`: static FP8 / INT8 activations) are for quantized activations,
which a dequantized model does not use: skipped, as transformers skips them. Other methods
(GPTQ, AWQ, bitsandbytes, NVFP4, ...) would load as garbage or not at all: refused by name.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from tierlm.errors import ModelLoadError

# A weight `X.weight`'s parts, stored beside it as `X.weight<suffix>`.
_PARTS = {"_scale_inv": "scale", "_scale": "scale", "_zero_point": "zero_point", "_shape": "shape",
          "_g_idx": "g_idx"}
PACKED_SUFFIX = "_packed"  # `X.weight_packed`: the packed ints of `X.weight`
_ACTIVATION_SCALES = (".input_scale", ".input_zero_point", ".activation_scale")
_FLOAT8 = frozenset({torch.float8_e4m3fn, torch.float8_e5m2})
_STRATEGIES = ("tensor", "channel", "group", "block")
_FORMATS = ("float-quantized", "int-quantized", "naive-quantized", "pack-quantized")
_MIXED = "mixed-precision"  # groups of different formats
_OFFLINE = ("weight_input", "weight_output")  # transforms folded into the weights (the others rotate activations)
_REEXPORT = "re-export the checkpoint"
# MXFP4 (gpt-oss): an expert projection `X` stored as `X_blocks` (packed FP4) and `X_scales` (E8M0 exponents)
MXFP4_BLOCKS, MXFP4_SCALES = "_blocks", "_scales"
_MXFP4_WEIGHT = re.compile(r"(?:^|\.)experts\.(?:gate_up_proj|down_proj)$")  # all transformers dequantizes
_MXFP4_PAIR = re.compile(r"^(.*)(_blocks|_scales)$")
# FP4 e2m1 by its 4 bits (sign, 2 exponent bits, 1 mantissa bit), as transformers' FP4_VALUES
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
MXFP4_BLOCK = 32  # values per scale


@dataclass(frozen=True)
class QuantizedWeights:
    """How a checkpoint stores its quantized weights."""

    method: str  # quant_method
    scale_name: str  # the suffix of a weight's scales: weight_scale_inv (fp8), weight_scale
    dtypes: frozenset[torch.dtype]  # what a weight with scales is stored as
    block: tuple[int, int] | None = None  # rows x columns a scale covers (None: read from the scales' grid)
    bits: int = 8  # bits per value of packed weights (int32 words)
    round_to_scale: bool = False  # products rounded to the scales' dtype (compressed-tensors)

    def stored_as(self) -> str:
        """What its weights are stored as, for the load log ('float8, 4-bit ints packed in int32' for
        mixed-precision FP8 attention and INT4 experts: one bit width would misname one of them)."""
        kinds = ["float8"] if self.dtypes & _FLOAT8 else []
        kinds += ["int8"] if torch.int8 in self.dtypes else []
        kinds += [f"{self.bits}-bit ints packed in int32"] if torch.int32 in self.dtypes else []
        kinds += ["FP4 e2m1 in blocks of 32 with E8M0 scales"] if self.method == "mxfp4" else []
        return ", ".join(kinds)


def quantization_of(cfg: dict, where: str) -> QuantizedWeights | None:
    """The checkpoint's quantization (config.json's `quantization_config`, or its language
    model's), None for plain weights; a ModelLoadError naming any tierlm cannot load."""
    q = cfg.get("quantization_config")
    if q is None and isinstance(cfg.get("text_config"), dict):
        q = cfg["text_config"].get("quantization_config")
    if q is None:
        return None
    method = q.get("quant_method") if isinstance(q, dict) else None
    if method == "fp8":
        return QuantizedWeights("fp8", "weight_scale_inv", _FLOAT8, _block(q.get("weight_block_size"), where))
    if method == "compressed-tensors":
        return _compressed_tensors(q, where)
    if method == "mxfp4":  # which tensors are quantized, the names say (modules_to_not_convert: those that are not)
        return QuantizedWeights("mxfp4", "scales", frozenset({torch.uint8}), (1, MXFP4_BLOCK), bits=4)
    raise ModelLoadError(
        f"{where} holds a quantized checkpoint (quant_method {method!r}), which tierlm cannot load: it loads "
        "unquantized checkpoints and those of quant_method 'fp8', 'compressed-tensors' (FP8, INT8 and packed "
        "INT weights) or 'mxfp4' (gpt-oss's FP4 experts), dequantized as they load; use the model's unquantized "
        "(bf16) checkpoint")


def _refuse(where: str, what: str) -> ModelLoadError:
    return ModelLoadError(f"{where}: {what}, which tierlm cannot load (it reads compressed-tensors' "
                          f"{', '.join(_FORMATS)} weights with tensor, channel, group or block scales); "
                          "use the model's unquantized (bf16) checkpoint")


def _compressed_tensors(q: dict, where: str) -> QuantizedWeights | None:
    sparsity = q.get("sparsity_config")
    if isinstance(sparsity, dict) and sparsity.get("format", "dense") != "dense":
        # 2:4 / bitmask-compressed weights: `weight_compressed` + `weight_bitmask`, nothing to multiply back
        raise _refuse(where, f"compressed-tensors sparsity format {sparsity['format']!r} (sparse weights stored "
                             "compressed)")
    transforms = q.get("transform_config") or {}
    online = [a.get("location") for g in (transforms.get("config_groups") or {}).values()
              for a in g.get("apply", []) if a.get("location") not in _OFFLINE]
    if online:  # weights rotated to match activations rotated at run time, which tierlm does not do
        raise _refuse(where, f"compressed-tensors transforms applied at run time (transform_config location "
                             f"{online[0]!r}: rotations of activations, SpinQuant / QuIP)")
    fmt = q.get("format")
    if fmt == "dense" or (fmt is None and not q.get("config_groups")):
        return None  # weights stored unquantized (only the KV cache's scheme, or sparsity stored dense, say)
    if fmt not in _FORMATS and fmt != _MIXED:
        raise _refuse(where, f"compressed-tensors format {fmt!r}")
    if q.get("quantization_status", "compressed") != "compressed":
        raise _refuse(where, f"compressed-tensors weights in status {q.get('quantization_status')!r}, not "
                             "'compressed'")
    groups = q.get("config_groups")
    # (format, weight args) per group; `mixed-precision`: each group says its own (Kimi: FP8 attention, INT4
    # experts), and a weight's dtype says which it is (float8, int8, packed int32)
    weights = [(g.get("format") if fmt == _MIXED else fmt, g.get("weights")) for g in groups.values()
               if isinstance(g, dict) and g.get("weights")] if isinstance(groups, dict) else []
    if not weights:
        raise ModelLoadError(f"{where}: quantization_config has no config_groups with weights; {_REEXPORT}")
    dtypes: set[torch.dtype] = set()
    bits, blocks = set(), set()
    for fmt, w in weights:
        if fmt not in _FORMATS:
            raise _refuse(where, f"compressed-tensors format {fmt!r} of a {_MIXED} group")
        kind, nbits, strategy = w.get("type"), w.get("num_bits"), w.get("strategy")
        if strategy not in _STRATEGIES:
            raise _refuse(where, f"weight strategy {strategy!r}")
        if w.get("actorder") in ("group", "dynamic"):
            raise _refuse(where, "activation-ordered groups (actorder 'group': a g_idx per column)")
        if fmt == "pack-quantized" and kind == "int" and isinstance(nbits, int) and 1 <= nbits <= 8:
            dtypes.add(torch.int32)
            bits.add(nbits)
        elif fmt != "pack-quantized" and (kind, nbits) == ("float", 8):
            dtypes |= _FLOAT8
        elif fmt != "pack-quantized" and kind == "int" and isinstance(nbits, int) and 1 <= nbits <= 8:
            dtypes.add(torch.int8)  # one int8 per value whatever its bits (W4A8: int-quantized 4-bit ints)
        else:
            raise _refuse(where, f"{nbits}-bit {kind} weights in format {fmt!r}")
        if strategy == "block":
            blocks.add(_block(w.get("block_structure"), where, "block_structure"))
    if len(bits) > 1 or len(blocks) > 1:
        raise _refuse(where, "groups of weights packed with different bit widths or quantized in different blocks")
    return QuantizedWeights("compressed-tensors", "weight_scale", frozenset(dtypes), next(iter(blocks), None),
                            next(iter(bits), 8), round_to_scale=True)


def _block(block, where: str, field: str = "weight_block_size") -> tuple[int, int] | None:
    if block is None:
        return None
    if not (isinstance(block, list) and len(block) == 2 and all(isinstance(b, int) and b > 0 for b in block)):
        raise ModelLoadError(f"{where}: quantization_config's {field} must be two positive integers (rows, "
                             f"columns), not {block!r}; {_REEXPORT}")
    return block[0], block[1]


def part_of(name: str) -> tuple[str, str] | None:
    """(`X.weight`, part) for a weight's part `X.weight_scale`, `X.weight_zero_point`, ...; (`X`,
    'scale') for MXFP4 expert scales `X_scales`; None for anything else."""
    for suffix, part in _PARTS.items():
        if name.endswith(".weight" + suffix):
            return name[:-len(suffix)], part
    if name.endswith(MXFP4_SCALES) and _MXFP4_WEIGHT.search(name[:-len(MXFP4_SCALES)]):
        return name[:-len(MXFP4_SCALES)], "scale"
    return None


def weight_name(stored: str) -> str:
    """The name transformers gives the parameter a stored tensor loads into: `X.weight` for packed
    ints `X.weight_packed`, `X` for MXFP4 expert blocks `X_blocks`, else the name as stored."""
    if stored.endswith(".weight" + PACKED_SUFFIX):
        return stored[:-len(PACKED_SUFFIX)]
    if stored.endswith(MXFP4_BLOCKS) and _MXFP4_WEIGHT.search(stored[:-len(MXFP4_BLOCKS)]):
        return stored[:-len(MXFP4_BLOCKS)]
    return stored


def check_mxfp4_name(name: str, where: str) -> None:
    """A ModelLoadError for MXFP4 blocks or scales of anything but an expert projection: transformers
    dequantizes only `experts.gate_up_proj` and `experts.down_proj`, and would not load them either."""
    m = _MXFP4_PAIR.match(name)
    if m and not _MXFP4_WEIGHT.search(m.group(1)):
        raise ModelLoadError(f"tensor '{name}' in {where}: MXFP4 {m.group(2)[1:]} of '{m.group(1)}', which tierlm "
                             "cannot load (as transformers, it reads MXFP4 only for MoE experts' "
                             "experts.gate_up_proj and experts.down_proj); use the model's unquantized (bf16) "
                             "checkpoint")


def is_activation_scale(name: str) -> bool:
    """A static activation scale: for quantized activations, which a dequantized model has not."""
    return name.endswith(_ACTIVATION_SCALES)


def is_quantized(tensor: torch.Tensor) -> bool:
    """Stored as what no weight of a plain checkpoint is (float8, or integers)."""
    return tensor.dtype in _FLOAT8 or not (tensor.dtype.is_floating_point or tensor.dtype.is_complex)


def dequantize(weight: torch.Tensor, parts: dict[str, torch.Tensor], fmt: QuantizedWeights,
               label: str) -> torch.Tensor:
    """`weight` (float8, int8, or int32 words of packed ints) as float32: (value - zero point)
    x scale, each scale and zero point over its block of the last two dims (leading dims:
    stacked experts); `label` names the tensor in errors."""
    if weight.dtype not in fmt.dtypes:
        raise ModelLoadError(f"{label} has scales ({fmt.scale_name}) but is {weight.dtype}, which "
                             f"quant_method {fmt.method!r} as configured does not store ("
                             f"{', '.join(sorted(str(d) for d in fmt.dtypes))}); use the model's unquantized checkpoint")
    if "g_idx" in parts:
        raise ModelLoadError(f"{label} has a g_idx (activation-ordered groups), which tierlm cannot load; use the "
                             "model's unquantized checkpoint")
    scales = parts.get("scale")
    if scales is None:
        raise ModelLoadError(f"{label} is {weight.dtype} but its scales ({fmt.scale_name}) are not in the "
                             f"checkpoint; {_REEXPORT}")
    if weight.dtype == torch.int32:
        shape = parts.get("shape")
        if shape is None or shape.numel() != weight.dim():
            raise ModelLoadError(f"{label}: packed weights without their weight_shape; {_REEXPORT}")
        shape = [int(d) for d in shape.tolist()]
        if -(-shape[-1] * fmt.bits // 32) != weight.shape[-1] or list(weight.shape[:-1]) != shape[:-1]:
            raise ModelLoadError(f"{label}: {list(weight.shape)} words of {fmt.bits}-bit values cannot hold a "
                                 f"{shape} weight; {_REEXPORT}")
        values = unpack_int32(weight, fmt.bits, shape[-1])
    else:
        values = weight.to(torch.float32)
    w = values.to(torch.float32)
    zero = parts.get("zero_point")
    if zero is not None:
        if zero.dtype == torch.int32 and weight.dtype == torch.int32:  # packed along the rows
            if zero.dim() < 2 or zero.shape[-2] != -(-w.shape[-2] * fmt.bits // 32):
                # (fewer words would unpack into a smaller grid of zero points, spread over other blocks)
                raise ModelLoadError(f"{label}: zero points {list(zero.shape)} are not {w.shape[-2]} rows of "
                                     f"{fmt.bits}-bit values packed into int32 words; {_REEXPORT}")
            zero = unpack_int32(zero.transpose(-1, -2).contiguous(), fmt.bits, w.shape[-2]).transpose(-1, -2)
        w = w - _spread(zero.to(torch.float32), w.shape, fmt, f"{label}'s zero points")
    if scales.dtype == torch.uint8:  # E8M0 exponents (MXFP8), as transformers reads them: not multipliers
        scales = (scales.to(torch.float32) - 127).exp2()
    out = w * _spread(scales.to(torch.float32), w.shape, fmt, f"{label}'s scales")
    if fmt.round_to_scale and scales.dtype.is_floating_point:
        out = out.to(scales.dtype).to(torch.float32)
    return out


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor | None, dtype: torch.dtype,
                     label: str) -> torch.Tensor:
    """MXFP4 expert weights in `dtype`, bit for bit as transformers' `convert_moe_packed_tensors`
    makes them: blocks [E, rows, G, 16] and scales [E, rows, G] give [E, G x 32, rows] (each
    block's 32 values, low nibble first, times 2^(scale - 127); then rows and columns swapped).
    The same arithmetic (FP4 values in `dtype`, ldexp), one expert at a time: a whole stack's
    temporaries would be several times the weights. `label` names the blocks in errors."""
    what = f"{label}: MXFP4 blocks"
    if blocks.dtype != torch.uint8:
        raise ModelLoadError(f"{label} is {blocks.dtype}, which quant_method 'mxfp4' does not store (its quantized "
                             f"tensors are experts' uint8 {MXFP4_BLOCKS} and {MXFP4_SCALES}); {_REEXPORT}")
    if scales is None:
        raise ModelLoadError(f"{label} holds MXFP4 blocks but their scales (the same name ending in "
                             f"{MXFP4_SCALES} instead of {MXFP4_BLOCKS}) are not in the checkpoint; {_REEXPORT}")
    if scales.dtype != torch.uint8:
        raise ModelLoadError(f"{what}' scales must be uint8 E8M0 exponents, not {scales.dtype}; {_REEXPORT}")
    if blocks.dim() != 4 or blocks.shape[-1] != MXFP4_BLOCK // 2 or tuple(scales.shape) != tuple(blocks.shape[:-1]):
        raise ModelLoadError(f"{what} {list(blocks.shape)} with scales {list(scales.shape)} do not fit: MXFP4 experts "
                             f"are blocks [experts, rows, groups, {MXFP4_BLOCK // 2}] (32 4-bit values per block) and "
                             f"one scale per block [experts, rows, groups]; {_REEXPORT}")
    experts, rows, groups, _ = blocks.shape
    lut = torch.tensor(FP4_VALUES, dtype=dtype)
    out = torch.empty(experts, groups * MXFP4_BLOCK, rows, dtype=dtype)
    for e in range(experts):
        packed = blocks[e].to(torch.int32)
        values = torch.empty(rows, groups, MXFP4_BLOCK, dtype=dtype)
        values[..., 0::2] = lut[packed & 0x0F]
        values[..., 1::2] = lut[packed >> 4]
        torch.ldexp(values, scales[e].to(torch.int32).sub(127).unsqueeze(-1), out=values)
        out[e] = values.reshape(rows, groups * MXFP4_BLOCK).T
    return out


def _spread(s: torch.Tensor, shape: torch.Size, fmt: QuantizedWeights, label: str) -> torch.Tensor:
    """Scales (or zero points) over a weight of `shape`: one per tensor, or a grid whose each
    entry covers a block of the last two dims; a grid that overhangs the weight (ceil
    division, as 128 x 128 blocks do on dimensions that are no multiple) is cut to it."""
    if s.numel() == 1:
        return s.reshape(())
    rows, cols = shape[-2:]
    if s.dim() < 2 or tuple(s.shape[:-2]) != tuple(shape[:-2]):
        raise ModelLoadError(f"{label}: shape {list(s.shape)} does not fit the weight's {list(shape)}; {_REEXPORT}")
    grid_rows, grid_cols = s.shape[-2:]
    block = fmt.block
    if block is None or (-(-rows // block[0]), -(-cols // block[1])) != (grid_rows, grid_cols):
        # no block size, or scales of another layout (a group quantized per channel): the grid's own
        exact = rows % grid_rows == 0 and cols % grid_cols == 0
        block = (rows // grid_rows, cols // grid_cols) if exact else None
    if block is None:
        raise ModelLoadError(f"{label}: a {grid_rows} x {grid_cols} grid does not cover a {rows} x {cols} weight "
                             f"in blocks of {fmt.block or 'equal size'}; {_REEXPORT}")
    block_rows, block_cols = block
    return s.repeat_interleave(block_rows, dim=-2)[..., :rows, :].repeat_interleave(block_cols, dim=-1)[..., :cols]


def unpack_int32(words: torch.Tensor, bits: int, count: int) -> torch.Tensor:
    """The first `count` values of `bits` bits each packed densely into int32 `words` along the
    last dim (value i at bit i x bits, little-endian; a value may straddle two words), stored
    offset by 2^(bits-1): as signed int16."""
    shifts = torch.arange(0, 32, 8, dtype=torch.int64)  # each word's bytes, least significant first
    raw = ((words.to(torch.int64).unsqueeze(-1) >> shifts) & 0xFF).to(torch.uint8).flatten(-2)
    if bits == 8:
        values = raw[..., :count].to(torch.int16)
    elif bits == 4:
        values = torch.stack((raw & 0xF, raw >> 4), dim=-1).flatten(-2)[..., :count].to(torch.int16)
    else:
        bit = (raw.unsqueeze(-1) >> torch.arange(8, dtype=torch.uint8)) & 1
        bit = bit.flatten(-2)[..., :count * bits].unflatten(-1, (count, bits)).to(torch.int16)
        values = (bit << torch.arange(bits, dtype=torch.int16)).sum(-1, dtype=torch.int16)
    return values - (1 << (bits - 1))
