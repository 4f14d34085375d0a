"""Per-layer scales for fp8 KV caches (vLLM's `k_scale` / `v_scale`): a layer stores k / k_scale
and v / v_scale, and attention reads them back multiplied.

Why: fp8 has a fixed range. e4m3 keeps 3 mantissa bits from 2^-6 up to 448 and saturates past
it: a model whose keys reach the hundreds (large q/k biases, an attention-sink token's outliers)
loses them to saturation, and small values fall into the subnormals, where fewer bits remain.
A scale per layer moves each layer's keys and values into the format's range.

Where the scales come from (`kv_cache_scales`):
- `checkpoint`: the checkpoint's own (`self_attn.k_scale` / `v_scale`, as llm-compressor and
  vLLM write them; `kv_scale` for both; `k_proj.output_scale` / `v_proj.output_scale`), 1.0
  without them: vLLM's behaviour without `calculate_kv_scales`.
- `calibrate`: measured at load on a fixed built-in text (vLLM's `calculate_kv_scales`, but at
  load and deterministic: vLLM measures whatever the first batch holds, so two servers of one
  model may store the same prompt differently and could not share cached blocks).
- `auto` (the default): the checkpoint's when it has them, else calibrated.

A calibrated scale is a power of two with `HEADROOM` between the largest value seen and the
format's largest: dividing by it is exact, so storing only rounds once, and two machines whose
measurements differ in the last bits still agree on the scale (block keys include the scales).

Attention never multiplies the cache back: k_scale folds into the softmax scale (q . k_scale k8
= k_scale (q . k8)) and v_scale multiplies the output (softmax weights sum to one), so every
attention path and kernel reads the stored bytes as before.
"""
from __future__ import annotations

import hashlib
import logging
import math
import re
import time
from pathlib import Path

import torch
from safetensors import safe_open

from tierlm.errors import ModelLoadError
from tierlm.models.kv_dtype import is_fp8

log = logging.getLogger(__name__)

KV_CACHE_SCALES = ("auto", "checkpoint", "calibrate")
#: the largest value a calibration saw is stored at most 1/HEADROOM of the format's largest:
#: prompts unlike the calibration text may reach further before saturating.
HEADROOM = 4.0
CALIBRATION_TOKENS = 512  # at most

# A checkpoint's scale tensors, after any "model." / language-model prefix: layer, which.
KV_SCALE_NAME = re.compile(r"(?:.*\.)?layers\.(\d+)\.self_attn\.(k_scale|v_scale|kv_scale|k_proj\.output_scale"
                           r"|v_proj\.output_scale)$")

# Prose, code, numbers, a conversation and other scripts: a calibration's keys and values should
# cover what prompts hold, and a model's outliers (the first token's, numbers', code's) among them.
CALIBRATION_TEXT = """\
The committee met on Tuesday, 14 March 2023, to review the quarterly results. Revenue rose 12.5% to
$4.81 billion, while operating costs fell by 3%; the board approved a dividend of 0.42 per share.
"We expect demand to stay strong through the second half," the chief executive said.

User: Can you explain how a hash table handles collisions?
Assistant: Sure. Two common strategies are separate chaining, where each bucket holds a list of
entries, and open addressing, where a colliding key probes the next free slot (linear, quadratic
or double hashing). The load factor decides when the table grows.

def merge_sorted(a: list[int], b: list[int]) -> list[int]:
    out, i, j = [], 0, 0
    while i < len(a) and j < len(b):
        if a[i] <= b[j]:
            out.append(a[i]); i += 1
        else:
            out.append(b[j]); j += 1
    return out + a[i:] + b[j:]

SELECT name, COUNT(*) AS n FROM orders WHERE created_at >= '2024-01-01' GROUP BY name ORDER BY n DESC;
{"id": 7, "tags": ["alpha", "beta"], "ratio": 0.618, "ok": true, "next": null}

Photosynthesis converts light energy into chemical energy: 6 CO2 + 6 H2O -> C6H12O6 + 6 O2.
Die Katze schläft auf dem Sofa. Le chat dort sur le canapé. 猫はソファで寝ています。 Кошка спит.
1 1 2 3 5 8 13 21 34 55 89 144 233 377 610 987 1597 2584 4181 6765 ... π ≈ 3.14159, e ≈ 2.71828.
"""


def check_kv_cache_scales(name: object) -> None:
    if not isinstance(name, str) or name not in KV_CACHE_SCALES:
        raise ValueError(f"kv_cache_scales must be one of {', '.join(KV_CACHE_SCALES)} (got {name!r})")


def pow2_scale(amax: float, dtype: torch.dtype) -> float:
    """The smallest power of two s with amax * HEADROOM / s within `dtype`'s range (1.0 for a
    layer that wrote nothing, or nothing finite)."""
    if not math.isfinite(amax) or amax <= 0:
        return 1.0
    return 2.0 ** math.ceil(math.log2(amax * HEADROOM / torch.finfo(dtype).max))


def checkpoint_kv_scales(files: list[Path], num_layers: int) -> list[tuple[float, float]] | None:
    """(k_scale, v_scale) per layer from the checkpoint's scale tensors; None when it has none.
    A layer the checkpoint gives no scale keeps 1.0 (as vLLM does), with a warning. A tensor of
    several scales (per head) gives its largest: one scale per layer stores the layer without
    saturating any head."""
    found: dict[tuple[int, str], float] = {}
    for f in files:
        with safe_open(str(f), framework="pt", device="cpu") as st:
            for name in st.keys():
                m = KV_SCALE_NAME.match(name)
                if m is None:
                    continue
                t = st.get_tensor(name).float()
                value = float(t.max()) if t.numel() else float("nan")
                if not (math.isfinite(value) and value > 0):
                    raise ModelLoadError(f"tensor '{name}' in {f} is not a positive finite KV scale ({value}); "
                                         "re-export the checkpoint, or start with kv_cache_scales=calibrate")
                layer, which = int(m.group(1)), m.group(2)
                for side in ("k", "v") if which == "kv_scale" else (which[0],):
                    found[(layer, side)] = value
    if not found:
        return None
    missing = [f"{side}_scale of layer {i}" for i in range(num_layers) for side in "kv" if (i, side) not in found]
    if missing:
        log.warning("the checkpoint gives no %s (%d missing); those store K/V unscaled (1.0)",
                    ", ".join(missing[:4]) + (", ..." if len(missing) > 4 else ""), len(missing))
    return [(found.get((i, "k"), 1.0), found.get((i, "v"), 1.0)) for i in range(num_layers)]


def calibration_token_ids(tokenizer, vocab_size: int) -> list[int]:
    ids = [t for t in tokenizer.encode(CALIBRATION_TEXT) if 0 <= t < vocab_size]
    return ids[:CALIBRATION_TOKENS] or list(range(min(vocab_size, 64)))


@torch.inference_mode()
def calibrate_kv_scales(model, args, device: torch.device, dtype: torch.dtype, token_ids: list[int],
                        kv_dtype: torch.dtype, block_size: int = 16) -> list[tuple[float, float]]:
    """One prefill of `token_ids` into a scratch cache of the compute dtype (nothing rounded
    yet); each layer's scales from the largest |key| and |value| it wrote."""
    from tierlm.models.attention import AttentionMetadata, PrefillSeq

    n = len(token_ids)
    blocks = -(-n // block_size)
    caches = [torch.zeros((2, blocks, block_size, args.num_kv_heads, args.head_dim), dtype=dtype, device=device)
              for _ in range(args.num_layers)]
    meta = AttentionMetadata(slot_mapping=torch.arange(n, device=device),
                             prefills=[PrefillSeq(0, n, n, torch.arange(blocks, device=device))], block_size=block_size)
    model.hidden_states(torch.tensor(token_ids, device=device), torch.arange(n, device=device), caches, meta,
                        logits_indices=torch.tensor([n - 1], device=device))
    amax = torch.stack([c.view(2, -1)[:, : n * args.num_kv_heads * args.head_dim].float().abs().amax(dim=1)
                        for c in caches]).tolist()
    return [(pow2_scale(k, kv_dtype), pow2_scale(v, kv_dtype)) for k, v in amax]


def apply_kv_scales(model, scales: list[tuple[float, float]] | None) -> None:
    """Set each attention layer's (k_scale, v_scale); None: unscaled."""
    for i, layer in enumerate(model.layers):
        layer.self_attn.k_scale, layer.self_attn.v_scale = scales[i] if scales is not None else (1.0, 1.0)


def scales_tag(scales: list[tuple[float, float]] | None) -> str:
    """A short key for the block identity: the same prompt stored with other scales is other bytes."""
    if scales is None or all(s == (1.0, 1.0) for s in scales):
        return ""
    return ":kvs-" + hashlib.sha256(repr([(float(k), float(v)) for k, v in scales]).encode()).hexdigest()[:16]


def describe(scales: list[tuple[float, float]]) -> str:
    """'keys 2^-6..2^-3, values 2^-7..2^-5' (or plain numbers where they are no powers of two)."""
    def span(values: list[float]) -> str:
        lo, hi = min(values), max(values)
        as_pow = lambda x: f"2^{int(math.log2(x))}" if math.log2(x).is_integer() else f"{x:.4g}"  # noqa: E731
        return as_pow(lo) if lo == hi else f"{as_pow(lo)}..{as_pow(hi)}"
    return f"keys {span([k for k, _ in scales])}, values {span([v for _, v in scales])}"


def resolve_kv_scales(mode: str, loaded, files: list[Path], tokenizer) -> list[tuple[float, float]] | None:
    """The scales `mode` asks for, set on the model; None where the cache is not fp8 (other
    dtypes keep their model's range: scales there would only add a multiply)."""
    check_kv_cache_scales(mode)
    if not is_fp8(loaded.kv_dtype):
        return None
    args = loaded.args
    scales = checkpoint_kv_scales(files, args.num_layers) if mode != "calibrate" else None
    source = "the checkpoint's"
    if scales is None and mode != "checkpoint":
        t0 = time.monotonic()
        # No further than the RoPE tables reach (max_model_len, where it is set lower).
        ids = calibration_token_ids(tokenizer, args.vocab_size)[:loaded.model.rope.cos.shape[0]]
        scales = calibrate_kv_scales(loaded.model, args, loaded.device, loaded.dtype, ids, loaded.kv_dtype)
        source = f"calibrated on {len(ids)} tokens in {time.monotonic() - t0:.2f} s"
    apply_kv_scales(loaded.model, scales)
    if scales is None:
        log.info("fp8 KV cache stored unscaled (kv_cache_scales=checkpoint, and the checkpoint has no k/v scales)")
    else:
        log.info("fp8 KV cache scales per layer, %s: %s", source, describe(scales))
    return scales
