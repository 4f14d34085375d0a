"""Tenants' cache partitions of the host tier (tiers.py `partition`): the device pool's rule
(block_pool.py) applied to what the device demotes."""
from __future__ import annotations

import random

import pytest
import torch

from tests.engine.test_kv_quotas import _check_tier_partitions
from tierlm.kv.tiers import HostTier

DATA = torch.zeros(4)


def _chain(tier: HostTier, name: str, n: int, owner: str | None) -> list[tuple]:
    """Store the chain name0 <- name1 <- ... (from `owner`'s side); what was evicted meanwhile."""
    evicted, parent = [], None
    for i in range(n):
        h = f"{name}{i}".encode()
        evicted += tier.put(h, parent, DATA, owner=owner)
        parent = h
    return evicted


def test_a_partition_within_its_share_gives_last_and_past_it_first():
    tier = HostTier(8, "lru")
    tier.partition("gold", 0.5)  # 4 of 8 blocks
    _chain(tier, "g", 4, "gold")
    evicted = _chain(tier, "f", 20, None)  # a flood of other tenants' blocks
    assert {h for h, *_ in evicted}.isdisjoint({b"g0", b"g1", b"g2", b"g3"})
    assert all(f"g{i}".encode() in tier for i in range(4))
    # The first of 3 more gold blocks finds gold at its share (a shared block gives); from then on
    # gold is past it, and its own least recent leaves go first, a chain tail first.
    more = _chain(tier, "h", 3, "gold")
    assert [h for h, *_ in more] == [b"f19", b"g3", b"g2"]
    _check_tier_partitions(tier)
    evicted = _chain(tier, "x", 8, None)  # gold, 1 past its share, gives 1; then the shared blocks do
    assert [h for h, *_ in evicted if not h.startswith((b"f", b"x"))] == [b"g1"]
    assert tier.partitions["gold"].evictable == 4
    _check_tier_partitions(tier)


def test_with_no_shared_block_the_partition_fullest_for_its_share_gives():
    tier = HostTier(4, "lru")
    tier.partition("a", 0.5)
    tier.partition("b", 0.5)
    _chain(tier, "a", 2, "a")
    _chain(tier, "b", 2, "b")
    assert [h for h, *_ in tier.put(b"c", None, DATA, owner="b")] == [b"a1"]  # as full: the first made
    assert [h for h, *_ in tier.put(b"d", None, DATA, owner="a")] == [b"b1"]  # b is past its share now
    _check_tier_partitions(tier)


def test_a_shared_block_stored_again_from_a_partitions_side_moves_into_it():
    """Two tenants of one salt share blocks: the one without a share demoted the prefix first.
    When the partitioned tenant's copy comes down again, the block joins its partition; else a
    flood took it, and the tenant's blocks after it were stranded."""
    tier = HostTier(6, "lru")
    tier.partition("gold", 0.5)
    _chain(tier, "p", 2, None)
    _chain(tier, "p", 3, "gold")  # p0, p1 again, then p2: all gold's now
    assert tier.owners == {b"p0": "gold", b"p1": "gold", b"p2": "gold"}
    _chain(tier, "f", 10, None)
    assert all(f"p{i}".encode() in tier for i in range(3))
    _check_tier_partitions(tier)


def test_a_shared_block_moved_into_a_partition_keeps_its_history():
    """As on the device (test_block_pool): a shared block stored again from a partitioned
    tenant's side joins its partition with its access count, not as a newcomer that LFU takes
    before the partition's blocks used once."""
    tier = HostTier(8, "lfu")
    tier.partition("gold", 0.25)  # 2 of 8 blocks
    for _ in range(6):
        tier.put(b"s", None, DATA)  # stored, then demoted again 5 times by tenants without a share
    tier.put(b"s", None, DATA, owner="gold")
    assert tier.owners[b"s"] == "gold" and tier.partitions["gold"].policy.export(b"s").accesses == 7
    _chain(tier, "g", 1, "gold")
    _chain(tier, "h", 1, "gold")  # gold is past its share: it gives first
    evicted = _chain(tier, "f", 6, None)
    assert [h for h, *_ in evicted] == [b"g0"] and b"s" in tier and b"h0" in tier
    _check_tier_partitions(tier)


@pytest.mark.parametrize("policy", ["lru", "lfu", "tlp", "s3fifo", "arc", "duel", "chain"])
def test_random_puts_and_takes_keep_the_counts_and_take_chains_tail_first(policy):
    """Random chains stored from three sides (two partitions, the shared blocks), shares that
    change, blocks taken back up (promotions): after every operation the partitions' counts and
    policies match the blocks, and no block leaves while a child of it is stored (each policy
    sees only the children it ranks: the tier walks down to them)."""
    rng = random.Random(policy)
    tier = HostTier(24, policy)
    tier.partition("a", 0.25)
    tier.partition("b", 0.3)
    stored: list[bytes] = []
    for step in range(1500):
        op = rng.random()
        if op < 0.8:  # a new block (as a chain's hash: never an ancestor of its parent), maybe a stored one's child
            parent = rng.choice(stored) if stored and rng.random() < 0.7 else None
            h = b"k%d" % step
            before = dict(tier.parents)
            for gone, *_ in tier.put(h, parent, DATA, owner=rng.choice(["a", "b", None])):
                kids = [c for c, p in before.items() if p == gone and c in tier]
                assert not kids, (step, gone, kids)
        elif op < 0.95 and stored:
            h = rng.choice(stored)
            with tier.lock:
                if h in tier and not any(p == h for p in tier.parents.values()):
                    tier.take(h)  # promoted back to the device (a leaf: its chain's end)
        else:
            tier.partition(rng.choice("ab"), rng.choice([0.1, 0.25, 0.5]))
        stored = list(tier.parents)
        _check_tier_partitions(tier)
    assert len(tier) <= 24
