"""The chain of lower KV tiers (host -> disk -> Redis), with their slow I/O kept off the model loop.

Writes: the host tier is written in place (it only keeps a reference to the copy); whatever it
evicts, and the write-through of fresh blocks to Redis (and to disk, if asked for), go to a
writer thread. Its queue holds at most `backlog_bytes` of K/V: when disk or Redis cannot keep
up, further writes are dropped and counted (`dropped` of the tier they were for) rather than
piling up in memory; it is a cache, so a dropped block is a later miss. Draining the host tier
(`spill`) waits instead.

Reads: when a request arrives, a reader thread fetches the part of its prefix that sits in disk
or Redis and stages it in memory. Admitting the request later then costs the model loop a
dictionary lookup, not a disk read and a checksum or a Redis round trip, and a request that
waits several steps for room is not re-read at every step. Staged blocks are dropped once they
are back on the device, and the oldest go first past `staging_bytes`. Blocks are keyed by
content hash, so a staged copy can never be stale. A prefix's run of Redis blocks is read
`remote_batch` blocks per round trip (one MGET), not one.
"""
from __future__ import annotations

import logging
import queue
import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

import torch

from tierlm.kv.tiers import DiskTier, HostTier, RedisTier, _CapacityTier

log = logging.getLogger(__name__)


class _ReadAhead:
    """A Redis tier's answers for a run of hashes, read `batch` blocks per round trip."""

    def __init__(self, tier: RedisTier, hashes: list[bytes], batch: int) -> None:
        self.tier, self.hashes, self.batch = tier, hashes, batch
        self.got: dict[int, tuple[torch.Tensor, int | None]] = {}
        self.known_to = 0  # answers are known for indices below this (missing from `got`: a miss)

    def fetch(self, index: int) -> tuple[torch.Tensor, int | None] | None:
        if index >= self.known_to:
            want = self.hashes[index:index + self.batch]
            run = self.tier.fetch_run(want)
            self.got = {index + j: found for j, found in enumerate(run)}
            self.known_to = index + (len(want) if len(run) == len(want) else len(run) + 1)
        return self.got.pop(index, None)


@dataclass(eq=False)
class Prefetch:
    """One request's background read of its lower-tier prefix (hashes in prefix order)."""

    hashes: list[bytes]
    done: threading.Event = field(default_factory=threading.Event)
    started: bool = False
    cancelled: bool = False
    found: int = 0  # leading blocks it found in some lower tier
    start: int = 0  # index of hashes[0] in the request's prefix (blocks on the device before it)
    finished: bool = False  # ran to its end: `found` is the whole run, and the block after it a miss
    ended: bool = False  # the reader is done with it (set under the store's lock)


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


class TieredStore:
    """Lower tiers in order, plus the writer and reader threads (see the module docstring)."""

    def __init__(self, tiers: list, write_through_remote: bool = True,
                 fence: Callable[[], None] | None = None, staging_bytes: int = 1 << 30,
                 backlog_bytes: int = 1 << 30, remote_batch: int = 32, write_through_disk: bool = False,
                 readers: int = 4) -> None:
        self.tiers = tiers
        self._ticked = [t for t in tiers if isinstance(t, _CapacityTier)]
        for t in self._ticked:
            t.auto_tick = False  # one tick per request (`tick`), as the device pool's policy gets
        self.remote_batch = remote_batch  # Redis blocks per round trip when reading a prefix
        # Where a freshly computed block is written at once (levels), besides the device.
        self.write_through_levels = [i for i, t in enumerate(tiers)
                                     if (write_through_remote and isinstance(t, RedisTier))
                                     or (write_through_disk and isinstance(t, DiskTier))]
        self.write_through = bool(self.write_through_levels)
        # Demoted blocks may still be in flight from the device (CUDA copy stream): the writer
        # calls `fence` before it reads a block's bytes (encode for disk/Redis).
        self.fence = fence
        self.slow = [t for t in tiers if not isinstance(t, HostTier)]  # worth prefetching from
        # Queued for the writer, still servable: block -> (K/V, hint, level it is on its way to).
        self.pending: dict[bytes, tuple[torch.Tensor, int | None, int]] = {}
        self.staged: OrderedDict[bytes, tuple[str, torch.Tensor, int | None]] = OrderedDict()
        self.staged_bytes = 0
        self.staging_bytes = staging_bytes
        self._live: set[Prefetch] = set()  # jobs whose request may still be admitted
        self._lock = threading.Lock()
        self._room = threading.Condition(self._lock)  # signalled as the writer's backlog shrinks
        self.backlog = 0  # bytes of K/V queued for the writer
        self.backlog_bytes = backlog_bytes
        self._shedding = False
        self._closed = False
        self._writes: queue.Queue = queue.Queue()
        self._reads: queue.Queue = queue.Queue()
        # Several readers: one request's slow read (a Redis that answers late, a cold disk) must
        # not hold up the reads of the requests that arrived after it.
        self._readers = max(1, readers)
        self._threads = [
            threading.Thread(target=self._serve, name="tierlm-kv-writer", daemon=True, args=(
                self._writes, self._write_one, "KV tier write failed; the block will be recomputed when needed")),
        ] + [
            threading.Thread(target=self._serve, name=f"tierlm-kv-reader-{i}", daemon=True, args=(
                self._reads, self._read_one, "KV prefetch failed; the blocks will be read when the request is scheduled"))
            for i in range(self._readers)
        ]
        for t in self._threads:
            t.start()

    # -- writes ----------------------------------------------------------------------------
    def demote(self, h: bytes, parent: bytes | None, data: torch.Tensor, start: int = 0,
               hint: int | None = None) -> None:
        """Store a block evicted from the level above `start` (0 = the device), with the output
        length of the last finished request that used it (`hint`), when known."""
        if start >= len(self.tiers):
            return
        tier = self.tiers[start]
        if start == 0 and isinstance(tier, HostTier):
            for evicted in tier.put(h, parent, data, hint):
                self._enqueue(("put", *evicted, 1))
        else:
            self._enqueue(("put", h, parent, data, hint, start))

    def write_through_block(self, h: bytes, parent: bytes | None, data: torch.Tensor) -> None:
        """Write a freshly computed block through to Redis (so peers can hit it) and, if asked
        for, to disk (so a crash does not lose it)."""
        for i in self.write_through_levels:
            self._enqueue(("remote" if isinstance(self.tiers[i], RedisTier) else "put", h, parent, data, None, i))

    def _enqueue(self, item, wait: bool = False) -> None:
        """Queue (kind, key, parent, K/V, hint, level) for the writer, within the backlog bound
        (dropped past it, or with `wait` held until there is room); a demoted block stays
        servable from `pending` meanwhile."""
        kind, h, _, data, hint, level = item
        if level >= len(self.tiers):
            return  # evicted from the last tier: nowhere further down
        size = _nbytes(data)
        with self._room:
            while self.backlog and self.backlog + size > self.backlog_bytes and not self._closed:
                if not wait:
                    self.tiers[level].stats.dropped += 1
                    if not self._shedding:
                        log.warning("KV tier writes are %d MiB behind (%s cannot keep up); dropping new ones "
                                    "until the backlog halves", self.backlog >> 20, self.tiers[level].name)
                    self._shedding = True
                    return
                self._room.wait()
            if self._closed:
                return
            self.backlog += size
            if kind == "put":
                self.pending[h] = (data, hint, level)
        self._writes.put(item)

    def _serve(self, q: queue.Queue, handle: Callable, failed: str) -> None:
        """A worker thread's loop: handle items until None; a failing tier must not kill it."""
        while True:
            item = q.get()
            try:
                if item is None:
                    return
                handle(item)
            except Exception:
                log.exception(failed)
            finally:
                q.task_done()

    def _write_one(self, item) -> None:
        try:
            self._write_down(*item)
        finally:
            with self._room:
                self.backlog -= _nbytes(item[3])
                if self.backlog <= self.backlog_bytes // 2:
                    self._shedding = False
                self._room.notify_all()

    def _write_down(self, kind: str, h: bytes, parent: bytes | None, data: torch.Tensor, hint: int | None,
                    level: int) -> None:
        if self.fence is not None:
            self.fence()
        if kind == "remote":
            self.tiers[level].put(h, parent, data)
            return
        # Walk down from `level` until some tier keeps the block.
        todo = [(h, parent, data, hint, level)]
        while todo:
            *block, lv = todo.pop()
            if lv >= len(self.tiers):
                continue
            for evicted in self.tiers[lv].put(*block):
                todo.append((*evicted, lv + 1))
        with self._lock:
            if h in self.pending and self.pending[h][0] is data:
                del self.pending[h]

    def tick(self) -> None:
        """A request's prefix is being looked up: advance the tiers' policy clocks, once."""
        for t in self._ticked:
            t.tick()

    # -- reads -----------------------------------------------------------------------------
    def fetch(self, h: bytes) -> tuple[str, torch.Tensor, int | None] | None:
        """(where it was, the block, its output-length hint) from staging, the writer's queue or
        the first tier holding it."""
        return self._find(h, read_host=True)

    def fetch_run(self, hashes: list[bytes]) -> list[tuple[str, torch.Tensor, int | None]]:
        """`fetch` for each of `hashes` up to the first miss: a request's prefix below the device."""
        return self._find_run(hashes, read_host=True)

    def _find_run(self, hashes: list[bytes], read_host: bool,
                  stop: Callable[[], bool] | None = None) -> list[tuple[str, torch.Tensor | None, int | None]]:
        """`_find` up to the first miss (or `stop()`), with Redis read ahead `remote_batch` blocks
        per round trip (one MGET) rather than one round trip per block: with a remote server
        at 0.5 ms, a 32k-token prefix is 2,000 blocks, a second of round trips."""
        remote = next((t for t in self.tiers if isinstance(t, RedisTier)), None)
        ahead = None if remote is None else _ReadAhead(remote, hashes, self.remote_batch)
        run = []
        for i, h in enumerate(hashes):
            found = None if stop is not None and stop() else self._find(h, read_host, ahead, i)
            if found is None:
                break
            run.append(found)
        return run

    def _find(self, h: bytes, read_host: bool, ahead: _ReadAhead | None = None,
              index: int = 0) -> tuple[str, torch.Tensor | None, int | None] | None:
        """Look `h` up in staging, the writer's queue, then each tier in order; a block read from
        disk or Redis is staged. With `read_host` False a host block is only checked for (data
        None), so that a prefetch does not count a host hit the admission will count again.
        Within a run, Redis answers from `ahead` (`h` is the run's `index`-th hash)."""
        with self._lock:
            hit = self.staged.get(h)
            queued = self.pending.get(h) if hit is None else None
        if queued is not None:  # on its way down: a hit of the tier it is going to (so that
            data, hint, level = queued  # tier's promotions count it, and never exceed its hits)
            tier = self.tiers[level]
            tier.stats.hits += 1
            return tier.name, data, hint
        if hit is not None:
            return hit
        for t in self.tiers:
            if isinstance(t, HostTier) and not read_host:
                if h in t:
                    return t.name, None, None
                continue
            found = ahead.fetch(index) if ahead is not None and t is ahead.tier else t.fetch(h)
            if found is not None:
                data, hint = found
                if not isinstance(t, HostTier):  # host reads are a dict lookup already
                    self._stage(h, t.name, data, hint)
                return t.name, data, hint
        return None

    def _stage(self, h: bytes, source: str, data: torch.Tensor, hint: int | None) -> None:
        with self._lock:
            if h in self.staged:
                return
            self.staged[h] = (source, data, hint)
            self.staged_bytes += _nbytes(data)
            while self.staged_bytes > self.staging_bytes and self.staged:
                _, (_, old, _) = self.staged.popitem(last=False)
                self.staged_bytes -= _nbytes(old)

    def promoted(self, h: bytes, source: str) -> None:
        """Block `h` is on the device again, copied from tier `source`: count it, unstage it."""
        with self._lock:
            entry = self.staged.pop(h, None)
            if entry is not None:
                self.staged_bytes -= _nbytes(entry[1])
        for t in self.tiers:
            if t.name == source:
                t.stats.promotions += 1

    def prefetch(self, hashes: list[bytes]) -> Prefetch | None:
        """Read these leading blocks (stopping at the first miss) into staging in the background."""
        if not hashes or not self.slow or self._closed:
            return None
        job = Prefetch(list(hashes))
        with self._lock:
            self._live.add(job)
        self._reads.put(job)
        return job

    def settle(self, job: Prefetch) -> None:
        """Called before the model loop looks up `job`'s blocks itself: a job not yet started is
        dropped, one under way is waited for (its reads would otherwise be done twice)."""
        with self._lock:
            self._live.discard(job)  # the model loop takes over its blocks (`promoted` unstages them)
            if not job.started:
                job.cancelled = True
                return
        job.done.wait()

    def cancel(self, job: Prefetch) -> None:
        """The request is gone: skip the job, or stop it after its current block, and drop what
        it staged that no other waiting request's read wants (else it stayed in memory until
        staging overflowed)."""
        with self._lock:
            job.cancelled = True
            self._live.discard(job)
            if job.ended:
                self._unstage(job.hashes[:job.found])

    def unstage(self, hashes: list[bytes]) -> None:
        """Drop these blocks from staging (a request gone before admission), except those a
        waiting request's read may still want."""
        with self._lock:
            self._unstage(hashes)

    def _unstage(self, hashes: list[bytes]) -> None:
        """`unstage`, holding `_lock`. A live job's whole prefix counts as wanted, not just what
        it has found so far: one still reading may have counted a block already."""
        if not self.staged:
            return
        wanted = {h for other in self._live for h in other.hashes}
        for h in hashes:
            if h not in wanted:
                entry = self.staged.pop(h, None)
                if entry is not None:
                    self.staged_bytes -= _nbytes(entry[1])

    def _read_one(self, job: Prefetch) -> None:
        try:
            with self._lock:
                if job.cancelled:
                    return
                job.started = True
            job.found = len(self._find_run(job.hashes, read_host=False, stop=lambda: job.cancelled))
            job.finished = not job.cancelled
        finally:
            with self._lock:
                job.ended = True
                if job.cancelled:  # cancelled while it read: `cancel` could not unstage yet
                    self._unstage(job.hashes[:job.found])
            job.done.set()

    # -- maintenance -----------------------------------------------------------------------
    def spill(self, level: int = 0) -> int:
        """Move every block of tier `level` down to the next tier (benchmarks, draining a host)."""
        tier = self.tiers[level]
        with tier.lock:
            blocks = [b for b in map(tier.take, list(tier.parents)) if b is not None]
        for block in blocks:  # the lock is not held while waiting for room
            self._enqueue(("put", *block, level + 1), wait=True)
        self.flush()
        return len(blocks)

    def flush(self) -> None:
        """Wait until every queued write and prefetch is done (tests, shutdown)."""
        if self._closed:
            return
        self._writes.join()
        self._reads.join()

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self) -> None:
        """Finish queued writes, stop the threads and release the tiers (the disk directory's
        lock): blocks already on disk stay there for the next engine."""
        if self._closed:
            return
        self.flush()
        with self._room:
            self._closed = True  # from now on writes are dropped: nothing waits on the stopped threads
            self._room.notify_all()
        self._writes.put(None)
        for _ in range(self._readers):
            self._reads.put(None)
        for t in self._threads:
            t.join()
        for tier in self.tiers:
            tier.close()

    def stats(self) -> dict[str, dict]:
        return {t.name: asdict(t.stats) for t in self.tiers}

    def usage(self) -> dict[str, dict[str, int]]:
        """Blocks held and capacity of the tiers tierlm sizes itself (host, disk; Redis sizes itself)."""
        return {t.name: {"blocks": len(t), "capacity": t.capacity} for t in self.tiers if isinstance(t, _CapacityTier)}
