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
    """Top-k router + grouped experts, optionally with a shared expert beside them (sigmoid-gated
    in Qwen2-MoE; ungated in GLM-4.5)."""

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
            if args.shared_expert_gated:
                self.shared_expert_gate = nn.Linear(H, 1, bias=False)
        # GLM-4.5's grouped sigmoid router (config.py: router_groups); its weight and bias stay
        # float32 whatever the model's dtype (keep_routers_in_fp32), as transformers keeps them.
        self.groups, self.topk_groups = args.router_groups, args.router_topk_groups
        self.routed_scaling_factor = args.routed_scaling_factor
        self.e_score_correction_bias = nn.Parameter(torch.zeros(E)) if self.groups else None
        # Mixtral and GLM-4.5 keep routing weights in float32 when scaling expert outputs;
        # Qwen2-MoE casts them to the activation dtype first. Matching each keeps outputs
        # bit-close to reference.
        self.weights_in_fp32 = args.model_type in ("mixtral", "glm4_moe")
        # Set by cpu_linear.add_bf16_decode_path: bf16 expert weights for small token groups.
        self.bf16_experts: Bf16Experts | None = None
        self.static_shapes = False  # set while a fixed-shape step runs: every expert on every token

    def _route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each token's top-k routing weights and experts, [T, k] each."""
        if self.topk_then_softmax:  # GPT-OSS: in the activations' dtype, as its reference does
            logits, experts = torch.topk(self.gate(x), self.top_k, dim=-1)
            return torch.softmax(logits, dim=-1), experts
        if self.groups:
            return self._route_grouped_sigmoid(x)
        probs = torch.softmax(self.gate(x).float(), dim=-1)
        weights, experts = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        if not self.weights_in_fp32:
            weights = weights.to(x.dtype)
        return weights, experts

    def _route_grouped_sigmoid(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """GLM-4.5's router, in float32 as transformers' Glm4MoeTopkRouter: sigmoid scores; the
        scores plus the correction bias choose, first the best `topk_groups` groups (each by the
        sum of its two best), then the top-k experts within them; the chosen experts' own scores
        are their weights, normalised to sum to 1 if norm_topk_prob, times routed_scaling_factor."""
        scores = torch.sigmoid(self.gate(x.float()))
        choice = scores + self.e_score_correction_bias
        T, E = choice.shape
        best_two = choice.view(T, self.groups, E // self.groups).topk(2, dim=-1)[0].sum(dim=-1)
        chosen = torch.topk(best_two, self.topk_groups, dim=-1, sorted=False)[1]
        in_group = torch.zeros_like(best_two, dtype=torch.bool).scatter_(1, chosen, True)
        choice = choice.masked_fill(~in_group.repeat_interleave(E // self.groups, dim=1), float("-inf"))
        experts = torch.topk(choice, self.top_k, dim=-1, sorted=False)[1]
        weights = scores.gather(1, experts)
        if self.norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights * self.routed_scaling_factor, experts

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
            shared = self.shared_expert(x)
            out = out + (shared if self.shared_expert_gate is None else torch.sigmoid(self.shared_expert_gate(x)) * shared)
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


def keep_routers_in_fp32(model: nn.Module) -> set[str]:
    """GLM-4.5's router weights and correction biases back to float32 after the model took a
    narrower dtype (transformers keeps them so: _keep_in_fp32_modules_strict); the names of
    those parameters, which the loader copies unrounded."""
    names: set[str] = set()
    for prefix, m in model.named_modules():
        if isinstance(m, SparseMoE) and m.groups:
            m.gate.float()
            m.e_score_correction_bias.data = m.e_score_correction_bias.data.float()
            names |= {f"{prefix}.gate.weight", f"{prefix}.e_score_correction_bias"}
    return names
