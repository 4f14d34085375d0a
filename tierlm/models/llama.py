"""Llama-family decoder (Llama 2/3, Mistral, Qwen2, Qwen3, Phi-3/Phi-4, Granite, and the MoE
variants Mixtral, Qwen2-MoE and Qwen3-MoE).

Plain torch in the gpt-fast style: a stack of decoder layers over a flat token batch.
Weights are fused where it saves matmuls (qkv, gate+up); `loader.py` maps HF names onto them.
"""
from __future__ import annotations

import torch
from torch import nn
import torch.nn.functional as F

from tierlm.models.attention import AttentionMetadata, paged_attention
from tierlm.models.config import ModelArgs
from tierlm.models.layers import GatedMLP, RMSNorm, RotaryEmbedding
from tierlm.models.moe import SparseMoE


class Attention(nn.Module):
    def __init__(self, args: ModelArgs, layer: int) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = args.num_heads, args.num_kv_heads, args.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.qkv_proj = nn.Linear(args.hidden_size, self.q_size + 2 * self.kv_size, bias=args.qkv_bias)
        self.o_proj = nn.Linear(self.q_size, args.hidden_size, bias=args.o_bias)
        self.scale = args.attention_multiplier or self.head_dim ** -0.5
        self.window = args.sliding_windows[layer] if args.sliding_windows else None
        self.q_norm = RMSNorm(self.head_dim, args.rms_norm_eps) if args.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, args.rms_norm_eps) if args.qk_norm else None

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
                cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        T = x.shape[0]
        qkv = self.qkv_proj(x)
        # Queries and keys are adjacent columns of the fused projection: rotate them together.
        qk = qkv[:, : self.q_size + self.kv_size].view(T, self.num_heads + self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            qk = self._norm_heads(qk)
        q, k = RotaryEmbedding.rotate(rope, qk).split([self.num_heads, self.num_kv_heads], dim=1)
        v = qkv[:, self.q_size + self.kv_size:].view(T, self.num_kv_heads, self.head_dim)
        o = paged_attention(q, k, v, cache, meta, self.scale, self.window)
        return self.o_proj(o.reshape(T, self.q_size))

    def _norm_heads(self, qk: torch.Tensor) -> torch.Tensor:
        """Qwen3's per-head RMSNorm of queries (q_norm) and keys (k_norm), both in one op: each
        head normalised over head_dim, then scaled by its side's weight, as the reference does."""
        D = self.head_dim
        weight = torch.cat((self.q_norm.weight.expand(self.num_heads, D), self.k_norm.weight.expand(self.num_kv_heads, D)))
        return weight * F.rms_norm(qk.float(), (D,), eps=self.q_norm.eps).to(qk.dtype)


class DecoderLayer(nn.Module):
    def __init__(self, args: ModelArgs, layer: int) -> None:
        super().__init__()
        self.self_attn = Attention(args, layer)
        self.mlp: nn.Module = SparseMoE(args) if args.moe_layers[layer] else GatedMLP(args.hidden_size, args.intermediate_size)
        self.input_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.residual_multiplier = args.residual_multiplier

    def forward(self, x, rope, cache, meta):
        h = self.self_attn(self.input_layernorm(x), rope, cache, meta)
        x = x + (h if self.residual_multiplier == 1.0 else h * self.residual_multiplier)
        h = self.mlp(self.post_attention_layernorm(x))
        return x + (h if self.residual_multiplier == 1.0 else h * self.residual_multiplier)


class CausalLM(nn.Module):
    """Forward over a flat batch of new tokens; returns logits only where asked (sampled rows)."""

    def __init__(self, args: ModelArgs, max_positions: int) -> None:
        super().__init__()
        self.args = args
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(args, i) for i in range(args.num_layers))
        self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.lm_head = nn.Linear(args.hidden_size, args.vocab_size, bias=False)
        if args.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.rope = RotaryEmbedding(args, max_positions)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor],
                meta: AttentionMetadata, logits_indices: torch.Tensor | None = None) -> torch.Tensor:
        h = self.embed_tokens(input_ids)
        if self.args.embedding_multiplier != 1.0:
            h = h * self.args.embedding_multiplier
        rope = self.rope.tables(positions, h.dtype)
        for layer, cache in zip(self.layers, kv_caches):
            h = layer(h, rope, cache, meta)
        if logits_indices is not None:
            h = h[logits_indices]
        logits = self.lm_head(self.norm(h))
        if self.args.logits_scaling != 1.0:
            logits = logits / self.args.logits_scaling
        return logits.float()
