"""The device block pool's lifecycle: free blocks first, then cached ones evicted in the policy's
order and handed down in one batch (one batch of device-to-host copies, not one per block)."""
from __future__ import annotations

import pytest

from tierlm.kv.block_pool import BlockPool


def _cache_chain(pool: BlockPool, names: list[bytes]) -> list:
    """Allocate one block per name, register them as a chain, and release them (cached, evictable)."""
    blocks = pool.allocate(len(names))
    for i, (blk, h) in enumerate(zip(blocks, names)):
        pool.tick()
        pool.register_full(blk, h, names[i - 1] if i else None)
    pool.free(blocks)
    return blocks


def test_free_blocks_go_first_then_cached_ones_leave_in_one_batch_tail_first():
    calls = []
    pool = BlockPool(6, policy="lru", on_evict=lambda blks: calls.append([(b.block_id, b.block_hash) for b in blks]))
    old = _cache_chain(pool, [b"a1", b"a2", b"a3"])  # used first: the LRU victims
    new = _cache_chain(pool, [b"b1", b"b2"])
    assert pool.num_free == 6 and calls == []
    got = pool.allocate(4)  # 1 truly free block, then 3 evictions
    assert got[0].block_id not in {b.block_id for b in old + new}
    assert len(calls) == 1, "evictions are handed down in one batch"
    victims = calls[0]
    assert [h for _, h in victims] == [b"a3", b"a2", b"a1"]  # the old chain, tail first (prefix property)
    assert [b.block_id for b in got[1:]] == [bid for bid, _ in victims]
    for blk in got:  # in use now, and no longer known by their old hashes
        assert blk.ref_cnt == 1 and blk.block_hash is None
    assert pool.lookup(b"a1") is None and pool.lookup(b"b1") is not None
    assert pool.num_free == 2 and pool.evictions == 3


def test_evict_all_hands_down_every_unreferenced_block_at_once():
    calls = []
    pool = BlockPool(5, policy="lru", on_evict=lambda blks: calls.append([b.block_hash for b in blks]))
    _cache_chain(pool, [b"x1", b"x2"])
    held = pool.allocate(1)
    pool.register_full(held[0], b"y1", None)  # cached but still in use: stays
    assert pool.evict_all() == 2
    assert len(calls) == 1 and sorted(calls[0]) == [b"x1", b"x2"]
    assert pool.lookup(b"y1") is held[0] and pool.num_free == 4
    assert pool.evict_all() == 0 and len(calls) == 1  # nothing left: no empty call


def test_asking_for_more_than_the_pool_has_changes_nothing():
    calls = []
    pool = BlockPool(3, policy="lru", on_evict=calls.append)
    _cache_chain(pool, [b"c1", b"c2"])
    with pytest.raises(RuntimeError, match="asked for 4 KV blocks with 3 free"):
        pool.allocate(4)
    assert calls == [] and pool.num_free == 3 and pool.lookup(b"c2") is not None
