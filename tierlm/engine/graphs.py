"""Small steps of fixed shape, recorded once as CUDA graphs and replayed.

Why: on a GPU a small step (a batch of decodes, or the few prompt tokens left after a prefix
hit) is bound by the host, not the GPU. On an H200 a 24-layer step launched 1,000-1,400 kernels
from Python and kept the GPU busy 3% (32 decodes) to 11% (a prefill after a 2,000-token hit) of
its time (`tools/device_profile.py`). A graph records the launches once and replays them with
one call.

Shapes are bucketed: rows (sequences), width (query tokens per row) and the block-table width
each round up to a power of two, and a step that fits no bucket (a long prefill chunk, or a
step with one) runs eagerly as before. Each bucket owns one int64 buffer on the device holding
the step's token ids, positions, K/V slots, block tables and the rows to take logits from; a step
fills a host copy and moves it with one copy, then replays. Padding tokens write their K/V to a
scratch block that the block pool never hands out. The vocabulary projection runs after the
replay, eagerly: recorded, each graph would keep a [rows, vocab] output allocated. MoE layers run
every expert on every token inside a graph (models/moe.py), so MoE steps use graphs only when
they have at least experts / top-k real tokens.

On CPU nothing is recorded: the same fixed-shape step runs eagerly. That is what the tests check
against transformers, so on CUDA a replay differs from a tested path only in being recorded.
"""
from __future__ import annotations

import functools
import gc
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from tierlm.engine.request import Request
from tierlm.models.attention import AttentionMetadata, PaddedBatch
from tierlm.models.moe import SparseMoE

log = logging.getLogger(__name__)

MAX_WIDTH = 128  # query tokens per row: covers decodes and the tail of a prompt after a prefix hit
MAX_TOKENS = 512  # rows x width of a bucket; larger steps are compute-bound anyway
MAX_GRAPHS = 128  # buckets recorded at most; later new shapes run eagerly
MAX_WASTE = 8  # a bucket may hold up to this many times the step's real tokens (GPU time is cheap here)
# torch allows one capture at a time per process, and starting one synchronises the device and
# empties the allocator's caches: the engines of a server with several models take turns.
_CAPTURE_LOCK = threading.Lock()


def context_lost(e: BaseException) -> bool:
    """Whether a failed recording left the CUDA context unusable (a device-side assert), so that
    eager steps cannot run either. Every CUDA error's text ends "...to enable device-side
    assertions", a failed capture's too: match the assert's own words, not that."""
    return any("device-side assert triggered" in str(x) for x in (e, e.__context__) if x is not None)


def _pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def decode_shapes(max_rows: int, max_blocks: int, min_rows: int, have: set) -> list["Bucket"]:
    """The decode buckets to record ahead, in recording order. Which: the smallest first (the
    shapes light load decodes in), as many as MAX_GRAPHS leaves room for beside `have`. In
    what order: largest first (as vLLM captures), since the graphs share one memory pool and
    smaller ones then fit in what larger ones left instead of the pool growing with each."""
    shapes = [Bucket(1 << r, 1, 1 << k)
              for r in range(_pow2(min(max_rows, MAX_TOKENS)).bit_length())
              for k in range(_pow2(max_blocks).bit_length()) if 1 << k <= max_blocks]
    size = lambda b: (b.rows * b.blocks, b.rows)  # noqa: E731
    kept = sorted((b for b in shapes if b not in have and b.rows >= min_rows), key=size)
    return sorted(kept[:max(0, MAX_GRAPHS - len(have))], key=size, reverse=True)


@dataclass(frozen=True)
class StepGraphsConfig:
    max_rows: int  # the engine's max_num_seqs
    max_blocks: int  # blocks of a sequence at max_model_len
    # MoE models: fewer real tokens than this (experts / top-k) run eagerly, where grouping by
    # expert reads fewer expert weights than running every expert on every token would.
    min_tokens: int = 1


@dataclass(frozen=True)
class Bucket:
    rows: int
    width: int
    blocks: int

    @property
    def tokens(self) -> int:
        return self.rows * self.width


class _BucketBuffers:
    """One bucket's static input buffer (device) with a host copy to fill, their views, the
    attention metadata over them, and the graph once recorded."""

    def __init__(self, b: Bucket, block_size: int, device: torch.device) -> None:
        T, B, NB = b.tokens, b.rows, b.blocks
        self.bucket = b
        size = 3 * T + B * NB + B
        self.host = torch.zeros(size, dtype=torch.long, pin_memory=device.type == "cuda")
        self.fill = self.host.numpy()
        self.device_buf = torch.zeros(size, dtype=torch.long, device=device)
        d = self.device_buf
        self.input_ids, self.positions, self.slots = d[:T], d[T:2 * T], d[2 * T:3 * T]
        tables = d[3 * T:3 * T + B * NB].view(B, NB)
        self.logits_rows = d[3 * T + B * NB:]
        self.padded = PaddedBatch(B, b.width, tables, self.positions.view(B, b.width))
        self.meta = AttentionMetadata(slot_mapping=self.slots, block_size=block_size, cpu_kernels=False,
                                      padded=self.padded)
        self.copied: torch.cuda.Event | None = None  # CUDA: the copy from `host` last queued
        self.graph: torch.cuda.CUDAGraph | None = None
        self.hidden: torch.Tensor | None = None  # the graph's output


class StepGraphs:
    """Runs the steps that fit a bucket; `execute` returns None for the others."""

    def __init__(self, model: torch.nn.Module, kv_caches: list[torch.Tensor], block_size: int,
                 scratch_block: int, max_rows: int, max_blocks: int, min_tokens: int = 1) -> None:
        self.model = model
        self.moe = [m for m in model.modules() if isinstance(m, SparseMoE)]
        self.min_tokens = min_tokens
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.device = kv_caches[0].device
        self.scratch_slot = scratch_block * block_size
        self.max_rows, self.max_blocks = max_rows, max_blocks
        self.record = self.device.type == "cuda"
        self.pool = torch.cuda.graph_pool_handle() if self.record else None
        # One capture stream for every graph: the pool's memory is shared between captures only
        # when they use the same stream (torch.cuda.graph's docs), else it grows graph by graph.
        self._capture_stream = torch.cuda.Stream(self.device) if self.record else None
        self.buckets: dict[Bucket, _BucketBuffers] = {}
        self.enabled = True
        self.steps = 0  # steps run through a bucket (replayed, or on CPU run eagerly)
        self.recorded = 0

    def bucket_for(self, scheduled: list[tuple[Request, int]]) -> Bucket | None:
        width = max(n for _, n in scheduled)
        blocks = -(-max(r.num_computed_tokens + n for r, n in scheduled) // self.block_size)
        if not self.enabled or width > MAX_WIDTH or len(scheduled) > self.max_rows or blocks > self.max_blocks:
            return None
        b = Bucket(_pow2(len(scheduled)), _pow2(width), min(_pow2(blocks), self.max_blocks))
        real = sum(n for _, n in scheduled)
        if real < self.min_tokens:
            return None
        if b.tokens > MAX_TOKENS or b.tokens > max(MAX_WASTE * real, 64):
            return None  # e.g. decodes beside one longer chunk: every row padded to the chunk's width
        if b not in self.buckets and len(self.buckets) >= MAX_GRAPHS:
            return None
        return b

    def execute(self, scheduled: list[tuple[Request, int]],
                block_ids: Callable[[Request], np.ndarray]) -> tuple[list[Request], torch.Tensor | None] | None:
        b = self.bucket_for(scheduled)
        if b is None:
            return None
        buf = self.buckets.get(b)
        if buf is None:
            buf = self.buckets[b] = _BucketBuffers(b, self.block_size, self.device)
        if buf.copied is not None:
            buf.copied.synchronize()  # the last step's copy out of the host buffer has run
        # Rows that sample first, so their logits are the first rows of the output.
        rows = sorted(scheduled, key=lambda e: e[0].num_computed_tokens + e[1] != e[0].num_tokens)
        samplers = self._fill(buf, rows, block_ids)
        buf.device_buf.copy_(buf.host, non_blocking=True)
        if self.record:
            buf.copied = torch.cuda.Event()
            buf.copied.record(torch.cuda.current_stream(self.device))  # this device's, not the thread's
        hidden = self._run(buf)
        if hidden is None:
            return None
        self.steps += 1
        if not samplers:
            return [], None
        return samplers, self.model.compute_logits(hidden[:len(samplers)])

    @torch.inference_mode()
    def record_decode_buckets(self, max_blocks: int = 256) -> int:
        """Record the decode shapes ahead (rows and block-table widths, powers of two up to
        `max_blocks`), as vLLM captures its batch sizes at start-up: recorded lazily, a busy
        server's first steps would pay for one recording each. Buffers hold padding only, so
        the forward writes nothing but the scratch block. Returns how many were recorded."""
        before = self.recorded
        for b in decode_shapes(self.max_rows, min(max_blocks, self.max_blocks), self.min_tokens, set(self.buckets)):
            if not self.enabled:
                break
            buf = self.buckets[b] = _BucketBuffers(b, self.block_size, self.device)
            buf.fill[:] = 0
            buf.fill[2 * b.tokens:3 * b.tokens] = self.scratch_slot
            buf.device_buf.copy_(buf.host)
            self._run(buf)
        return self.recorded - before

    def _fill(self, buf: _BucketBuffers, rows: list[tuple[Request, int]],
              block_ids: Callable[[Request], np.ndarray]) -> list[Request]:
        b, bs = buf.bucket, self.block_size
        T, W, NB = b.tokens, b.width, b.blocks
        a = buf.fill
        a[:] = 0
        a[2 * T:3 * T] = self.scratch_slot
        samplers = []
        for r, (req, n) in enumerate(rows):
            start, end = req.num_computed_tokens, req.num_computed_tokens + n
            at = r * W
            pos = np.arange(start, end, dtype=np.int64)
            table = block_ids(req)
            a[at:at + n] = req.all_token_ids[start:end]
            a[T + at:T + at + n] = pos
            a[2 * T + at:2 * T + at + n] = table[pos // bs] * bs + pos % bs
            used = -(-end // bs)
            a[3 * T + r * NB:3 * T + r * NB + used] = table[:used]
            if end == req.num_tokens:
                a[3 * T + b.rows * NB + r] = at + n - 1
                samplers.append(req)
        return samplers

    def _forward(self, buf: _BucketBuffers) -> torch.Tensor:
        buf.padded.reset()  # the masks are rebuilt from the buffers, inside the forward (and the graph)
        for m in self.moe:
            m.static_shapes = True
        try:
            return self.model.hidden_states(buf.input_ids, buf.positions, self.kv_caches, buf.meta,
                                            logits_indices=buf.logits_rows)
        finally:
            for m in self.moe:
                m.static_shapes = False

    def _run(self, buf: _BucketBuffers) -> torch.Tensor | None:
        if not self.record:
            return self._forward(buf)
        if buf.graph is None:
            try:
                # On cuda:N the capture stream and the capture itself must be on that device, not
                # on the thread's current one (cuda:0 unless set): else nothing is captured.
                with _CAPTURE_LOCK, torch.cuda.device(self.device):
                    self._record(buf)
            except Exception as e:  # a model this path cannot record: eager steps, not a failed server
                if context_lost(e):
                    raise  # the CUDA context is unusable: no eager step can run either
                # (Not every AcceleratorError: since torch 2.8 a broken capture raises one too.)
                during = f" (while: {type(e.__context__).__name__}: {e.__context__})" if e.__context__ else ""
                log.warning("recording a CUDA graph for %s failed (%s: %s%s); every step runs eagerly from now on",
                            buf.bucket, type(e).__name__, e, during, exc_info=True)
                self.enabled = False
                return None
        # The buckets share one memory pool: a replay may overwrite memory that another graph's
        # output lives in, so each replay's output is used (compute_logits, queued on this
        # stream) before any other graph replays.
        buf.graph.replay()
        return buf.hidden

    def _undo_failed_capture(self, current: torch.cuda.Stream) -> None:
        """torch.cuda.graph's exit raises from capture_end before it restores the stream, and
        the allocator's capture is not ended then: every later eager step would run on the
        capture stream and the next recording (or empty_cache) trip the allocator's check that
        no capture is under way. Put both back."""
        torch.cuda.set_stream(current)
        end = getattr(torch._C, "_cuda_endAllocateToPool", None)
        if end is not None:
            try:
                end(self.device.index if self.device.index is not None else torch.cuda.current_device(), self.pool)
            except Exception:  # already ended (the failure came after capture_end): nothing to undo
                pass

    def _record(self, buf: _BucketBuffers) -> None:
        """Warm up on a side stream (library handles, kernel choice), then record. The warm-up
        computes this step for real (K/V written), the replay that follows writes the same values."""
        current = torch.cuda.current_stream(self.device)
        side = torch.cuda.Stream(self.device)
        side.wait_stream(current)
        with torch.cuda.stream(side):
            self._forward(buf)
        current.wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        forward = functools.partial(self._forward, buf)
        # A dead engine's graphs, freed by Python's cycle collector while this thread captures,
        # destroy their executables inside the capture and invalidate it (seen on an H100: a test's
        # engine collected while the next one recorded; torch.cuda.graph no longer collects on
        # entry). The collector stays off until the capture has ended; what it would have freed
        # waits for its next run (no full collection here: shapes are also recorded mid-serving).
        collecting = gc.isenabled()
        gc.disable()
        # thread_local: the K/V prefetch thread may touch CUDA while this thread records.
        try:
            with torch.cuda.graph(graph, pool=self.pool, stream=self._capture_stream,
                                  capture_error_mode="thread_local"):
                hidden = forward()
        except BaseException:
            self._undo_failed_capture(current)
            raise
        finally:
            if collecting:
                gc.enable()
        buf.padded.reset()  # the masks made while recording: the graph rebuilds its own on each replay
        buf.graph, buf.hidden = graph, hidden
        self.recorded += 1
        log.info("recorded a CUDA graph for %d rows x %d tokens over %d blocks (%d recorded)",
                 buf.bucket.rows, buf.bucket.width, buf.bucket.blocks, self.recorded)
