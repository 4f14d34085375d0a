"""Eviction policies for prefix-cached KV blocks.

One small interface (`EvictionPolicy`) serves both the engine's block pool and the offline trace
simulator (`tierlm.bench.cache`), so a policy measured offline is exactly the one that runs online.

Every policy honours two constraints that come from prefix caching, not from the policy:

- **Leaf-only eviction.** A block is only reachable through its parent (a request hits the longest
  run of *leading* cached blocks), so evicting a parent strands its cached descendants. Victims are
  therefore always tracked blocks with no tracked children; chains are eaten from the tail.
- **Pins.** Blocks owned by running requests are pinned (counted) and never chosen.

Policies keep their candidates (tracked, unpinned, childless blocks) in heaps with lazy
invalidation: a block's entry is re-pushed whenever its priority or candidacy may have changed and
stale entries are skipped when they reach the top. This keeps every operation O(log n), which the
simulator needs (hundreds of thousands of references per run).

When a request finishes, the engine (and the simulator, from a trace's `output_length`) tells the
policy how many tokens it generated (`finished`): a hint only the serving side has. Only
`gittins_hint` uses it.

`now` is a caller-supplied, non-decreasing logical clock. The simulator advances it once per
request (see `tierlm.bench.cache` for the measurement behind that choice); the engine should do the
same (one tick per scheduled request / prefix lookup) so the tuned constants carry over.
"""

from __future__ import annotations

import bisect
import functools
import heapq
import itertools
import math
import numbers
import random
from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable, Hashable, Protocol, Sequence, runtime_checkable

import numpy as np

__all__ = [
    "BlockRecord",
    "EvictionPolicy",
    "LRUPolicy",
    "LFUPolicy",
    "TLPPolicy",
    "S3FIFOPolicy",
    "ARCPolicy",
    "GittinsPolicy",
    "HintedGittinsPolicy",
    "DuelPolicy",
    "ShadowPolicy",
    "ChainPolicy",
    "BeladyPolicy",
    "PopularityOraclePolicy",
    "POLICIES",
    "OFFLINE_POLICIES",
    "SAMPLED_POLICIES",
    "DEFAULT_POLICY",
    "make_policy",
    "move_block",
]


@runtime_checkable
class EvictionPolicy(Protocol):
    """What the block pool and the simulator need from a policy; nothing more."""

    name: str

    def access(self, key: Hashable, parent: Hashable | None, now: int) -> None:
        """`key` was referenced at logical time `now` (hit or fresh insert); tracks it if new.

        `parent` is the previous block of the prefix chain (None for a first block). It is
        recorded on first access only: a block's parent is part of its hash, so it cannot change.
        """

    def pin(self, key: Hashable) -> None:
        """Protect `key` from eviction (counted: n pins need n unpins; may precede its access)."""

    def unpin(self, key: Hashable) -> None:
        """Undo one `pin`."""

    def victim(self) -> Hashable | None:
        """The block to evict next (tracked, unpinned, no tracked children) or None; not removed."""

    def remove(self, key: Hashable) -> None:
        """Stop tracking `key` (evicted or dropped)."""

    def finished(self, keys: Sequence[Hashable], output_tokens: int) -> None:
        """A request that referenced `keys` finished after generating `output_tokens` tokens.

        A hint known only when the request ends; most policies ignore it (see `GittinsPolicy`'s
        `hints`). Keys the policy does not track are skipped.
        """

    def export(self, key: Hashable) -> BlockRecord | None:
        """`key`'s history here, for the policy it moves to (`adopt`); None if this policy keeps
        none that carries over, or does not track `key`."""

    def adopt(self, key: Hashable, parent: Hashable | None, record: BlockRecord) -> None:
        """Track `key`, new here, with the history `record` another policy of this kind exported.

        A cached block moving into a tenant's cache partition (kv/block_pool.py, kv/tiers.py)
        keeps its rank there (it entered as a newcomer: under LFU a block hit a hundred times was
        the partition's first victim). The access that moves it follows, as a hit (a reuse, for
        the Gittins family). A policy that keeps no such history (s3fifo, arc) does nothing: that
        access tracks the block as new.
        """

    def __len__(self) -> int: ...

    def __contains__(self, key: object) -> bool: ...


@dataclass(frozen=True, slots=True)
class BlockRecord:
    """What one policy knew of a cached block, carried to the policy it moves to (`export`,
    `adopt`)."""

    last: int  # the caller's clock at its last access
    accesses: int = 1  # accesses while tracked (where the policy counts them)
    # The Gittins family's classes: ticks between its last two accesses (-1: one so far), its
    # place in its prefix chain (0: first), and whether it ever had a child
    interval: int = -1
    depth: int = 0
    is_parent: bool = False


class _CandidateHeap:
    """Min-heap of keys with lazy invalidation.

    Each key has at most one *current* entry (its latest push); older entries are skipped on peek.
    A global sequence number breaks priority ties in push order and keeps keys out of comparisons,
    so keys only need to be hashable.
    """

    __slots__ = ("_heap", "_cur", "_seq")

    def __init__(self) -> None:
        self._heap: list[tuple[object, int, Hashable]] = []
        self._cur: dict[Hashable, tuple[object, int]] = {}
        self._seq = itertools.count()

    def push(self, key: Hashable, prio: object) -> None:
        cur = self._cur.get(key)
        if cur is not None and cur[0] == prio:
            return  # the live entry already says this
        seq = next(self._seq)
        self._cur[key] = (prio, seq)
        heapq.heappush(self._heap, (prio, seq, key))
        if len(self._heap) > 2 * len(self._cur) + 1024:
            self._compact()

    def discard(self, key: Hashable) -> None:
        self._cur.pop(key, None)

    def smallest(self, k: int, is_candidate: Callable[[Hashable], bool]) -> list[Hashable]:
        """Up to `k` candidate keys with the lowest priorities (lowest first); the heap keeps them."""
        heap, cur = self._heap, self._cur
        found: list[tuple[object, int, Hashable]] = []
        while heap and len(found) < k:
            entry = heapq.heappop(heap)
            key = entry[2]
            live = cur.get(key)
            if live is None or live[1] != entry[1]:
                continue  # superseded by a later push, or discarded
            if not is_candidate(key):
                del cur[key]  # re-pushed when it becomes a candidate again
                continue
            found.append(entry)
        for entry in found:
            heapq.heappush(heap, entry)
        return [entry[2] for entry in found]

    def peek(self, is_candidate: Callable[[Hashable], bool]) -> Hashable | None:
        heap, cur = self._heap, self._cur
        while heap:
            prio, seq, key = heap[0]
            live = cur.get(key)
            if live is not None and live[1] == seq:
                if is_candidate(key):
                    return key
                del cur[key]  # re-pushed when it becomes a candidate again
            heapq.heappop(heap)
        return None

    def _compact(self) -> None:
        self._heap = [(p, s, k) for k, (p, s) in self._cur.items()]
        heapq.heapify(self._heap)


class _LeafPolicy:
    """Tracking, parent/child counts and pins shared by every policy.

    Subclasses implement `_on_insert`, `_on_hit`, `_on_remove`, `_refresh` (re-push `key` if it is
    a candidate) and `victim`. Child counts are kept per parent key even when the parent itself is
    not tracked, so a parent that (re)appears later still knows it is not a leaf.
    """

    name = "base"

    def __init__(self) -> None:
        self._parent: dict[Hashable, Hashable | None] = {}
        self._children: dict[Hashable, int] = {}
        self._pins: dict[Hashable, int] = {}

    # -- interface ---------------------------------------------------------------------------
    def access(self, key: Hashable, parent: Hashable | None, now: int) -> None:
        if key in self._parent:
            self._on_hit(key, now)
        else:
            self._track(key, parent)
            self._on_insert(key, now)
        self._refresh(key)

    def pin(self, key: Hashable) -> None:
        self._pins[key] = self._pins.get(key, 0) + 1

    def unpin(self, key: Hashable) -> None:
        n = self._pins.get(key, 0)
        if n <= 0:
            raise ValueError(f"unpin({key!r}) without a matching pin; pin and unpin must pair up")
        if n == 1:
            del self._pins[key]
            self._refresh(key)
        else:
            self._pins[key] = n - 1

    def remove(self, key: Hashable) -> None:
        if key not in self._parent:
            raise KeyError(f"remove({key!r}): block is not tracked by policy {self.name!r}")
        parent = self._parent.pop(key)
        self._on_remove(key)
        if parent is not None:
            n = self._children[parent] - 1
            if n:
                self._children[parent] = n
            else:
                del self._children[parent]
                if parent in self._parent:
                    self._refresh(parent)  # it just became a leaf

    def victim(self) -> Hashable | None:
        raise NotImplementedError

    def finished(self, keys: Sequence[Hashable], output_tokens: int) -> None:
        pass  # only hint-aware policies use it

    def export(self, key: Hashable) -> BlockRecord | None:
        return None  # (policies with a history that carries over say so)

    def adopt(self, key: Hashable, parent: Hashable | None, record: BlockRecord) -> None:
        pass

    def __len__(self) -> int:
        return len(self._parent)

    def __contains__(self, key: object) -> bool:
        return key in self._parent

    # -- helpers -----------------------------------------------------------------------------
    def _track(self, key: Hashable, parent: Hashable | None) -> None:
        """Start tracking `key` under `parent` (its history is the caller's to set)."""
        self._parent[key] = parent
        if parent is not None:
            self._children[parent] = self._children.get(parent, 0) + 1

    def _is_candidate(self, key: Hashable) -> bool:
        return key in self._parent and key not in self._pins and key not in self._children

    def _on_insert(self, key: Hashable, now: int) -> None:
        raise NotImplementedError

    def _on_hit(self, key: Hashable, now: int) -> None:
        raise NotImplementedError

    def _on_remove(self, key: Hashable) -> None:
        raise NotImplementedError

    def _refresh(self, key: Hashable) -> None:
        raise NotImplementedError


class _ScoredPolicy(_LeafPolicy):
    """A policy that is one priority per block: the candidate with the lowest `_priority` goes."""

    def __init__(self) -> None:
        super().__init__()
        self._heap = _CandidateHeap()

    def _priority(self, key: Hashable) -> object:
        raise NotImplementedError

    def _refresh(self, key: Hashable) -> None:
        if self._is_candidate(key):
            self._heap.push(key, self._priority(key))

    def victim(self) -> Hashable | None:
        return self._heap.peek(self._is_candidate)


class LRUPolicy(_ScoredPolicy):
    """Least recently used leaf goes first. The baseline every other policy is measured against."""

    name = "lru"

    def __init__(self) -> None:
        super().__init__()
        self._last: dict[Hashable, int] = {}

    def _on_insert(self, key: Hashable, now: int) -> None:
        self._last[key] = now

    _on_hit = _on_insert

    def _on_remove(self, key: Hashable) -> None:
        del self._last[key]
        self._heap.discard(key)

    def _priority(self, key: Hashable) -> object:
        return self._last[key]

    def export(self, key: Hashable) -> BlockRecord | None:
        last = self._last.get(key)
        return None if last is None else BlockRecord(last)

    def adopt(self, key: Hashable, parent: Hashable | None, record: BlockRecord) -> None:
        if key not in self._parent:
            self._track(key, parent)
            self._last[key] = record.last
            self._refresh(key)


class _CountingPolicy(_ScoredPolicy):
    """A scored policy that keeps each tracked block's access count and last access time, and
    forgets both on eviction (no history)."""

    def __init__(self) -> None:
        super().__init__()
        self._count: dict[Hashable, int] = {}
        self._last: dict[Hashable, int] = {}

    def _on_insert(self, key: Hashable, now: int) -> None:
        self._count[key] = 1
        self._last[key] = now

    def _on_hit(self, key: Hashable, now: int) -> None:
        self._count[key] += 1
        self._last[key] = now

    def _on_remove(self, key: Hashable) -> None:
        del self._count[key], self._last[key]
        self._heap.discard(key)

    def export(self, key: Hashable) -> BlockRecord | None:
        count = self._count.get(key)
        return None if count is None else BlockRecord(self._last[key], count)

    def adopt(self, key: Hashable, parent: Hashable | None, record: BlockRecord) -> None:
        if key not in self._parent:
            self._track(key, parent)
            self._count[key], self._last[key] = record.accesses, record.last
            self._refresh(key)


class LFUPolicy(_CountingPolicy):
    """Least frequently used leaf goes first; ties go to the least recent.

    Counts are forgotten on eviction (no history), so a once-hot block that was evicted starts
    over - the classic LFU weakness against shifting popularity.
    """

    name = "lfu"

    def _priority(self, key: Hashable) -> object:
        return (self._count[key], self._last[key])


class TLPPolicy(_CountingPolicy):
    """Temporal-locality predictor, as the issue defines it: a block's score is its access count
    decayed by alpha ** age, `count * alpha**(now - last access)`; the lowest score goes first.

    Scores at different `last` times compare alike at every `now`: count * alpha**(now - last)
    orders like log(count) - last * log(alpha), so that is the heap key and no entry ever needs
    rescoring; ties (equal keys: two exactly equal scores may differ in the last bit, and then the
    key decides) go to the least recent. (An earlier version summed each access's own decay,
    sum(alpha**(now - t)); the issue's form scored higher in 5 of the 6 trace cells.)

    `alpha` is per tick of the caller's clock; the default 0.995 assumes one tick per request.
    """

    name = "tlp"

    def __init__(self, alpha: float = 0.995) -> None:
        if not 0.0 < alpha <= 1.0:
            raise ValueError(f"tlp alpha must be in (0, 1], got {alpha}")
        super().__init__()
        self.alpha = alpha
        self._neg_log_alpha = -math.log(alpha)

    def _priority(self, key: Hashable) -> object:
        return (math.log(self._count[key]) + self._last[key] * self._neg_log_alpha, self._last[key])

    def score(self, key: Hashable, now: int) -> float:
        """The decayed access count of `key` at time `now` (for inspection and tests)."""
        return self._count[key] * self.alpha ** (now - self._last[key])


class S3FIFOPolicy(_LeafPolicy):
    """S3-FIFO (Yang et al., SOSP'23) restricted to leaf victims.

    New blocks enter a small FIFO (`small_ratio` of the cache); one that is referenced again before
    it reaches the small queue's tail is promoted to the main FIFO, otherwise it is evicted and
    remembered in a ghost FIFO, and a ghost that comes back goes straight to main. Main is a FIFO
    with 2-bit frequency: a referenced block at the tail is reinserted with frequency - 1.
    Queue order is kept as a per-queue sequence number in a candidate heap, so "the tail" means
    the oldest *evictable leaf* of that queue: a parent waits behind its children, and a block
    promoted to main takes its ancestors still in small along (`_promote`).

    Differences from the paper: the ghost FIFO remembers as many blocks as the cache holds, not
    |main| (better in 5 of the 6 trace cells, e.g. conversation at 4,000 blocks 11.1% vs 10.2%;
    synthetic at 4,000: 20.8% vs 22.3%); and, as in the paper, one `victim()` call may walk
    main's whole tail of referenced blocks (up to ~80 ms at 16,000 blocks, amortised O(1)).
    """

    name = "s3fifo"
    _SMALL, _MAIN = 0, 1

    def __init__(self, small_ratio: float = 0.1, max_freq: int = 3) -> None:
        super().__init__()
        self.small_ratio = small_ratio
        self.max_freq = max_freq
        self._queue: dict[Hashable, int] = {}
        self._freq: dict[Hashable, int] = {}
        self._pos: dict[Hashable, int] = {}
        self._heaps = (_CandidateHeap(), _CandidateHeap())
        self._small_size = 0
        self._ghost: OrderedDict[Hashable, None] = OrderedDict()
        self._clock = itertools.count()

    def _enqueue(self, key: Hashable, queue: int) -> None:
        old = self._queue.get(key)
        if old is not None:
            self._heaps[old].discard(key)
            self._small_size -= old == self._SMALL
        self._queue[key] = queue
        self._small_size += queue == self._SMALL
        self._pos[key] = next(self._clock)
        self._refresh(key)

    def _promote(self, key: Hashable) -> None:
        """Move `key` to main, and its ancestors still in the small queue with it: a parent can
        only leave after its children, so one left behind in small would never reach small's
        tail, and such parents piled up to a third or more of the cache (small is 10%)."""
        self._enqueue(key, self._MAIN)
        parent = self._parent.get(key)
        while parent is not None and self._queue.get(parent) == self._SMALL:
            self._freq[parent] = 0
            self._enqueue(parent, self._MAIN)
            parent = self._parent.get(parent)

    def _on_insert(self, key: Hashable, now: int) -> None:
        self._freq[key] = 0
        if key in self._ghost:
            del self._ghost[key]
            self._promote(key)
        else:
            self._enqueue(key, self._SMALL)

    def _on_hit(self, key: Hashable, now: int) -> None:
        self._freq[key] = min(self._freq[key] + 1, self.max_freq)

    def _on_remove(self, key: Hashable) -> None:
        queue = self._queue.pop(key)
        self._heaps[queue].discard(key)
        del self._freq[key], self._pos[key]
        if queue == self._SMALL:
            self._small_size -= 1
            self._ghost[key] = None
            while len(self._ghost) > max(len(self._parent), 1):
                self._ghost.popitem(last=False)

    def _refresh(self, key: Hashable) -> None:
        if self._is_candidate(key):
            self._heaps[self._queue[key]].push(key, self._pos[key])

    def victim(self) -> Hashable | None:
        small, main = self._heaps
        is_cand = self._is_candidate
        while True:
            use_small = self._small_size >= self.small_ratio * len(self._parent)
            first, second = (small, main) if use_small else (main, small)
            key = first.peek(is_cand)
            if key is None:
                key = second.peek(is_cand)
                if key is None:
                    return None
            freq = self._freq[key]
            if freq == 0:
                return key
            if self._queue[key] == self._SMALL:
                self._freq[key] = 0
                self._promote(key)
            else:
                self._freq[key] = freq - 1
                self._enqueue(key, self._MAIN)


class ARCPolicy(_LeafPolicy):
    """Adaptive Replacement Cache (Megiddo & Modha, FAST'03) restricted to leaf victims.

    T1 holds blocks seen once recently, T2 blocks seen at least twice; B1/B2 remember what each
    list evicted. A ghost hit in B1 grows T1's target share `p`, one in B2 shrinks it, so the
    recency/frequency balance adapts to the trace. The cache size `c` is taken as the number of
    tracked blocks when a victim is needed (the cache is full then), so no capacity is configured.

    Three differences from the paper, all forced by or chosen for this interface (an audit
    against a textbook ARC explained every differing eviction by them; on the first 2,000
    conversation requests at 1,000 blocks this version hits 5.3% vs the textbook's 4.6%):
    `p` adapts when the ghost hit is *accessed*, after `victim()` already chose (the caller asks
    for room before inserting); the "x in B2 and |T1| = p" tie rule is not applied; and the
    ghosts are capped at |B1| + |B2| <= tracked blocks by trimming the longer list.
    """

    name = "arc"

    def __init__(self) -> None:
        super().__init__()
        self._list: dict[Hashable, int] = {}  # 1 or 2
        self._last: dict[Hashable, int] = {}
        self._heaps = {1: _CandidateHeap(), 2: _CandidateHeap()}
        self._size = {1: 0, 2: 0}
        self._b1: OrderedDict[Hashable, None] = OrderedDict()
        self._b2: OrderedDict[Hashable, None] = OrderedDict()
        self._p = 0.0
        self._tick = itertools.count()

    def _move(self, key: Hashable, lst: int) -> None:
        old = self._list.get(key)
        if old is not None:
            self._heaps[old].discard(key)
            self._size[old] -= 1
        self._list[key] = lst
        self._size[lst] += 1
        self._last[key] = next(self._tick)

    def _on_insert(self, key: Hashable, now: int) -> None:
        c = max(len(self._parent), 1)
        if key in self._b1:
            self._p = min(float(c), self._p + max(len(self._b2) / len(self._b1), 1.0))
            del self._b1[key]
            self._move(key, 2)
        elif key in self._b2:
            self._p = max(0.0, self._p - max(len(self._b1) / len(self._b2), 1.0))
            del self._b2[key]
            self._move(key, 2)
        else:
            self._move(key, 1)

    def _on_hit(self, key: Hashable, now: int) -> None:
        self._move(key, 2)

    def _on_remove(self, key: Hashable) -> None:
        lst = self._list.pop(key)
        self._heaps[lst].discard(key)
        self._size[lst] -= 1
        del self._last[key]
        ghost = self._b1 if lst == 1 else self._b2
        ghost[key] = None
        c = max(len(self._parent), 1)
        while len(self._b1) + len(self._b2) > c:
            (self._b1 if len(self._b1) > len(self._b2) else self._b2).popitem(last=False)

    def _refresh(self, key: Hashable) -> None:
        if self._is_candidate(key):
            self._heaps[self._list[key]].push(key, self._last[key])

    def victim(self) -> Hashable | None:
        first, second = (1, 2) if self._size[1] > max(self._p, 0.0) else (2, 1)
        key = self._heaps[first].peek(self._is_candidate)
        if key is None:
            key = self._heaps[second].peek(self._is_candidate)
        return key


def gittins_index(hazard: Sequence[float], edges: Sequence[int]) -> list[float]:
    """G[a] = max over horizons H of P(reuse in [a, H)) / E[ticks held from a to reuse or H].

    `hazard[b]` is P(reuse at an age in bucket b | not reused before it); bucket b covers ages
    [edges[b], edges[b+1]). The result is the best hits-per-block-tick a block that has reached
    the start of bucket a can still deliver if kept for the best horizon: the Gittins index of
    the "keep it" arm, so evicting the lowest index loses the fewest hits per freed slot.
    """
    nb = len(edges)
    q, surv, s = [0.0] * nb, [0.0] * nb, 1.0
    for b in range(nb):
        surv[b] = s
        q[b] = s * min(max(hazard[b], 0.0), 1.0)
        s -= q[b]
    last = max((b for b in range(nb) if q[b] > 0), default=-1)
    table = [0.0] * nb
    for a in range(last + 1):
        if surv[a] <= 1e-12:
            break
        hits = cost = best = 0.0
        start = edges[a]
        for x in range(a, last + 1):
            end = edges[x + 1] if x + 1 < nb else edges[x] + 1
            hits += q[x]
            cost += q[x] * ((edges[x] + end) / 2 - start)
            held = cost + (surv[a] - hits) * (end - start)
            if held > 0 and hits > best * held:
                best = hits / held
        table[a] = best
    return table


def gittins_tables(hazards: np.ndarray, edges: Sequence[int]) -> np.ndarray:
    """`gittins_index` for every row of `hazards` (one table per row) in a few array operations.

    Why: a refit builds up to a few hundred tables, and the scalar loop made each refit a
    30-100 ms pause of the step that triggered it. Same sums in the same order per row (running
    sums from each start bucket, not differences of one long sum); only the best horizon is
    taken as the max of hits / held where the loop compared hits > best * held, which can pick
    another of two horizons whose ratios tie to rounding (1 ULP apart, seen with constant
    hazards). On the traces' replays every refit's tables were identical.
    """
    h = np.clip(np.asarray(hazards, dtype=np.float64), 0.0, 1.0)
    k, nb = h.shape
    q, surv, s = np.zeros((k, nb)), np.zeros((k, nb)), np.ones(k)
    for b in range(nb):
        surv[:, b] = s
        q[:, b] = s * h[:, b]
        s = s - q[:, b]
    e = np.asarray(edges, dtype=np.float64)
    end = np.append(e[1:], e[-1] + 1)
    mid = (e + end) / 2
    has = q > 0
    last = np.where(has.any(axis=1), nb - 1 - np.argmax(has[:, ::-1], axis=1), -1)
    q = np.where(np.arange(nb)[None, :] <= last[:, None], q, 0.0)  # no reuse past `last`
    table = np.zeros((k, nb))
    for a in range(int(last.max(initial=-1)) + 1):  # a block that has reached bucket a
        qa = q[:, a:]
        hits = np.cumsum(qa, axis=1)  # [row, x]: the horizon ends in bucket a + x
        cost = np.cumsum(qa * (mid[a:] - e[a]), axis=1)
        held = cost + (surv[:, a, None] - hits) * (end[a:] - e[a])
        ok = (held > 0) & (hits > 0) & (np.arange(a, nb) <= last[:, None]) & (surv[:, a, None] > 1e-12)
        table[:, a] = np.where(ok, hits / np.where(ok, held, 1.0), 0.0).max(axis=1)
    return table


class _SampledPolicy(_LeafPolicy):
    """Leaf tracking plus a uniform sample of the evictable leaves, for policies whose scores
    change with time (so no heap order can be kept): victim() scores `samples` random candidates,
    plus the `oldest` least recently accessed ones when the subclass knows access times (`_last`).

    Why the oldest too: most scores here fall with age, so the best victim is often among the
    oldest leaves, and a uniform sample of 64 out of hundreds of leaves misses most of them.
    Measured with `chain` on conversation/16k (share of the LRU->Belady gap; seeds): 64 random
    23.9-24.4% (0-4), 256 random 24.3-24.6% (0-1), 64 random + 16 oldest 24.2-25.1% (0-3),
    128 random + 16 oldest 25.0-25.8% (0-9; chain's setting), a full scan of every leaf 24.8%.
    A little randomness helps, apparently because the learned index is not perfectly calibrated.

    Candidates sit in a list with O(1) swap-removal; stale entries (pinned, got a child) are
    purged lazily when drawn and re-added by `_refresh` when they become candidates again. The
    oldest come from a heap keyed by last access, with the same lazy invalidation.
    """

    def __init__(self, samples: int = 64, seed: int = 0, oldest: int = 0) -> None:
        super().__init__()
        # A sample of none could never find a victim among many leaves (victim() would spin).
        if isinstance(samples, bool) or not isinstance(samples, numbers.Integral) or samples < 1:
            raise ValueError(f"samples must be a whole number of at least 1, got {samples!r}")
        if isinstance(oldest, bool) or not isinstance(oldest, numbers.Integral) or oldest < 0:
            raise ValueError(f"oldest must be a whole number of at least 0, got {oldest!r}")
        self.samples, self.oldest = int(samples), int(oldest)
        self._cands: list[Hashable] = []  # evictable leaves (plus stale ones, purged lazily)
        self._cand_pos: dict[Hashable, int] = {}
        self._by_last = _CandidateHeap() if oldest > 0 else None
        self._rng = random.Random(seed)

    def _last(self, key: Hashable) -> int:
        """Tick of `key`'s last access (needed only when `oldest` > 0)."""
        raise NotImplementedError

    def _on_insert(self, key: Hashable, now: int) -> None:
        pass  # scores are computed when a victim is needed (Gittins keeps its history in access())

    _on_hit = _on_insert

    def _on_remove(self, key: Hashable) -> None:
        self._drop(key)
        if self._by_last is not None:
            self._by_last.discard(key)

    def _drop(self, key: Hashable) -> None:
        i = self._cand_pos.pop(key, None)
        if i is not None:
            last = self._cands.pop()
            if i < len(self._cands):
                self._cands[i] = last
                self._cand_pos[last] = i

    def _refresh(self, key: Hashable) -> None:
        if self._is_candidate(key):
            if key not in self._cand_pos:
                self._cand_pos[key] = len(self._cands)
                self._cands.append(key)
            if self._by_last is not None:
                self._by_last.push(key, self._last(key))  # a no-op unless its last access moved

    def _sample(self) -> list[Hashable]:
        cands, is_cand = self._cands, self._is_candidate
        while True:  # each round drops the stale keys it drew, so this ends
            if len(cands) <= self.samples + self.oldest:  # few left: take them all
                for key in [k for k in cands if not is_cand(k)]:
                    self._drop(key)
                return list(cands)
            pool = []
            for key in self._rng.choices(cands, k=self.samples):
                if is_cand(key):
                    pool.append(key)
                else:
                    self._drop(key)  # pinned or got a child; _refresh re-adds it when that ends
            if self._by_last is not None:
                pool += self._by_last.smallest(self.oldest, is_cand)
            if pool:
                return pool


@dataclass(slots=True)
class _History:
    """What the Gittins policy remembers about a block, cached or not."""

    count: int  # accesses so far
    last: int  # tick of the last access
    interval: int  # ticks between the last two accesses; -1 before the second access
    depth: int  # position in its prefix chain (0 = first block)
    is_parent: bool = False  # ever had a child (a request's last, partial block never does)
    hint: int = 0  # output-length bucket of the last finished request that referenced it (0: none)
    cls: int = 0
    # ChainPolicy only: its segment, [latest access, previous access, parent segment, fan-out]
    seg: list | None = None


@functools.lru_cache(maxsize=None)
def _age_buckets(edges: tuple[int, ...]) -> tuple[int, ...]:
    """The bucket among `edges` of each age below 2**16, built once for every policy of those
    edges: a table of its own (0.5 MiB) per policy added up, as each tenant's cache partition
    has a policy of its own (kv/block_pool.py)."""
    return tuple(bisect.bisect_right(edges, a) - 1 for a in range(1 << 16))


class GittinsPolicy(_SampledPolicy):
    """Evict the leaf with the lowest Gittins index of reuse, learned online per class (own design).

    Why: on the Mooncake traces most reuse happens hundreds of requests after the last access,
    far beyond what LRU keeps at useful sizes, and which blocks come back is predictable only
    statistically. A block's access count, the gap between its last two accesses (or, for a new
    block, its depth), and whether it ever had a child (a request's partial last block never
    does and is almost never reused) separate blocks whose reuse odds differ several-fold, and
    how the odds fall with age differs per class too.

    How:
    - Every referenced block, cached or not, keeps a small `_History` (up to `history` of them),
      so reuse statistics come from the reference stream itself, not from what this cache
      happened to keep: no exploration problem, unlike hit-age statistics (LHD).
    - Per class and log-spaced age bucket, the reuse hazard is estimated Kaplan-Meier style
      (blocks still waiting, or forgotten from history, are censored rather than "never
      reused"), weighted towards the last `half_life` ticks so the tables follow drifting
      traffic, and shrunk towards the class group with `prior` pseudo-observations.
    - Every `refit_every` accesses the hazards become tables G[class][age bucket] via
      `gittins_index`: the best hits per block-tick the block can still deliver.
    - `victim()` samples `samples` evictable leaves (all when fewer) and evicts the lowest
      G(age), the older on ties. Before the first refit every G is 0, which is (sampled) LRU.

    Ages are ticks of the caller's clock (one per request in the simulator). Cost: O(samples)
    per victim, O(1) per access plus the periodic refit; memory ~ `history` small records.
    """

    name = "gittins"
    _SLOT = 16  # live records are histogrammed by start tick in slots of this many ticks
    _N_SUB = 14  # sub-classes: interval (or, for new blocks, depth) in powers of 4
    _N_HINT = 7  # with hints: none, then output lengths [0,4), [4,16), ..., [1024, inf) tokens

    def __init__(self, samples: int = 64, history: int = 1 << 18, refit_every: int = 8192,
                 max_count: int = 8, half_life: float = 2000.0, prior: float = 20.0,
                 growth: float = 1.3, seed: int = 0, oldest: int = 0, hints: bool = False) -> None:
        super().__init__(samples=samples, seed=seed, oldest=oldest)
        bad = [f"{k}={v!r} (must be {rule})" for k, v, ok, rule in (
            ("history", history, isinstance(history, numbers.Integral) and history >= 1, "at least 1"),
            ("refit_every", refit_every, isinstance(refit_every, numbers.Integral) and refit_every >= 1, "at least 1"),
            ("max_count", max_count, isinstance(max_count, numbers.Integral) and max_count >= 1, "at least 1"),
            ("half_life", half_life, half_life > 0 and math.isfinite(half_life), "a finite number above 0"),
            ("prior", prior, prior >= 0 and math.isfinite(prior), "a finite number of at least 0"),
            ("growth", growth, 1.01 <= growth <= 16, "from 1.01 to 16"),
        ) if not ok]
        if bad:  # each would stall (a tiny growth makes millions of buckets) or divide by zero later
            raise ValueError(f"{type(self).__name__}: bad settings {', '.join(bad)}")
        self.hints = hints
        self._n_sub = self._N_SUB * (self._N_HINT if hints else 1)  # classes per group
        self.history, self.refit_every = history, refit_every
        self.max_count, self.half_life, self.prior = max_count, half_life, prior
        edges = [0]
        while edges[-1] < 1 << 24:
            edges.append(max(edges[-1] + 1, int(edges[-1] * growth)))
        self._edges = edges
        self._age_bucket = _age_buckets(tuple(edges))  # fast path for bisect
        nb, n_cls = len(edges), max_count * 2 * self._n_sub
        self._reused = [[0.0] * nb for _ in range(n_cls)]  # weighted reuses per age bucket
        self._ended = [[0.0] * nb for _ in range(n_cls)]  # weighted reuses + censorings
        self._live: list[dict[int, int]] = [{} for _ in range(n_cls)]  # start slot -> records
        self._index = [[0.0] * nb for _ in range(n_cls)]
        self._hist: OrderedDict[Hashable, _History] = OrderedDict()
        self._now = 0
        self._since_refit = 0
        self._t_ref = 0  # statistics are weighted 2 ** ((start - _t_ref) / half_life)
        # Refits are counted in accesses; a clock that runs far ahead meanwhile (many requests
        # shorter than a block) also triggers one, before those weights overflow a float.
        self._max_lag = 64 * half_life

    # -- history and statistics ------------------------------------------------------------------
    def _last(self, key: Hashable) -> int:
        return self._hist[key].last

    def _bucket(self, age: int) -> int:
        return bisect.bisect_right(self._edges, age) - 1

    def _class(self, h: _History) -> int:
        sub = h.depth if h.interval < 0 else h.interval + 1  # depth only until a 2nd access
        sub = min(1 + sub.bit_length() // 2, self._N_SUB - 1)
        if self.hints:
            sub = sub * self._N_HINT + h.hint
        return ((min(h.count, self.max_count) - 1) * 2 + h.is_parent) * self._n_sub + sub

    def _live_add(self, h: _History, delta: int) -> None:
        live, slot = self._live[h.cls], h.last // self._SLOT
        n = live.get(slot, 0) + delta
        if n:
            live[slot] = n
        else:
            del live[slot]

    def _end(self, h: _History, reused: bool) -> None:
        b = self._bucket(self._now - h.last)
        w = 2.0 ** ((h.last - self._t_ref) / self.half_life)
        self._ended[h.cls][b] += w
        if reused:
            self._reused[h.cls][b] += w
        self._live_add(h, -1)

    def access(self, key: Hashable, parent: Hashable | None, now: int) -> None:
        self._now = now
        if now - self._t_ref > self._max_lag:  # weights are 2 ** (ticks since the last refit / half_life)
            self.refit()
        hist = self._hist
        ph = hist.get(parent) if parent is not None else None
        h = hist.get(key)
        if h is None:
            h = hist[key] = self._new_history(ph, now)
            self._forget_oldest()
        else:
            self._end(h, reused=True)
            h.count, h.interval, h.last = h.count + 1, now - h.last, now
            hist.move_to_end(key)
        h.cls = self._class(h)
        self._live_add(h, +1)
        if ph is not None and not ph.is_parent:
            self._live_add(ph, -1)
            ph.is_parent = True
            ph.cls = self._class(ph)
            self._live_add(ph, +1)
        super().access(key, parent, now)
        self._since_refit += 1
        if self._since_refit >= self.refit_every:
            self.refit()

    def finished(self, keys: Sequence[Hashable], output_tokens: int) -> None:
        """With `hints`, re-class the blocks of a finished request by its output length."""
        if not self.hints:
            return
        hint = 1 + min(max(output_tokens, 0).bit_length() // 2, self._N_HINT - 2)
        hist = self._hist
        for key in keys:
            h = hist.get(key)
            if h is None or h.hint == hint:
                continue
            self._live_add(h, -1)  # its open record moves to the new class
            h.hint = hint
            h.cls = self._class(h)
            self._live_add(h, +1)

    def export(self, key: Hashable) -> BlockRecord | None:
        h = self._hist.get(key) if key in self._parent else None
        return None if h is None else BlockRecord(h.last, h.count, h.interval, h.depth, h.is_parent)

    def adopt(self, key: Hashable, parent: Hashable | None, record: BlockRecord) -> None:
        """The block's record from `record` (its own, if it was here before, goes on), so the
        access that moves it is a reuse of a block with its history: tracking is that access's."""
        if key in self._hist:
            return
        h = self._hist[key] = self._new_history(self._hist.get(parent) if parent is not None else None, record.last)
        h.count, h.interval, h.depth, h.is_parent = record.accesses, record.interval, record.depth, record.is_parent
        h.cls = self._class(h)
        self._live_add(h, +1)
        self._forget_oldest()

    def _new_history(self, ph: _History | None, now: int) -> _History:
        """The record of a block first seen at `now` whose parent's record is `ph` (or None)."""
        depth = ph.depth + 1 if ph is not None else 0
        return _History(count=1, last=now, interval=-1, depth=depth)

    def _forget_oldest(self) -> None:
        """Keep at most `history` records (or twice those still needed, if more): the oldest
        go first, except a block's that is still cached, which moves to the back."""
        hist = self._hist
        limit = max(self.history, 2 * self._n_kept())
        moved = 0
        while len(hist) > limit and moved < len(hist):
            key, h = hist.popitem(last=False)
            if self._kept(key):
                hist[key] = h
                moved += 1
                continue
            self._end(h, reused=False)  # censored: we stop watching, it was not "never reused"

    def _kept(self, key: Hashable) -> bool:
        """Whether `key`'s record must stay: something still scores the block by it."""
        return key in self._parent

    def _n_kept(self) -> int:
        """At least the number of records `_kept` holds on to."""
        return len(self._parent)

    def refit(self) -> None:
        """Rebuild the G tables from the statistics gathered so far (also called periodically).

        Array arithmetic over the classes that saw traffic, and one `gittins_tables` call for
        every table: the refit pauses the step that triggers it.
        """
        self._since_refit = 0
        nb, now, m, slot = len(self._edges), self._now, self.prior, self._SLOT
        decay = 2.0 ** ((self._t_ref - now) / self.half_life)
        self._t_ref = now
        active = [c for c, (ended, live) in enumerate(zip(self._ended, self._live)) if live or any(ended)]
        if not active:
            return
        reused = np.array([self._reused[c] for c in active]) * decay
        ended = np.array([self._ended[c] for c in active]) * decay
        for i, c in enumerate(active):
            self._reused[c], self._ended[c] = reused[i].tolist(), ended[i].tolist()
        rows, starts, counts = [], [], []
        for i, c in enumerate(active):
            live = self._live[c]
            rows += [i] * len(live)
            starts += live.keys()
            counts += live.values()
        start = np.array(starts, dtype=np.int64) * slot + slot // 2
        weight = np.power(2.0, (start - now) / self.half_life)
        bucket = np.searchsorted(self._edges, np.maximum(0, now - start), side="right") - 1
        risk = ended.copy()  # [class, b]: records that reached bucket b still unreused
        np.add.at(risk, (np.array(rows, dtype=np.int64), bucket), np.array(counts) * weight)
        risk = np.cumsum(risk[:, ::-1], axis=1)[:, ::-1]

        def shrink(r: np.ndarray, k: np.ndarray, prior: np.ndarray) -> np.ndarray:
            return (r + m * prior) / (k + m)

        r_all, k_all = reused.sum(axis=0), risk.sum(axis=0)
        h_all = np.where(k_all > 0, r_all / np.where(k_all > 0, k_all, 1.0), 0.0)
        group_of = np.array(active) // self._n_sub
        groups = sorted(set(group_of.tolist()))
        hazards = [h_all]
        for g in groups:
            mine = group_of == g
            hazards.append(shrink(reused[mine].sum(axis=0), risk[mine].sum(axis=0), h_all))
        row_of = {g: 1 + j for j, g in enumerate(groups)}
        hazards += [shrink(reused[i], risk[i], hazards[row_of[g]]) for i, g in enumerate(group_of.tolist())]
        tables = gittins_tables(np.array(hazards), self._edges).tolist()
        for group in range(len(self._reused) // self._n_sub):
            g_table = tables[row_of[group]] if group in row_of else tables[0]
            for c in range(group * self._n_sub, (group + 1) * self._n_sub):
                self._index[c] = g_table
        for i, c in enumerate(active):
            self._index[c] = tables[1 + len(groups) + i]

    def victim(self) -> Hashable | None:
        hist, index, now = self._hist, self._index, self._now
        age_bucket, bucket = self._age_bucket, self._bucket
        best, best_v = None, None
        for key in self._sample():
            h = hist[key]
            age = max(now - h.last, 0)
            v = (index[h.cls][age_bucket[age] if age < len(age_bucket) else bucket(age)], h.last)
            if best_v is None or v < best_v:
                best, best_v = key, v
        return best


class HintedGittinsPolicy(GittinsPolicy):
    """Gittins whose classes also know how long the last answer that used a block was (own design).

    Why: how many tokens a request generated says what kind of request it was, and on the
    synthetic Mooncake trace that predicts whether its prompt comes back: a document first seen
    with an answer of 300+ tokens returns within 200 requests 0-1% of the time, one first seen
    with an answer under 20 tokens 9-32% (first/second half of the trace). Only the serving
    engine knows this, when the request finishes (`EvictionPolicy.finished`), so no score built
    from block hashes and times can see it.

    How: `GittinsPolicy(hints=True)`: each block's class also holds the output length of the
    last finished request that referenced it, in powers of 4 ([0, 4), [4, 16), ..., 1024+
    tokens, or none yet), and the per-class reuse hazards are learned as before, so the policy
    finds out by itself whether the hint matters (shrinkage pulls sparse classes to their
    group). Blocks of a request still running keep their previous hint.

    Measured (gap closed vs LRU, bench_results/cache.json; gittins in brackets): synthetic
    1k/4k/16k 5.6% (3.5) / 11.3% (6.5) / 51.7% (15.4); conversation 24.0% (27.3) / 28.0% (28.4) /
    21.9% (21.0), where output lengths say little and the finer classes cost a few points at 1k.
    Cost: Gittins' per access and per victim; refits scan up to 7x the classes.
    """

    name = "gittins_hint"

    def __init__(self, hints: bool = True, **gittins_kwargs: object) -> None:
        super().__init__(hints=hints, **gittins_kwargs)  # type: ignore[arg-type]


class DuelPolicy(GittinsPolicy):
    """Gittins and a reuse-rate expert propose victims; pairwise duels decide whom to follow (own design).

    Why: no single score wins on both Mooncake traces. On the conversation trace the learned
    Gittins index is best (a conversation's next turn reuses blocks seen once, and partial tails
    are dead). On the synthetic trace, popularity is the signal: a document seen once comes back
    18% of the time, one seen twice 80%, and popularity rises over the trace, which Gittins'
    per-class tables average away. The *reuse-rate* expert scores a block
    (count - 1) / (age + rate_offset) from the history Gittins already keeps for evicted blocks,
    so a block seen once scores 0 and goes first (admission control: a new document only stays
    while nothing else is cheaper) and a re-referenced block is ranked by its re-reference rate.

    How: both experts score the same sampled candidates; the policy follows the expert with the
    higher duel balance. Whenever the two disagree (expert A picks a, B picks b), a *duel* is
    recorded and resolved by the reference stream itself, with Belady's criterion: whichever of
    a and b is referenced first was the worse victim, so the expert that proposed it loses. The
    balance is a sum of +/-1 outcomes decayed by `decay` per decision, so it follows phases of
    the trace. Duels whose keys are never referenced again expire (oldest first, `max_duels`).
    Nothing needs the future and no shadow cache is simulated: a duel costs two dict entries.

    Cost: victim() is Gittins' sample scan with a second score per candidate; access() pops the
    key's pending duels (usually none).
    """

    name = "duel"

    def __init__(self, rate_offset: float = 30.0, decay: float = 0.99, max_duels: int = 1 << 16,
                 **gittins_kwargs: object) -> None:
        super().__init__(**gittins_kwargs)  # type: ignore[arg-type]
        self.rate_offset, self.decay, self.max_duels = rate_offset, decay, max_duels
        self.balance = 0.0  # > 0: reuse-rate expert has been winning; <= 0: follow Gittins
        self._duels: OrderedDict[int, tuple[Hashable, Hashable]] = OrderedDict()  # id -> (g, r)
        self._duels_of: dict[Hashable, list[int]] = {}  # key -> pending duel ids
        self._duel_ids = itertools.count()

    def access(self, key: Hashable, parent: Hashable | None, now: int) -> None:
        ids = self._duels_of.pop(key, None)
        if ids:
            for d in ids:
                pair = self._duels.pop(d, None)
                if pair is None:
                    continue
                g_key, r_key = pair
                self.balance += 1.0 if key == g_key else -1.0  # Gittins' victim was needed first
                self._unlink(d, r_key if key == g_key else g_key)
        super().access(key, parent, now)

    def _unlink(self, duel: int, key: Hashable) -> None:
        ids = self._duels_of.get(key)
        if ids is not None:
            ids.remove(duel)
            if not ids:
                del self._duels_of[key]

    # A subclass's test for blocks known to be dead: they get the lowest score under both experts.
    _dead: Callable[[Hashable], bool] | None = None

    def victim(self) -> Hashable | None:
        hist, index, now, off = self._hist, self._index, self._now, self.rate_offset
        age_bucket, bucket, dead = self._age_bucket, self._bucket, self._dead
        g_best = r_best = None
        g_v: tuple[float, int] | None = None
        r_v: tuple[float, int] | None = None
        for key in self._sample():
            h = hist[key]
            if dead is not None and dead(key):
                g = r = (-1.0, h.last)
            else:
                age = max(now - h.last, 0)
                g = (index[h.cls][age_bucket[age] if age < len(age_bucket) else bucket(age)], h.last)
                r = ((h.count - 1) / (age + off), h.last)
            if g_v is None or g < g_v:
                g_best, g_v = key, g
            if r_v is None or r < r_v:
                r_best, r_v = key, r
        return self._decide(g_best, r_best)

    def _decide(self, g_best: Hashable | None, r_best: Hashable | None) -> Hashable | None:
        """Record a duel if the experts disagree; return the victim of the leading expert."""
        self.balance *= self.decay
        if g_best != r_best:
            d = next(self._duel_ids)
            self._duels[d] = (g_best, r_best)
            self._duels_of.setdefault(g_best, []).append(d)
            self._duels_of.setdefault(r_best, []).append(d)
            if len(self._duels) > self.max_duels:
                old, (a, b) = self._duels.popitem(last=False)
                self._unlink(old, a)
                self._unlink(old, b)
        return r_best if self.balance > 0 else g_best


class _ShadowCache(_SampledPolicy):
    """A metadata-only cache that evicts by one expert's score (see `ShadowPolicy`)."""

    name = "shadow-cache"

    def __init__(self, score: Callable[[Hashable], object], samples: int, seed: int) -> None:
        super().__init__(samples=samples, seed=seed)
        self._score = score

    def victim(self) -> Hashable | None:
        score = self._score
        best, best_v = None, None
        for key in self._sample():
            v = score(key)
            if best_v is None or v < best_v:  # type: ignore[operator]
                best, best_v = key, v
        return best


class ShadowPolicy(GittinsPolicy):
    """Follow whichever expert - Gittins index or reuse rate - has been hitting more (own design).

    Why: the two experts of `DuelPolicy` win on different traces and sizes (Gittins on the
    conversation trace, the reuse rate (count - 1) / (age + rate_offset) on the synthetic one,
    where it is 10 points better at 16k blocks), but Duel's pairwise duels ("whose victim was
    needed first") often back the wrong one: with prefix caching a block's reuse is only a hit
    when its whole leading run is cached, which a duel between two single blocks cannot see.

    How: each expert also runs a *shadow cache* - its own leaf set, pins and evictions, holding
    keys only, at the real cache's size (inferred as the largest `len(self)` seen by
    `victim()`, i.e. the size at which the owner evicts) - fed the same access stream. A shadow
    counts its own hits with the simulator's rule (a block hits if it is cached and every block
    before it in the request hit), tracked as "the parent's latest access was a hit", which
    also holds when the engine interleaves requests. Hits are decayed by
    1 - 1 / (window * capacity) per access once the capacity is known, so the race follows
    phases of the trace over a span proportional to the cache's turnover. `victim()` scores the
    real candidates with the expert whose shadow leads (Gittins on ties, before any evidence).
    Both experts score from the history and tables this Gittins instance keeps, which come from
    the reference stream and not from what any cache holds, so they are shared, not duplicated.

    Shadows sample `shadow_samples` candidates per victim (they only need to be representative).

    Cost: two extra leaf sets of up to `capacity` keys; access() does each shadow's insert and,
    when a shadow is full, one sampled victim scan: about 2.5x Gittins' time per reference in
    the simulator (conversation trace, 16k blocks: ~30 s vs ~12 s for 288k references).
    """

    name = "shadow"

    def __init__(self, rate_offset: float = 30.0, window: float = 8.0,
                 shadow_samples: int = 16, **gittins_kwargs: object) -> None:
        super().__init__(**gittins_kwargs)  # type: ignore[arg-type]
        if window <= 0:
            raise ValueError(f"shadow window must be > 0, got {window}")
        self.rate_offset, self.window = rate_offset, window
        self.capacity: int | None = None  # learned from the first victim() call
        self.scores = [0.0, 0.0]  # decayed shadow hits: [gittins, rate]
        self._shadows = (_ShadowCache(self._gittins_value, shadow_samples, 1),
                         _ShadowCache(self._rate_value, shadow_samples, 2))
        # per shadow: cached keys whose latest access was a hit. A block hits only if its parent's
        # latest access (normally just before, in the same request) hit too: the leading-run
        # rule, without assuming one request's blocks arrive back to back.
        self._hit: tuple[set[Hashable], set[Hashable]] = (set(), set())

    def _gittins_value(self, key: Hashable) -> tuple[float, int]:
        h = self._hist[key]
        age = max(self._now - h.last, 0)
        b = self._age_bucket[age] if age < len(self._age_bucket) else self._bucket(age)
        return (self._index[h.cls][b], h.last)

    def _rate_value(self, key: Hashable) -> tuple[float, int]:
        h = self._hist[key]
        return ((h.count - 1) / (max(self._now - h.last, 0) + self.rate_offset), h.last)

    def _kept(self, key: Hashable) -> bool:  # the shadows score their own blocks by these records too
        return key in self._parent or key in self._shadows[0] or key in self._shadows[1]

    def _n_kept(self) -> int:
        return len(self._parent) + len(self._shadows[0]) + len(self._shadows[1])

    def pin(self, key: Hashable) -> None:
        super().pin(key)
        for shadow in self._shadows:
            shadow.pin(key)

    def unpin(self, key: Hashable) -> None:
        super().unpin(key)
        for shadow in self._shadows:
            shadow.unpin(key)

    def access(self, key: Hashable, parent: Hashable | None, now: int) -> None:
        self._now = now  # shadows score with the current clock
        cap = self.capacity
        decay = 1.0 - 1.0 / (self.window * cap) if cap else 1.0
        for i, shadow in enumerate(self._shadows):
            hit_set = self._hit[i]
            hit = key in shadow and (parent is None or parent in hit_set)
            self.scores[i] = self.scores[i] * decay + hit
            if hit:
                hit_set.add(key)
                shadow.access(key, parent, now)
                continue
            hit_set.discard(key)
            # Down to below the capacity, not one out per insert: blocks the real cache lost
            # without an eviction (a reset, a tier dropping a damaged entry) before the capacity
            # was known stay in the shadows, which stayed that much larger for good.
            while cap and key not in shadow and len(shadow) >= cap:
                v = shadow.victim()
                if v is None:  # all pinned by this request: like the real cache, skip the insert
                    break
                shadow.remove(v)
                hit_set.discard(v)
            else:
                shadow.access(key, parent, now)
        super().access(key, parent, now)

    @property
    def follows(self) -> str:
        """The expert `victim()` currently uses: "gittins" or "rate"."""
        return "rate" if self.scores[1] > self.scores[0] else "gittins"

    def victim(self) -> Hashable | None:
        n = len(self._parent)
        if self.capacity is None or n > self.capacity:
            self.capacity = n
        score = self._rate_value if self.scores[1] > self.scores[0] else self._gittins_value
        best, best_v = None, None
        for key in self._sample():
            v = score(key)
            if best_v is None or v < best_v:
                best, best_v = key, v
        return best


class ChainPolicy(DuelPolicy):
    """Duel (Gittins vs reuse rate) that first evicts blocks on *abandoned branches* (own design).

    Why: per-block counts and ages cannot tell a dead block from a live one of the same class,
    but the prefix tree can. Every request walks its chain from the root, so when a later
    request walks part of a chain and then leaves it - it stops, or continues into another
    child - the blocks it skipped below that point are on a branch the traffic has moved away
    from: a conversation's previous partial last block once the next turn arrives, the rest of
    an earlier answer after an edit/regenerate, a prompt tail that a follow-up only partly
    reused. Such blocks are almost never referenced again (conversation trace, 16k blocks:
    of ~10k evictions of abandoned leaves, 16 were referenced later), yet Gittins rates them
    like any other block of their class and age and keeps them for hundreds of requests.

    How: blocks created together by one request (a run of new blocks, each the child of the
    previous) form a *segment*: one small shared record with the segment's latest and previous
    access ticks, its parent segment and its fan-out (child segments started from it). A
    block's access stamps its segment. A leaf is *abandoned* when its own segment, or one of
    its `walk` nearest ancestor segments, was accessed by an earlier request after the leaf's
    own last access: that request went through the leaf's prefix without reaching the leaf.
    The walk stops at a segment with more than `max_fan` child segments (a shared system
    prompt or document fans out to many independent chains, so passing through it says nothing
    about any one of them). `victim()` scores the sampled leaves like `DuelPolicy` (both
    experts, same duels), except that an abandoned leaf gets the lowest score under both
    experts (DuelPolicy's `_dead` hook), so it goes first (oldest first). Everything is known at the time: no lookahead.

    Settings chosen on conversation/16k, the trace it is for (gap closed vs LRU): its Gittins
    tables are rebuilt every 2,048 accesses (duel: 8,192; 23.9-24.4% over seeds 0-4, against
    23.3-23.4% over seeds 0-2), and each victim is picked from 128 random leaves plus the 16
    least recently used (duel: 64 random; 25.0-25.8% over seeds 0-9, see `_SampledPolicy`). On
    synthetic both cost a few points, and duel is the better choice there.

    Measured (request clock, gap closed vs LRU; duel in brackets): conversation 1k/4k/16k
    22.7% (22.9) / 29.9% (28.7) / 25.3% (21.2); synthetic 7.1% (9.1) / 8.1% (9.9) / 17.3% (20.3).

    Tried and dropped (conversation, 16k blocks): giving a new tail block its conversation's
    turn count and inter-turn gap (inheriting the chain's evidence) took Gittins from 21.0% to
    16.7-17.7%; boosting long conversations, finer interval classes and learning the abandoned
    flag as a Gittins class instead of this hard rule were all at or below plain Gittins.

    Cost: one record per segment (a few per request), an O(1) stamp per access and at most
    `walk` + 1 segment checks per scored candidate, twice duel's candidates per victim and
    four times its refits: 1.5-3.2x `duel`'s replay time (bench_results/cache.json).
    """

    name = "chain"

    def __init__(self, walk: int = 16, max_fan: int = 3, refit_every: int = 2048,
                 samples: int = 128, oldest: int = 16, **duel_kwargs: object) -> None:
        super().__init__(refit_every=refit_every, samples=samples, oldest=oldest,
                         **duel_kwargs)  # type: ignore[arg-type]
        self.walk, self.max_fan = walk, max_fan
        self._dead = self.abandoned

    def _new_history(self, ph: _History | None, now: int) -> _History:
        h = super()._new_history(ph, now)
        if ph is not None and ph.seg is not None and ph.count == 1 and ph.last == now:
            h.seg = ph.seg  # created by the same request right after its parent: same segment
        else:
            pseg = ph.seg if ph is not None else None
            if pseg is not None:
                pseg[3] += 1
            h.seg = [now, -1, pseg, 0]  # latest access, previous access, parent, fan-out
        return h

    def access(self, key: Hashable, parent: Hashable | None, now: int) -> None:
        super().access(key, parent, now)
        seg = self._hist[key].seg
        if seg is not None and seg[0] != now:
            seg[1], seg[0] = seg[0], now

    def abandoned(self, key: Hashable) -> bool:
        """Whether an earlier request went through `key`'s prefix after its last access but
        left the chain before reaching it (see the class docstring)."""
        h = self._hist[key]
        seg, last, now = h.seg, h.last, self._now
        if seg is None:
            return False
        for _ in range(self.walk + 1):
            if seg[3] > self.max_fan:
                return False  # a shared prefix: passing through it says nothing about this chain
            # the segment's latest access by an earlier request (not the one in progress)
            if (seg[0] if seg[0] < now else seg[1]) > last:
                return True
            seg = seg[2]
            if seg is None:
                return False
        return False


class _OfflinePolicy(_ScoredPolicy):
    """A simulator-only policy that is told the whole future reference string up front.

    `set_future(refs)` feeds every block key in the order it will be accessed; accesses must
    follow that order (references the caller skips, blocks it could not insert, are skipped
    over). Subclasses turn each reference's position into a priority with `_value`.
    """

    def __init__(self) -> None:
        super().__init__()
        self._refs: Sequence[Hashable] = ()
        self._cursor = 0
        self._value_of: dict[Hashable, object] = {}

    def set_future(self, refs: Sequence[Hashable]) -> None:
        self._refs, self._cursor = refs, 0
        self._prepare(refs)

    def _prepare(self, refs: Sequence[Hashable]) -> None:
        raise NotImplementedError

    def _value(self, i: int) -> object:
        """Priority of the block referenced at position `i` until its next access."""
        raise NotImplementedError

    def _advance(self, key: Hashable) -> int:
        refs, i = self._refs, self._cursor
        while i < len(refs) and refs[i] != key:
            i += 1
        if i == len(refs):
            raise ValueError(
                f"{self.name}: access to {key!r} is not in the remaining future; call "
                "set_future() with the exact reference order before replaying"
            )
        self._cursor = i + 1
        return i

    def _on_insert(self, key: Hashable, now: int) -> None:
        self._value_of[key] = self._value(self._advance(key))

    _on_hit = _on_insert

    def _on_remove(self, key: Hashable) -> None:
        del self._value_of[key]
        self._heap.discard(key)

    def _priority(self, key: Hashable) -> object:
        return self._value_of[key]


class BeladyPolicy(_OfflinePolicy):
    """Belady's MIN: evict the evictable leaf whose next use is farthest in the future.

    Offline only (see `_OfflinePolicy`). A parent is never used later than its child, so the
    leaf restriction costs MIN nothing.
    """

    name = "belady"

    def _prepare(self, refs: Sequence[Hashable]) -> None:
        never = len(refs)
        nxt = [never] * len(refs)
        seen: dict[Hashable, int] = {}
        for i in range(len(refs) - 1, -1, -1):
            nxt[i] = seen.get(refs[i], never)
            seen[refs[i]] = i
        self._next = nxt

    def _value(self, i: int) -> object:
        return -self._next[i]


class PopularityOraclePolicy(_OfflinePolicy):
    """Offline ceiling for popularity-based policies: evict the leaf with the fewest references
    still to come (ties: least recently used).

    Why: it is the best any policy that ranks blocks by how popular they are can do, given the
    exact popularity over the rest of the trace but not *when* the references come (the A0
    rule, optimal when references are independent draws). An online policy has to estimate
    popularity from the past, so where this oracle closes little of the LRU→Belady gap, the
    rest is timing that no score of counts and ages can recover. A parent has at least as many
    references to come as its child, so the leaf restriction costs it nothing either.
    """

    name = "oracle_pop"

    def _prepare(self, refs: Sequence[Hashable]) -> None:
        left = [0] * len(refs)
        count: dict[Hashable, int] = {}
        for i in range(len(refs) - 1, -1, -1):
            left[i] = count.get(refs[i], 0)
            count[refs[i]] = left[i] + 1
        self._left = left

    def _value(self, i: int) -> object:
        return (self._left[i], i)


_REGISTRY: dict[str, Callable[..., EvictionPolicy]] = {
    "lru": LRUPolicy,
    "lfu": LFUPolicy,
    "tlp": TLPPolicy,
    "s3fifo": S3FIFOPolicy,
    "arc": ARCPolicy,
    "gittins": GittinsPolicy,
    "gittins_hint": HintedGittinsPolicy,
    "duel": DuelPolicy,
    "shadow": ShadowPolicy,
    "chain": ChainPolicy,
    "belady": BeladyPolicy,
    "oracle_pop": PopularityOraclePolicy,
}

#: Simulator-only references that are told the future (`set_future`), never used by the engine.
OFFLINE_POLICIES: list[str] = ["belady", "oracle_pop"]
#: Online policies selectable by name.
POLICIES: list[str] = [n for n in _REGISTRY if n not in OFFLINE_POLICIES]
#: Online policies that sample their victims, so their results depend on their `seed` argument.
SAMPLED_POLICIES: list[str] = [n for n in POLICIES
                               if issubclass(_REGISTRY[n], _SampledPolicy)]  # type: ignore[arg-type]

#: Default for the engine and configs. On bench_results/cache.json it is at or above LRU in all six
#: trace x capacity cells and has the best worst case: it keeps Gittins' lead on the conversation
#: trace (a few points less at 1k blocks) and roughly doubles Gittins' gain on the synthetic trace,
#: where popularity, not age, predicts reuse. "gittins" is the single-expert variant; "arc" the
#: cheap one (O(log n) victims, no history) and the best on the synthetic trace at 16k blocks.
DEFAULT_POLICY = "duel"
MIN_POLICY_HISTORY = 1024  # kv_policy_history's floor: fewer records leave a policy too little to learn from


def partition_history(history: int | None, share: float) -> int | None:
    """The records a tenant's cache partition's policy keeps: its share of `history` (each
    partition keeping a whole pool's cost ~85 MiB per partitioned tenant), at least the floor.
    None (the policy's default) stays None."""
    return None if history is None else max(MIN_POLICY_HISTORY, int(share * history))


def move_block(key: Hashable, parent: Hashable | None, src: EvictionPolicy, dst: EvictionPolicy) -> None:
    """Cached block `key` moves from the policy ranking it, `src`, to `dst` (a tenant's cache
    partition's): out of `src`, into `dst` with its history where `dst` can take it (`adopt`).
    Unpinned in `src` first; the access that moves it is the caller's."""
    record = src.export(key)
    src.remove(key)
    if record is not None:
        dst.adopt(key, parent, record)


def make_policy(name: str, history: int | None = None, **kwargs: object) -> EvictionPolicy:
    """Build a policy by name (`POLICIES`, or "belady" in the simulator). `history`: how many
    blocks' records a policy that learns from its history (the Gittins family) keeps; the
    others keep none and ignore it."""
    try:
        cls = _REGISTRY[name]
    except KeyError:
        raise ValueError(
            f"unknown eviction policy {name!r}; choose one of {sorted(_REGISTRY)}"
        ) from None
    if history is not None and issubclass(cls, GittinsPolicy):
        kwargs["history"] = history
    return cls(**kwargs)
