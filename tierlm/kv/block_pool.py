"""The device KV block pool: reference counts and the block lifecycle.

free -> in use (ref >= 1) -> cached (ref 0, full, hashed, evictable, still hit-able)
     -> reused (ref back to >= 1) or evicted (handed to `on_evict`, e.g. demoted to host).
Which cached block goes first is the eviction policy's call (kv/policies.py); the pool only
guarantees that blocks in use are pinned and never chosen.

Cache partitions (a tenant's `kv_cache_share`): why: one tenant sending a flood of new prompts
turns the whole pool over, and every other tenant's cached prefixes go with it (a noisy
neighbour; a policy that ranks blocks cannot tell whose they are). A tenant with a share keeps
the blocks its requests cached, and the shared ones they hit, in a partition of its own, ranked
by a policy instance of its own: up to its share of the pool, other tenants' traffic evicts them
only when nothing else can go (a running request always gets its slots); past its share, its own
least valuable cached blocks are the first to go. Blocks of tenants without a share are ranked
together, as before. Whichever partition gives, a chain still goes tail first.
"""
from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from tierlm.kv.policies import DEFAULT_POLICY, EvictionPolicy, make_policy, move_block
from tierlm.kv.prefix_cache import BlockHash


@dataclass
class KVBlock:
    block_id: int
    ref_cnt: int = 0
    block_hash: BlockHash | None = None
    parent_hash: BlockHash | None = None
    output_tokens: int | None = None  # of the last finished request that used it: travels down the tiers
    owner: str | None = None  # the cache partition it is ranked in while cached (None: the shared one)


@dataclass
class Partition:
    """A tenant's cache partition: its cached blocks and the policy that ranks them."""

    policy: EvictionPolicy
    cap: int  # blocks it keeps cached safe from other tenants' traffic; past it, its own go first
    evictable: int = 0  # its blocks that may go: cached ones no running request holds (in a tier: all)
    order: int = 0  # partitions made before it: of two as full, the first made gives


def set_partition(parts: dict[str, Partition], tenant: str, share: float, capacity: int,
                  policy: Callable[[float], EvictionPolicy]) -> None:
    """Make `tenant`'s partition in `parts` for `share` of `capacity` blocks (ranked by
    `policy(share)`), or resize the one it has (the device pool's and the host tier's)."""
    cap = max(1, int(share * capacity))
    part = parts.get(tenant)
    if part is None:
        parts[tenant] = Partition(policy(share), cap, order=len(parts))
    else:
        part.cap = cap


class Givers:
    """Where each victim of one `_take` comes from (None: the shared blocks): a partition past its
    cap (the furthest past), else the shared blocks, else the partition fullest for its cap; ties
    go to the partition made first. Kept in heaps, an entry stale once its partition's count
    moves on: a walk over every partition for each victim made evicting cost O(partitions) per
    block (70 us a block with 1,000 partitions, 9 ms for a 2,048-token prefill), and a tier's
    lone keys may each have a partition."""

    def __init__(self, parts: dict[str, Partition], evictable: int) -> None:
        self._parts = parts
        self._shared = evictable - sum(p.evictable for p in parts.values())
        self._over = [_past(key, p) for key, p in parts.items() if p.evictable > p.cap]
        heapq.heapify(self._over)
        self._full: list[tuple[float, int, str, int]] | None = None  # made when first needed

    def next(self) -> Partition | None:
        over = self._top(self._over)
        if over is not None or self._shared:
            return over
        if self._full is None:
            self._full = [_fill(key, p) for key, p in self._parts.items() if p.evictable]
            heapq.heapify(self._full)
        return self._top(self._full)

    def took(self, owner: str | None) -> None:
        """A victim left partition `owner` (None: the shared blocks)."""
        if owner is None:
            self._shared -= 1
            return
        part = self._parts[owner]
        if part.evictable > part.cap:
            heapq.heappush(self._over, _past(owner, part))
        if self._full is not None and part.evictable:
            heapq.heappush(self._full, _fill(owner, part))

    def _top(self, heap: list) -> Partition | None:
        while heap and self._parts[heap[0][2]].evictable != heap[0][3]:
            heapq.heappop(heap)  # its partition has given since (counts only fall during a take)
        return self._parts[heap[0][2]] if heap else None


def _past(key: str, part: Partition) -> tuple[int, int, str, int]:
    """`Givers`' entry for a partition past its cap: the furthest past first."""
    return part.cap - part.evictable, part.order, key, part.evictable


def _fill(key: str, part: Partition) -> tuple[float, int, str, int]:
    """`Givers`' entry for a partition by how full it is for its cap: the fullest first."""
    return -part.evictable / part.cap, part.order, key, part.evictable


class BlockPool:
    def __init__(self, num_blocks: int, enable_caching: bool = True, policy: str | EvictionPolicy = DEFAULT_POLICY,
                 on_evict: Callable[[list[KVBlock]], None] | None = None,
                 partition_policy: Callable[[float], EvictionPolicy] | None = None) -> None:
        if num_blocks < 1:
            raise ValueError("the KV pool needs at least one block; raise kv_cache_memory")
        self.num_blocks = num_blocks
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        self._free: deque[int] = deque(range(num_blocks))
        self.enable_caching = enable_caching
        self.policy = make_policy(policy) if isinstance(policy, str) else policy
        # A new partition's policy for its share of the pool: the shared one's kind (and settings,
        # where given; the engine's sizes a learning policy's history by the share).
        self._partition_policy = partition_policy or (lambda share: make_policy(self.policy.name))
        self.partitions: dict[str, Partition] = {}
        self.cached: dict[BlockHash, KVBlock] = {}
        self.on_evict = on_evict
        # Parent hash -> hashes of its cached children, whichever policy ranks them: a policy sees
        # only the children it ranks, so a parent whose children are in another partition looks
        # like a leaf to it (`_take` evicts those children first).
        self._kids: dict[BlockHash, set[BlockHash]] = {}
        self._clock = 0
        self._num_evictable = 0
        self.evictions = 0

    # -- capacity ---------------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        """Blocks that can be handed out now: truly free plus cached-but-unreferenced."""
        return len(self._free) + self._num_evictable

    @property
    def num_used(self) -> int:
        return self.num_blocks - self.num_free

    # -- lifecycle --------------------------------------------------------------------------
    def allocate(self, n: int) -> list[KVBlock]:
        if n > self.num_free:
            raise RuntimeError(f"asked for {n} KV blocks with {self.num_free} free (scheduler bug)")
        take = min(n, len(self._free))
        out = [self.blocks[self._free.popleft()] for _ in range(take)] + self._evict(n - take)
        for blk in out:
            blk.ref_cnt = 1
        return out

    def _evict(self, n: int) -> list[KVBlock]:
        """Take `n` cached, unreferenced blocks as the policy picks them, handing them to
        `on_evict` in one call: their K/V leaves the device in one batch of copies, not one
        copy per block and layer."""
        victims = self._take(n)
        self._hand_over(victims)
        return victims

    def _take(self, n: int) -> list[KVBlock]:
        """`n` cached, unreferenced blocks out of the cache, in the policy's order (a chain's
        tail before its head); with partitions, from the one `Givers` names each time."""
        victims = []
        givers = Givers(self.partitions, self._num_evictable) if self.partitions else None
        for _ in range(n):
            part = givers.next() if givers is not None else None
            policy = self.policy if part is None else part.policy
            key = policy.victim()
            if key is None:
                raise RuntimeError("no evictable KV block although the pool counted one (policy bug)")
            blk = self.cached[key]
            # Cached children in another partition (a tenant extended another's chain): a chain
            # goes tail first, else they stay cached but unreachable (a lookup walks from the
            # head), in a partition that keeps them from other traffic. (Never one in use.)
            while (kid := next((self.cached[h] for h in self._kids.get(blk.block_hash, ())
                                if not self.cached[h].ref_cnt), None)) is not None:
                blk = kid
            self._uncache(blk)
            victims.append(blk)
            self._num_evictable -= 1
            if blk.owner is not None:
                self.partitions[blk.owner].evictable -= 1
            if givers is not None:
                givers.took(blk.owner)
        self.evictions += len(victims)
        return victims

    def _uncache(self, blk: KVBlock) -> None:
        """Take cached block `blk` out of the cache and its policy (its counts are the caller's)."""
        del self.cached[blk.block_hash]
        self.policy_of(blk).remove(blk.block_hash)
        kids = self._kids.get(blk.parent_hash)
        if kids is not None:
            kids.discard(blk.block_hash)
            if not kids:
                del self._kids[blk.parent_hash]

    def partition(self, tenant: str, share: float) -> str:
        """The cache partition of `tenant`, made or resized for `share` of the pool; its key."""
        set_partition(self.partitions, tenant, share, self.num_blocks, self._partition_policy)
        return tenant

    def policy_of(self, blk: KVBlock) -> EvictionPolicy:
        """The policy ranking cached block `blk` (its partition's, or the shared one)."""
        return self.policy if blk.owner is None else self.partitions[blk.owner].policy

    def finished(self, blocks: list[KVBlock], hashes: list[BlockHash], output_tokens: int) -> None:
        """A request whose prefix blocks `blocks` (hashes `hashes`) are cached ended with
        `output_tokens`: each policy hears of the blocks it ranks."""
        if not self.partitions:
            self.policy.finished(hashes, output_tokens)
            return
        for owner in dict.fromkeys(blk.owner for blk in blocks):
            policy = self.policy if owner is None else self.partitions[owner].policy
            policy.finished([h for blk, h in zip(blocks, hashes) if blk.owner == owner], output_tokens)

    def _hand_over(self, victims: list[KVBlock]) -> None:
        """Demote taken blocks through `on_evict` (their K/V is read before their ids are reused)."""
        if victims and self.on_evict is not None:
            self.on_evict(victims)
        for blk in victims:
            blk.block_hash = blk.parent_hash = blk.output_tokens = blk.owner = None

    def lookup(self, h: BlockHash) -> KVBlock | None:
        return self.cached.get(h) if self.enable_caching else None

    def tick(self) -> None:
        """Advance the policies' logical clock: once per request lookup (what they were tuned on)."""
        self._clock += 1

    def acquire_cached(self, blk: KVBlock, parent: BlockHash | None, owner: str | None = None) -> None:
        """A request reuses a cached block (prefix hit). A request of partition `owner` takes a
        block of the shared ones into its partition: else the prefix it lives on, cached first
        by a tenant without a share, went with other tenants' traffic, and the blocks its chain
        went on to in the partition with it (tail first)."""
        moved = owner is not None and blk.owner is None
        if moved:
            if blk.ref_cnt:
                self.policy.unpin(blk.block_hash)  # one pin per block in use: it moves along
            blk.owner = owner  # in use from here on: the partition never counts it evictable
            move_block(blk.block_hash, parent, self.policy, self.policy_of(blk))  # with its history
        policy = self.policy_of(blk)
        policy.access(blk.block_hash, parent, self._clock)
        if moved and blk.output_tokens is not None:  # what the shared policy had heard of it
            policy.finished([blk.block_hash], blk.output_tokens)
        if blk.ref_cnt == 0:
            self._num_evictable -= 1
            if blk.owner is not None and not moved:  # (a moved block was never its partition's to count)
                self.partitions[blk.owner].evictable -= 1
        if blk.ref_cnt == 0 or moved:  # one pin per block in use, however many requests share it
            policy.pin(blk.block_hash)
        blk.ref_cnt += 1

    def register_full(self, blk: KVBlock, h: BlockHash, parent: BlockHash | None,
                      owner: str | None = None) -> None:
        """A block just filled with computed K/V becomes hit-able under hash `h`, ranked in
        partition `owner` (a key from `partition`; None: with the shared blocks)."""
        if not self.enable_caching or blk.block_hash is not None or h in self.cached:
            return  # same content already cached by a concurrent request: keep that copy
        blk.block_hash = h
        blk.parent_hash = parent
        blk.owner = owner
        self.cached[h] = blk
        if parent is not None:
            self._kids.setdefault(parent, set()).add(h)
        policy = self.policy_of(blk)
        policy.access(h, parent, self._clock)
        policy.pin(h)

    def free(self, blocks: list[KVBlock]) -> None:
        """Drop one reference from each block; tail first so chains age from the end."""
        for blk in reversed(blocks):
            blk.ref_cnt -= 1
            if blk.ref_cnt > 0:
                continue
            if blk.block_hash is not None:
                self.policy_of(blk).unpin(blk.block_hash)
                self._num_evictable += 1
                if blk.owner is not None:
                    self.partitions[blk.owner].evictable += 1
            else:
                self._free.append(blk.block_id)

    EVICT_ALL_BATCH = 64  # blocks per `on_evict` call when the whole cache goes

    def evict_all(self, heads_first: bool = False) -> int:
        """Evict every cached, unreferenced block (demoting them through `on_evict`); returns how
        many. In the policy's order (a chain's tail first, so host memory keeps the heads), or with
        `heads_first` the reverse: a shutdown whose writes are cut short then leaves prefixes a
        restart can hit, not tails. In batches: one batch of a whole pool was gathered on the
        device in one piece (a second pool's worth of device memory) and copied to host at once."""
        victims = self._take(self._num_evictable)
        if heads_first:
            victims.reverse()  # a parent leaves after its children: reversed, before
        for i in range(0, len(victims), self.EVICT_ALL_BATCH):
            self._hand_over(victims[i:i + self.EVICT_ALL_BATCH])
        self._free.extend(blk.block_id for blk in victims)
        return len(victims)

    def reset_cache(self) -> None:
        """Forget every cached-but-unreferenced block (e.g. after weights change)."""
        for h, blk in list(self.cached.items()):
            if blk.ref_cnt == 0:
                self._uncache(blk)
                blk.block_hash = blk.parent_hash = blk.output_tokens = blk.owner = None
                self._free.append(blk.block_id)
        self._num_evictable = 0
        for part in self.partitions.values():
            part.evictable = 0
