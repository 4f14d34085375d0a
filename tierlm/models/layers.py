"""Small building blocks shared by every model: norm, rotary embedding, gated MLP."""
from __future__ import annotations

import math

import torch
from torch import nn
import torch.nn.functional as F

from tierlm.models.config import ModelArgs


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, plus_one: bool = False,
             weight_in_fp32: bool = False) -> torch.Tensor:
    """x * rsqrt(mean(x^2) + eps) over the last dim, in float32 through torch's rms_norm (one op
    rather than five: a kernel launch each on a GPU, where launches bound a step's time), then
    scaled as the reference does: Llama-style, cast back and multiply by `weight`; Gemma-style
    (`plus_one`), multiply by 1 + weight in float32, then cast; GPT-OSS-style
    (`weight_in_fp32`), multiply by the weight in float32, then cast. `weight` broadcasts over x."""
    normed = F.rms_norm(x.float(), (x.shape[-1],), eps=eps)
    if plus_one:
        return (normed * (1.0 + weight.float())).to(x.dtype)
    if weight_in_fp32:
        return (normed * weight.float()).to(x.dtype)
    return weight * normed.to(x.dtype)


class RMSNorm(nn.Module):
    """RMSNorm computed in float32 then cast back, as Llama-family reference code does; Gemma's
    variant (`plus_one`) stores the weight as an offset from 1; GPT-OSS's scales in float32."""

    def __init__(self, dim: int, eps: float, plus_one: bool = False, weight_in_fp32: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim) if plus_one else torch.ones(dim))
        self.eps = eps
        self.plus_one = plus_one
        self.weight_in_fp32 = weight_in_fp32

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps, self.plus_one, self.weight_in_fp32)


def make_norm(args: ModelArgs, dim: int) -> nn.Module:
    return RMSNorm(dim, args.rms_norm_eps, plus_one=args.gemma_norms, weight_in_fp32=args.norm_weight_in_fp32)


def rope_inv_freq(args: ModelArgs, max_positions: int | None = None) -> tuple[torch.Tensor, float]:
    """Inverse frequencies, with linear, Llama-3.1, YaRN or LongRoPE scaling applied when
    configured, and the factor the cos/sin tables are multiplied by (YaRN's and LongRoPE's
    attention factor; else 1). Over the rotated dims only (fewer than head_dim with a partial
    rotary factor). `max_positions`: the longest sequence served (max_position_embeddings when
    None), which picks LongRoPE's factors."""
    dim = args.rotary_dim
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
    sc = args.rope_scaling
    if sc and sc["rope_type"] == "longrope":
        return _longrope(args, exponents, max_positions or args.max_position_embeddings)
    inv = 1.0 / (args.rope_theta ** exponents)
    if not sc:
        return inv, 1.0
    if sc["rope_type"] == "linear":
        return inv / float(sc["factor"]), 1.0
    if sc["rope_type"] == "yarn":
        return _yarn(args, inv)
    # llama3: keep high frequencies, divide low ones by `factor`, blend in between.
    factor = float(sc["factor"])
    low, high = float(sc["low_freq_factor"]), float(sc["high_freq_factor"])
    old_len = float(sc["original_max_position_embeddings"])
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > low_wavelen, inv / factor, inv)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled), 1.0


def _yarn(args: ModelArgs, extrapolated: torch.Tensor) -> tuple[torch.Tensor, float]:
    """YaRN (arXiv 2309.00071): dimensions that turn many times within the original context keep
    their frequency, slow ones are interpolated by `factor`, a linear ramp blends those between;
    cos/sin are scaled by 0.1 ln(factor) + 1 (or the checkpoint's mscale ratio or explicit
    attention_factor). The same arithmetic as transformers' YaRN, so tables match bit for bit."""
    sc, dim = args.rope_scaling, args.rotary_dim
    original = float(sc["original_max_position_embeddings"])
    factor = sc.get("factor") or args.max_position_embeddings / original
    factor = float(factor)

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention = sc.get("attention_factor")
    if attention is None:
        m, m_all = sc.get("mscale"), sc.get("mscale_all_dim")
        attention = mscale(factor, m) / mscale(factor, m_all) if m and m_all else mscale(factor)
    fast, slow = sc.get("beta_fast") or 32, sc.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:  # the dimension that turns `rotations` times in `original`
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(args.rope_theta))

    low, high = correction_dim(fast), correction_dim(slow)
    if sc.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # no zero-width ramp
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    keep = 1 - ramp  # 1: keep the original frequency; 0: interpolate
    pos_freqs = args.rope_theta ** (torch.arange(0, dim, 2).to(dtype=torch.float) / dim)
    inv = 1.0 / (factor * pos_freqs) * (1 - keep) + 1.0 / pos_freqs * keep
    return inv, float(attention)


def _longrope(args: ModelArgs, exponents: torch.Tensor, max_positions: int) -> tuple[torch.Tensor, float]:
    """LongRoPE (Phi-3-128k, Phi-3.5-mini, Phi-4-mini): each frequency divided by its own factor, from
    `long_factor` for a model served past original_max_position_embeddings, else from
    `short_factor`; cos/sin scaled by sqrt(1 + ln(factor) / ln(original)) (factor: the
    checkpoint's, else max_position_embeddings / original), or the explicit attention_factor.
    The same arithmetic as transformers' _compute_longrope_parameters, bit for bit.

    transformers switches per forward call: the long factors once the sequence is longer than
    the original length, and Phi-3's generate() then recomputes the whole cache with them. A
    paged engine cannot redo a sequence's keys when it crosses (nor share prefix blocks across
    the switch), so tierlm does as vLLM does: one set for the engine's life, the long one when
    it serves sequences longer than the original length. Outputs match transformers for every
    sequence when max_model_len is at most the original length, and for sequences whose prompt
    is already past it otherwise; a shorter sequence then differs from transformers, which
    rotates it with the short factors."""
    sc = args.rope_scaling
    original = int(sc["original_max_position_embeddings"])
    factor = float(sc.get("factor") or args.max_position_embeddings / original)
    attention = sc.get("attention_factor")
    if attention is None:
        attention = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    ext = torch.tensor(sc[longrope_factors(args, max_positions)], dtype=torch.float32)
    return 1.0 / (ext * args.rope_theta ** exponents), float(attention)


def longrope_factors(args: ModelArgs, max_positions: int) -> str:
    """Which LongRoPE factor list an engine serving sequences of up to `max_positions` tokens
    rotates with (see _longrope): 'long_factor' past original_max_position_embeddings."""
    original = int(args.rope_scaling["original_max_position_embeddings"])
    return "long_factor" if max_positions > original else "short_factor"


def rope_tag(args: ModelArgs, max_positions: int) -> str:
    """What of the RoPE tables depends on the engine rather than on the checkpoint, for the KV
    blocks' identity: LongRoPE's factor set (chosen by max_model_len), '' for every other RoPE.
    Keys rotated with the short factors are other keys than the long factors give for the same
    tokens, so engines of one checkpoint with a max_model_len on either side of the original
    length must not share cached blocks (a disk tier across restarts, a shared remote tier)."""
    sc = args.rope_scaling
    if not sc or sc["rope_type"] != "longrope":
        return ""
    return ":longrope-" + longrope_factors(args, max_positions).removesuffix("_factor")


class RotaryEmbedding(nn.Module):
    """Precomputed cos/sin tables indexed by absolute position (no per-step trig), for sequences
    of up to `max_positions` tokens."""

    def __init__(self, args: ModelArgs, max_positions: int) -> None:
        super().__init__()
        inv, scale = rope_inv_freq(args, max_positions)
        self.tag = rope_tag(args, max_positions)  # for the KV blocks' identity (engine.model_identity)
        t = torch.arange(max_positions, dtype=torch.float32)
        freqs = torch.outer(t, inv)
        emb = torch.cat([freqs, freqs], dim=-1)
        self.register_buffer("cos", emb.cos() * scale, persistent=False)
        # rotate_half's minus sign folded into the first half of sin, once, so rotating is a swap.
        sin = freqs.sin() * scale
        self.register_buffer("sin", torch.cat([-sin, sin], dim=-1), persistent=False)

    def tables(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sign-folded sin rows for a step's positions, [T, 1, D]: gathered once per step
        and shared by every layer."""
        return self.cos[positions].to(dtype).unsqueeze(1), self.sin[positions].to(dtype).unsqueeze(1)

    @staticmethod
    def rotate(tables: tuple[torch.Tensor, torch.Tensor], qk: torch.Tensor) -> torch.Tensor:
        """qk: [T, Hq + Hkv, D], the query and key heads side by side as the fused projection
        lays them out -> rotated (HF's rotate_half convention), both in one pass. Tables
        narrower than D (a partial rotary factor) rotate each head's first dims, as transformers'
        Phi-3 does (rotate_half within that part), and pass the rest through."""
        cos, sin = tables
        R = cos.shape[-1]
        if R == qk.shape[-1]:
            return _rotate(qk, cos, sin)
        return torch.cat((_rotate(qk[..., :R], cos, sin), qk[..., R:]), dim=-1)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x * cos + rotate_half(x) * sin, with the sign already in `sin`: swap the halves, no
    negation. `x` may be a strided slice of the heads (the rotated part)."""
    D = x.shape[-1]
    swapped = x.unflatten(-1, (2, D // 2)).flip(-2).flatten(-2)
    return torch.addcmul(x * cos, swapped, sin)


class GatedMLP(nn.Module):
    """Gated MLP (SwiGLU, or GeGLU with tanh-approximated GELU for Gemma) with gate and up
    projections fused into one matmul."""

    def __init__(self, hidden: int, intermediate: int, act: str = "silu") -> None:
        super().__init__()
        self.intermediate = intermediate
        self.gate_up_proj = nn.Linear(hidden, 2 * intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)
        self.gelu = act == "gelu_pytorch_tanh"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.intermediate, dim=-1)
        act = F.gelu(gate, approximate="tanh") if self.gelu else F.silu(gate)
        return self.down_proj(act.mul_(up))
