"""Prefill attention against a plain reference: GQA, a cached context before the chunk, and
sliding windows."""
from __future__ import annotations

import pytest
import torch

from tierlm.models.attention import (AttentionMetadata, DecodeGroup, PrefillSeq, _causal_attention, paged_attention,
                                     write_kv)


def _reference(q, k, v, scale, window, sinks=None):
    """Softmax attention in q's dtype; `sinks` ([Hq]): a logit per head in each row's softmax,
    dropped after it (gpt-oss)."""
    n, L = q.shape[0], k.shape[0]
    G = q.shape[1] // k.shape[1]
    kk, vv = k.repeat_interleave(G, 1), v.repeat_interleave(G, 1)
    scores = torch.einsum("nhd,lhd->hnl", q, kk) * scale
    qpos, kpos = torch.arange(L - n, L)[:, None], torch.arange(L)[None, :]
    allowed = kpos <= qpos
    if window is not None:
        allowed &= kpos > qpos - window
    scores = scores.masked_fill(~allowed, float("-inf"))
    if sinks is not None:
        with_sinks = torch.cat((scores, sinks.to(scores.dtype)[:, None, None].expand(-1, n, 1)), -1)
        return torch.einsum("hnl,lhd->nhd", torch.softmax(with_sinks, -1)[..., :-1], vv)
    return torch.einsum("hnl,lhd->nhd", torch.softmax(scores, -1), vv)


@pytest.mark.parametrize("n,L,window", [(7, 7, None), (5, 23, None), (16, 40, 9), (1, 30, None), (12, 12, 4),
                                       (300, 900, None), (64, 700, 100)])
def test_prefill_attention_matches_the_reference(n, L, window):
    g = torch.Generator().manual_seed(n * 100 + L)
    q = torch.randn(n, 6, 8, generator=g)
    k = torch.randn(L, 2, 8, generator=g)
    v = torch.randn(L, 2, 8, generator=g)
    assert torch.allclose(_causal_attention(q, k, v, 0.3, window), _reference(q, k, v, 0.3, window), atol=1e-5)


@pytest.mark.parametrize("n,L,window,hq,hkv", [(7, 7, None, 6, 2), (5, 23, None, 8, 1), (16, 40, 9, 4, 4),
                                               (64, 300, 100, 64, 8)])
def test_prefill_attention_with_sinks_keeps_one_mask_for_every_head(n, L, window, hq, hkv, sdpa_masks):
    """gpt-oss's sinks in a prefill chunk: the reference's answer, through a [n, keys] bool mask
    shared by the heads, so SDPA keeps its fused kernel. A float mask per query head, [1, heads,
    n, keys + 1], took 1.1 GB at 64 heads, 512 tokens over 8,192 keys (17 GB at 128k)."""
    g = torch.Generator().manual_seed(n + L + hq)
    q, k, v = (torch.randn(m, h, 16, generator=g, dtype=torch.float64) for m, h in ((n, hq), (L, hkv), (L, hkv)))
    sinks = 3 * torch.randn(hq, generator=g, dtype=torch.float64)
    sinks[0] = 40.0  # far above every score: that head's output shrinks towards 0
    got = _causal_attention(q, k, v, 0.25, window, sinks=sinks)
    assert torch.allclose(got, _reference(q, k, v, 0.25, window, sinks), atol=1e-10)
    assert not torch.allclose(got, _reference(q, k, v, 0.25, window), atol=1e-3)  # the sinks change it
    assert sdpa_masks[0].dtype == torch.bool and tuple(sdpa_masks[0].shape) == (n, L + 1)


def test_one_chunk_shares_its_masks_across_layers_of_different_windows():
    """A step's prefill chunk builds its mask once and every layer reuses it: layers with and
    without a sliding window must each get their own."""
    n, L = 10, 36
    seq = PrefillSeq(0, n, L, torch.empty(0))
    g = torch.Generator().manual_seed(5)
    for window in (None, 9, None, 9, 4):  # layer by layer, as a model with mixed windows runs
        q, k, v = (torch.randn(m, h, 8, generator=g) for m, h in ((n, 6), (L, 2), (L, 2)))
        assert torch.allclose(_causal_attention(q, k, v, 0.3, window, seq), _reference(q, k, v, 0.3, window),
                              atol=1e-5), window
    assert set(seq._masks) == {("allowed", None), ("allowed", 9), ("allowed", 4)}


@pytest.mark.parametrize("stale", [False, True])
def test_one_sequences_overflow_never_reaches_another_through_masked_keys(stale):
    """A float16 cache: request A's keys and values overflow to inf/NaN. Request B's decode
    gathers A's block as padding (block tables are padded with block 0), or as the stale tail of
    a block A freed and B now owns. Masked or not, an inf there made B's output NaN; B must get
    exactly what its own keys give."""
    bs, hkv, d = 4, 1, 8
    cache = torch.zeros(2, 3, bs, hkv, d, dtype=torch.float16)
    bad = torch.full((bs, hkv, d), float("inf"))
    bad[1] = float("nan")
    a_block = 1 if stale else 0
    write_kv(cache, -bad, bad, torch.arange(a_block * bs, (a_block + 1) * bs))  # A's whole block
    g = torch.Generator().manual_seed(3)
    n_b = 6  # B: block 2, then the first 2 slots of A's old block (stale) - or block 2 alone, padded with 0
    k_b = torch.randn(n_b if stale else 3, hkv, d, generator=g)
    v_b = torch.randn(n_b if stale else 3, hkv, d, generator=g)
    slots = torch.tensor([8, 9, 10, 11, 4, 5]) if stale else torch.tensor([8, 9, 10])
    write_kv(cache, k_b[:-1], v_b[:-1], slots[:-1])  # B's earlier tokens; its newest comes with the step
    table = torch.tensor([[2, 1]]) if stale else torch.tensor([[2, 0]])
    q = torch.randn(1, 2, d, generator=g)
    group = DecodeGroup(0, 1, table, torch.tensor([len(slots)]))
    meta = AttentionMetadata(slot_mapping=slots[-1:], decode_groups=[group], block_size=bs, cpu_kernels=False)
    out = paged_attention(q, k_b[-1:], v_b[-1:], cache, meta, scale=0.35)
    ks, vs = (x.to(torch.float16).float() for x in (k_b, v_b))
    expected = _reference(q, ks, vs, 0.35, None)
    assert torch.isfinite(out).all()
    assert torch.allclose(out, expected, atol=1e-3)
    kept = cache[:, a_block].float()
    assert torch.isfinite(kept).all()  # clamped where it was written: A's own rows are garbage either way
