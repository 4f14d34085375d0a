"""The explicit-GEMM prefill attention (short chunks on CPU) against SDPA and a plain reference:
GQA, a cached context before the chunk, and sliding windows."""
from __future__ import annotations

import pytest
import torch

from tierlm.models import attention
from tierlm.models.attention import PrefillSeq, _causal_attention, _sdpa_causal


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


@pytest.mark.parametrize("n,L,window", [(7, 7, None), (5, 23, None), (16, 40, 9), (1, 30, None), (12, 12, 4)])
def test_explicit_path_matches_sdpa_and_reference(n, L, window):
    g = torch.Generator().manual_seed(n * 100 + L)
    q = torch.randn(n, 6, 8, generator=g)
    k = torch.randn(L, 2, 8, generator=g)
    v = torch.randn(L, 2, 8, generator=g)
    ref = _reference(q, k, v, 0.3, window)
    explicit = _causal_attention(q, k, v, 0.3, window)
    assert torch.allclose(explicit, ref, atol=1e-5)
    assert torch.allclose(_sdpa_causal(q, k, v, 0.3, window), ref, atol=1e-5)


def test_one_chunk_shares_its_masks_across_layers_of_different_windows():
    """A step's prefill chunk builds its masks once and every layer reuses them: layers with and
    without a sliding window (and in another dtype) must each get their own, on both paths."""
    n, L = 10, 36
    seq = PrefillSeq(0, n, L, torch.empty(0))
    g = torch.Generator().manual_seed(5)
    for window in (None, 9, None, 9, 4):  # layer by layer, as a model with mixed windows runs
        for dtype in (torch.float32, torch.float64):
            q, k, v = (torch.randn(m, h, 8, generator=g, dtype=dtype) for m, h in ((n, 6), (L, 2), (L, 2)))
            ref = _reference(q, k, v, 0.3, window)
            assert torch.allclose(_causal_attention(q, k, v, 0.3, window, seq), ref, atol=1e-5), window
            assert torch.allclose(_sdpa_causal(q, k, v, 0.3, window, seq), ref, atol=1e-5), window
    assert {key[:2] for key in seq._masks} == {("allowed", None), ("allowed", 9), ("allowed", 4),
                                               ("bias", None), ("bias", 9), ("bias", 4)}


def test_long_problems_fall_back_to_sdpa(monkeypatch):
    """Past the score-matrix cap the blocked SDPA kernel is used (same result)."""
    monkeypatch.setattr(attention, "_EXPLICIT_SCORES_MAX", 10)
    calls = []
    real = attention._sdpa_causal
    monkeypatch.setattr(attention, "_sdpa_causal", lambda *a: calls.append(1) or real(*a))
    q, k, v = torch.randn(4, 4, 8), torch.randn(9, 2, 8), torch.randn(9, 2, 8)
    out = _causal_attention(q, k, v, 0.5, None)
    assert calls and torch.allclose(out, _reference(q, k, v, 0.5, None), atol=1e-5)
