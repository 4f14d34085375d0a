"""Sparse mixture-of-experts blocks: top-k routing, experts run only on their tokens.

Tokens are grouped by expert (one sort), so each routed expert does one matmul over exactly
the tokens sent to it; experts nobody chose cost nothing. Expert weights are stacked
([E, 2I, H] and [E, H, I]) so loading and a future fused kernel see one tensor per layer.

Grouping has data-dependent shapes, which a CUDA graph cannot record. For fixed-shape steps
(engine/graphs.py) `static_shapes` is set while the step runs, and every expert runs on every
token, weighted by its routing weight (zero where not chosen). The engine takes that path only
for steps with enough tokens that grouping would touch every expert anyway (tokens x top-k >=
experts), so it reads no more weights than grouping does; the extra arithmetic is small there.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn
import torch.nn.functional as F

from tierlm.models.config import ModelArgs
from tierlm.models.layers import GatedMLP

if TYPE_CHECKING:
    from tierlm.models.cpu_linear import Bf16Experts


class SparseMoE(nn.Module):
    """Top-k router + grouped experts, optionally with a sigmoid-gated shared expert (Qwen2-MoE)."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        E, H, I = args.num_experts, args.hidden_size, args.moe_intermediate_size
        self.num_experts, self.top_k, self.inter = E, args.num_experts_per_tok, I
        self.norm_topk_prob = args.norm_topk_prob
        self.gate = nn.Linear(H, E, bias=args.moe_bias)
        self.w13 = nn.Parameter(torch.empty(E, 2 * I, H))
        self.w2 = nn.Parameter(torch.empty(E, H, I))
        # GPT-OSS: biases on every expert projection, a clamped SwiGLU, and a router that
        # softmaxes its top-k logits (everyone else: top-k of the softmax over all experts).
        self.b13 = nn.Parameter(torch.empty(E, 2 * I)) if args.moe_bias else None
        self.b2 = nn.Parameter(torch.empty(E, H)) if args.moe_bias else None
        self.topk_then_softmax = args.router_topk_then_softmax
        self.swiglu_alpha, self.swiglu_limit = args.swiglu_alpha, args.swiglu_limit
        self.shared_expert: GatedMLP | None = None
        self.shared_expert_gate: nn.Linear | None = None
        if args.shared_expert_intermediate_size:
            self.shared_expert = GatedMLP(H, args.shared_expert_intermediate_size)
            self.shared_expert_gate = nn.Linear(H, 1, bias=False)
        # Mixtral keeps routing weights in float32 when scaling expert outputs; Qwen2-MoE casts
        # them to the activation dtype first. Matching each keeps outputs bit-close to reference.
        self.weights_in_fp32 = args.model_type == "mixtral"
        # Set by cpu_linear.add_bf16_decode_path: bf16 expert weights for small token groups.
        self.bf16_experts: Bf16Experts | None = None
        self.static_shapes = False  # set while a fixed-shape step runs: every expert on every token

    def _route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each token's top-k routing weights and experts, [T, k] each."""
        if self.topk_then_softmax:  # GPT-OSS: in the activations' dtype, as its reference does
            logits, experts = torch.topk(self.gate(x), self.top_k, dim=-1)
            return torch.softmax(logits, dim=-1), experts
        probs = torch.softmax(self.gate(x).float(), dim=-1)
        weights, experts = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        if not self.weights_in_fp32:
            weights = weights.to(x.dtype)
        return weights, experts

    def _act(self, h: torch.Tensor) -> torch.Tensor:
        """The gated activation of [..., 2I] gate+up outputs: SwiGLU, or GPT-OSS's clamped
        variant (up + 1) * gate * sigmoid(alpha * gate), in its reference's order of operations."""
        gate, up = h.split(self.inter, dim=-1)
        if not self.swiglu_alpha:
            return F.silu(gate) * up
        if self.swiglu_limit is not None:
            gate, up = gate.clamp(max=self.swiglu_limit), up.clamp(-self.swiglu_limit, self.swiglu_limit)
        return (up + 1) * (gate * torch.sigmoid(gate * self.swiglu_alpha))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self._all_experts(x) if self.static_shapes else self._grouped(x)
        if self.shared_expert is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out

    def _all_experts(self, x: torch.Tensor) -> torch.Tensor:
        weights, experts = self._route(x)
        dense = torch.zeros(x.shape[0], self.num_experts, dtype=weights.dtype, device=x.device)
        dense.scatter_(1, experts, weights)  # [T, E]: the routing weight, 0 where not chosen
        h = torch.matmul(x, self.w13.transpose(1, 2))  # [E, T, 2I]
        if self.b13 is not None:
            h = h + self.b13[:, None, :]
        y = torch.matmul(self._act(h), self.w2.transpose(1, 2))  # [E, T, H]
        if self.b2 is not None:
            y = y + self.b2[:, None, :]
        return (y * dense.t().unsqueeze(-1)).to(x.dtype).sum(dim=0)

    def _grouped(self, x: torch.Tensor) -> torch.Tensor:
        weights, experts = self._route(x)
        flat = experts.reshape(-1)
        order = torch.argsort(flat, stable=True)
        token_of = order // self.top_k
        w_sorted = weights.reshape(-1)[order]
        counts = torch.bincount(flat, minlength=self.num_experts).tolist()
        out = torch.zeros_like(x)
        bf = self.bf16_experts
        start = 0
        for e, c in enumerate(counts):
            if c == 0:
                continue
            idx = token_of[start:start + c]
            xe = x[idx]
            b13 = self.b13[e] if self.b13 is not None else None
            b2 = self.b2[e] if self.b2 is not None else None
            h = bf.linear(xe, 0, e, b13) if bf is not None else None
            if h is None:
                h = F.linear(xe, self.w13[e], b13)
            act = self._act(h)
            y = bf.linear(act, 1, e, b2) if bf is not None else None
            if y is None:
                y = F.linear(act, self.w2[e], b2)
            y = y * w_sorted[start:start + c, None]
            out.index_add_(0, idx, y.to(x.dtype))
            start += c
        return out
