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

import contextlib
import logging
import queue
import threading
import time
from collections import Counter, OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field

import torch

from tierlm.kv.tiers import WRITE_WARN_EVERY_S, DiskTier, HostTier, Layout, RedisTier, _CapacityTier, warn_due

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
    created: float = field(default_factory=time.monotonic)
    tier: object = None  # the tier its reader is reading now, since `tier_since` (which one was slow)
    tier_since: float = 0.0
    run: list = field(default_factory=list)  # what its reader has found so far, in order
    # Stopped because its request was admitted (`settle`), not because it is gone: the blocks
    # found by then are the request's to take, the reader unstages only those found after.
    settled_at: int | None = None


def nbytes(t: torch.Tensor) -> int:
    """Bytes of K/V a tensor holds."""
    return t.numel() * t.element_size()


def _join(q: queue.Queue, deadline: float) -> bool:
    """`q.join()` until `deadline` (time.monotonic()); False if items were still unfinished then."""
    with q.all_tasks_done:
        while q.unfinished_tasks:
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            q.all_tasks_done.wait(left)
    return True


def _drain(q: queue.Queue, each: Callable | None = None) -> int:
    """Take out every item still queued (each marked done, and given to `each`); how many there were."""
    n = 0
    while True:
        try:
            item = q.get_nowait()
        except queue.Empty:
            return n
        try:
            if each is not None and item is not None:
                each(item)
        finally:
            q.task_done()
        n += 1


class TieredStore:
    """Lower tiers in order, plus the writer and reader threads (see the module docstring)."""

    def __init__(self, tiers: list, write_through_remote: bool = True,
                 fence: Callable[[], None] | None = None, staging_bytes: int = 1 << 30,
                 backlog_bytes: int = 1 << 30, remote_batch: int = 32, write_through_disk: bool = False,
                 readers: int = 4, read_timeout_s: float = 5.0, close_timeout_s: float = 10.0,
                 layout: Layout | None = None) -> None:
        self.tiers = tiers
        for t in tiers:
            t.layout = layout  # disk and Redis entries of another dtype or shape are never served
        # A request waits at most this long for its prefix to be read, when nothing else can run
        # either; then it starts with what was read so far. A Redis round trip slower than this
        # counts as an outage (its socket timeout bounds each read from the socket, not a reply
        # that trickles in).
        self.read_timeout_s = read_timeout_s
        self.close_timeout_s = close_timeout_s  # queued writes wait at most this long at shutdown
        self._deadline: float | None = None  # set during a shutdown (`deadline`): no wait goes past it
        self._lossless = False  # set while the cache is persisted (`lossless`): writes wait for room
        self._warned_at: dict[str, float] = {}  # kind of trouble -> when last warned about
        for t in tiers:
            if isinstance(t, RedisTier):
                t.slow_after_s = read_timeout_s
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
        self.overflows = 0  # blocks pushed out of staging by newer ones (a read larger than it)
        self._live: set[Prefetch] = set()  # jobs whose request may still be admitted
        # How many live jobs want each block (their whole prefix): an unstage asks this for every
        # block it drops, and building the set from `_live` each time cost a whole second with
        # 1,000 long prompts waiting, under the lock the readers and the model loop share.
        self._wanted: Counter[bytes] = Counter()
        # Staged blocks an unstage kept because a live job wanted them: looked at again when a job
        # settles or is cancelled (they stayed staged for good when that job found fewer).
        self._kept_for_jobs: set[bytes] = set()
        self._reading: dict[bytes, threading.Event] = {}  # blocks a reader is reading from disk or Redis now
        self._lock = threading.Lock()
        self._room = threading.Condition(self._lock)  # signalled as the writer's backlog shrinks
        self.backlog = 0  # bytes of K/V queued for the writer
        self.backlog_bytes = backlog_bytes
        self._shedding = False
        self._closed = False
        # Two writers: disk (and host spills) on one, Redis on the other, so disk writes never
        # queue behind a slow Redis (at shutdown they were lost behind it).
        self._writes: queue.Queue = queue.Queue()
        self._remote_writes: queue.Queue = queue.Queue()
        self._write_queues = (self._writes, self._remote_writes)
        self._reads: queue.Queue = queue.Queue()
        # Several readers: one request's slow read (a Redis that answers late, a cold disk) must
        # not hold up the reads of the requests that arrived after it.
        self._readers = max(1, readers)
        failed_write = "KV tier write failed; the block will be recomputed when needed"
        self._threads = [
            threading.Thread(target=self._serve, name="tierlm-kv-writer", daemon=True,
                             args=(self._writes, self._write_one, failed_write)),
            threading.Thread(target=self._serve, name="tierlm-kv-writer-redis", daemon=True,
                             args=(self._remote_writes, self._write_one, failed_write)),
        ] + [
            threading.Thread(target=self._serve, name=f"tierlm-kv-reader-{i}", daemon=True, args=(
                self._reads, self._read_one, "KV prefetch failed; the request starts with the blocks read so far "
                                             "and recomputes the rest"))
            for i in range(self._readers)
        ]
        for t in self._threads:
            t.start()

    # -- writes ----------------------------------------------------------------------------
    def demote(self, h: bytes, parent: bytes | None, data: torch.Tensor, start: int = 0,
               hint: int | None = None, owner: str | None = None) -> None:
        """Store a block evicted from the level above `start` (0 = the device), with the output
        length of the last finished request that used it (`hint`), when known, from the device
        pool's cache partition `owner` (kept in the host tier's partition of that tenant)."""
        if start >= len(self.tiers):
            return
        tier = self.tiers[start]
        if start == 0 and isinstance(tier, HostTier):
            for evicted in tier.put(h, parent, data, hint, owner):
                self._enqueue(("put", *evicted, 1))
        else:
            self._enqueue(("put", h, parent, data, hint, start))

    def partition(self, tenant: str, share: float) -> None:
        """`tenant`'s cache partition of the host tier (the first, when there is one), for `share`
        of it, as the device pool has one (tiers.py `partition`); the lower tiers have none."""
        if self.tiers and isinstance(self.tiers[0], HostTier):
            self.tiers[0].partition(tenant, share)

    def write_through_block(self, h: bytes, parent: bytes | None, data: torch.Tensor) -> None:
        """Write a freshly computed block through to Redis (so peers can hit it) and, if asked
        for, to disk (so a crash does not lose it)."""
        for i in self.write_through_levels:
            self._enqueue(("remote" if isinstance(self.tiers[i], RedisTier) else "put", h, parent, data, None, i))

    def _enqueue(self, item, wait: bool = False, force: bool = False) -> None:
        """Queue (kind, key, parent, K/V, hint, level) for the writer, within the backlog bound
        (dropped past it, with `wait` held until there is room, with `force` queued all the same); a demoted block stays
        servable from `pending` meanwhile."""
        kind, h, _, data, hint, level = item
        if level >= len(self.tiers):
            return  # evicted from the last tier: nowhere further down
        size, wait = nbytes(data), wait or self._lossless
        with self._room:
            while not force and self.backlog and self.backlog + size > self.backlog_bytes and not self._closed:
                left = None if self._deadline is None else self._deadline - time.monotonic()
                if not wait or (left is not None and left <= 0):
                    self.tiers[level].stats.count(dropped=1)
                    if not self._shedding:
                        log.warning("KV tier writes are %d MiB behind (%s cannot keep up); dropping new ones "
                                    "until the backlog halves", self.backlog >> 20, self.tiers[level].name)
                    self._shedding = True
                    return
                self._room.wait(left)
            if self._closed:
                return
            self.backlog += size
            if kind == "put":
                self.pending[h] = (data, hint, level)
        (self._remote_writes if isinstance(self.tiers[level], RedisTier) else self._writes).put(item)

    def _unqueue(self, item) -> None:
        """A queued write dropped at shutdown: undo what `_enqueue` counted and kept for it (the
        backlog reported a stale size, and `pending` held its K/V for as long as the store lived)."""
        _, h, _, data, _, level = item
        self.tiers[level].stats.count(dropped=1)
        with self._room:
            self.backlog -= nbytes(data)
            if h in self.pending and self.pending[h][0] is data:
                del self.pending[h]

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
                self.backlog -= nbytes(item[3])
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
        try:
            # Walk down from `level` until some tier keeps the block; what goes on to Redis is
            # queued for its own writer (and stays servable from `pending` meanwhile).
            todo = [(h, parent, data, hint, level)]
            while todo:
                *block, lv = todo.pop()
                if lv >= len(self.tiers):
                    continue
                if isinstance(self.tiers[lv], RedisTier) and lv != level:
                    # Past the bound if need be: written inline before, it was never dropped (and
                    # only this writer could make the room it would wait for).
                    self._enqueue(("put", *block, lv), force=True)
                    continue
                for evicted in self.tiers[lv].put(*block):
                    todo.append((*evicted, lv + 1))
        finally:  # stored, or failed (then recomputed when needed): no longer queued either way
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

    def fetch_run(self, hashes: list[bytes], slow: bool = True) -> list[tuple[str, torch.Tensor, int | None]]:
        """`fetch` for each of `hashes` up to the first miss: a request's prefix below the device.
        With `slow` False only staging, the writer's queue and the host tier are looked in: no
        disk or Redis read on the caller's thread."""
        return self._find_run(hashes, read_host=True, slow=slow)

    def in_memory_run(self, hashes: list[bytes]) -> int:
        """How many of `hashes`, from the first, staging or the host tier hold: what the model
        loop can take without a disk or Redis read. Not the writer's queue: its write may land
        first (a prefetch stages what it finds there). A check: nothing is counted or touched."""
        n = 0
        for h in hashes:
            if not self._holds(h, queued=False, disk=False):
                break
            n += 1
        return n

    def known_here(self, h: bytes, slow: bool = True) -> bool:
        """Whether staging, the writer's queue, the host tier or (if `slow`) the disk tier's
        index holds `h`, so that `fetch_run(.., slow)` may find it. Redis is not asked (a round
        trip)."""
        return self._holds(h, queued=True, disk=slow)

    def _holds(self, h: bytes, queued: bool, disk: bool) -> bool:
        """Whether staging (with `queued`, the writer's queue too), the host tier or (with
        `disk`) the disk tier's index holds `h`: a look at memory only, nothing counted or
        touched. Without the tiers' locks: the disk tier holds its own while it writes a file,
        and a stale answer costs only a lookup (one dict membership test is atomic)."""
        with self._lock:
            if h in self.staged or (queued and h in self.pending):
                return True
        return any(h in t.parents for t in self._ticked if disk or isinstance(t, HostTier))

    def _find_run(self, hashes: list[bytes], read_host: bool, job: Prefetch | None = None,
                  slow: bool = True, run: list | None = None) -> list[tuple[str, torch.Tensor | None, int | None]]:
        """`_find` up to the first miss (or `job`'s cancellation), with Redis read ahead
        `remote_batch` blocks per round trip (one MGET) rather than one round trip per block:
        with a remote server at 0.5 ms, a 32k-token prefix is 2,000 blocks, a second of round
        trips. Appends to `run` if given, so a caller knows what was found (and staged) even if
        a tier raised."""
        remote = next((t for t in self.tiers if isinstance(t, RedisTier)), None) if slow else None
        ahead = None if remote is None else _ReadAhead(remote, hashes, self.remote_batch)
        run = [] if run is None else run
        for i, h in enumerate(hashes):
            found = None if job is not None and job.cancelled else self._find(h, read_host, ahead, i, job, slow)
            if found is None:
                break
            run.append(found)
        return run

    def _find(self, h: bytes, read_host: bool, ahead: _ReadAhead | None = None, index: int = 0,
              job: Prefetch | None = None, slow: bool = True) -> tuple[str, torch.Tensor | None, int | None] | None:
        """Look `h` up in staging, the writer's queue, then each tier in order (disk and Redis
        only if `slow`); a block read from disk or Redis is staged. With `read_host` False a host
        block is only checked for (data None), so that a prefetch does not count a host hit the
        admission will count again. Within a run, Redis answers from `ahead` (`h` is the run's
        `index`-th hash). A `job`'s reader notes which tier it is reading."""
        with self._lock:
            hit = self.staged.get(h)
            queued = self.pending.get(h) if hit is None else None
        if queued is not None:  # on its way down: a hit of the tier it is going to (whose
            data, hint, level = queued  # promotions count it). A staged block is no new read: its hit
            # was counted when it was read, and it may be promoted for several requests
            tier = self.tiers[level]
            tier.stats.count(hits=1, bytes_out=nbytes(data))
            if not read_host:  # a prefetch: staged, as a disk read is. Its write may land before the
                self._stage(h, tier.name, data, hint)  # admission, which reads no disk (the whole prefix
            return tier.name, data, hint  # was recomputed), and found queued it counted a second hit
        if hit is not None:
            return hit
        for t in self.tiers:
            if isinstance(t, HostTier) and not read_host:
                if h in t:
                    return t.name, None, None
                t.stats.count(misses=1)  # (its hit is counted when admission reads it)
                continue
            if not slow and not isinstance(t, HostTier):
                return None
            if job is not None:
                job.tier, job.tier_since = t, time.monotonic()
            if isinstance(t, HostTier):  # a dict lookup: nothing to stage
                found = t.fetch(h)
                if found is not None:
                    return t.name, *found
                continue
            if ahead is not None and t is ahead.tier:
                hit = self._staged(t, h, ahead.fetch(index))
            else:
                hit = self._read_once(t, h, job)
            if hit is not None or (job is not None and job.cancelled):
                return hit  # (a stopped job reads no further tier)
        return None

    def _staged(self, t, h: bytes, found: tuple[torch.Tensor, int | None] | None):
        """What a read of `h` from tier `t` found, staged, as `_find` returns it (or None)."""
        if found is None:
            return None
        self._stage(h, t.name, *found)
        return t.name, *found

    def _read_once(self, t, h: bytes, job: Prefetch | None = None) -> tuple[str, torch.Tensor, int | None] | None:
        """`t.fetch(h)`, staged if found, one read of a block at a time: the readers of a burst
        of requests sharing a prefix each read (and counted a hit of) the same file. A second
        reader waits for the first, however long that read takes (reading alongside it loaded a
        disk already slower than the read timeout all the more), or until its own job is
        stopped, and takes what the first staged; if that found nothing, it looks for itself."""
        with self._lock:
            busy = self._reading.get(h)
            if busy is None:
                self._reading[h] = mine = threading.Event()
        if busy is not None:
            if job is None:  # (the model loop reading for itself: no readers run then)
                busy.wait(self.read_timeout_s)
            while job is not None and not busy.wait(0.05):
                if job.cancelled:
                    return None
            with self._lock:
                hit = self.staged.get(h)
            return hit if hit is not None else self._staged(t, h, t.fetch(h))
        try:
            return self._staged(t, h, t.fetch(h))
        finally:
            with self._lock:
                del self._reading[h]
            mine.set()

    def _stage(self, h: bytes, source: str, data: torch.Tensor, hint: int | None) -> None:
        with self._lock:
            if h in self.staged:
                return
            self.staged[h] = (source, data, hint)
            self.staged_bytes += nbytes(data)
            while self.staged_bytes > self.staging_bytes and self.staged:
                _, (_, old, _) = self.staged.popitem(last=False)
                self.staged_bytes -= nbytes(old)
                self.overflows += 1

    def promoted(self, h: bytes, source: str) -> None:
        """Block `h` is on the device again, copied from tier `source`: count it, and unstage it
        unless another waiting request's read wants it (a held request whose read found it staged
        by a sibling's read lost it when the sibling was admitted, and recomputed its prefix)."""
        with self._lock:
            if self._wanted.get(h):  # another waiting request's read counted it as found: kept for
                if h in self.staged:  # that request (it may leave the device before that one's turn)
                    self._kept_for_jobs.add(h)
            else:
                entry = self.staged.pop(h, None)
                if entry is not None:
                    self.staged_bytes -= nbytes(entry[1])
        for t in self.tiers:
            if t.name == source:
                t.stats.count(promotions=1)

    def prefetch(self, hashes: list[bytes]) -> Prefetch | None:
        """Read these leading blocks (stopping at the first miss) into staging in the background."""
        if not hashes or not self.slow or self._closed:
            return None
        job = Prefetch(list(hashes))
        with self._lock:
            self._live.add(job)
            self._wanted.update(job.hashes)
        self._reads.put(job)
        return job

    def overdue(self, job: Prefetch) -> bool:
        """`job` has read for longer than `read_timeout_s` (or waited that long to start)."""
        return not job.done.is_set() and time.monotonic() - job.created > self.read_timeout_s

    def settle(self, job: Prefetch) -> None:
        """Called when the model loop admits `job`'s request: it takes over the blocks (`promoted`
        unstages them). A job not done (overdue) is stopped, never waited for: the request
        starts with what was staged so far, and a Redis that held the read up counts as down."""
        with self._lock:
            self._leave_live(job)
            # What it found (all it may have, if it has not finished) is its request's to take or
            # list as spare; the rest kept for it no longer is (`found` counts only once it ends).
            self._recheck_kept(job.hashes[:job.found] if job.finished else job.hashes)
            if job.ended:
                return
            # What its reader found by now: the run, and a block staged but not yet added to it
            # (`_find` stages under this lock, `_find_run` appends after)
            found = len(job.run)
            while found < len(job.hashes) and job.hashes[found] in self.staged:
                found += 1
            job.cancelled, job.settled_at = True, found
            # Blame the tier only for its own round trip, not for time the job spent queued for
            # a reader (a burst of requests is no outage).
            # Not ended, the job is overdue (its request is admitted only then): the tier is
            # blamed if its reader has been on it for half the timeout or more. A full timeout
            # on the tier alone was too strict: the loop admits the request the moment the job
            # is overdue, so a reader that started 2 ms after the job was made left it unblamed.
            waited = time.monotonic() - job.tier_since
            stuck = job.tier if job.started and job.tier is not None and waited > self.read_timeout_s / 2 else None
        if isinstance(stuck, RedisTier):
            stuck.too_slow(waited)
        elif stuck is not None:
            # (The store's own times, not the tier's: the disk tier holds its lock while it writes.)
            if warn_due(self._warned_at, "slow read"):
                log.warning("KV %s has taken %.1f s to read one block (over %g s); starting the request without "
                            "the rest of its prefix (it is recomputed). Check that storage (said again at most "
                            "every %d s)", stuck.where, waited, self.read_timeout_s, WRITE_WARN_EVERY_S)

    def cancel(self, job: Prefetch) -> None:
        """The request is gone: skip the job, or stop it after its current block, and drop what
        it staged that no other waiting request's read wants (else it stayed in memory until
        staging overflowed)."""
        with self._lock:
            job.cancelled = True
            self._leave_live(job)
            self._recheck_kept()
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
        wanted = self._wanted
        for h in hashes:
            if h in wanted:
                if h in self.staged:
                    self._kept_for_jobs.add(h)
                continue
            entry = self.staged.pop(h, None)
            if entry is not None:
                self.staged_bytes -= nbytes(entry[1])

    def _leave_live(self, job: Prefetch) -> None:
        """`job`'s request was admitted or is gone (hold `_lock`): its prefix is no longer wanted."""
        if job not in self._live:
            return
        self._live.discard(job)
        wanted = self._wanted
        for h in job.hashes:
            if wanted[h] > 1:
                wanted[h] -= 1
            else:
                wanted.pop(h, None)

    def _recheck_kept(self, taken: list[bytes] = ()) -> None:
        """A job left `_live` (hold `_lock`): unstage what was kept only for live jobs and no live
        job wants now. `taken`, what the settling job found, is its request's to take or let go
        (promotion, a hold, or the manager's spare list), so it is no longer this set's."""
        if not self._kept_for_jobs:
            return
        self._kept_for_jobs.difference_update(taken)
        kept, self._kept_for_jobs = self._kept_for_jobs, set()
        self._unstage(list(kept))  # (what is still wanted is kept again)

    def _read_one(self, job: Prefetch) -> None:
        run = job.run
        try:
            with self._lock:
                if job.cancelled:
                    return
                job.started = True
            self._find_run(job.hashes, read_host=False, job=job, run=run)
            job.found = len(run)  # before `finished`: the model loop reads the two without the lock
            job.finished = not job.cancelled
        finally:  # a tier that raised: what was staged before it is still counted, and unstaged if cancelled
            job.found = len(run)
            with self._lock:
                job.ended = True
                if job.cancelled:  # cancelled while it read: `cancel` could not unstage yet. Settled
                    # (admitted when overdue): what it found by then the admission takes, and
                    # unstaging it first (the loop reads staging just after) recomputed it all.
                    self._unstage(job.hashes[job.settled_at or 0:job.found])
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

    def flush(self) -> bool:
        """Wait until every queued write and prefetch is done (tests, shutdown); within a
        `deadline`, only until then. False if it gave up."""
        if self._closed:
            return True
        if self._deadline is None:
            # The disk writer may queue for Redis, never the other way round: disk first.
            self._writes.join()
            self._remote_writes.join()
            self._reads.join()
            return True
        # Shutting down: reads are for requests that are gone. The disk's writes are not held up
        # by Redis's: whatever Redis leaves undone, the disk's land first.
        return _join(self._writes, self._deadline) & _join(self._remote_writes, self._deadline)

    @contextlib.contextmanager
    def deadline(self) -> Iterator[None]:
        """A shutdown: for `close_timeout_s` from here, every wait on the writer (`flush`, a
        `spill` waiting for room) ends at the same deadline. A disk or Redis too slow for its
        backlog must not hold a shutdown up for as long as that backlog takes (an orchestrator
        kills the process after its grace period anyway, losing more)."""
        if self._deadline is not None:  # nested: the outer deadline holds
            yield
            return
        self._deadline = time.monotonic() + self.close_timeout_s
        try:
            yield
        finally:
            self._deadline = None

    @contextlib.contextmanager
    def lossless(self) -> Iterator[None]:
        """Writes queued meanwhile wait for room in the writer's backlog (up to a `deadline`)
        rather than being dropped past it: persisting a device pool of tens of GiB through a
        1 GiB backlog dropped most of it (the heads of chains too, so the tails that landed were
        unreachable), while its log said all was written."""
        before, self._lossless = self._lossless, True
        try:
            yield
        finally:
            self._lossless = before

    def dropped(self) -> int:
        """Writes dropped so far because the writer was too far behind, all tiers together."""
        return sum(t.stats.dropped for t in self.tiers)

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self) -> None:
        """Finish queued writes (for up to `close_timeout_s`: a Redis that answers slowly must
        not hold up a shutdown for as long as its backlog takes), stop the threads and release
        the tiers (the disk directory's lock): blocks already on disk stay there for the next
        engine."""
        if self._closed:
            return
        with self._lock:  # reads are for requests that are gone: stop them, never wait for them
            for job in self._live:
                job.cancelled = True
            self._live.clear()
            self._wanted.clear()
        _drain(self._reads)
        with self.deadline():
            finished = self.flush()
            stop_by = max(self._deadline, time.monotonic()) + 1.0  # the threads' last second to end
        with self._room:
            self._closed = True  # from now on writes are dropped: nothing waits on the stopped threads
            self._room.notify_all()
        if not finished:
            dropped = {name: _drain(q, self._unqueue)
                       for name, q in (("disk", self._writes), ("Redis", self._remote_writes))}
            log.warning("KV tier writes were still under way after %g s at shutdown (a slow disk or Redis); "
                        "dropped those still queued (%s): those blocks are recomputed when needed",
                        self.close_timeout_s, ", ".join(f"{n} for {k}" for k, n in dropped.items() if n) or "none")
        for q in self._write_queues:
            q.put(None)
        for _ in range(self._readers):
            self._reads.put(None)
        writers, readers = self._threads[:2], self._threads[2:]
        for t in writers:
            t.join(max(0.0, stop_by - time.monotonic()))  # one stuck in a slow call is left to it
        readers_by = time.monotonic() + 0.1  # reads are for nobody now: a hung one is not waited for
        for t in readers:
            t.join(max(0.0, readers_by - time.monotonic()))
        for tier in self.tiers:  # the disk tier's indexer may wait behind a writer stuck in a hung write
            tier.close(timeout=max(0.0, stop_by - time.monotonic()))

    def stats(self) -> dict[str, dict]:
        return {t.name: asdict(t.stats) for t in self.tiers}

    def partitions(self) -> dict[str, dict[str, int]] | None:
        """The host tier's tenant partitions, as `EngineStats.kv_host_partitions` reports them."""
        host = self.tiers[0] if self.tiers and isinstance(self.tiers[0], HostTier) else None
        if host is None:
            return None
        with host.lock:
            return {t: {"blocks": p.evictable, "capacity": p.cap} for t, p in host.partitions.items()} or None

    def usage(self) -> dict[str, dict[str, int]]:
        """Blocks held and capacity of the tiers tierlm sizes itself (host, disk; Redis sizes itself)."""
        return {t.name: {"blocks": len(t), "capacity": t.capacity} for t in self.tiers if isinstance(t, _CapacityTier)}
