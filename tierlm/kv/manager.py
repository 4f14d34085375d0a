"""Per-request KV bookkeeping on top of the block pool: prefix hits, slot allocation, freeing.

The scheduler asks two questions of it — "how much of this prompt is already cached?" and
"can these new tokens get slots?" — and tells it when a request's blocks are done with. With
lower tiers configured, the cached prefix continues past the device into host, disk and Redis:
those blocks get fresh device blocks and their K/V is copied back in (promotion).
"""
from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from tierlm.kv.block_pool import BlockPool, KVBlock
from tierlm.kv.prefix_cache import BlockHash, chain_hashes, extra_key
from tierlm.kv.store import Prefetch, TieredStore, nbytes


@dataclass
class CacheStats:
    queries: int = 0  # prompt tokens looked up (requests that could take a cached prefix)
    hits: int = 0  # prompt tokens served from cache (any tier)
    device_hit_blocks: int = 0
    promoted_blocks: int = 0
    promoted_bytes: int = 0
    demoted_blocks: int = 0
    demoted_bytes: int = 0


@dataclass
class PrefixHit:
    """The cached prefix of one request: device blocks, then blocks found in lower tiers."""

    device: list[KVBlock] = field(default_factory=list)
    # (hash, tier, K/V, output length of the last finished request that used it, if known)
    lower: list[tuple[BlockHash, str, torch.Tensor, int | None]] = field(default_factory=list)
    # Blocks read (staged) for this request that it does not take now (another request brought
    # them to the device meanwhile): unstaged once it is admitted or gone, not before, as they
    # may leave the device again while it waits for room.
    spare: list[BlockHash] = field(default_factory=list)

    @property
    def num_blocks(self) -> int:
        return len(self.device) + len(self.lower)


@dataclass
class BlockIO:
    """How the manager reads and writes device blocks' K/V (all layers of each), given by the
    runner: a batch of blocks at a time, so that moving a long prefix costs a few large copies
    rather than one small copy per block and layer."""

    read: Callable[[list[int]], list[torch.Tensor]]
    write: Callable[[list[int], list[torch.Tensor]], None]


class KVCacheManager:
    def __init__(self, pool: BlockPool, block_size: int, model_id: str,
                 store: TieredStore | None = None, io: BlockIO | None = None, prefetch: bool = True) -> None:
        self.pool = pool
        self.block_size = block_size
        self.model_id = model_id
        self.stats = CacheStats()
        self.store = store
        self.prefetching = prefetch
        self._prefetches: dict[str, Prefetch] = {}  # request id -> its lower-tier read under way
        # Waiting request id -> how many leading blocks of its prefix were on the device when its
        # prefix was last read (on arrival, preemption or a re-read): fewer now, and what left
        # may be read back in the background (`_read_gap`).
        self._device_then: dict[str, int] = {}
        # Waiting request id -> the (device blocks, end of the run) split its last re-read started
        # from, the store's staging overflows then, and how many re-reads it started
        # (`_read_lost`): a few in all, and none again from a split whose read staging could not
        # keep (a run larger than staging loses its first blocks to its own last ones, and was
        # read for ever).
        # Held requests' reads past their run (`_read_past`) count here too, their split marked
        # ("past", where the run stopped).
        self._rereads: dict[str, tuple[tuple, int, int]] = {}
        # What the lookup of a request that found no device room gave (even nothing), kept for
        # its next try until admitted or gone: looking it up again at every step re-counted its
        # host hits, re-ordered the host tier's eviction queue and probed disk and Redis for the
        # block past its run each time. Request id -> (device blocks then, the lower-tier run
        # read, staged blocks it does not take, whether the run is whole: not cut short by
        # `held_bytes_limit`). Several may be held at once.
        self._held: dict[str, tuple[int, list, list, bool]] = {}
        # Request id -> the block its last lookup stopped at though the store knew of it (it could
        # not be read): not read past its run into again while held.
        self._looked_past: dict[str, bytes] = {}
        # What held requests' K/V weighs, each block counted once however many hold it: bounded
        # like staging (a burst of requests waiting for room, each with a long disk or Redis
        # prefix, kept every run it read, without limit). Block -> (holders, bytes).
        self._held_refs: dict[BlockHash, list[int]] = {}
        self.held_bytes = 0
        self.held_bytes_limit = store.staging_bytes if store is not None else 0
        self.io = io
        if store is not None:
            if io is None:
                raise ValueError("lower KV tiers need block I/O from the runner")
            pool.on_evict = self._demote

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def _hashes(self, req) -> list[bytes]:
        if len(req.block_hashes) < req.num_tokens // self.block_size:
            extra = extra_key(self.model_id, req.cache_salt, req.lora.fingerprint if req.lora is not None else None)
            req.block_hashes = chain_hashes(req.all_token_ids, self.block_size, extra, req.block_hashes)
        return req.block_hashes

    def _owner(self, req) -> str | None:
        """The cache partition `req`'s new cached blocks are ranked in: its tenant's, when it
        carries a `kv_cache_share` (block_pool.py), else None (the shared blocks)."""
        share = req.kv_cache_share
        if share is None:
            return None
        if self.store is not None:  # and the host tier's, which takes what leaves the device's
            self.store.partition(req.tenant_id or "", share)
        return self.pool.partition(req.tenant_id or "", share)

    def _device_prefix(self, req) -> tuple[list[bytes], list[KVBlock], int]:
        """`req`'s block hashes, its leading blocks cached on the device, and how many leading
        blocks may come from a cache at all (never the whole prompt: the last token must be
        computed to produce logits; nor a prompt position whose logprobs are asked for and not
        yet scored: once all are, a preempted scored request takes its output's blocks back too)."""
        hashes = self._hashes(req)
        limit = (req.num_tokens - 1) // self.block_size
        scored = req.prompt_logprobs
        if scored is not None and len(scored) < req.num_prompt_tokens - 1:  # still to score: computed, not served
            limit = min(limit, len(scored) // self.block_size)
        device: list[KVBlock] = []
        while len(device) < limit:
            blk = self.pool.lookup(hashes[len(device)])
            if blk is None:
                break
            device.append(blk)
        return hashes, device, limit

    def _demote(self, blocks: list[KVBlock]) -> None:
        for blk, data in zip(blocks, self.io.read([blk.block_id for blk in blocks])):
            self.stats.demoted_blocks += 1
            self.stats.demoted_bytes += nbytes(data)
            self.store.demote(blk.block_hash, blk.parent_hash, data, hint=blk.output_tokens, owner=blk.owner)

    def prefetch(self, req) -> None:
        """On arrival: start reading the part of `req`'s prefix that is below the device (disk,
        Redis) in the background, so its admission does not wait on that I/O."""
        if not self.prefetching or self.store is None or not self.store.slow or not self.pool.enable_caching:
            return
        hashes, device, limit = self._device_prefix(req)
        self._start_read(req.request_id, hashes[len(device):limit], len(device))

    def _start_read(self, rid: str, hashes: list[bytes], start: int) -> Prefetch | None:
        """Read `hashes` (the prefix from block `start`, the device's split now) in the background
        as request `rid`'s read, in place of any it had."""
        self._device_then[rid] = start
        job = self.store.prefetch(hashes)
        if job is None:
            self._prefetches.pop(rid, None)
        else:
            job.start = start
            self._prefetches[rid] = job
        return job

    def prefix_ready(self, req) -> bool:
        """False while `req`'s background read of its lower-tier prefix is still under way."""
        job = self._prefetches.get(req.request_id)
        if job is None:
            job = self._read_gap(req) or self._read_past(req)
        elif job.done.is_set() and job.finished and req.request_id not in self._held:
            job = self._read_lost(req, job) or job
        return job is None or job.done.is_set()

    MAX_REREADS = 4  # `_read_lost`'s reads per request, whatever the splits

    def _read_lost(self, req, job: Prefetch) -> Prefetch | None:
        """Read again, off the loop, when the prefix's run in memory (device, staging, host) now
        stops at a block on disk, which the loop does not read, while its request waited: part of
        the run up to what `job` found has left memory (blocks that were on the device when it
        arrived, or that the read found in the host tier: only checked, not copied, as the loop
        reads host memory itself), or blocks past what it found have been stored since (a burst
        of requests sharing a prompt all read before the first computed it, which then went
        down). Else the request recomputed all of its prefix past that block."""
        hashes, device, limit = self._device_prefix(req)
        end, d = job.start + job.found, len(device)
        m = d + self.store.in_memory_run(hashes[d:limit])
        if m >= limit or (m >= end and not self.store.known_here(hashes[m], slow=True)):
            return None
        last, overflows, count = self._rereads.get(req.request_id, (None, 0, 0))
        if count >= self.MAX_REREADS or (last == (d, end) and self.store.overflows != overflows):
            return None  # read from here already, and staging could not keep it all
        self._rereads[req.request_id] = ((d, end), self.store.overflows, count + 1)
        again = self._start_read(req.request_id, hashes[d:limit], d)
        self.store.cancel(job)  # after: what it staged stays, the new read wants it
        return again

    def is_held(self, req) -> bool:
        """Whether `req` found no device room on an earlier try and waits for it."""
        return req.request_id in self._held

    def _read_gap(self, req) -> Prefetch | None:
        """With prefetching, start reading back the part of a waiting request's prefix that left
        the device for disk or Redis since its prefix was last read (it arrived, or was preempted,
        with that part on the device) or since it was held for room: the model loop reads
        neither, so that part (and, held, the run read past it) was recomputed once admitted.
        One read per loss of device blocks: the split it starts from is remembered."""
        rid = req.request_id
        held = self._held.get(rid)
        then = held[0] if held is not None else self._device_then.get(rid)
        if not then or not self.prefetching or self.store is None or not self.store.slow:
            return None
        hashes, device, limit = self._device_prefix(req)
        if len(device) >= then:
            return None
        gap = hashes[len(device):then]
        if held is not None and self.store.in_memory_run(gap) == len(gap):
            return None  # host and staging are the model loop's to read
        # Held: the part that left, before the run it keeps. Else all below the device, as on arrival.
        return self._start_read(rid, gap if held is not None else hashes[len(device):limit], len(device))

    def _read_past(self, req) -> Prefetch | None:
        """With prefetching, start reading the blocks past a held request's run that have reached
        disk since it was held (a sibling's prefix moved down, another process's writes): the
        model loop reads only memory, so they were recomputed once it was admitted. Once from
        each place its run stops, `MAX_REREADS` times in all; Redis is not asked (a round trip
        at every step while it waits)."""
        rid = req.request_id
        held = self._held.get(rid)
        if held is None or not held[3] or not self.prefetching or self.store is None or not self.store.slow:
            return None
        (start, lower, _, _), (hashes, device, limit) = held, self._device_prefix(req)
        past = max(len(device), start + len(lower))
        if past >= limit or self._looked_past.get(rid) == hashes[past]:
            return None
        if self.store.known_here(hashes[past], slow=False) or not self.store.known_here(hashes[past], slow=True):
            return None  # in memory (the loop takes it) or not stored here
        last, overflows, count = self._rereads.get(rid, (None, 0, 0))
        if count >= self.MAX_REREADS or last == ("past", past):
            return None
        self._rereads[rid] = (("past", past), self.store.overflows, count + 1)
        return self._start_read(rid, hashes[past:limit], past)

    def read_overdue(self, req) -> bool:
        """`req`'s read has run past the store's read timeout: admit it with what it has."""
        job = self._prefetches.get(req.request_id)
        return job is not None and self.store.overdue(job)

    def wait_for_read(self, req, timeout: float | None) -> None:
        """Block until `req`'s read is done, for at most `timeout` s (None: until it is overdue;
        an AsyncEngine gives a short one, to get back to new arrivals and aborts)."""
        job = self._prefetches.get(req.request_id)
        if job is None:
            return
        left = job.created + self.store.read_timeout_s - time.monotonic() + 1e-3
        job.done.wait(min(max(0.0, left if timeout is None else min(timeout, left)), threading.TIMEOUT_MAX))

    def find_cached_prefix(self, req) -> PrefixHit:
        """Longest run of leading full blocks cached in any tier (never the whole prompt:
        the last token must be computed to produce logits)."""
        hit = PrefixHit()
        if not self.pool.enable_caching:
            return hit
        self.pool.tick()
        if self.store is not None:
            self.store.tick()
        job = self._prefetches.pop(req.request_id, None)
        if job is not None:
            self.store.settle(job)
        hashes, hit.device, limit = self._device_prefix(req)
        if self.store is not None:
            held = self._held.get(req.request_id)
            if held is not None:
                # Blocks are keyed by content, so what was read is still right. Only the split
                # moved if other requests' demand pushed some of this prefix off the device (read
                # those few back, from host or the writer's queue) or brought more of it there.
                (start, lower, hit.spare, whole), d = held, len(hit.device)
                intact = True
                if d >= start:
                    hit.lower = lower[d - start:]
                    hit.spare = hit.spare + [entry[0] for entry in lower[:d - start]]  # on the device now
                else:
                    # A finished read of the gap found the run's end: no second look (and miss) there,
                    # unless that block is on the device again by now (another request brought it).
                    stop = job.start + job.found if job is not None and job.finished else start
                    end = start if stop < d else min(start, stop)
                    gap = hashes[d:end]
                    found = self.store.fetch_run(gap, slow=not self.prefetching)
                    hit.lower = [(h, *f) for h, f in zip(gap, found)]
                    intact = len(found) == len(gap) and end == start
                    if intact:
                        hit.lower += lower
                    else:  # the run broke in the gap: what it read past it is no longer taken
                        hit.spare = hit.spare + [entry[0] for entry in lower]
                past = d + len(hit.lower)
                if (intact and whole and past < limit and self._looked_past.get(req.request_id) != hashes[past]
                        and self.store.known_here(hashes[past], slow=not self.prefetching)):
                    # The block past the run has been stored below since (a burst sharing this
                    # prefix may push it off the device meanwhile): read on from there.
                    tail = hashes[past:limit]
                    more = [(h, *f) for h, f in zip(tail, self.store.fetch_run(tail, slow=not self.prefetching))]
                    self._note_stop(req, hashes, past + len(more), limit)
                    if more:
                        hit.lower += more
                        taken = {entry[0] for entry in more}
                        hit.spare = [h for h in hit.spare if h not in taken]
                if job is not None:  # a read of the gap: what it staged and this try does not take
                    hit.spare = hit.spare + self._not_taken(job, hit)
                return hit
            finished = job is not None and job.finished
            end = max(job.start + job.found, len(hit.device)) if finished else limit
            if end < limit and not self.store.known_here(hashes[end], slow=False):
                # The reader found the run and the miss after it: no second look (and miss) there,
                # unless that block has reached memory since (computed by another request and
                # moved down): the loop reads only memory (what was staged, the host tier).
                limit = end
            below = hashes[len(hit.device):limit]
            # With prefetching the model loop never reads disk or Redis itself, not even for a
            # read that did not finish (overdue, or failed) or a request without one (preempted):
            # it takes what was staged and what the host tier and the writer's queue hold.
            hit.lower = [(h, *found) for h, found in zip(below, self.store.fetch_run(below, slow=not self.prefetching))]
            self._note_stop(req, hashes, len(hit.device) + len(hit.lower), limit)
            if job is not None:
                # What its reader staged that this request does not take (another request brought
                # it to the device meanwhile): else it stayed staged for good.
                hit.spare = self._not_taken(job, hit)
        return hit

    def count_lookup(self, req, num_cached: int) -> None:
        """Count `req`'s first admission in the prefix cache's queries and hits (vLLM's), unless
        its lookup could take nothing: caching off, or a prompt to score (computed whole), which
        counted as misses and made a scoring workload's hit rate 0 where nothing was looked up."""
        if self.pool.enable_caching and req.prompt_logprobs is None:
            self.stats.queries += req.num_prompt_tokens
            self.stats.hits += num_cached

    def _note_stop(self, req, hashes: list[BlockHash], stop: int, limit: int) -> None:
        """A lookup of `req`'s prefix stopped at block `stop`: if the store knows that block, it
        could not be read (a disk entry failing its reads), so a held request's next tries do
        not read past its run into it again."""
        if stop < limit and self.store.known_here(hashes[stop], slow=not self.prefetching):
            self._looked_past[req.request_id] = hashes[stop]

    @staticmethod
    def _not_taken(job: Prefetch, hit: PrefixHit) -> list[BlockHash]:
        """What `job` staged, or may have (all it was to read, if it did not finish: staged by
        another request's read and kept for this one), that `hit` does not take."""
        used = {entry[0] for entry in hit.lower}
        return [h for h in (job.hashes[:job.found] if job.finished else job.hashes) if h not in used]

    def allocate(self, req, num_new_tokens: int, hit: PrefixHit | None = None) -> bool:
        """Give `req` slots for `num_new_tokens` more tokens (after any cached prefix `hit`).

        Returns False, changing nothing, when the pool cannot supply them.
        """
        admitting = hit is not None
        hit = hit or PrefixHit()
        total = req.num_computed_tokens + hit.num_blocks * self.block_size + num_new_tokens
        need = self.blocks_needed(total) - len(req.blocks) - len(hit.device)
        reviving = sum(1 for b in hit.device if b.ref_cnt == 0)  # cached blocks leave the free count
        if need + reviving > self.pool.num_free:
            if admitting:  # a running request that cannot grow holds nothing
                self._hold(req.request_id, len(hit.device), hit.lower, hit.spare)
            return False
        self._release(req.request_id)
        self._looked_past.pop(req.request_id, None)
        self._device_then.pop(req.request_id, None)
        self._rereads.pop(req.request_id, None)
        if hit.spare and self.store is not None:
            self.store.unstage(hit.spare)
        owner = self._owner(req) if hit.num_blocks else None
        for i, blk in enumerate(hit.device):
            self.pool.acquire_cached(blk, req.block_hashes[i - 1] if i else None, owner)
        req.blocks.extend(hit.device)
        if need > 0:
            req.blocks.extend(self.pool.allocate(need))
        base = len(hit.device)
        if hit.lower:
            self.io.write([blk.block_id for blk in req.blocks[base:base + len(hit.lower)]],
                          [data for _, _, data, _ in hit.lower])
        for j, (h, source, data, hint) in enumerate(hit.lower):
            blk = req.blocks[base + j]
            self.pool.register_full(blk, h, req.block_hashes[base + j - 1] if base + j else None, owner)
            if hint is not None and blk.block_hash == h:  # what the lower tier knew comes back up
                blk.output_tokens = hint
                self.pool.policy_of(blk).finished([h], hint)
            self.store.promoted(h, source)
            self.stats.promoted_blocks += 1
            self.stats.promoted_bytes += nbytes(data)
        self.stats.device_hit_blocks += len(hit.device)
        req.num_registered_blocks = max(req.num_registered_blocks, hit.num_blocks)
        return True

    def register_computed(self, req) -> None:
        """Make newly completed full blocks hit-able for later requests."""
        if not self.pool.enable_caching:
            return
        full = min(req.num_computed_tokens, req.num_tokens) // self.block_size
        if full <= req.num_registered_blocks:
            return
        hashes = self._hashes(req)
        owner = self._owner(req)
        through = []  # (index, hash, parent) of blocks to write through to lower tiers
        for i in range(req.num_registered_blocks, full):
            parent = hashes[i - 1] if i else None
            existing = self.pool.lookup(hashes[i])
            if existing is not None and existing is not req.blocks[i]:
                # A concurrent request computed the same block first: share its copy and free
                # ours, so every in-use cached block's ancestors stay in use (leaf-only eviction).
                self.pool.acquire_cached(existing, parent, owner)
                self.pool.free([req.blocks[i]])
                req.blocks[i] = existing
                continue
            self.pool.register_full(req.blocks[i], hashes[i], parent, owner)
            if self.store is not None and self.store.write_through:
                through.append((i, hashes[i], parent))
        if through:
            datas = self.io.read([req.blocks[i].block_id for i, _, _ in through])
            for (_, h, parent), data in zip(through, datas):
                self.store.write_through_block(h, parent, data)
        req.num_registered_blocks = full

    def _hold(self, request_id: str, start: int, lower: list, spare: list) -> None:
        """Keep what the lower tiers gave a request that found no device room, for its next try,
        within `held_bytes_limit`: past it, the tail of its run is let go (recomputed when it is
        admitted; the head alone is still a valid prefix), so requests that came first keep theirs."""
        before = self._release(request_id)
        kept = 0
        for h, _, data, _ in lower:
            ref = self._held_refs.get(h)
            if ref is None:
                size = nbytes(data)
                if self.held_bytes + size > self.held_bytes_limit:
                    break
                ref = self._held_refs[h] = [0, size]
                self.held_bytes += size
            ref[0] += 1
            kept += 1
        if kept < len(lower) and self.store is not None:
            self.store.unstage([entry[0] for entry in lower[kept:]])
        # Even with nothing found or kept: its next try must not look the lower tiers up again.
        # A run once cut short stays so (its next tries pass the cut run back in).
        whole = kept == len(lower) and (before is None or before[3])
        self._held[request_id] = (start, lower[:kept], spare, whole)

    def _release(self, request_id: str):
        """Forget `request_id`'s hold (admitted or gone) and return it, or None."""
        held = self._held.pop(request_id, None)
        if held is not None:
            for h, *_ in held[1]:
                ref = self._held_refs[h]
                ref[0] -= 1
                if not ref[0]:
                    del self._held_refs[h]
                    self.held_bytes -= ref[1]
        return held

    def free(self, req) -> None:
        self._device_then.pop(req.request_id, None)
        self._rereads.pop(req.request_id, None)
        self._looked_past.pop(req.request_id, None)
        held = self._release(req.request_id)
        if held is not None and self.store is not None:  # held for room, gone before admission: what it read goes too
            self.store.unstage([entry[0] for entry in held[1]] + held[2])  # (another held request keeps its own references)
        job = self._prefetches.pop(req.request_id, None)
        if job is not None:  # finished or aborted before admission
            self.store.cancel(job)
        if req.finish_reason in ("stop", "length"):  # done, not aborted or preempted
            n = req.num_registered_blocks
            self.pool.finished(req.blocks[:n], req.block_hashes[:n], req.num_output_tokens)
            for blk in req.blocks[:req.num_registered_blocks]:
                blk.output_tokens = req.num_output_tokens
        self.pool.free(req.blocks)
        req.blocks = []
        req.num_registered_blocks = 0
