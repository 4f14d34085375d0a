"""Scheduler output -> flat tensors -> model forward -> logits of the tokens to sample.

Owns the KV memory (allocated once: [2, num_blocks, block_size, kv_heads, head_dim] per layer)
and the only code that knows how a step's tokens are laid out for attention.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np
import torch

from tierlm.engine.graphs import StepGraphs, StepGraphsConfig
from tierlm.engine.request import Request
from tierlm.engine.scheduler import SchedulerOutput
from tierlm.models import cpu_kernels as cpu_kernel_lib
from tierlm.models.attention import AttentionMetadata, DecodeGroup, PrefillSeq
from tierlm.models.kv_dtype import as_bytes
from tierlm.models.loader import LoadedModel
from tierlm.models.lora import LoRAAdapter, LoRAState

log = logging.getLogger(__name__)


@dataclass
class PromptRows:
    """Final hidden states of prompt positions a request needs itself: for prompt logprobs, row
    i predicts prompt token `start + i + 1`; for a pooling request, the one row is the last
    prompt token's, its embedding. Hidden states, not logits: the vocabulary projection of a
    long chunk at once ([2,048, 150k] floats is 1.2 GB) is the sampler's to do in pieces."""

    req: Request
    start: int
    hidden: torch.Tensor


def _prompt_span(req: Request, start: int, end: int) -> tuple[int, int]:
    """(first position, how many): the positions in [start, end) whose hidden states `req`
    still needs: its last prompt token's when it pools, else those its prompt logprobs need
    (those scored before a preemption are not scored again)."""
    if req.pooling is not None:
        last = req.num_prompt_tokens - 1
        return last, int(start <= last < end)
    if req.prompt_logprobs is None:
        return start, 0
    lo = max(start, len(req.prompt_logprobs))
    return lo, max(0, min(end, req.num_prompt_tokens - 1) - lo)


def row_ranges(rows: list[int]) -> list[tuple[int, int]]:
    """Ascending rows as [start, end) runs: an adapter's rows, for slices rather than gathers."""
    runs: list[tuple[int, int]] = []
    for r in rows:
        if runs and runs[-1][1] == r:
            runs[-1] = (runs[-1][0], r + 1)
        else:
            runs.append((r, r + 1))
    return runs


def kv_bytes_per_block(args, kv_dtype: torch.dtype, block_size: int) -> int:
    """Bytes one KV block takes across all layers (keys and values)."""
    elem = torch.empty((), dtype=kv_dtype).element_size()
    return 2 * args.num_layers * block_size * args.num_kv_heads * args.head_dim * elem


class ModelRunner:
    def __init__(self, loaded: LoadedModel, num_blocks: int, block_size: int, cpu_kernels: bool = True,
                 graphs: StepGraphsConfig | None = None) -> None:
        self.model = loaded.model
        self.cpu_kernels = cpu_kernels
        self.args = loaded.args
        self.device = loaded.device
        if cpu_kernels and self.device.type == "cpu":
            cpu_kernel_lib.library()  # build/load now, not inside the first decode step
        self.block_size = block_size
        self.num_blocks = num_blocks
        # Fixed-shape steps need one more block, past the pool's, for their padding tokens' K/V.
        shape = (2, num_blocks + (graphs is not None), block_size, self.args.num_kv_heads, self.args.head_dim)
        self.kv_caches = [torch.zeros(shape, dtype=loaded.kv_dtype, device=self.device)
                          for _ in range(self.args.num_layers)]
        self.graphs = None if graphs is None else StepGraphs(
            self.model, self.kv_caches, block_size, scratch_block=num_blocks, max_rows=graphs.max_rows,
            max_blocks=graphs.max_blocks, min_tokens=graphs.min_tokens)
        # K/V copies to host (demotion) run here on CUDA, off the compute stream.
        self._copy_stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        self._last_copy: torch.cuda.Event | None = None
        self._pin = True  # K/V copies to host land in page-locked memory while it can be had
        self.lora_state: LoRAState | None = None  # set by the engine when it serves LoRA adapters

    @torch.inference_mode()
    def warm_up(self, num_tokens: int, num_decodes: int) -> None:
        """Run one prefill chunk of `num_tokens` and a batch of `num_decodes` decodes through the
        model, writing K/V only into free blocks at the start of the pool (contents of free blocks
        are never read), so the shapes of real steps find their kernels ready."""
        bs = self.block_size
        num_blocks = self.num_blocks
        n = max(1, min(num_tokens, num_blocks * bs))
        d = max(0, min(num_decodes, num_blocks * bs // 2))
        dev = self.device
        table = torch.arange(-(-n // bs), device=dev)
        meta = AttentionMetadata(slot_mapping=torch.arange(n, device=dev),
                                 prefills=[PrefillSeq(0, n, n, table)], block_size=bs)
        self.model(torch.zeros(n, dtype=torch.long, device=dev), torch.arange(n, device=dev), self.kv_caches, meta,
                   logits_indices=torch.tensor([n - 1], device=dev))
        if d:
            # `d` decodes at position 1, each attending to two keys (slots 2i and 2i + 1): one
            # block, or two when a block holds one slot (the tables must cover every key).
            slots = torch.arange(d, device=dev) * 2 + 1
            tables = ((slots - 1) // bs)[:, None] + torch.arange(-(-2 // bs), device=dev)[None, :]
            group = DecodeGroup(0, d, tables, torch.full((d,), 2, dtype=torch.long, device=dev))
            meta = AttentionMetadata(slot_mapping=slots, decode_groups=[group], block_size=bs,
                                     cpu_kernels=self.cpu_kernels)
            self.model(torch.zeros(d, dtype=torch.long, device=dev), torch.ones(d, dtype=torch.long, device=dev),
                       self.kv_caches, meta, logits_indices=torch.arange(d, device=dev))

    def read_blocks(self, block_ids: list[int]) -> list[torch.Tensor]:
        """These blocks' K/V for every layer, copied to host, one tensor per block:
        [layers, 2, block_size, kv_heads, head_dim].

        One gather per layer, then one copy per block: a 2,000-token prefix is ~150 copies,
        not one per block and layer (~3,000 on a 24-layer model, which on a GPU cost more time
        in launches than the bytes take to move). Each block gets its own host tensor, so a
        lower tier frees a block's memory when it drops that block.

        On CUDA this returns at once: the copies run on a side stream into pinned memory, later
        compute kernels (which may overwrite the blocks' slots) wait for them on the GPU, and the
        bytes may be read on the CPU only after `copies_done()`. Promotion back needs no fence:
        its host-to-device copies are queued on the compute stream, behind the wait.
        """
        if not block_ids:
            return []
        caches = self.kv_caches
        block_shape = (len(caches), *caches[0][:, 0].shape)
        idx = torch.tensor(block_ids, dtype=torch.long).to(self.device, non_blocking=True)
        if self._copy_stream is None:
            out = [torch.empty(block_shape, dtype=caches[0].dtype) for _ in block_ids]
            for blk, data in zip(out, self._gather(idx)):
                blk.copy_(data)
            return out
        compute = torch.cuda.current_stream(self.device)
        out = [self._host_block(block_shape, caches[0].dtype) for _ in block_ids]
        self._copy_stream.wait_stream(compute)  # the blocks as last written, and `idx`
        with torch.cuda.stream(self._copy_stream):
            idx.record_stream(self._copy_stream)
            gathered = self._gather(idx).contiguous()  # each block's bytes in one piece: one copy out each
            for blk, data in zip(out, gathered):
                blk.copy_(data, non_blocking=True)
            done = torch.cuda.Event()
            done.record(self._copy_stream)
        compute.wait_event(done)
        self._last_copy = done
        return out

    @property
    def block_layout(self) -> tuple[torch.dtype, tuple[int, ...]]:
        """(dtype, shape) of one block as `read_blocks` returns it and `write_blocks` takes it."""
        return self.kv_caches[0].dtype, (len(self.kv_caches), *self.kv_caches[0][:, 0].shape)

    def _gather(self, idx: torch.Tensor) -> torch.Tensor:
        """Blocks `idx` of every layer as one [n, layers, 2, block_size, kv_heads, head_dim] view."""
        return torch.stack([c.index_select(1, idx) for c in self.kv_caches]).permute(2, 0, 1, 3, 4, 5)

    def _host_block(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """A host tensor for one block's copy out: pinned while page-locked memory can be had."""
        if self._pin:
            try:
                return torch.empty(shape, dtype=dtype, pin_memory=True)
            except RuntimeError as e:  # page-locked memory exhausted: slower copies, not a failed step
                log.warning("cannot pin host memory for K/V copies (%s); using ordinary memory from now on", e)
                self._pin = False
        return torch.empty(shape, dtype=dtype)

    def copies_done(self) -> None:
        """Wait until every K/V copy to host queued so far has landed (nothing to wait for off CUDA).

        Copies complete in stream order, so the latest one's event covers all earlier ones.
        """
        done = self._last_copy
        if done is not None:
            done.synchronize()

    def write_blocks(self, block_ids: list[int], datas: list[torch.Tensor]) -> None:
        """Copy host K/V (one [layers, 2, block_size, kv_heads, head_dim] tensor per block) into
        these device blocks: one copy in per block, then one scatter per layer."""
        if not block_ids:
            return
        caches = self.kv_caches
        staged = torch.empty((len(block_ids), *datas[0].shape), dtype=caches[0].dtype, device=self.device)
        for i, data in enumerate(datas):
            staged[i].copy_(data, non_blocking=True)  # async from pinned memory, converting dtype if need be
        idx = torch.tensor(block_ids, dtype=torch.long).to(self.device, non_blocking=True)
        for layer, c in enumerate(caches):
            as_bytes(c).index_copy_(1, idx, as_bytes(staged[:, layer].transpose(0, 1)))

    def _block_ids(self, req: Request) -> np.ndarray:
        return np.fromiter((b.block_id for b in req.blocks), dtype=np.int64, count=len(req.blocks))

    def _decode_groups(self, tables: list[np.ndarray], lens: list[int]) -> list[DecodeGroup]:
        """Split length-sorted decodes where padding to the group's longest would exceed ~50%
        (and where the order starts again from short ones: the next LoRA adapter's decodes)."""
        groups = []
        start = 0
        for i in range(1, len(tables) + 1):
            if (i < len(tables) and len(tables[i - 1]) <= len(tables[i])
                    and 2 * len(tables[i]) <= 3 * len(tables[start]) + 2):
                continue  # still within ~1.5x of the group's shortest
            width = len(tables[i - 1])
            padded = np.zeros((i - start, width), dtype=np.int64)
            for j, t in enumerate(tables[start:i]):
                padded[j, : len(t)] = t
            groups.append(DecodeGroup(start, i, torch.from_numpy(padded).to(self.device),
                                      torch.tensor(lens[start:i], dtype=torch.long, device=self.device)))
            start = i
        return groups

    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput) -> tuple[list[Request], torch.Tensor | None, list[PromptRows]]:
        """Run one step; returns the requests that produce a token now, their logits rows (a
        request with speculative guesses has 1 + guesses consecutive rows), and the hidden
        states of the prompt positions to score (prompt logprobs)."""
        scoring = any(_prompt_span(req, req.num_computed_tokens, req.num_computed_tokens + n)[1]
                      for req, n in sched.scheduled)
        adapted = any(req.lora is not None for req, _ in sched.scheduled)
        guessing = any(req.spec_token_ids for req, _ in sched.scheduled)
        # (a graph keeps one sampling row per request, and records no adapter)
        if self.graphs is not None and sched.scheduled and not scoring and not adapted and not guessing:
            done = self.graphs.execute(sched.scheduled, self._block_ids)
            if done is not None:
                return (*done, [])
        bs = self.block_size
        ids: list[int] = []
        positions: list[np.ndarray] = []
        slots: list[np.ndarray] = []
        logits_idx: list[int] = []
        samplers: list[Request] = []
        score_idx: list[int] = []
        spans: list[tuple[Request, int, int]] = []  # (request, first position scored, how many)
        prefills: list[PrefillSeq] = []
        lora_rows: dict[LoRAAdapter, list[int]] = {}
        dec_tables: list[np.ndarray] = []
        dec_lens: list[int] = []
        offset = 0
        # Decodes first, shortest context first, so similar lengths share a padded attention batch;
        # with LoRA adapters, each adapter's rows together first, so its delta is one slice each
        # for its decodes and its prefills (see LoRALinear).
        order = {a: i for i, a in enumerate(dict.fromkeys(r.lora for r, _ in sched.scheduled))} if adapted else None
        entries = sorted(sched.scheduled, key=lambda e: (e[1] > 1, order[e[0].lora] if adapted else 0,
                                                         e[0].num_computed_tokens if e[1] == 1 else 0))
        for req, n in entries:
            start, end = req.num_computed_tokens, req.num_computed_tokens + n
            ids.extend(req.all_token_ids[start:end])
            if end > req.num_tokens:  # a decode with speculative guesses after its last real token
                ids.extend(req.spec_token_ids[:end - req.num_tokens])
            table = self._block_ids(req)
            pos = np.arange(start, end, dtype=np.int64)
            positions.append(pos)
            slots.append(table[pos // bs] * bs + pos % bs)
            used = -(-end // bs)
            if n == 1:
                dec_tables.append(table[:used])
                dec_lens.append(end)
            else:
                prefills.append(PrefillSeq(offset, offset + n, end,
                                           torch.from_numpy(table[:used]).to(self.device)))
            if end >= req.num_tokens and req.pooling is None:
                # The last real token's row, and one per guess after it: row j is the model's
                # next token after j guesses (one row, without guesses).
                for row in range(offset + req.num_tokens - 1 - start, offset + n):
                    logits_idx.append(row)
                    samplers.append(req)
            if req.lora is not None:
                lora_rows.setdefault(req.lora, []).extend(range(offset, offset + n))
            lo, count = _prompt_span(req, start, end)
            if count:
                spans.append((req, lo, count))
                score_idx.extend(range(offset + lo - start, offset + lo - start + count))
            offset += n
        if not ids:
            return [], None, []
        dev = self.device
        meta = AttentionMetadata(
            slot_mapping=torch.from_numpy(np.concatenate(slots)).to(dev),
            decode_groups=self._decode_groups(dec_tables, dec_lens), prefills=prefills, block_size=bs,
            cpu_kernels=self.cpu_kernels)
        input_ids = torch.tensor(ids, dtype=torch.long, device=dev)
        pos_t = torch.from_numpy(np.concatenate(positions)).to(dev)
        idx = torch.tensor(logits_idx + score_idx, dtype=torch.long, device=dev)
        if lora_rows:
            self.lora_state.batch = [(adapter, row_ranges(rows)) for adapter, rows in lora_rows.items()]
        try:
            return self._forward(input_ids, pos_t, meta, idx, samplers, spans, bool(score_idx))
        finally:
            if lora_rows:
                self.lora_state.batch = None

    def _forward(self, input_ids: torch.Tensor, pos_t: torch.Tensor, meta: AttentionMetadata, idx: torch.Tensor,
                 samplers: list[Request], spans: list[tuple[Request, int, int]], scoring: bool
                 ) -> tuple[list[Request], torch.Tensor | None, list[PromptRows]]:
        if not scoring:
            logits = self.model(input_ids, pos_t, self.kv_caches, meta, logits_indices=idx)
            return (samplers, logits, []) if samplers else ([], None, [])
        hidden = self.model.hidden_states(input_ids, pos_t, self.kv_caches, meta, logits_indices=idx)
        logits = self.model.compute_logits(hidden[:len(samplers)]) if samplers else None
        rows, at = [], len(samplers)
        for req, lo, count in spans:
            rows.append(PromptRows(req, lo, hidden[at:at + count]))
            at += count
        return samplers, logits, rows
