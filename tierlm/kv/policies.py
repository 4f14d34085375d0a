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

`now` is a caller-supplied, non-decreasing logical clock. The simulator advances it once per
request (see `tierlm.bench.cache` for the measurement behind that choice); the engine should do the
same (one tick per scheduled request / prefix lookup) so the tuned constants carry over.
"""

from __future__ import annotations

import bisect
import heapq
import itertools
import math
import random
from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable, Hashable, Protocol, Sequence, runtime_checkable

__all__ = [
    "EvictionPolicy",
    "LRUPolicy",
    "LFUPolicy",
    "TLPPolicy",
    "S3FIFOPolicy",
    "ARCPolicy",
    "GittinsPolicy",
    "BeladyPolicy",
    "POLICIES",
    "DEFAULT_POLICY",
    "make_policy",
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
        """Protect `key` from eviction (counted: n pins need n unpins)."""

    def unpin(self, key: Hashable) -> None:
        """Undo one `pin`."""

    def victim(self) -> Hashable | None:
        """The block to evict next (unpinned, tracked, no tracked children), or None. Not removed."""

    def remove(self, key: Hashable) -> None:
        """Stop tracking `key` (evicted or dropped)."""

    def __len__(self) -> int: ...

    def __contains__(self, key: object) -> bool: ...


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
            self._parent[key] = parent
            if parent is not None:
                self._children[parent] = self._children.get(parent, 0) + 1
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

    def __len__(self) -> int:
        return len(self._parent)

    def __contains__(self, key: object) -> bool:
        return key in self._parent

    # -- helpers -----------------------------------------------------------------------------
    def _is_candidate(self, key: Hashable) -> bool:
        return key in self._parent and key not in self._pins and key not in self._children

    def is_pinned(self, key: Hashable) -> bool:
        return key in self._pins

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


class LFUPolicy(_ScoredPolicy):
    """Least frequently used leaf goes first; ties go to the least recent.

    Counts are forgotten on eviction (no history), so a once-hot block that was evicted starts
    over - the classic LFU weakness against shifting popularity.
    """

    name = "lfu"

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

    def _priority(self, key: Hashable) -> object:
        return (self._count[key], self._last[key])


class TLPPolicy(_ScoredPolicy):
    """Temporal-locality predictor: score(now) = sum over accesses of alpha**(now - t_access).

    Kept incrementally as score = score * alpha**(now - last) + 1. Comparing scores at different
    `last` times needs a common reference: score(now) = S * alpha**(now - last) orders like
    log(S) - last * log(alpha) for every `now`, so that log-domain value is the heap key and no
    entry ever needs rescoring. Lowest score goes first.

    `alpha` is per tick of the caller's clock; the default 0.995 assumes one tick per request.
    """

    name = "tlp"

    def __init__(self, alpha: float = 0.995) -> None:
        if not 0.0 < alpha <= 1.0:
            raise ValueError(f"tlp alpha must be in (0, 1], got {alpha}")
        super().__init__()
        self.alpha = alpha
        self._neg_log_alpha = -math.log(alpha)
        self._score: dict[Hashable, float] = {}
        self._last: dict[Hashable, int] = {}

    def _on_insert(self, key: Hashable, now: int) -> None:
        self._score[key] = 1.0
        self._last[key] = now

    def _on_hit(self, key: Hashable, now: int) -> None:
        self._score[key] = self._score[key] * self.alpha ** (now - self._last[key]) + 1.0
        self._last[key] = now

    def _on_remove(self, key: Hashable) -> None:
        del self._score[key], self._last[key]
        self._heap.discard(key)

    def _priority(self, key: Hashable) -> object:
        return (math.log(self._score[key]) + self._last[key] * self._neg_log_alpha, self._last[key])

    def score(self, key: Hashable, now: int) -> float:
        """The decayed access count of `key` at time `now` (for inspection and tests)."""
        return self._score[key] * self.alpha ** (now - self._last[key])


class S3FIFOPolicy(_LeafPolicy):
    """S3-FIFO (Yang et al., SOSP'23) restricted to leaf victims.

    New blocks enter a small FIFO (`small_ratio` of the cache); one that is referenced again before
    it reaches the small queue's tail is promoted to the main FIFO, otherwise it is evicted and
    remembered in a ghost FIFO, and a ghost that comes back goes straight to main. Main is a FIFO
    with 2-bit frequency: a referenced block at the tail is reinserted with frequency - 1.
    Queue order is kept as a per-queue sequence number in a candidate heap, so "the tail" means
    the oldest *evictable leaf* of that queue: a parent waits behind its children.
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

    def _on_insert(self, key: Hashable, now: int) -> None:
        self._freq[key] = 0
        if key in self._ghost:
            del self._ghost[key]
            self._enqueue(key, self._MAIN)
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
                self._enqueue(key, self._MAIN)
            else:
                self._freq[key] = freq - 1
                self._enqueue(key, self._MAIN)


class ARCPolicy(_LeafPolicy):
    """Adaptive Replacement Cache (Megiddo & Modha, FAST'03) restricted to leaf victims.

    T1 holds blocks seen once recently, T2 blocks seen at least twice; B1/B2 remember what each
    list evicted. A ghost hit in B1 grows T1's target share `p`, one in B2 shrinks it, so the
    recency/frequency balance adapts to the trace. The cache size `c` is taken as the number of
    tracked blocks when a victim is needed (the cache is full then), so no capacity is configured.
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


@dataclass(slots=True)
class _History:
    """What the Gittins policy remembers about a block, cached or not."""

    count: int
    last: int
    interval: int  # ticks between the last two accesses; -1 before the second access
    is_parent: bool
    cls: int


class GittinsPolicy(_LeafPolicy):
    """Evict the leaf with the lowest hit density, learned online per block class (own design).

    Why: on the Mooncake traces most reuse happens hundreds of requests after the last access,
    far beyond what LRU keeps, and which blocks come back is predictable only statistically:
    a block's access count, the gap between its last two accesses, and whether it ever had a
    child (a request's last, partial block almost never does and is almost never reused) separate
    blocks whose reuse probability differs by an order of magnitude.

    How:
    - Every referenced block (cached or not, up to `history` blocks) keeps a small history record,
      so reuse statistics come from the reference stream itself and do not depend on what this
      cache happened to keep (no exploration problem, unlike hit-age statistics).
    - Per class, the reuse-age distribution is estimated with Kaplan-Meier (blocks still waiting
      or forgotten from history are censored, not counted as "never reused") on log-spaced age
      buckets, and refitted every `refit_every` accesses.
    - From it, the Gittins index G(age) = max over horizons H of P(reuse before H) / E[ticks held
      until reuse or H], i.e. the best hit rate per block-tick this block can still deliver.
    - `victim()` samples `samples` evictable leaves (all of them when fewer) and evicts the lowest
      G(age), the older on ties. Before the first refit all G are 0, which makes it LRU.

    Ages are in ticks of the caller's clock (one per request in the simulator).
    """

    name = "gittins"

    def __init__(self, samples: int = 32, history: int = 1 << 20, refit_every: int = 8192,
                 max_count: int = 4, growth: float = 1.3, seed: int = 0) -> None:
        super().__init__()
        self.samples, self.history, self.refit_every = samples, history, refit_every
        self.max_count = max_count
        edges = [0]
        while edges[-1] < 1 << 24:
            edges.append(max(edges[-1] + 1, int(edges[-1] * growth)))
        self._edges = edges
        nb = len(edges)
        self._mid = [(edges[b] + edges[min(b + 1, nb - 1)]) / 2 for b in range(nb)]
        self._n_iv = 14  # interval buckets: "none", then powers of 4
        n_cls = max_count * 2 * self._n_iv
        self._reused = [[0.0] * nb for _ in range(n_cls)]
        self._ended = [[0.0] * nb for _ in range(n_cls)]
        self._live: list[dict[int, int]] = [{} for _ in range(n_cls)]
        self._index = [[0.0] * nb for _ in range(n_cls)]
        self._hist: OrderedDict[Hashable, _History] = OrderedDict()
        self._cands: list[Hashable] = []
        self._cand_pos: dict[Hashable, int] = {}
        self._rng = random.Random(seed)
        self._now = 0
        self._since_refit = 0

    # -- statistics ----------------------------------------------------------------------------
    _SLOT = 16  # live entries are histogrammed by start time in slots of this many ticks

    def _bucket(self, age: int) -> int:
        return bisect.bisect_right(self._edges, age) - 1

    def _class(self, h: _History) -> int:
        iv = 0 if h.interval < 0 else min(1 + (h.interval + 1).bit_length() // 2, self._n_iv - 1)
        return ((min(h.count, self.max_count) - 1) * 2 + h.is_parent) * self._n_iv + iv

    def _live_add(self, h: _History, delta: int) -> None:
        live = self._live[h.cls]
        slot = h.last // self._SLOT
        n = live.get(slot, 0) + delta
        if n:
            live[slot] = n
        else:
            del live[slot]

    def _end(self, h: _History, now: int, reused: bool) -> None:
        b = self._bucket(now - h.last)
        self._ended[h.cls][b] += 1
        if reused:
            self._reused[h.cls][b] += 1
        self._live_add(h, -1)

    def access(self, key: Hashable, parent: Hashable | None, now: int) -> None:
        self._now = now
        hist = self._hist
        h = hist.get(key)
        if h is None:
            h = hist[key] = _History(count=1, last=now, interval=-1, is_parent=False, cls=0)
            self._forget_oldest()
        else:
            self._end(h, now, reused=True)
            h.count, h.interval, h.last = h.count + 1, now - h.last, now
            hist.move_to_end(key)
        h.cls = self._class(h)
        self._live_add(h, +1)
        if parent is not None:
            ph = hist.get(parent)
            if ph is not None and not ph.is_parent:
                self._live_add(ph, -1)
                ph.is_parent = True
                ph.cls = self._class(ph)
                self._live_add(ph, +1)
        super().access(key, parent, now)
        self._since_refit += 1
        if self._since_refit >= self.refit_every:
            self.refit()

    def _forget_oldest(self) -> None:
        hist = self._hist
        if len(hist) <= max(self.history, 2 * len(self._parent)):
            return
        key, h = hist.popitem(last=False)
        if key in self._parent:  # still cached: keep its record, forget something else later
            hist[key] = h
            return
        self._end(h, self._now, reused=False)  # censored: we stop watching, not "never reused"

    def refit(self) -> None:
        """Re-estimate every class's G(age) table from the statistics gathered so far."""
        self._since_refit = 0
        edges, mid, nb, now = self._edges, self._mid, len(self._edges), self._now
        for c, (reused, ended, live) in enumerate(zip(self._reused, self._ended, self._live)):
            at_risk = list(ended)
            for slot, n in live.items():
                at_risk[self._bucket(max(0, now - slot * self._SLOT - self._SLOT // 2))] += n
            for b in range(nb - 2, -1, -1):
                at_risk[b] += at_risk[b + 1]
            if not any(reused):
                self._index[c] = [0.0] * nb
                continue
            q, surv, s = [0.0] * nb, [0.0] * (nb + 1), 1.0  # q[b]: P(reuse at age in bucket b)
            for b in range(nb):
                surv[b] = s
                if at_risk[b] > 0:
                    q[b] = s * reused[b] / at_risk[b]
                    s -= q[b]
            surv[nb] = s
            last = max(b for b in range(nb) if q[b] > 0)
            table = [0.0] * nb
            for a in range(last + 1):
                if surv[a] <= 1e-12:
                    break
                hits = cost = best = 0.0
                for x in range(a, last + 1):
                    hits += q[x]
                    cost += q[x] * (mid[x] - edges[a])
                    held = cost + (surv[a] - hits) * (edges[min(x + 1, nb - 1)] - edges[a])
                    if held > 0 and hits / held > best:
                        best = hits / held
                table[a] = best
            self._index[c] = table

    # -- candidates ----------------------------------------------------------------------------
    def _on_insert(self, key: Hashable, now: int) -> None:
        pass

    _on_hit = _on_insert

    def _on_remove(self, key: Hashable) -> None:
        self._drop(key)

    def _drop(self, key: Hashable) -> None:
        i = self._cand_pos.pop(key, None)
        if i is not None:
            last = self._cands.pop()
            if i < len(self._cands):
                self._cands[i] = last
                self._cand_pos[last] = i

    def _refresh(self, key: Hashable) -> None:
        if key not in self._cand_pos and self._is_candidate(key):
            self._cand_pos[key] = len(self._cands)
            self._cands.append(key)

    def victim(self) -> Hashable | None:
        cands, is_cand = self._cands, self._is_candidate
        for key in [k for k in cands if not is_cand(k)] if len(cands) <= self.samples else ():
            self._drop(key)
        if len(cands) <= self.samples:
            pool: Sequence[Hashable] = list(cands)
        else:
            pool = []
            while len(pool) < self.samples and len(cands) > self.samples:
                key = cands[self._rng.randrange(len(cands))]
                if is_cand(key):
                    pool.append(key)
                else:
                    self._drop(key)  # pinned or got a child since; re-added when that changes
            if len(pool) < self.samples:
                pool = [k for k in cands if is_cand(k)]
        best, best_v = None, None
        hist, index, now, bucket = self._hist, self._index, self._now, self._bucket
        for key in pool:
            h = hist[key]
            v = (index[h.cls][bucket(now - h.last)], h.last)
            if best_v is None or v < best_v:
                best, best_v = key, v
        return best


class BeladyPolicy(_ScoredPolicy):
    """Belady's MIN: evict the evictable leaf whose next use is farthest in the future.

    Offline only: `set_future(refs)` feeds the whole reference string (block keys in the order
    they will be accessed). Accesses must follow that order; references the caller skips (blocks
    it could not insert) are skipped over. A parent is never used later than its child, so the
    leaf restriction costs MIN nothing.
    """

    name = "belady"

    def __init__(self) -> None:
        super().__init__()
        self._refs: Sequence[Hashable] = ()
        self._next: list[int] = []
        self._cursor = 0
        self._next_use: dict[Hashable, int] = {}

    def set_future(self, refs: Sequence[Hashable]) -> None:
        never = len(refs)
        nxt = [never] * len(refs)
        seen: dict[Hashable, int] = {}
        for i in range(len(refs) - 1, -1, -1):
            nxt[i] = seen.get(refs[i], never)
            seen[refs[i]] = i
        self._refs, self._next, self._cursor = refs, nxt, 0

    def _advance(self, key: Hashable) -> int:
        refs, i = self._refs, self._cursor
        while i < len(refs) and refs[i] != key:
            i += 1
        if i == len(refs):
            raise ValueError(
                f"belady: access to {key!r} is not in the remaining future; call set_future() "
                "with the exact reference order before replaying"
            )
        self._cursor = i + 1
        return self._next[i]

    def _on_insert(self, key: Hashable, now: int) -> None:
        self._next_use[key] = self._advance(key)

    _on_hit = _on_insert

    def _on_remove(self, key: Hashable) -> None:
        del self._next_use[key]
        self._heap.discard(key)

    def _priority(self, key: Hashable) -> object:
        return -self._next_use[key]


_REGISTRY: dict[str, Callable[..., EvictionPolicy]] = {
    "lru": LRUPolicy,
    "lfu": LFUPolicy,
    "tlp": TLPPolicy,
    "s3fifo": S3FIFOPolicy,
    "arc": ARCPolicy,
    "gittins": GittinsPolicy,
    "belady": BeladyPolicy,
}

#: Online policies selectable by name (Belady needs the future, so it is simulator-only).
POLICIES: list[str] = [n for n in _REGISTRY if n != "belady"]

DEFAULT_POLICY = "lru"


def make_policy(name: str, **kwargs: object) -> EvictionPolicy:
    """Build a policy by name (`POLICIES`, or "belady" in the simulator)."""
    try:
        cls = _REGISTRY[name]
    except KeyError:
        raise ValueError(
            f"unknown eviction policy {name!r}; choose one of {sorted(_REGISTRY)}"
        ) from None
    return cls(**kwargs)
