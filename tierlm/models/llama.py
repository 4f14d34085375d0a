"""Llama-family decoder (Llama 2/3, Mistral, Ministral, Qwen2, Qwen3, Phi-3/Phi-4, Granite,
SmolLM3, Gemma 3 (text), OLMo 2 and 3, and the MoE variants Mixtral, Qwen2-MoE, Qwen3-MoE, GPT-OSS and GLM-4.5).

Plain torch in the gpt-fast style: a stack of decoder layers over a flat token batch.
Weights are fused where it saves matmuls (qkv, gate+up); `loader.py` maps HF names onto them.
"""
from __future__ import annotations

from dataclasses import replace

import torch
from torch import nn

from tierlm.models.attention import AttentionMetadata, paged_attention
from tierlm.models.config import ModelArgs
from tierlm.models.layers import GatedMLP, RotaryEmbedding, make_norm, rms_norm
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
        self.q_norm = self.k_norm = None
        if args.qk_norm:  # per head
            self.q_norm, self.k_norm = make_norm(args, self.head_dim), make_norm(args, self.head_dim)
        elif args.qk_norm_whole:  # OLMo: over all query heads at once, and all key heads
            self.q_norm, self.k_norm = make_norm(args, self.q_size), make_norm(args, self.kv_size)
        self.whole_qk_norm = args.qk_norm_whole
        # Gemma 3's sliding layers rotate with their own base; every other model has one RoPE.
        self.local_rope = self.window is not None and args.local_rope_theta is not None
        self.use_rope = args.rope_layers[layer] if args.rope_layers else True
        # fp8 caches store k / k_scale and v / v_scale (models/kv_scales.py sets them after loading).
        self.k_scale = self.v_scale = 1.0
        self.sinks = nn.Parameter(torch.zeros(self.num_heads)) if args.attention_sinks else None  # GPT-OSS

    def forward(self, x: torch.Tensor,
                ropes: tuple[tuple[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor], torch.Tensor | None],
                cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """`ropes`: the step's (cos, sin) tables, global then local (the same tables twice for
        models with one RoPE), then Ministral 3's query scale per position ([T, 1, 1]; None
        for every other model)."""
        T = x.shape[0]
        rope = ropes[1] if self.local_rope else ropes[0]
        qkv = self.qkv_proj(x)
        # Queries and keys are adjacent columns of the fused projection: rotate them together.
        if self.whole_qk_norm:
            q_k = (self.q_norm(qkv[:, : self.q_size]), self.k_norm(qkv[:, self.q_size: self.q_size + self.kv_size]))
            qk = torch.cat(q_k, dim=-1).view(T, self.num_heads + self.num_kv_heads, self.head_dim)
        else:
            qk = qkv[:, : self.q_size + self.kv_size].view(T, self.num_heads + self.num_kv_heads, self.head_dim)
            if self.q_norm is not None:
                qk = self._norm_heads(qk)
        if self.use_rope:
            qk = RotaryEmbedding.rotate(rope, qk)
        q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)
        if ropes[2] is not None:
            q = q * ropes[2]
        v = qkv[:, self.q_size + self.kv_size:].view(T, self.num_kv_heads, self.head_dim)
        o = paged_attention(q, k, v, cache, meta, self.scale, self.window, self.k_scale, self.v_scale, self.sinks)
        return self.o_proj(o.reshape(T, self.q_size))

    def _norm_heads(self, qk: torch.Tensor) -> torch.Tensor:
        """The per-head RMSNorm of queries (q_norm) and keys (k_norm) of Qwen3 and Gemma 3, both
        in one op: each head normalised over head_dim, then scaled by its side's weight."""
        D = self.head_dim
        weight = torch.cat((self.q_norm.weight.expand(self.num_heads, D), self.k_norm.weight.expand(self.num_kv_heads, D)))
        return rms_norm(qk, weight, self.q_norm.eps, self.q_norm.plus_one)


class DecoderLayer(nn.Module):
    def __init__(self, args: ModelArgs, layer: int) -> None:
        super().__init__()
        self.self_attn = Attention(args, layer)
        self.mlp: nn.Module = (SparseMoE(args) if args.moe_layers[layer]
                               else GatedMLP(args.hidden_size, args.intermediate_size, args.hidden_act))
        self.post_only = args.post_norms_only
        if not self.post_only:
            self.input_layernorm = make_norm(args, args.hidden_size)
        self.post_attention_layernorm = make_norm(args, args.hidden_size)
        self.sandwich = args.sandwich_norms
        if self.sandwich:  # Gemma: post_attention_layernorm norms the attention output; these wrap the MLP
            self.pre_feedforward_layernorm = make_norm(args, args.hidden_size)
        if self.sandwich or self.post_only:
            self.post_feedforward_layernorm = make_norm(args, args.hidden_size)
        self.residual_multiplier = args.residual_multiplier

    def forward(self, x, ropes, cache, meta):
        if self.post_only:  # OLMo 2 and 3: each branch's output normed, its input not
            x = x + self.post_attention_layernorm(self.self_attn(x, ropes, cache, meta))
            return x + self.post_feedforward_layernorm(self.mlp(x))
        if self.sandwich:
            x = x + self.post_attention_layernorm(self.self_attn(self.input_layernorm(x), ropes, cache, meta))
            return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))
        x = self._residual(x, self.self_attn(self.input_layernorm(x), ropes, cache, meta))
        return self._residual(x, self.mlp(self.post_attention_layernorm(x)))

    def _residual(self, x: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        """x + h, with h scaled by Granite's residual multiplier (no op where it is 1)."""
        return x + (h if self.residual_multiplier == 1.0 else h * self.residual_multiplier)


class CausalLM(nn.Module):
    """Forward over a flat batch of new tokens; returns logits only where asked (sampled rows)."""

    def __init__(self, args: ModelArgs, max_positions: int) -> None:
        super().__init__()
        self.args = args
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(args, i) for i in range(args.num_layers))
        self.norm = make_norm(args, args.hidden_size)
        self.lm_head = nn.Linear(args.hidden_size, args.vocab_size, bias=False)
        if args.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.build_rope(max_positions)

    def build_rope(self, max_positions: int, device: torch.device | None = None) -> None:
        """The RoPE tables (and Gemma 3's second, unscaled set for its sliding layers), moved to
        `device` when given (the loader builds them again after the weights: they are computed,
        not loaded)."""
        self.rope = RotaryEmbedding(self.args, max_positions)
        self.rope_local: RotaryEmbedding | None = None
        if self.args.local_rope_theta is not None:
            local = replace(self.args, rope_theta=self.args.local_rope_theta, rope_scaling=None)
            self.rope_local = RotaryEmbedding(local, max_positions)
        if device is not None:
            self.rope.to(device)
            if self.rope_local is not None:
                self.rope_local.to(device)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor],
                meta: AttentionMetadata, logits_indices: torch.Tensor | None = None) -> torch.Tensor:
        return self.compute_logits(self.hidden_states(input_ids, positions, kv_caches, meta, logits_indices))

    def hidden_states(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor],
                      meta: AttentionMetadata, logits_indices: torch.Tensor | None = None) -> torch.Tensor:
        """The final-normed hidden states of the rows `logits_indices` picks (all rows when None):
        everything but the vocabulary projection, which a recorded graph leaves out (its [rows,
        vocab] output would stay allocated for every graph)."""
        h = self.embed_tokens(input_ids)
        if self.args.embedding_multiplier != 1.0:
            scale = self.args.embedding_multiplier
            # Gemma rounds its scale to the weights' dtype first; Granite multiplies by the float.
            h = h * (torch.tensor(scale, dtype=h.dtype) if self.args.embedding_multiplier_in_dtype else scale)
        rope = self.rope.tables(positions, h.dtype)
        ropes = (rope, self.rope_local.tables(positions, h.dtype) if self.rope_local is not None else rope,
                 self._query_scale(positions, h.dtype))
        for layer, cache in zip(self.layers, kv_caches):
            h = layer(h, ropes, cache, meta)
        if logits_indices is not None:
            h = h[logits_indices]
        return self.norm(h)

    def _query_scale(self, positions: torch.Tensor, dtype: torch.dtype) -> torch.Tensor | None:
        """Ministral 3's 1 + beta * log(1 + floor(position / original)), [T, 1, 1], computed in
        float32 and rounded to `dtype` as transformers does; None for other models."""
        beta = self.args.query_scale_beta
        if not beta:
            return None
        scale = 1 + beta * torch.log(1 + torch.floor(positions / self.args.query_scale_original))
        return scale.to(dtype).view(-1, 1, 1)

    def compute_logits(self, h: torch.Tensor) -> torch.Tensor:
        """float32 logits of final-normed hidden states."""
        logits = self.lm_head(h)
        if self.args.logits_scaling != 1.0:
            logits = logits / self.args.logits_scaling
        return logits.float()
