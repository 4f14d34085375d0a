"""The device block pool's lifecycle: free blocks first, then cached ones evicted in the policy's
order and handed down in one batch (one batch of device-to-host copies, not one per block)."""
from __future__ import annotations

import random

import pytest

from tierlm.kv.block_pool import BlockPool
from tierlm.kv.policies import POLICIES, make_policy


def _cache_chain(pool: BlockPool, names: list[bytes], owner: str | None = None) -> list:
    """Allocate one block per name, register them as a chain (in partition `owner`), and release
    them (cached, evictable)."""
    blocks = pool.allocate(len(names))
    for i, (blk, h) in enumerate(zip(blocks, names)):
        pool.tick()
        pool.register_full(blk, h, names[i - 1] if i else None, owner)
    pool.free(blocks)
    return blocks


def _cached(pool: BlockPool, prefix: bytes) -> list[bytes]:
    return sorted(h for h in pool.cached if h.startswith(prefix))


def test_a_cache_partition_is_safe_from_other_traffic_up_to_its_share_and_gives_first_past_it():
    """Why partitions: under one policy, a tenant flooding the pool with new prompts evicts every
    other tenant's cached prefixes. Within its share a partition's blocks outlive any amount of
    other traffic; past it, its own blocks are the first to go (its own LRU order, tail first)."""
    pool = BlockPool(10, policy="lru")
    gold = pool.partition("gold", 0.4)  # 4 blocks
    _cache_chain(pool, [b"g1", b"g2", b"g3"], gold)
    for i in range(30):  # the flood: 30 chains of 3 new blocks through the 7 blocks left
        _cache_chain(pool, [b"n%d.%d" % (i, j) for j in range(3)])
    assert _cached(pool, b"g") == [b"g1", b"g2", b"g3"]
    assert len(pool.cached) == 10 and pool.partitions[gold].evictable == 3
    # Past its share: gold's 7 cached blocks (two chains), so the next 3 blocks anyone needs are gold's,
    # its older chain first and from the tail; then, back at its share, the shared blocks give again.
    _cache_chain(pool, [b"h1", b"h2", b"h3", b"h4"], gold)
    assert pool.partitions[gold].evictable == 7 and len(_cached(pool, b"n")) == 3
    taken = pool.allocate(2)
    assert _cached(pool, b"g") == [b"g1"] and pool.partitions[gold].evictable == 5
    taken += pool.allocate(2)
    assert _cached(pool, b"g") == [] and _cached(pool, b"h") == [b"h1", b"h2", b"h3", b"h4"]
    assert len(_cached(pool, b"n")) == 2 and pool.partitions[gold].evictable == 4
    pool.free(taken)
    assert pool.num_free == 10


def test_a_running_request_takes_a_partitions_blocks_when_nothing_else_can_go():
    """A partition keeps cached prefixes, never a running request from its slots: once the shared
    blocks are gone, the partition fullest for its share gives."""
    pool = BlockPool(8, policy="lru")
    a, b = pool.partition("a", 0.5), pool.partition("b", 0.25)
    _cache_chain(pool, [b"a1", b"a2", b"a3"], a)  # 3 of its 4
    _cache_chain(pool, [b"b1", b"b2"], b)  # 2 of its 2: the fuller one
    _cache_chain(pool, [b"s1"])
    held = pool.allocate(4)  # 2 free, then the shared s1, then b's tail
    assert _cached(pool, b"s") == [] and _cached(pool, b"b") == [b"b1"] and len(_cached(pool, b"a")) == 3
    assert pool.num_free == 4 and pool.partitions[b].evictable == 1
    more = pool.allocate(4)  # everything: b1, then a's chain (0.25 vs 0.5 full: a first), tail first
    assert pool.cached == {} and pool.num_free == 0
    assert [p.evictable for p in pool.partitions.values()] == [0, 0]
    pool.free(held + more)
    assert pool.num_free == 8


def test_partitions_hear_their_own_requests_and_reset_with_the_pool():
    """`finished` reaches the policy ranking each block; a reset forgets partitions' blocks too."""
    pool = BlockPool(6, policy="gittins_hint")
    gold = pool.partition("gold", 0.5)
    mine = _cache_chain(pool, [b"g1", b"g2"], gold)
    shared = _cache_chain(pool, [b"s1"])
    pool.finished(mine + shared, [b"g1", b"g2", b"s1"], 40)
    assert [pool.partitions[gold].policy._hist[h].hint for h in (b"g1", b"g2")] == [4, 4]  # 40 tokens: [16, 64)
    assert b"g1" not in pool.policy._hist and pool.policy._hist[b"s1"].hint == 4
    pool.reset_cache()
    assert pool.cached == {} and pool.num_free == 6 and pool.partitions[gold].evictable == 0
    assert len(pool.partitions[gold].policy) == 0 and len(pool.policy) == 0


def _extend(pool: BlockPool, hit: list[bytes], names: list[bytes], owner: str | None = None) -> None:
    """A request of partition `owner` hits the cached chain `hit` and caches `names` after it."""
    pool.tick()
    held = [pool.lookup(h) for h in hit]
    for i, blk in enumerate(held):
        pool.acquire_cached(blk, hit[i - 1] if i else None, owner)
    new = pool.allocate(len(names))
    for i, (blk, h) in enumerate(zip(new, names)):
        pool.register_full(blk, h, (hit + names)[len(hit) + i - 1] if hit or i else None, owner)
    pool.free(held + new)


def test_a_partition_keeps_the_prefix_its_tenant_hit_though_another_tenant_cached_it():
    """A prompt cached first by a tenant without a share (or by one sharing its salt) is the
    partitioned tenant's prefix too: ranked with the shared blocks, the flood took it and left
    the blocks the tenant appended, cached in its partition but unreachable (a lookup walks from
    the head). Its hits take the blocks into its partition."""
    pool = BlockPool(8, policy="lru")
    gold = pool.partition("gold", 0.5)
    _cache_chain(pool, [b"s1", b"s2"])
    _extend(pool, [b"s1", b"s2"], [b"g3", b"g4"], gold)
    assert pool.partitions[gold].evictable == 4 and len(pool.partitions[gold].policy) == 4
    for i in range(10):
        _cache_chain(pool, [b"n%d" % i])
    assert _cached(pool, b"s") == [b"s1", b"s2"] and _cached(pool, b"g") == [b"g3", b"g4"]
    assert pool._num_evictable == 8 and len(pool.policy) == 4


@pytest.mark.parametrize("policy", ["lfu", "tlp"])
def test_a_block_moved_into_a_partition_keeps_its_history(policy):
    """A shared block a partitioned tenant hits moves into its partition with what the shared
    policy knew of it (access count, last access): it entered as a newcomer, and under LFU a block
    hit six times was the partition's first victim, before blocks used once."""
    pool = BlockPool(8, policy=policy)
    gold = pool.partition("gold", 0.25)  # 2 blocks
    _cache_chain(pool, [b"s"])
    for _ in range(5):
        _extend(pool, [b"s"], [])  # hits of tenants without a share: counted by the shared policy
    _extend(pool, [b"s"], [], gold)  # into gold's partition
    assert pool.lookup(b"s").owner == gold and pool.partitions[gold].policy.export(b"s").accesses == 7
    _cache_chain(pool, [b"g1"], gold)
    _cache_chain(pool, [b"g2"], gold)  # gold past its share: it gives first
    taken = pool.allocate(6)  # 5 free blocks, then one of gold's: its least used, g1
    assert _cached(pool, b"") == [b"g2", b"s"]
    pool.free(taken)


@pytest.mark.parametrize("policy", [p for p in POLICIES if p not in ("lru", "s3fifo", "arc")])
def test_every_policy_that_counts_accesses_carries_the_count_into_a_partition(policy):
    """The record a moved block takes along, for each policy that counts accesses (the Gittins
    family classes blocks by it): its 6 accesses in the shared policy and the one that moved it."""
    pool = BlockPool(8, policy=policy)
    gold = pool.partition("gold", 0.25)
    _cache_chain(pool, [b"s1", b"s2"])
    for _ in range(5):
        _extend(pool, [b"s1", b"s2"], [])
    _extend(pool, [b"s1", b"s2"], [], gold)
    moved = [pool.partitions[gold].policy.export(h) for h in (b"s1", b"s2")]
    assert [(r.accesses, r.last) for r in moved] == [(7, pool._clock)] * 2 and pool.policy.export(b"s1") is None
    if policy not in ("lfu", "tlp"):
        assert [(r.depth, r.is_parent, r.interval) for r in moved] == [(0, True, 1), (1, False, 1)]


def test_a_chain_through_two_partitions_still_goes_tail_first():
    """A policy sees only the children it ranks: to the partition past its share, the head of a
    chain another tenant's partition went on from was a leaf, and it went first, stranding the
    rest (cached, unreachable, kept from other traffic). The chain's tail goes first instead."""
    pool = BlockPool(6, policy="lru")
    a, b = pool.partition("a", 1 / 6), pool.partition("b", 0.5)
    _cache_chain(pool, [b"a1", b"a2"], a)  # past a's share of one block
    _extend(pool, [b"a1", b"a2"], [b"b3"], b)
    taken = pool.allocate(4)  # 3 free, then one from a: the chain's tail in b before a2
    assert _cached(pool, b"") == [b"a1", b"a2"]
    assert pool.partitions[a].evictable == 2 and pool.partitions[b].evictable == 0
    taken += pool.allocate(2)
    assert pool.cached == {} and pool.num_free == 0
    pool.free(taken)


def test_a_block_in_use_never_goes_for_its_idle_parent():
    """A request may hold a child without its cached parent (its own copy of the parent was
    computed alongside and not registered): the parent goes, stranding the child as before,
    never the child its request still reads."""
    pool = BlockPool(3, policy="lru")
    gold = pool.partition("gold", 1 / 3)
    _cache_chain(pool, [b"s1"])
    mine = pool.allocate(2)
    pool.register_full(mine[0], b"s1", None, gold)  # cached already: not registered
    pool.register_full(mine[1], b"g2", b"s1", gold)
    taken = pool.allocate(1)
    assert mine[1].block_hash == b"g2" and pool.lookup(b"g2") is mine[1] and pool.lookup(b"s1") is None
    pool.free(mine + taken)
    assert pool.num_free == 3


@pytest.mark.parametrize("policy", POLICIES)
def test_partitioned_pool_counts_match_its_blocks_under_random_traffic(policy):
    """Tenants with and without shares (which change) hitting and extending each other's chains,
    with whole-cache evictions and resets: each count the pool keeps matches its blocks at every
    step, no cached block outlives its parent, and all blocks come back at the end."""
    rng = random.Random(0)
    pool = BlockPool(16, policy=policy, partition_policy=lambda share: make_policy(policy))
    shares: dict[str, float | None] = {"a": 0.25, "b": 0.5, "c": None, "": None}
    running = []
    for _ in range(300):
        op = rng.random()
        if op < 0.55:
            tenant = rng.choice(list(shares))
            if rng.random() < 0.05:
                shares[tenant] = rng.choice([None, 1 / 16, 0.25, 0.5])
            owner = pool.partition(tenant, shares[tenant]) if shares[tenant] is not None else None
            path = [b"r%d" % rng.randrange(3)] + [b"%d" % rng.randrange(2) for _ in range(rng.randrange(5))]
            names = [b"/".join(path[:i + 1]) for i in range(len(path))]
            hit = next((i for i, h in enumerate(names) if pool.lookup(h) is None), len(names))
            if len(names) - hit + sum(pool.lookup(h).ref_cnt == 0 for h in names[:hit]) > pool.num_free:
                continue
            blocks = [pool.lookup(h) for h in names[:hit]]
            for i, blk in enumerate(blocks):
                pool.acquire_cached(blk, names[i - 1] if i else None, owner)
            blocks += pool.allocate(len(names) - hit)
            for i in range(hit, len(names)):
                pool.register_full(blocks[i], names[i], names[i - 1] if i else None, owner)
            running.append((blocks, names))
        elif op < 0.9 and running:
            blocks, names = running.pop(rng.randrange(len(running)))
            pool.finished(blocks, names, rng.randrange(1, 50))
            pool.free(blocks)
        elif op < 0.95:
            pool.evict_all(heads_first=rng.random() < 0.5)
        else:
            pool.reset_cache()
        _check_counts(pool)
    for blocks, _ in running:
        pool.free(blocks)
    pool.evict_all()
    _check_counts(pool)
    assert pool.num_free == 16 and pool.cached == {}


def _check_counts(pool: BlockPool) -> None:
    cached = list(pool.cached.values())
    assert pool._num_evictable == sum(blk.ref_cnt == 0 for blk in cached)
    assert len(pool.policy) == sum(blk.owner is None for blk in cached)
    for name, part in pool.partitions.items():
        mine = [blk for blk in cached if blk.owner == name]
        assert part.evictable == sum(blk.ref_cnt == 0 for blk in mine) and len(part.policy) == len(mine)
    free = set(pool._free)
    for blk in pool.blocks:
        assert (blk.block_id in free) == (blk.ref_cnt == 0 and blk.block_hash is None)
        assert blk.block_hash is None or pool.cached[blk.block_hash] is blk
        assert blk.block_hash is None or blk.parent_hash is None or blk.parent_hash in pool.cached


def test_evicting_a_pools_worth_visits_the_partitions_a_few_times_not_once_per_block():
    """A tier's lone keys may each have a partition. Finding each victim's giver walked every
    partition (four passes per victim: a pool's worth of evictions took ~20x as long with 1,000
    partitions as with one, 70 us a block). Per victim the giver now comes from heaps kept
    through the take: the partitions are walked a few times per take, not per block. Counted as
    partitions visited, not timed (times on a shared machine drift)."""

    class Visits(dict):
        count = 0

        def values(self):
            Visits.count += len(self)
            return super().values()

        def items(self):
            Visits.count += len(self)
            return super().items()

    pool = BlockPool(4096, policy="lru")
    pool.partitions = Visits()
    for t in range(1000):
        pool.partition(f"t{t}", 1 / 1000)
    blocks = pool.allocate(4096)
    for k, blk in enumerate(blocks):  # half in the partitions, half shared
        pool.register_full(blk, b"h%d" % k, None, f"t{k % 1000}" if k % 2 else None)
    pool.free(blocks)
    Visits.count = 0
    taken = pool.allocate(4096)
    assert pool.cached == {} and len(taken) == 4096
    assert Visits.count <= 5 * 1000, Visits.count  # (per victim: 4096 x 4 x 1,000)


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
