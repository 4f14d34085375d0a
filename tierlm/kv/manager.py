"""Per-request KV bookkeeping on top of the block pool: prefix hits, slot allocation, freeing.

The scheduler asks two questions of it — "how much of this prompt is already cached?" and
"can these new tokens get slots?" — and tells it when a request's blocks are done with.
"""
from __future__ import annotations

from dataclasses import dataclass

from tierlm.kv.block_pool import BlockPool, KVBlock
from tierlm.kv.prefix_cache import chain_hashes, extra_key


@dataclass
class CacheStats:
    queries: int = 0  # prompt tokens looked up
    hits: int = 0  # prompt tokens served from cache


class KVCacheManager:
    def __init__(self, pool: BlockPool, block_size: int, model_id: str) -> None:
        self.pool = pool
        self.block_size = block_size
        self.model_id = model_id
        self.stats = CacheStats()

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def _hashes(self, req) -> list[bytes]:
        if len(req.block_hashes) < req.num_tokens // self.block_size:
            req.block_hashes = chain_hashes(req.all_token_ids, self.block_size,
                                            extra_key(self.model_id, req.cache_salt), req.block_hashes)
        return req.block_hashes

    def find_cached_prefix(self, req) -> list[KVBlock]:
        """Longest run of leading full blocks already on the device (never the whole prompt:
        the last token must be computed to produce logits)."""
        if not self.pool.enable_caching:
            return []
        hashes = self._hashes(req)
        limit = (req.num_tokens - 1) // self.block_size
        hit: list[KVBlock] = []
        for h in hashes[:limit]:
            blk = self.pool.lookup(h)
            if blk is None:
                break
            hit.append(blk)
        return hit

    def allocate(self, req, num_new_tokens: int, cached: list[KVBlock] | None = None) -> bool:
        """Give `req` slots for `num_new_tokens` more tokens (after any `cached` prefix blocks).

        Returns False, changing nothing, when the pool cannot supply them.
        """
        cached = cached or []
        total = req.num_computed_tokens + len(cached) * self.block_size + num_new_tokens
        need = self.blocks_needed(total) - len(req.blocks) - len(cached)
        reviving = sum(1 for b in cached if b.ref_cnt == 0)  # cached blocks leave the free count
        if need + reviving > self.pool.num_free:
            return False
        for i, blk in enumerate(cached):
            self.pool.acquire_cached(blk, req.block_hashes[i - 1] if i else None)
        req.blocks.extend(cached)
        req.num_registered_blocks = max(req.num_registered_blocks, len(req.blocks))
        if need > 0:
            req.blocks.extend(self.pool.allocate(need))
        return True

    def register_computed(self, req) -> None:
        """Make newly completed full blocks hit-able for later requests."""
        if not self.pool.enable_caching:
            return
        full = min(req.num_computed_tokens, req.num_tokens) // self.block_size
        if full <= req.num_registered_blocks:
            return
        hashes = self._hashes(req)
        for i in range(req.num_registered_blocks, full):
            parent = hashes[i - 1] if i else None
            existing = self.pool.lookup(hashes[i])
            if existing is not None and existing is not req.blocks[i]:
                # A concurrent request computed the same block first: share its copy and free
                # ours, so every in-use cached block's ancestors stay in use (leaf-only eviction).
                self.pool.acquire_cached(existing, parent)
                self.pool.free([req.blocks[i]])
                req.blocks[i] = existing
            else:
                self.pool.register_full(req.blocks[i], hashes[i], parent)
        req.num_registered_blocks = full

    def free(self, req) -> None:
        self.pool.free(req.blocks)
        req.blocks = []
        req.num_registered_blocks = 0
