"""Paged attention: K/V live in fixed-size blocks; each sequence reads them via its block table.

One step's batch is flat (no padding): decodes come first (one query token each), sorted by
context length and attended in a few batched matmuls over their gathered blocks (groups of
similar length, so padding stays small); prefill chunks follow and are attended one sequence
at a time with SDPA and a causal mask offset by the cached context.
On CPU, decodes go through tierlm's own kernel (cpu_kernels), which reads the paged K/V in place,
and so do prefill chunks of a few queries over a cached context (each query a decode row); the
PyTorch path above is the fallback and the reference. A CUDA kernel would slot in the same way.

A third layout, `PaddedBatch`, gives a step fixed shapes (rows x width query tokens over a fixed
block-table width) so it can be recorded once as a CUDA graph and replayed (engine/graphs.py).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from tierlm.models import cpu_kernels
from tierlm.models.kv_dtype import as_bytes, is_fp8, to_storage


KERNEL_CHUNK_MAX = 16  # prefill chunks of up to this many queries over a cached context: CPU decode kernel


@dataclass
class PrefillSeq:
    """One prefill chunk: query tokens [q_start, q_end) of the flat batch, `ctx_len` keys in total."""

    q_start: int
    q_end: int
    ctx_len: int
    block_table: torch.Tensor  # [num_blocks] long, covering ctx_len
    _masks: dict = field(default_factory=dict)  # built by the first layer, shared by the others

    def kernel_rows(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(block tables, key counts) that run this chunk's queries as decode rows (query i sees
        the first ctx_len - n + 1 + i keys), for a chunk of at most KERNEL_CHUNK_MAX queries
        over a cached context; None otherwise (a fresh prompt attends to its own keys in one
        SDPA call). Built once per step, shared by every layer."""
        if "kernel" not in self._masks:
            n = self.q_end - self.q_start
            rows = None
            if n <= KERNEL_CHUNK_MAX and n < self.ctx_len:
                lens = torch.arange(self.ctx_len - n + 1, self.ctx_len + 1, device=self.block_table.device)
                rows = (self.block_table.expand(n, -1).contiguous(), lens)
            self._masks["kernel"] = rows
        return self._masks["kernel"]

    def allowed(self, window: int | None, device: torch.device) -> torch.Tensor:
        """[n, ctx_len] bool: which keys each of the chunk's queries may attend to (causal, offset
        by the cached context; within `window` when set)."""
        key = ("allowed", window)
        if key not in self._masks:
            n, L = self.q_end - self.q_start, self.ctx_len
            qpos = torch.arange(L - n, L, device=device)[:, None]
            kpos = torch.arange(L, device=device)[None, :]
            allowed = kpos <= qpos
            if window is not None:
                allowed &= kpos > qpos - window
            self._masks[key] = allowed
        return self._masks[key]


@dataclass
class DecodeGroup:
    """Decodes [start, end) of similar context length, attended in one padded batch."""

    start: int
    end: int
    block_tables: torch.Tensor  # [end - start, max_blocks] long (padded with 0)
    ctx_lens: torch.Tensor  # [end - start] long: keys per decode incl. the new one
    _masks: dict = field(default_factory=dict)  # per sliding window, shared by every layer

    def longest(self) -> int:
        """The longest context in the group, read once per step (not once per layer)."""
        if "longest" not in self._masks:
            self._masks["longest"] = int(self.ctx_lens.max()) if self.end > self.start else 0
        return self._masks["longest"]

    def mask(self, max_len: int, window: int | None) -> torch.Tensor:
        if window not in self._masks:
            pos = torch.arange(max_len, device=self.ctx_lens.device)[None, :]
            lens = self.ctx_lens[:, None]
            allowed = pos < lens
            if window is not None:
                allowed &= pos > (lens - 1 - window)
            self._masks[window] = allowed[:, None, None, :]  # [B, 1, 1, L]
        return self._masks[window]


@dataclass
class PaddedBatch:
    """A step of fixed shape: `rows` sequences of `width` query tokens each (token t of the flat
    batch is row t // width), every row reading `block_tables.shape[1]` blocks.

    Padding tokens sit at position 0 and write their K/V to a scratch slot no block table names;
    padding table entries are masked out by position (their keys lie past every query). Every
    tensor here is a view of the step's static input buffer, and the mask is computed from them
    inside the forward, so a recorded graph recomputes it from the new contents at each replay.
    """

    rows: int
    width: int
    block_tables: torch.Tensor  # [rows, blocks] long
    positions: torch.Tensor  # [rows, width] long: each query token's position
    _masks: dict = field(default_factory=dict)  # per window, built by the first layer

    def mask(self, num_keys: int, window: int | None, group: int) -> torch.Tensor:
        """[rows, 1, width * group, num_keys] bool, queries laid out as (token, head of the group)."""
        if window not in self._masks:
            kpos = torch.arange(num_keys, device=self.positions.device)
            qpos = self.positions[:, :, None]
            allowed = kpos <= qpos
            if window is not None:
                allowed &= kpos > qpos - window
            B, W = self.rows, self.width
            self._masks[window] = allowed[:, None, :, None, :].expand(B, 1, W, group, num_keys).reshape(
                B, 1, W * group, num_keys)
        return self._masks[window]

    def reset(self) -> None:
        """Forget the masks: the next forward builds them from the buffers' current contents (an
        eager replay must; a capture must, or the graph would hold the old mask as a constant)."""
        self._masks.clear()


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] long: where each new token's K/V is written
    decode_groups: list[DecodeGroup] = field(default_factory=list)  # the first tokens of the batch
    prefills: list[PrefillSeq] = field(default_factory=list)
    block_size: int = 16
    cpu_kernels: bool = True  # decode attention through tierlm's CPU kernel where it applies
    padded: PaddedBatch | None = None  # set: the whole step is this fixed-shape batch


def from_storage(kv: torch.Tensor, dtype: torch.dtype, kernels: bool = True) -> torch.Tensor:
    """Cached K/V (gathered) in the compute dtype: fp8 on CPU through tierlm's kernel unless
    `kernels` is off (torch's conversion is scalar there: ~30 ms of a 2,000-token prefix hit's
    0.2 s on the bench model)."""
    if kernels and is_fp8(kv.dtype):
        out = cpu_kernels.fp8_widen(kv, dtype)
        if out is not None:
            return out
    return kv.to(dtype)


def write_kv(cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor,
             k_scale: float = 1.0, v_scale: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Scatter new keys/values, divided by their scales, into their slots. cache: [2,
    num_blocks, block_size, Hkv, D]. Returns them as stored (in the cache's dtype; see
    kv_dtype.to_storage)."""
    kc = cache[0].view(-1, *k.shape[1:])
    vc = cache[1].view(-1, *v.shape[1:])
    k, v = to_storage(k, kc.dtype, k_scale), to_storage(v, vc.dtype, v_scale)
    as_bytes(kc).index_copy_(0, slots, as_bytes(k))
    as_bytes(vc).index_copy_(0, slots, as_bytes(v))
    return k, v


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    window: int | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """q: [T, Hq, D]; k, v: [T, Hkv, D] (new tokens). Returns [T, Hq, D].

    `k_scale` / `v_scale` (fp8 caches; models/kv_scales.py): the cache holds k / k_scale and
    v / v_scale. Attention reads the stored values as they are: k_scale folds into the softmax
    scale and v_scale multiplies the output, so no path widens and multiplies the cache.

    `sinks` ([Hq], GPT-OSS): a logit per query head that joins each softmax beside the keys' and
    contributes no value (see `_sink_dims`)."""
    k_stored, v_stored = write_kv(cache, k, v, meta.slot_mapping, k_scale, v_scale)
    if cache.dtype != q.dtype or k_scale != 1.0 or v_scale != 1.0:
        # A chunk attends to its own keys as later steps will read them back (rounded to the
        # cache's dtype), as vLLM's kernels do, reading everything from the cache: cold and
        # cached prefixes, and every chunking of a prompt, then see the same values.
        k, v = from_storage(k_stored, q.dtype, meta.cpu_kernels), from_storage(v_stored, q.dtype, meta.cpu_kernels)
    o = _attend(q, k, v, cache, meta, scale * k_scale, window, sinks)
    return o if v_scale == 1.0 else o.mul_(v_scale)  # o is this call's own tensor


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: torch.Tensor, meta: AttentionMetadata,
            scale: float, window: int | None, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """paged_attention over K/V as stored (the new tokens' already written)."""
    T, Hq, D = q.shape
    Hkv = k.shape[1]
    group = Hq // Hkv
    pieces: list[tuple[int, int, torch.Tensor]] = []  # (first row, end row, [rows, Hq, D])
    # Blocks as rows: one index_select gathers a sequence's blocks, keys and values together
    # (several times faster than advanced indexing on CPU; one op, not two, per layer).
    kv_rows = cache.view(2, cache.shape[1], -1)
    if meta.padded is not None:
        return _padded_attention(q, kv_rows, meta.padded, meta.block_size, scale, window, sinks)
    use_kernel = (meta.cpu_kernels and q.device.type == "cpu"
                  and (bool(meta.decode_groups) or any(p.kernel_rows() for p in meta.prefills))
                  and cpu_kernels.decode_attention_supported(q, cache))
    for g in meta.decode_groups:
        if use_kernel:
            # tierlm's CPU kernel reads the paged (bf16) K/V in place: no gather, convert or mask.
            o = cpu_kernels.decode_attention(q[g.start:g.end], cache, g.block_tables, g.ctx_lens, scale, window,
                                             longest=g.longest(), sinks=sinks)
            if o is not None:
                pieces.append((g.start, g.end, o))
                continue
        nd, bt = g.end - g.start, g.block_tables.view(-1)
        L = g.block_tables.shape[1] * meta.block_size
        kvd = from_storage(kv_rows.index_select(1, bt), q.dtype, meta.cpu_kernels).view(2, nd, L, Hkv, D).transpose(2, 3)
        kd, vd = kvd[0], kvd[1]
        qd = q[g.start:g.end].view(nd, Hkv, group, D)  # a KV head's query heads, as a query "length"
        mask = g.mask(L, window)
        if sinks is not None:  # query row j of KV head h is query head h * group + j
            qd, kd, vd, mask = _sink_dims(qd, kd, vd, mask, sinks, scale, _eye(group, q))
        o = F.scaled_dot_product_attention(qd, kd, vd, attn_mask=mask, scale=scale)[..., :D]
        pieces.append((g.start, g.end, o.reshape(nd, Hq, D)))
    for p in meta.prefills:
        qs = q[p.q_start:p.q_end]
        n = p.q_end - p.q_start
        if use_kernel and p.kernel_rows():
            # A few queries over a cached context (speculative guesses, the tail of a prompt after
            # a prefix hit, a short last chunk): each as a decode row over its own prefix of the
            # keys, read in place (2-4x the gather and masked SDPA below at up to 5 rows, still
            # ahead at 16; measured per layer at 300 and 2,000 keys on the bench model's shapes).
            tables, lens = p.kernel_rows()
            o = cpu_kernels.decode_attention(qs, cache, tables, lens, scale, window, longest=p.ctx_len, sinks=sinks)
            if o is not None:
                pieces.append((p.q_start, p.q_end, o))
                continue
        if p.ctx_len == n:
            # Nothing cached before this chunk: attend to the new keys directly.
            ks, vs = k[p.q_start:p.q_end], v[p.q_start:p.q_end]
        else:
            kvs = from_storage(kv_rows.index_select(1, p.block_table), q.dtype, meta.cpu_kernels).view(2, -1, Hkv, D)[:, : p.ctx_len]
            ks, vs = kvs[0], kvs[1]
        pieces.append((p.q_start, p.q_end, _causal_attention(qs, ks, vs, scale, window, p, sinks)))
    if len(pieces) == 1 and pieces[0][1] - pieces[0][0] == T:
        return pieces[0][2]  # one group or one prefill is the whole step: no copy into a buffer
    out = q.new_empty(q.shape)
    for start, end, o in pieces:
        out[start:end] = o
    return out


def _padded_attention(q: torch.Tensor, kv_rows: torch.Tensor, p: PaddedBatch, block_size: int, scale: float,
                      window: int | None, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Every row's queries over its gathered blocks in one SDPA call, a KV head's query heads
    folded into the query length (as for decodes above), so the shapes depend on the bucket only."""
    T, Hq, D = q.shape
    B, W = p.rows, p.width
    L = p.block_tables.shape[1] * block_size
    Hkv = kv_rows.shape[2] // (block_size * D)
    group = Hq // Hkv
    # torch ops only: what a CUDA graph records and replays.
    kv = from_storage(kv_rows.index_select(1, p.block_tables.view(-1)), q.dtype, kernels=False).view(
        2, B, L, Hkv, D).transpose(2, 3)
    qg = q.view(B, W, Hkv, group, D).transpose(1, 2).reshape(B, Hkv, W * group, D)
    kp, vp, mask = kv[0], kv[1], p.mask(L, window, group)
    if sinks is not None:  # query row w * group + j of KV head h is query head h * group + j
        qg, kp, vp, mask = _sink_dims(qg, kp, vp, mask, sinks, scale, _eye(group, q).repeat(W, 1))
    o = F.scaled_dot_product_attention(qg, kp, vp, attn_mask=mask, scale=scale)[..., :D]
    return o.reshape(B, Hkv, W, group, D).transpose(1, 2).reshape(T, Hq, D)


def _sink_key(x: torch.Tensor) -> torch.Tensor:
    """x ([..., keys, D]) with one more key of zeros: the sink's value (see `_sink_dims`)."""
    return torch.cat((x, x.new_zeros(*x.shape[:-2], 1, x.shape[-1])), dim=-2)


def _causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                      window: int | None, seq: PrefillSeq | None = None,
                      sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention of the last q.shape[0] positions over all k.shape[0] keys (`seq`, when
    given, holds the mask across layers).

    Through SDPA on [1, heads, tokens, head_dim] views: with a batch dimension SDPA may pick its
    fused kernels (its blocked CPU kernel; flash on CUDA), which it never does for 3-D inputs.
    Measured on the 2-core CPU at 32-2,048 tokens over up to 2,048 keys (float32): 2-4x faster
    than two explicit GEMMs per KV head, which were in turn 2x faster than 3-D SDPA.
    """
    n, L = q.shape[0], k.shape[0]
    qh, kh, vh = (t.transpose(0, 1).unsqueeze(0) for t in (q, k, v))
    if n == L and window is None and sinks is None:
        o = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, scale=scale, enable_gqa=True)
    else:
        seq = seq or PrefillSeq(0, n, L, torch.empty(0))
        mask = seq.allowed(window, q.device)
        if sinks is not None:  # query head h is row h % group of its KV head's
            group = qh.shape[1] // kh.shape[1]
            qh, kh, vh, mask = _sink_dims(qh, kh, vh, mask, sinks, scale, _eye(group, q).repeat(kh.shape[1], 1)[:, None])
        o = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, scale=scale, enable_gqa=True)
        o = o[..., : q.shape[-1]]  # the sink's dims (_sink_dims) carry no value
    return o[0].transpose(0, 1)


def _eye(group: int, like: torch.Tensor) -> torch.Tensor:
    return torch.eye(group, dtype=like.dtype, device=like.device)


def _sink_dims(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor, sinks: torch.Tensor,
               scale: float, onehot: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """gpt-oss's sinks as one more key whose logit the dot product itself gives, so the mask
    stays `allowed` (bool, one for every head) and SDPA keeps its fused kernels. A float mask
    per query head instead ([heads, rows, keys + 1]) was 1.1 GB for a prefill chunk of gpt-oss's
    64 heads, 512 tokens over 8,192 keys (17 GB at 128k; ~1 GB for 256 decodes over 32k keys):
    12x this way's peak, and 1.4-2x its time on the 2-core CPU, for the same outputs (float32,
    bit for bit).

    q [B, heads, rows, D] gains `group` dims holding `onehot` ([..., group], broadcast over q's
    leading dims): each query's place j in its KV head's group of query heads. k [B, Hkv, keys,
    D] gains zeros there, and one more key: zeros in D, its KV head's group's sinks / scale in
    the new dims, so q . k_sink * scale is the query head's sink (exactly where scale is a power
    of two: head_dim 64, 16). v gains the sink key's zero value and zero dims to match: the
    output's extra dims are zero, and the callers drop them."""
    D, Hkv, group = q.shape[-1], k.shape[1], onehot.shape[-1]
    q = torch.cat((q, onehot.expand(*q.shape[:-1], group)), dim=-1)
    sink_key = torch.cat((q.new_zeros(Hkv, D), sinks.view(Hkv, group).to(q.dtype) / scale), dim=-1)
    k = torch.cat((F.pad(k, (0, group)), sink_key.view(1, Hkv, 1, D + group).expand(k.shape[0], -1, -1, -1)), dim=2)
    v = F.pad(_sink_key(v), (0, group))
    return q, k, v, F.pad(allowed, (0, 1), value=True)
