"""CPU linear layers: oneDNN-prepacked float32 weights, plus a bf16-weight path for decode batches.

At decode batch sizes (tens of rows) MKL's sgemm spends much of its time re-laying out the
weight matrix; oneDNN's inner-product kernel on a weight packed once at load time is measurably
faster there (about 20% on the reference machine). Enabled only on CPU, in float32, when a
start-up measurement on a layer-sized GEMM shows the gain — never assumed.

When the checkpoint is bf16 but computed in float32 (see loader.cpu_prefers_fp32), a decode step
still streams float32 weights. Bf16DecodeLinear also keeps the bf16 weights and sends small
batches through tierlm's bf16-weight float32 kernel (cpu_kernels): half the bytes per step, same
values. Prefill-sized batches stay on the float32 GEMM, which is faster once compute-bound.
"""
from __future__ import annotations

import logging
import statistics
import time
from collections.abc import Callable

import torch
from torch import nn

from tierlm.models import cpu_kernels
from tierlm.models.moe import SparseMoE

log = logging.getLogger(__name__)


def _available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")


class PackedLinear(nn.Module):
    """Drop-in for nn.Linear (inference only) holding its weight in oneDNN's packed layout."""

    def __init__(self, linear: nn.Linear, batch_hint: int = 32) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.packed = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), batch_hint)
        self.bias = linear.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        y = torch.ops.mkldnn._linear_pointwise(x.reshape(-1, self.in_features), self.packed, self.bias,
                                               "none", [], "")
        return y.reshape(*lead, self.out_features)


def time_ratio(candidate: Callable[[], object], baseline: Callable[[], object], reps: int = 11) -> float:
    """Median of time(candidate) / time(baseline) over interleaved runs.

    Interleaving and the median keep a burst of load from another process (common on shared
    machines) from flipping a start-up decision, which separate best-of-N timings did.
    """
    candidate(), baseline()
    ratios = []
    for _ in range(reps):
        t0 = time.perf_counter()
        candidate()
        t1 = time.perf_counter()
        baseline()
        ratios.append((t1 - t0) / max(time.perf_counter() - t1, 1e-9))
    return statistics.median(ratios)


_FASTER: bool | None = None


def packing_pays_off() -> bool:
    """Measure once per process: packed vs plain float32 GEMM at a decode-like batch."""
    global _FASTER
    if _FASTER is None:
        if not _available():
            _FASTER = False
        else:
            lin = nn.Linear(1024, 4096, bias=False)
            packed = PackedLinear(lin)
            x = torch.randn(32, 1024)
            with torch.inference_mode():
                _FASTER = time_ratio(lambda: packed(x), lambda: lin(x)) < 0.95
    return _FASTER


def pack_linears(model: nn.Module) -> int:
    """Replace every float32 nn.Linear in `model` by a PackedLinear; returns how many."""
    n = 0
    for name, child in list(model.named_children()):
        if isinstance(child, nn.Linear) and child.weight.dtype == torch.float32:
            setattr(model, name, PackedLinear(child))
            n += 1
        else:
            n += pack_linears(child)
    return n


# Rows up to which the bf16-weight kernel beats oneDNN's packed float32 GEMM on the reference
# machine (1.8x at 1 row, 1.3x at 32, even at 48) with the weights streamed from memory.
DECODE_MAX_ROWS = 40


class Bf16DecodeLinear(nn.Module):
    """A float32 linear whose weights are exactly bf16 values: batches of up to `max_rows` rows run
    on the bf16-weight kernel, larger ones on `inner` (nn.Linear, or PackedLinear once packed)."""

    def __init__(self, linear: nn.Linear, max_rows: int = DECODE_MAX_ROWS) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.inner = linear
        self.packed_bf16 = cpu_kernels.pack_bf16(linear.weight.detach().to(torch.bfloat16))
        self.max_rows = max_rows

    @property
    def bias(self) -> torch.Tensor | None:
        return self.inner.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        rows = x.numel() // self.in_features
        if rows <= self.max_rows:
            y = cpu_kernels.gemm_bf16w(x.reshape(rows, self.in_features), self.packed_bf16, self.out_features,
                                       self.bias)
            if y is not None:
                return y.reshape(*lead, self.out_features)
        return self.inner(x)


class Bf16Experts:
    """bf16 copies of a SparseMoE's stacked expert weights ([E, 2I, H] and [E, H, I]) for the
    bf16-weight kernel: an expert's decode-sized token group streams half the bytes."""

    def __init__(self, w13: torch.Tensor, w2: torch.Tensor, max_rows: int = DECODE_MAX_ROWS) -> None:
        self.packed = [[cpu_kernels.pack_bf16(w[e].to(torch.bfloat16)) for e in range(w.shape[0])] for w in (w13, w2)]
        self.out_features = (w13.shape[1], w2.shape[1])
        self.max_rows = max_rows

    def linear(self, x: torch.Tensor, which: int, expert: int,
               bias: torch.Tensor | None = None) -> torch.Tensor | None:
        """x @ W^T (+ bias) for expert `expert`'s w13 (which=0) or w2 (1); None for batches too large."""
        if x.shape[0] > self.max_rows:
            return None
        return cpu_kernels.gemm_bf16w(x, self.packed[which][expert], self.out_features[which], bias)


def _bf16_exact(w: torch.Tensor) -> bool:
    return w.dtype == torch.float32 and torch.equal(w.to(torch.bfloat16).float(), w)


def add_bf16_decode_path(model: nn.Module) -> int:
    """Give every float32 linear layer (and MoE expert stack) whose weights are bf16-exact the
    bf16-weight decode path; returns how many."""
    if not cpu_kernels.has_avx512():
        return 0
    n = 0
    for name, child in list(model.named_children()):
        if isinstance(child, nn.Linear):
            if _bf16_exact(child.weight.detach()):
                setattr(model, name, Bf16DecodeLinear(child))
                n += 1
            continue
        if isinstance(child, SparseMoE) and _bf16_exact(child.w13.detach()) and _bf16_exact(child.w2.detach()):
            child.bf16_experts = Bf16Experts(child.w13.detach(), child.w2.detach())
            n += 2
        n += add_bf16_decode_path(child)
    return n
