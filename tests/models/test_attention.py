"""Prefill attention against a plain reference: GQA, a cached context before the chunk, and
sliding windows."""
from __future__ import annotations

import pytest
import torch

from tierlm.models.attention import PrefillSeq, _causal_attention


def _reference(q, k, v, scale, window):
    n, L = q.shape[0], k.shape[0]
    G = q.shape[1] // k.shape[1]
    kk, vv = k.repeat_interleave(G, 1), v.repeat_interleave(G, 1)
    scores = torch.einsum("nhd,lhd->hnl", q, kk) * scale
    qpos, kpos = torch.arange(L - n, L)[:, None], torch.arange(L)[None, :]
    allowed = kpos <= qpos
    if window is not None:
        allowed &= kpos > qpos - window
    scores = scores.masked_fill(~allowed, float("-inf"))
    return torch.einsum("hnl,lhd->nhd", torch.softmax(scores, -1), vv)


@pytest.mark.parametrize("n,L,window", [(7, 7, None), (5, 23, None), (16, 40, 9), (1, 30, None), (12, 12, 4),
                                       (300, 900, None), (64, 700, 100)])
def test_prefill_attention_matches_the_reference(n, L, window):
    g = torch.Generator().manual_seed(n * 100 + L)
    q = torch.randn(n, 6, 8, generator=g)
    k = torch.randn(L, 2, 8, generator=g)
    v = torch.randn(L, 2, 8, generator=g)
    assert torch.allclose(_causal_attention(q, k, v, 0.3, window), _reference(q, k, v, 0.3, window), atol=1e-5)


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
