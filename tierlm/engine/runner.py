"""Scheduler output -> flat tensors -> model forward -> logits of the tokens to sample.

Owns the KV memory (allocated once: [2, num_blocks, block_size, kv_heads, head_dim] per layer)
and the only code that knows how a step's tokens are laid out for attention.
"""
from __future__ import annotations

import logging

import numpy as np
import torch

from tierlm.engine.request import Request
from tierlm.engine.scheduler import SchedulerOutput
from tierlm.models import cpu_kernels as cpu_kernel_lib
from tierlm.models.attention import AttentionMetadata, DecodeGroup, PrefillSeq
from tierlm.models.loader import LoadedModel

log = logging.getLogger(__name__)


def kv_bytes_per_block(args, kv_dtype: torch.dtype, block_size: int) -> int:
    """Bytes one KV block takes across all layers (keys and values)."""
    elem = torch.empty((), dtype=kv_dtype).element_size()
    return 2 * args.num_layers * block_size * args.num_kv_heads * args.head_dim * elem


class ModelRunner:
    def __init__(self, loaded: LoadedModel, num_blocks: int, block_size: int, cpu_kernels: bool = True) -> None:
        self.model = loaded.model
        self.cpu_kernels = cpu_kernels
        self.args = loaded.args
        self.device = loaded.device
        if cpu_kernels and self.device.type == "cpu":
            cpu_kernel_lib.library()  # build/load now, not inside the first decode step
        self.block_size = block_size
        shape = (2, num_blocks, block_size, self.args.num_kv_heads, self.args.head_dim)
        self.kv_caches = [torch.zeros(shape, dtype=loaded.kv_dtype, device=self.device)
                          for _ in range(self.args.num_layers)]
        # K/V copies to host (demotion) run here on CUDA, off the compute stream.
        self._copy_stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        self._last_copy: torch.cuda.Event | None = None
        self._pin = True  # K/V copies to host land in page-locked memory while it can be had

    @torch.inference_mode()
    def warm_up(self, num_tokens: int, num_decodes: int) -> None:
        """Run one prefill chunk of `num_tokens` and a batch of `num_decodes` decodes through the
        model, writing K/V only into free blocks at the start of the pool (contents of free blocks
        are never read), so the shapes of real steps find their kernels ready."""
        bs = self.block_size
        num_blocks = self.kv_caches[0].shape[1]
        n = max(1, min(num_tokens, num_blocks * bs))
        d = max(0, min(num_decodes, num_blocks * bs // 2))
        dev = self.device
        table = torch.arange(-(-n // bs), device=dev)
        meta = AttentionMetadata(slot_mapping=torch.arange(n, device=dev),
                                 prefills=[PrefillSeq(0, n, n, table)], block_size=bs)
        self.model(torch.zeros(n, dtype=torch.long, device=dev), torch.arange(n, device=dev), self.kv_caches, meta,
                   logits_indices=torch.tensor([n - 1], device=dev))
        if d:
            # `d` decodes at position 1, each attending to two keys of one of the first blocks.
            slots = torch.arange(d, device=dev) * 2 + 1
            tables = (slots // bs)[:, None]
            group = DecodeGroup(0, d, tables, torch.full((d,), 2, dtype=torch.long, device=dev))
            meta = AttentionMetadata(slot_mapping=slots, decode_groups=[group], block_size=bs,
                                     cpu_kernels=self.cpu_kernels)
            self.model(torch.zeros(d, dtype=torch.long, device=dev), torch.ones(d, dtype=torch.long, device=dev),
                       self.kv_caches, meta, logits_indices=torch.arange(d, device=dev))

    def read_block(self, block_id: int) -> torch.Tensor:
        """One block's K/V for every layer, copied to host: [layers, 2, block_size, kv_heads, head_dim].

        On CUDA this returns at once: the copy runs on a side stream into pinned memory, later
        compute kernels (which may overwrite the block's slot) wait for it on the GPU, and the
        bytes may be read on the CPU only after `copies_done()`. Promotion back needs no fence:
        its host-to-device copy is queued on the compute stream, behind the wait.
        """
        layers = [c[:, block_id] for c in self.kv_caches]
        if self._copy_stream is None:
            return torch.stack(layers).to("cpu", copy=True)
        compute = torch.cuda.current_stream(self.device)
        shape = (len(layers), *layers[0].shape)
        try:
            out = torch.empty(shape, dtype=layers[0].dtype, pin_memory=self._pin)
        except RuntimeError as e:  # page-locked memory exhausted: slower copies, not a failed step
            log.warning("cannot pin host memory for K/V copies (%s); using ordinary memory from now on", e)
            self._pin = False
            out = torch.empty(shape, dtype=layers[0].dtype)
        self._copy_stream.wait_stream(compute)  # the block as last written
        with torch.cuda.stream(self._copy_stream):
            for i, layer in enumerate(layers):
                out[i].copy_(layer, non_blocking=True)
            done = torch.cuda.Event()
            done.record(self._copy_stream)
        compute.wait_event(done)
        self._last_copy = done
        return out

    def copies_done(self) -> None:
        """Wait until every K/V copy to host queued so far has landed (nothing to wait for off CUDA).

        Copies complete in stream order, so the latest one's event covers all earlier ones.
        """
        done = self._last_copy
        if done is not None:
            done.synchronize()

    def write_block(self, block_id: int, data: torch.Tensor) -> None:
        data = data.to(self.device, dtype=self.kv_caches[0].dtype, non_blocking=True)
        for layer, c in enumerate(self.kv_caches):
            c[:, block_id].copy_(data[layer])

    def _block_ids(self, req: Request) -> np.ndarray:
        return np.fromiter((b.block_id for b in req.blocks), dtype=np.int64, count=len(req.blocks))

    def _decode_groups(self, tables: list[np.ndarray], lens: list[int]) -> list[DecodeGroup]:
        """Split length-sorted decodes where padding to the group's longest would exceed ~50%."""
        groups = []
        start = 0
        for i in range(1, len(tables) + 1):
            if i < len(tables) and 2 * len(tables[i]) <= 3 * len(tables[start]) + 2:
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
    def execute(self, sched: SchedulerOutput) -> tuple[list[Request], torch.Tensor | None]:
        """Run one step; returns the requests that produce a token now and their logits rows."""
        bs = self.block_size
        ids: list[int] = []
        positions: list[np.ndarray] = []
        slots: list[np.ndarray] = []
        logits_idx: list[int] = []
        samplers: list[Request] = []
        prefills: list[PrefillSeq] = []
        dec_tables: list[np.ndarray] = []
        dec_lens: list[int] = []
        offset = 0
        # Decodes first, shortest context first, so similar lengths share a padded attention batch.
        entries = sorted(sched.scheduled, key=lambda e: (e[1] > 1, e[0].num_computed_tokens if e[1] == 1 else 0))
        for req, n in entries:
            start, end = req.num_computed_tokens, req.num_computed_tokens + n
            ids.extend(req.all_token_ids[start:end])
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
            if end == req.num_tokens:
                logits_idx.append(offset + n - 1)
                samplers.append(req)
            offset += n
        if not ids:
            return [], None
        dev = self.device
        meta = AttentionMetadata(
            slot_mapping=torch.from_numpy(np.concatenate(slots)).to(dev),
            decode_groups=self._decode_groups(dec_tables, dec_lens), prefills=prefills, block_size=bs,
            cpu_kernels=self.cpu_kernels)
        input_ids = torch.tensor(ids, dtype=torch.long, device=dev)
        pos_t = torch.from_numpy(np.concatenate(positions)).to(dev)
        if not samplers:
            self.model(input_ids, pos_t, self.kv_caches, meta, logits_indices=torch.empty(0, dtype=torch.long, device=dev))
            return [], None
        idx = torch.tensor(logits_idx, dtype=torch.long, device=dev)
        return samplers, self.model(input_ids, pos_t, self.kv_caches, meta, logits_indices=idx)
