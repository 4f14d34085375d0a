"""Chained block hashes that identify a full KV block by everything that determines it.

A block's K/V depend on every token before it, so its key chains the parent's key, its own
token ids and extra keys (model id, tenant cache salt). SHA-256 is used because a collision
would silently serve another prompt's K/V (and, across tenants, leak it); Python's hash() is
64-bit, seeded per process (useless for a shared Redis tier) and not collision-resistant.
"""
from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence

BlockHash = bytes


def block_hash(parent: BlockHash | None, tokens: Sequence[int], extra: bytes = b"") -> BlockHash:
    h = hashlib.sha256()
    h.update(parent or b"\x00" * 32)
    h.update(array("q", tokens).tobytes())
    h.update(extra)
    return h.digest()


def extra_key(model_id: str, cache_salt: str | None, adapter: str | None = None) -> bytes:
    """Bytes mixed into every block hash: different salts never share a block, nor do different
    LoRA adapters (`adapter`: its fingerprint; None for the base model, whose keys are unchanged)."""
    salt = cache_salt or ""
    key = f"{model_id}\x1f{len(salt)}:{salt}"
    return (key + f"\x1flora:{adapter}" if adapter else key).encode()


def chain_hashes(tokens: Sequence[int], block_size: int, extra: bytes,
                 known: list[BlockHash] | None = None) -> list[BlockHash]:
    """Hashes of every full block of `tokens`, extending an already computed prefix `known`.

    Each is `block_hash` of its slice; the new tokens become int64 bytes in one conversion and
    each block hashes one slice of them (a 2,000-token prompt's 125 array conversions and 375
    `update` calls were a third of a prefix hit's bookkeeping)."""
    out = list(known or [])
    first = len(out) * block_size
    n = (len(tokens) - first) // block_size
    if n <= 0:
        return out
    raw = memoryview(array("q", tokens[first:first + n * block_size]).tobytes())
    width = 8 * block_size  # bytes: int64 tokens
    sha256 = hashlib.sha256
    parent = out[-1] if out else b"\x00" * 32
    for i in range(n):
        parent = sha256(b"".join((parent, raw[i * width:(i + 1) * width], extra))).digest()
        out.append(parent)
    return out
