"""KV cache storage dtypes (vLLM's `kv_cache_dtype`): what each stored key and value is rounded to.

fp8 stores a key or value in one byte: half a bf16 cache, a quarter of a float32 one. The same
memory then holds two or four times the tokens (more sequences at once, fewer preemptions, a
longer prefix cache), and every copy between KV tiers moves that many fewer bytes. Values are
stored unscaled, as vLLM does with its default k/v scale of 1.0: e4m3 keeps 3 mantissa bits up
to ±448, e5m2 keeps 2 up to ±57,344; larger values saturate to the largest finite one. Attention
reads them back into the compute dtype, so every other part of the model is unchanged.
"""
from __future__ import annotations

import torch

#: name -> storage dtype; "auto" (None) stores K/V in the model's dtype.
KV_CACHE_DTYPES: dict[str, torch.dtype | None] = {
    "auto": None,
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "fp8": torch.float8_e4m3fn,  # vLLM's "fp8" is e4m3 too
    "fp8_e4m3": torch.float8_e4m3fn,
    "fp8_e5m2": torch.float8_e5m2,
}

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


def check_kv_cache_dtype(name: object) -> None:
    """A ValueError naming the choices, for a name that is not one of them."""
    if not isinstance(name, str) or name not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)} (got {name!r})")


def resolve_kv_cache_dtype(name: str, model_kv_dtype: torch.dtype) -> torch.dtype:
    """The storage dtype `name` asks for; "auto" keeps `model_kv_dtype` (the model's own)."""
    check_kv_cache_dtype(name)
    return KV_CACHE_DTYPES[name] or model_kv_dtype


def is_fp8(dtype: torch.dtype) -> bool:
    return dtype in FP8_DTYPES


def to_storage(x: torch.Tensor, dtype: torch.dtype, scale: float = 1.0) -> torch.Tensor:
    """`x` / `scale` as the cache stores it. float16 and fp8 have a narrower range than the
    compute dtype: an inf or NaN kept in the pool would reach *other* sequences (attention
    gathers keys it then masks out, and a masked inf still gives NaN), so non-finite values
    become finite first; fp8 values past the format's largest saturate to it (a plain cast gives
    NaN or inf). The division runs in float32: a scale that is no power of two (a
    checkpoint's) then rounds once, into the storage format."""
    if scale != 1.0:
        x = x.float() / scale
    if dtype == torch.float16:
        return torch.nan_to_num(x.to(dtype))
    if is_fp8(dtype):
        top = torch.finfo(dtype).max
        return torch.nan_to_num(x).clamp_(-top, top).to(dtype)
    return x.to(dtype)


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """A uint8 view of an fp8 tensor, for scatters (index_copy_) that have no fp8 kernel; other
    tensors as they are."""
    return t.view(torch.uint8) if is_fp8(t.dtype) else t
