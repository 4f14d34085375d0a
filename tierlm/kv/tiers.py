"""Lower KV tiers below the device pool: host memory -> local disk -> remote Redis.

A block evicted from one tier is demoted to the next; a hit in any tier is promoted back to the
device by the KV manager. Every tier holds whole blocks ([layers, 2, block_size, kv_heads,
head_dim] tensors) keyed by the block's chained SHA-256 hash, so equal keys always mean equal
content, across processes too (that is what makes a shared Redis tier safe).

Disk and Redis entries carry a SHA-256 of their payload: a corrupt or truncated entry is
detected, dropped and counted, and the block is recomputed — never served. A Redis outage is a
miss, never an error. `kv/store.py` chains the tiers and keeps their slow I/O off the model loop.
"""
from __future__ import annotations

import errno
import fcntl
import hashlib
import json
import logging
import math
import os
import re
import secrets
import shutil
import ssl
import stat
import struct
import sys
import threading
import time
import urllib.parse
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from tierlm.errors import KVTierError
from tierlm.files import read_regular
from tierlm.kv.block_pool import Givers, Partition, set_partition
from tierlm.kv.policies import DEFAULT_POLICY, EvictionPolicy, make_policy, move_block, partition_history

log = logging.getLogger(__name__)

_MAGIC = b"TLKV3"  # 2: the checksum covers the block's key and parent too; 3: and its dtype and shape
ENTRY_HEADER_BYTES = 320  # at most, per disk entry or Redis value: magic, length, JSON header (~250)
WRITE_WARN_EVERY_S = 300  # a tier whose writes keep failing says so again at most this often
_AUTO_CAPACITY = sys.maxsize  # the capacity "asked for" by a tier given none that started on a full disk
ENTRY_NAME = re.compile(r"[0-9a-f]{64}\.(kv|tmp[0-9a-f]+)")  # a disk entry, or one being written


@dataclass
class TierStats:
    hits: int = 0
    misses: int = 0
    stores: int = 0
    evictions: int = 0
    promotions: int = 0
    bytes_in: int = 0
    bytes_out: int = 0
    corrupt: int = 0
    lost: int = 0  # indexed entries found deleted by something else (disk)
    errors: int = 0
    dropped: int = 0  # writes for this tier dropped because the writer was too far behind

    def count(self, **deltas: int) -> None:
        """Add to counters. Readers, writers and the model loop count into one tier's stats, not
        all under its lock, and `+=` is a read and a write another thread can come between."""
        with _COUNTING:
            for name, n in deltas.items():
                setattr(self, name, getattr(self, name) + n)


_COUNTING = threading.Lock()  # held for a few additions at a time: one for every tier is enough


_ALIGN = 64  # a new entry's payload starts at a multiple of this many bytes (a cache line)
_HINT_KEY = b'"output_tokens": '
_HINT_WIDTH = 12  # the hint's value is padded to this width, so it can be patched in place


def warn_due(warned_at: dict[str, float], kind: str) -> bool:
    """Whether a `kind` of trouble may be warned about again (at most every WRITE_WARN_EVERY_S,
    by the times kept in `warned_at`); True marks it done."""
    now = time.monotonic()
    last = warned_at.get(kind)
    if last is not None and now - last < WRITE_WARN_EVERY_S:
        return False
    warned_at[kind] = now
    return True


def _hint_slot(hint: int | None) -> bytes:
    return json.dumps(hint).encode().ljust(_HINT_WIDTH)


def _checksum(key: bytes, parent: bytes | None, payload: bytes, dtype: str, shape: list) -> str:
    """SHA-256 over the block's own key, its parent's, its dtype and shape, and the K/V: an
    intact entry stored under another key (a file copied or linked over, a Redis value set
    under the wrong name) fails it like a damaged one, instead of being served as this block;
    so does a header whose dtype or shape was changed (the same bytes read as other numbers)."""
    digest = hashlib.sha256(len(key).to_bytes(1, "little") + key + (parent or b""))
    digest.update(f"{dtype}:{','.join(map(str, shape))};".encode())
    digest.update(payload)
    return digest.hexdigest()


def encode_block(data: torch.Tensor, parent: bytes | None = None, hint: int | None = None,
                 key: bytes = b"") -> bytes:
    """Self-describing bytes: magic, header length, JSON header (dtype, shape, checksum over
    `key`, parent and payload; the parent hash and output-length hint, which a disk tier re-reads
    on restart), payload. The hint comes last in a fixed-width slot (JSON ignores the padding),
    so a disk entry can be given one later by rewriting a few bytes (`patch_hint`) instead of the
    block."""
    payload = data.contiguous().view(torch.uint8).numpy().tobytes()
    dtype, shape = str(data.dtype).replace("torch.", ""), list(data.shape)
    header = json.dumps({"dtype": dtype, "shape": shape, "sha256": _checksum(key, parent, payload, dtype, shape),
                         "parent": parent.hex() if parent else None}).encode()
    tail = b", " + _HINT_KEY + _hint_slot(hint) + b"}"
    # Spaces (JSON ignores them) put the payload at a multiple of _ALIGN bytes into the entry, so
    # a read can use it in place as the block's numbers (`decode_entry`) instead of copying it.
    pad = -(len(_MAGIC) + 4 + len(header) - 1 + len(tail)) % _ALIGN
    header = header[:-1] + b" " * pad + tail
    return _MAGIC + struct.pack("<I", len(header)) + header + payload


def patch_hint(f, hint: int) -> bool:
    """Set the hint of the entry open in `f` (read-write binary) in place; False if the entry has
    no fixed-width slot (written before slots existed) or is not an entry."""
    slot = _hint_slot(hint)
    f.seek(0)
    head = f.read(4096)
    parsed = _header(head)
    if parsed is None or len(slot) != _HINT_WIDTH:
        return False
    _, end = parsed  # the header is head[9:end]; the slot sits just before its closing brace
    slot_at = end - 1 - _HINT_WIDTH
    if head[slot_at - len(_HINT_KEY):slot_at] != _HINT_KEY:
        return False
    f.seek(slot_at)
    f.write(slot)
    return True


def _header(raw: bytes) -> tuple[dict, int] | None:
    """(header, payload offset), or None if `raw` does not start like an entry."""
    try:
        if raw[:5] != _MAGIC:
            return None
        (n,) = struct.unpack("<I", raw[5:9])
        header = json.loads(raw[9:9 + n])
        return (header, 9 + n) if isinstance(header, dict) else None
    except (ValueError, struct.error, json.JSONDecodeError, UnicodeDecodeError):
        return None


#: (dtype, shape) of a block as the engine holds it: [layers, 2, block_size, kv_heads, head_dim].
Layout = tuple[torch.dtype, tuple[int, ...]]


def decode_block(raw: bytes, key: bytes = b"", layout: Layout | None = None) -> torch.Tensor | None:
    """The block, or None if the bytes are not a whole, intact entry for `key` (of `layout`)."""
    decoded = decode_entry(raw, key, layout)
    return None if decoded is None else decoded[0]


def decode_entry(raw: bytes, key: bytes = b"", layout: Layout | None = None) -> tuple[torch.Tensor, int | None] | None:
    """(block, output-length hint of its header), or None if the bytes are not a whole, intact
    entry written for `key` or, given a `layout`, not a block of that dtype and shape (whatever
    a header says, the engine copies only its own layout back to the device)."""
    try:
        parsed = _header(raw)
        if parsed is None:
            return None
        header, start = parsed
        payload = memoryview(raw)[start:]
        parent = bytes.fromhex(header["parent"]) if header["parent"] else None
        if _checksum(key, parent, payload, header["dtype"], header["shape"]) != header["sha256"]:
            return None
        dtype = getattr(torch, header["dtype"])
        if not isinstance(dtype, torch.dtype):
            return None
        if layout is not None and (dtype, tuple(header["shape"])) != layout:
            return None
        data = _payload_tensor(raw, start, dtype, header["shape"])
        hint = header.get("output_tokens")
        return data, hint if isinstance(hint, int) else None
    except (ValueError, KeyError, struct.error, json.JSONDecodeError, RuntimeError, TypeError, AttributeError):
        return None


def _payload_tensor(raw: bytes | bytearray, start: int, dtype: torch.dtype, shape: list[int]) -> torch.Tensor:
    """The block over `raw[start:]`: the entry's own memory when `raw` is a bytearray (a disk
    read: no copy of ~200 KB per block, which with the checksum was most of a disk hit's time),
    a copy of it otherwise (bytes, as Redis answers, are immutable). Raises ValueError when the
    payload is not `shape` of `dtype`."""
    count = math.prod(shape)
    if count * dtype.itemsize != len(raw) - start:
        raise ValueError(f"payload of {len(raw) - start} bytes is not {shape} of {dtype}")
    if not isinstance(raw, bytearray):
        raw, start = bytearray(memoryview(raw)[start:]), 0
    return torch.frombuffer(raw, dtype=dtype, offset=start, count=count).reshape(shape)


_UNITS = {"tib": 1 << 40, "gib": 1 << 30, "mib": 1 << 20, "kib": 1 << 10,  # longest first
          "ti": 1 << 40, "gi": 1 << 30, "mi": 1 << 20, "ki": 1 << 10,  # Kubernetes style
          "tb": 10**12, "gb": 10**9, "mb": 10**6, "kb": 10**3, "b": 1}


def parse_capacity(value: int | str | None, block_bytes: int) -> int:
    """Blocks from "1000 blocks" / "2GiB" / "512MiB" / "1.5TB" / "4096B" / a byte count.

    A size in bytes that is not 0 but under one block is refused: rounded down it would be 0,
    which silently turns the tier off."""
    if value is None:
        return 0
    bad = ValueError(f"cannot read KV tier capacity {value!r}; use e.g. '1000 blocks', '2GiB', '500GB' or a "
                     "byte count (0 turns the tier off)")
    if isinstance(value, bool):
        raise bad
    if isinstance(value, int):
        if value < 0:
            raise bad
        return _bytes_to_blocks(value, block_bytes, value)
    s = str(value).strip().lower().replace(" ", "")
    if not s.isascii():  # str.isdigit() is true for "²", which int() refuses
        raise bad
    count = block_count(s)
    if count is not None:
        return count
    for u, mult in _UNITS.items():
        if s.endswith(u):
            try:
                amount = float(s[: -len(u)])
            except ValueError:
                raise bad from None
            if not math.isfinite(amount) or amount < 0:
                raise bad
            nbytes = int(amount * mult)
            if nbytes == 0 and amount > 0:  # "0.5B": not 0, so not "off"; under one block, refused below
                nbytes = 1
            return _bytes_to_blocks(nbytes, block_bytes, value)
    if s.isdigit():
        return _bytes_to_blocks(int(s), block_bytes, value)
    raise bad


def block_count(value: object) -> int | None:
    """N of a capacity given as "N blocks" (or "N block", any case and spacing), else None."""
    if not isinstance(value, str):
        return None
    s = value.strip().lower().replace(" ", "")
    for suffix in ("blocks", "block"):
        if s.endswith(suffix) and s[: -len(suffix)].isascii() and s[: -len(suffix)].isdigit():
            return int(s[: -len(suffix)])
    return None


def _bytes_to_blocks(nbytes: int, block_bytes: int, given: object) -> int:
    if 0 < nbytes < block_bytes:
        raise ValueError(f"KV tier capacity {given!r} is less than one KV block ({block_bytes} bytes): give "
                         f"at least {block_bytes} bytes, a count such as '1000 blocks', or 0 to turn the tier off")
    return nbytes // block_bytes


_PASSWORD_PARAM = re.compile(r"([?&;]password=)[^&#]*", re.IGNORECASE)  # redis-py reads a ; into the value


def url_cut_short(parts: urllib.parse.SplitResult) -> bool:
    """Whether a password with an unencoded / # or ? cut the URL short: an @ (the one that
    ends the password) then lands in the path, the fragment, or the query before any `=`."""
    query_at = parts.query.find("@")
    return "@" in parts.path or "@" in parts.fragment or (query_at >= 0 and "=" not in parts.query[:query_at])


def lower_scheme(url: str) -> str:
    """`REDIS://...` as `redis://...`: redis-py takes lower-case schemes only."""
    head, sep, rest = url.partition("://")
    return head.lower() + sep + rest if sep else url


_LOOPBACK = {"localhost", "127.0.0.1", "::1"}


def redis_server_of(url: str) -> tuple[str, object]:
    """The Redis server a (checked) URL names, whatever its database: ("unix", socket path) or
    (host, port), loopback names as one. Memory limits and eviction are the server's, not a
    database's, so this is what two users of one Redis must be told apart by."""
    try:
        parts = urllib.parse.urlsplit(lower_scheme(url))
        if parts.scheme == "unix":
            return "unix", os.path.realpath(parts.path)
        host = (parts.hostname or "localhost").lower()
        return ("loopback" if host in _LOOPBACK else host), parts.port or 6379
    except ValueError:  # unreadable: its own check names what is wrong with it
        return "url", url


def redact_url(url: str) -> str:
    """`url` with any password shown as *** (for logs and errors): the user-info part of the
    host (`:PASSWORD@`), a `?password=` value (redis-py reads that too), and, for a password with
    an unencoded / # or ? that cuts the URL short, everything up to the @ that ends it."""
    head, sep, rest = url.partition("://")
    if not sep:
        return _PASSWORD_PARAM.sub(r"\1***", url)
    try:
        parts = urllib.parse.urlsplit(url)
        netloc, cut_short = parts.netloc, url_cut_short(parts)
    except ValueError:  # e.g. an unclosed [ of an IPv6 host: hide whatever could be a password
        netloc, cut_short = "", "@" in rest
    if cut_short:  # first: an @ in the netloc may be part of such a password too
        rest = "***" + rest[rest.rfind("@"):]
    elif "@" in netloc:
        info, host = netloc.rsplit("@", 1)
        user, colon, _ = info.partition(":")
        rest = (f"{user}:***" if colon else "***") + "@" + host + rest[len(netloc):]
    return _PASSWORD_PARAM.sub(r"\1***", head + sep + rest)


Demoted = tuple[bytes, "bytes | None", torch.Tensor, "int | None"]  # (key, parent, K/V, output-length hint)

_OUT_OF_SPACE = (errno.ENOSPC, errno.EDQUOT)
_FULL_TRIES = 4  # evictions one store may make after the storage said it is full


class _CapacityTier:
    """A tier of fixed capacity in blocks with an eviction policy; subclasses store the bytes.

    A block may come with a hint, the output length of the last finished request that used it
    (what `gittins_hint` learns from): the tier hands it to its policy, keeps it while it holds
    the block, and passes it on when the block moves down or back up to the device.
    """

    name = "tier"
    layout: Layout | None = None  # what a block read back must be (set by the TieredStore), if known

    def __init__(self, capacity_blocks: int, policy: str, history: int | None = None) -> None:
        self.capacity = capacity_blocks
        self.policy = make_policy(policy, history=history)
        self._policy_args = (policy, history)  # to build it anew (the disk tier, once it has indexed)
        self.parents: dict[bytes, bytes | None] = {}
        self.hints: dict[bytes, int] = {}
        self.stats = TierStats()
        self.lock = threading.RLock()
        # The policy's clock. Alone, a tier ticks once per store or read; in a TieredStore the
        # engine ticks it once per request looked up (`tick`), the unit the policies' constants
        # (TLP's alpha, Gittins' half-life, chain's same-request segments) were tuned in.
        self.auto_tick = True
        # Two counters, each with one writer, so no update is lost between threads: the ticks (the
        # tier's own stores and reads under `lock`, or else only the model loop's `tick`) and the
        # disk index's shift past an earlier run's entries.
        self._ticks = self._shift = 0
        self._warned_at: dict[str, float] = {}  # "write" / "read": when failing ones were last warned about
        self._shrunk = False  # capacity was lowered to what the storage could hold
        self._wanted: int | None = None  # the capacity asked for, while lowered
        # Entries below one found damaged: stored again, not kept, when their block comes down
        # again (see _suspect_below)
        self._suspect: set[bytes] = set()
        self.partitions: dict[str, Partition] = {}  # tenants' cache partitions (`partition`)
        self.owners: dict[bytes, str] = {}  # stored block -> its partition (absent: the shared blocks)
        self._kids: dict[bytes | None, set[bytes]] = {}  # parent -> stored children, while partitions exist

    @property
    def where(self) -> str:
        """The tier as logs name it."""
        return f"{self.name} tier"

    @property
    def clock(self) -> int:
        return self._ticks + self._shift

    def tick(self) -> None:
        """One request looked up (see `clock`). Only the model loop ticks, so no lock: the disk
        tier holds its lock while it writes a block, and the loop must not wait for that."""
        self._ticks += 1

    def __contains__(self, h: bytes) -> bool:
        with self.lock:
            return h in self.parents

    def __len__(self) -> int:
        return len(self.parents)

    def put(self, h: bytes, parent: bytes | None, data: torch.Tensor, hint: int | None = None,
            owner: str | None = None) -> list[Demoted]:
        """Store a block (from tenant partition `owner`'s side, if any: see `partition`); returns
        what had to be evicted to make room (to demote further)."""
        if self.capacity <= 0:
            return [(h, parent, data, hint)]
        evicted: list[Demoted] = []
        with self.lock:
            if self.auto_tick:
                self._ticks += 1
            if h in self.parents and not self._still_there(h):
                self._forget_deleted(h)  # its file was deleted behind the tier's back: store the block again
            if h in self._suspect and h in self.parents:
                self._drop(h)  # maybe damaged as its ancestor was: these fresh bytes replace it
            if h in self.parents:
                if hint is not None and hint != self.hints.get(h):
                    self._rehint(h, parent, data, hint)
                self._adopt(h, parent, owner)
                self.policy_of(h).access(h, parent, self.clock)
                self._hint(h, hint)
                return []
            while len(self.parents) >= self.capacity:
                victim = self._victim()
                if victim is None:
                    break
                taken = self.take(victim)
                self.stats.count(evictions=1)
                if taken is not None:
                    evicted.append(taken)
            if len(self.parents) >= self.capacity:
                return evicted + [(h, parent, data, hint)]
            e = self._store(h, parent, data, hint, evicted)
            if e is not None:  # permissions, a disk that stays full, ...: pass the block on, keep serving
                self.stats.count(errors=1)
                if self._warn_due("write"):
                    log.warning("KV %s cannot store blocks (%s); passing them to the next tier while writes fail "
                                "(%d errors so far; said again at most every %d s). Free space or fix the cache "
                                "directory", self.where, e, self.stats.errors, WRITE_WARN_EVERY_S)
                return evicted + [(h, parent, data, hint)]
            self.parents[h] = parent
            self._own(h, parent, owner)
            self.policy_of(h).access(h, parent, self.clock)
            self._hint(h, hint)
            self.stats.count(stores=1, bytes_in=data.numel() * data.element_size())
        return evicted

    def _store(self, h: bytes, parent: bytes | None, data: torch.Tensor, hint: int | None,
               evicted: list[Demoted]) -> OSError | None:
        """Write a block; None, or the error that stopped it. Out of space below capacity (the
        disk filled up with other files, or the default capacity was too hopeful), the tier holds
        what fits from then on and evicts for this block."""
        tries = _FULL_TRIES
        while True:
            try:
                self._write(h, parent, data, hint)
                return None
            except OSError as e:
                if not (tries and e.errno in _OUT_OF_SPACE and self._make_room_when_full(evicted)):
                    return e
                tries -= 1

    def _held(self) -> int:
        """Entries that count against capacity."""
        return len(self.parents)

    def _make_room_when_full(self, evicted: list[Demoted]) -> bool:
        """The storage is full: lower capacity to what the tier holds, so it stays there, and
        evict one entry (appended to `evicted`, to move down). False if nothing can go."""
        held = self._held()
        if 0 < held < self.capacity:
            (log.warning if not self._shrunk else log.info)(
                "KV %s ran out of space at %d blocks, below its capacity of %d; holding %d until space "
                "frees up (give it a capacity that fits)", self.where, held, self.capacity, held)
            self._shrunk = True
            self._wanted = self._wanted or self.capacity
            self.capacity = held
        victim = self._victim()
        if victim is None:
            return False
        taken = self.take(victim)
        self.stats.count(evictions=1)
        if taken is not None:
            evicted.append(taken)
        return True

    def get(self, h: bytes) -> torch.Tensor | None:
        """The block, read outside the lock (a disk read must not queue other lookups behind
        it). A read that fails is tried again under the lock before the entry is called corrupt
        and dropped: an eviction or a hint patched in place may have raced it."""
        with self.lock:
            hint = self._before_read(h)
            if h not in self.parents:
                self.stats.count(misses=1)
                return None
        try:
            data = self._read(h)
        except FileNotFoundError:  # evicted (and maybe stored again) meanwhile, or deleted: look again
            data = None
        except OSError as e:
            return self._unreadable(h, e)
        with self.lock:
            if data is None and h in self.parents:
                try:
                    data = self._read(h)
                except FileNotFoundError:  # indexed, under the lock, and not there: deleted by something else
                    self._forget_deleted(h)
                except OSError as e:
                    return self._unreadable(h, e)
                if data is None and h in self.parents:  # there, but damaged: drop it, the caller recomputes
                    self.stats.count(corrupt=1)
                    self._suspect_below(h)
                    self._drop(h)
            if data is None:
                self.stats.count(misses=1)
                return None
            self._suspect.discard(h)  # (read whole and checked)
            if h in self.parents:  # else evicted meanwhile: the bytes read are still this block's
                if self.auto_tick:
                    self._ticks += 1
                self.policy_of(h).access(h, self.parents[h], self.clock)
                if hint is not None:
                    self.policy_of(h).finished([h], hint)
            self.stats.count(hits=1, bytes_out=data.numel() * data.element_size())
            return data

    def _suspect_below(self, h: bytes) -> None:
        """`h` was found damaged: its descendants here become suspect (hold `lock`). Damage comes
        in runs (a bad region of a disk, a copy cut short), and a lookup stops at the first bad
        block, so the rest of the chain was never checked: when the request that recomputes them
        moves them down again, a suspect is stored anew instead of being taken as already there
        (which left damaged files to be found one block per request, and kept after a clean
        stop). A suspect read whole, and so checked, is cleared; other branches below `h` stay
        until then."""
        children: dict[bytes | None, list[bytes]] = {}
        for child, parent in self.parents.items():
            children.setdefault(parent, []).append(child)
        stack = list(children.get(h, ()))
        while stack:
            child = stack.pop()
            self._suspect.add(child)
            stack.extend(children.get(child, ()))

    def _forget_deleted(self, h: bytes) -> None:
        """Drop the index entry of `h`, whose bytes something else deleted. Hold `lock`."""
        self._drop(h)
        self.stats.count(lost=1)
        if self._warn_due("vanished"):
            log.warning("KV %s: entries were deleted by something else (%d so far; said again at most every %d s); "
                        "they are misses, recomputed and stored again. Keep cleaners away from kv_disk_dir",
                        self.where, self.stats.lost, WRITE_WARN_EVERY_S)

    def _still_there(self, h: bytes) -> bool:
        """Whether an indexed entry's bytes still exist (a file can be deleted behind our back)."""
        return True

    def _unreadable(self, h: bytes, e: OSError) -> None:
        """A read failed for a reason that says nothing about the entry (out of file descriptors,
        permissions, I/O): a miss, and the entry is kept, to be served once reads work again."""
        with self.lock:
            if h in self.parents and h not in self.policy:  # adopted for this read: evictable like any
                if self.auto_tick:
                    self._ticks += 1
                self.policy.access(h, self.parents[h], self.clock)
            self.stats.count(errors=1, misses=1)
            if self._warn_due("read"):
                log.warning("KV %s cannot read entries (%s); counting them as misses and keeping them (said again "
                            "at most every %d s). Check the process's open-file limit and the directory's "
                            "permissions", self.where, e, WRITE_WARN_EVERY_S)
        return None

    def _warn_due(self, kind: str) -> bool:
        """`warn_due` for this tier's warnings. Hold `lock`."""
        return warn_due(self._warned_at, kind)

    def _before_read(self, h: bytes) -> int | None:
        """Under the lock, before a lookup: make `h` known if it is stored but not yet indexed;
        returns its hint, for the policy once the access has made it tracked."""
        return None

    def _hint(self, h: bytes, hint: int | None) -> None:
        if hint is not None:
            self.hints[h] = hint
            self.policy_of(h).finished([h], hint)

    def hint_of(self, h: bytes) -> int | None:
        with self.lock:
            return self.hints.get(h)

    def fetch(self, h: bytes) -> tuple[torch.Tensor, int | None] | None:
        """A hit as (block, its output-length hint), or None."""
        data = self.get(h)
        return None if data is None else (data, self.hint_of(h))

    def take(self, h: bytes) -> Demoted | None:
        """Remove `h` and return it as it moves down (None if its bytes are gone); hold `lock`."""
        try:
            data = self._read(h)
        except OSError:  # evicted all the same; its bytes cannot move down
            data = None
        hint = self.hints.get(h)
        parent = self._drop(h)
        return None if data is None else (h, parent, data, hint)

    def _drop(self, h: bytes) -> bytes | None:
        self.hints.pop(h, None)
        self._suspect.discard(h)
        policy = self.policy_of(h)
        if h in policy:  # not yet, for a disk entry that failed its first read
            policy.remove(h)
        self._disown(h)
        self._erase(h)
        return self.parents.pop(h, None)

    # -- cache partitions (the host tier's: a tenant's `kv_cache_share`, as in block_pool.py) --
    def partition(self, tenant: str, share: float) -> None:
        """Make or resize `tenant`'s partition for `share` of the tier: blocks the device demotes
        from the tenant's own partition are kept here in one, ranked by a policy of its own, safe
        from other tenants' traffic up to its share (block_pool.py's rule: a partition past its
        share gives first, then the blocks of tenants without one, then the partition fullest for
        its share). Else one tenant's flood, turned over on the device, turned the host tier over
        too, and a partitioned tenant's prefixes the device could not hold went with it."""
        name, history = self._policy_args
        with self.lock:
            set_partition(self.partitions, tenant, share, self.capacity,
                          lambda s: make_policy(name, history=partition_history(history, s)))

    def policy_of(self, h: bytes) -> EvictionPolicy:
        """The policy ranking stored block `h`: its tenant's partition's, or the shared one."""
        owner = self.owners.get(h)
        return self.policy if owner is None else self.partitions[owner].policy

    def _own(self, h: bytes, parent: bytes | None, owner: str | None) -> None:
        """A block just stored: counted in `owner`'s partition when it has one; its parent learns
        of it while partitions exist (a chain across partitions goes tail first: `_victim`)."""
        if not self.partitions:
            return
        if parent is not None:
            self._kids.setdefault(parent, set()).add(h)
        part = self.partitions.get(owner) if owner is not None else None
        if part is not None:
            self.owners[h] = owner
            part.evictable += 1

    def _adopt(self, h: bytes, parent: bytes | None, owner: str | None) -> None:
        """A stored block of the shared ones comes down again from a partitioned tenant's side:
        it moves into the tenant's partition (else a prefix that a tenant without a share stored
        first stays exposed to other tenants' traffic, as on the device)."""
        if owner is None or owner not in self.partitions or h in self.owners:
            return
        if h in self.policy:  # (with its history, where the partition's policy takes it)
            move_block(h, parent, self.policy, self.partitions[owner].policy)
        self.owners[h] = owner
        self.partitions[owner].evictable += 1

    def _disown(self, h: bytes) -> None:
        """`h` leaves the tier: out of its partition's count and its parent's children."""
        owner = self.owners.pop(h, None)
        if owner is not None:
            self.partitions[owner].evictable -= 1
        parent = self.parents.get(h)
        kids = self._kids.get(parent)
        if kids is not None:
            kids.discard(h)
            if not kids:
                del self._kids[parent]

    def _victim(self) -> bytes | None:
        """The next block to evict: the policy's choice, or with partitions the one the giving
        partition's policy (or the shared one) picks, walked down to a stored child first (each
        policy sees only the children it ranks; a parent gone first strands them)."""
        if not self.partitions:
            return self.policy.victim()
        part = Givers(self.partitions, len(self.parents)).next()
        key = (self.policy if part is None else part.policy).victim()
        for _ in range(len(self.parents)):  # (a chain is no longer than what the tier holds)
            kid = next(iter(self._kids.get(key, ())), None)
            if kid is None:
                break
            key = kid
        return key

    def close(self, timeout: float | None = None) -> None:
        """Release what the tier holds outside this process (nothing, unless overridden), waiting
        at most `timeout` seconds for its own threads."""

    # storage hooks
    def _write(self, h: bytes, parent: bytes | None, data: torch.Tensor, hint: int | None) -> None: ...
    def _rehint(self, h: bytes, parent: bytes | None, data: torch.Tensor, hint: int) -> None:
        """A stored block's hint changed (nothing to do where it is kept in memory only)."""
    def _read(self, h: bytes) -> torch.Tensor | None: ...
    def _erase(self, h: bytes) -> None: ...


def host_block_bytes(block_bytes: int, pinned: bool) -> int:
    """Memory one host-tier block takes. torch's pinned-memory allocator rounds every allocation
    up to a power of two and keeps it cached: a pinned block of 196,608 bytes (Qwen2-0.5B's)
    takes 262,144, one of 5 MiB (Llama-3-70B's) 8 MiB."""
    return 1 << (block_bytes - 1).bit_length() if pinned else block_bytes


class HostTier(_CapacityTier):
    """Blocks in host RAM (pinned when the device is CUDA, so copies back can overlap)."""

    name = "host"
    # This process's open host tiers (its models' engines): one machine's memory for all of them.
    _open: "weakref.WeakSet[HostTier]" = weakref.WeakSet()

    def __init__(self, capacity_blocks: int, policy: str = DEFAULT_POLICY, pin: bool = False,
                 history: int | None = None, nbytes: int = 0) -> None:
        """`nbytes`: the most memory it may take (its capacity in bytes, pinned rounding included)."""
        super().__init__(capacity_blocks, policy, history)
        self.pin = pin
        self.nbytes = nbytes
        self.data: dict[bytes, torch.Tensor] = {}
        HostTier._open.add(self)

    @classmethod
    def taken_here(cls) -> int:
        """Bytes this process's open host tiers may take: each fills lazily, so the memory
        available now does not show what the others will take."""
        return sum(t.nbytes for t in list(cls._open))

    def close(self, timeout: float | None = None) -> None:
        HostTier._open.discard(self)

    def _write(self, h, parent, data, hint):
        if self.pin and not data.is_pinned():
            try:
                data = data.pin_memory()
            except RuntimeError as e:  # page-locked memory exhausted (a container's limit), or no device
                self.pin = False
                log.warning("KV host tier cannot pin memory (%s); keeping blocks in ordinary memory, so copies "
                            "back to the device will not overlap with compute", e)
        self.data[h] = data

    def _read(self, h):
        return self.data.get(h)

    def _erase(self, h):
        self.data.pop(h, None)


class _RecordingPolicy:
    """A policy that also logs every call that changes it, so the calls can be replayed onto a
    policy rebuilt underneath them (the disk tier while it indexes an earlier run's entries)."""

    def __init__(self, inner) -> None:
        self.inner = inner
        self.name = inner.name
        self.log: list[tuple] = []

    def access(self, key, parent, now) -> None:
        self.log.append(("access", key, parent, now))
        self.inner.access(key, parent, now)

    def remove(self, key) -> None:
        self.log.append(("remove", key))
        self.inner.remove(key)

    def finished(self, keys, output_tokens) -> None:
        self.log.append(("finished", tuple(keys), output_tokens))
        self.inner.finished(keys, output_tokens)

    def export(self, key):
        return self.inner.export(key)  # (changes nothing: a block leaving is logged by its `remove`)

    def victim(self):
        return self.inner.victim()

    def __len__(self) -> int:
        return len(self.inner)

    def __contains__(self, key: object) -> bool:
        return key in self.inner


Entry = tuple[int, bytes, "bytes | None", "int | None"]  # (mtime ns, key, parent, output-length hint)


class DiskTier(_CapacityTier):
    """One checksummed file per block under a cache directory; written atomically (tmp + rename).

    The directory outlives the process: an earlier run's entries are re-indexed (their headers
    name the parent block; newest kept up to capacity, the rest deleted, as are half-written
    temporaries), so a restarted server is warm and the directory never grows past its capacity
    across restarts. Indexing reads one header per file, minutes for millions of entries, so it
    runs in the background: meanwhile the tier serves and stores as usual, an entry not yet
    indexed is read straight from its file when asked for, and the policy records its calls;
    when the scan is done, a policy is built from the old entries (oldest first, by file time)
    with those calls replayed on top, as if the entries had been indexed at start. The scan
    first lists the files with their times (a second per 200,000; headers take four times
    longer): from then on the old entries count against capacity, and while some are still
    unindexed a store that needs room deletes the oldest of them (older than anything this run
    touched, so what LRU would evict first). Once the listing is done and what it found beyond
    capacity is deleted, the directory never holds more than its capacity (measured: 100,000
    entries reopened at 50,000 blocks were down to 50,000 files after 4 s, and stayed there).

    Block keys cover the model and dtypes, so an entry can only be found by an engine that would
    compute the same K/V. One engine owns a directory at a time (an advisory lock): two
    processes sharing one would each evict the other's files unseen. Engines share blocks
    through the Redis tier instead.
    """

    name = "disk"
    _locked_here: set[Path] = set()  # directories this process's disk tiers hold the lock of

    @classmethod
    def held_here(cls) -> set[Path]:
        return set(cls._locked_here)

    @property
    def where(self) -> str:
        return f"disk tier {self.root}"

    @property
    def usable(self) -> bool:
        """False when it could not set up its directory (a full disk) and is off for this run."""
        return self._lock_file is not None

    def __init__(self, root: str | Path, capacity_blocks: int | None, policy: str = DEFAULT_POLICY,
                 block_bytes: int = 0, index_in_background: bool = True, regrow_every_s: float = 30.0,
                 history: int | None = None, audit_every_s: float = 300.0) -> None:
        """`index_in_background=False` leaves the scan to a call of `index()` (tests place tier
        operations before it that way). After the disk filled up, the capacity grows back
        towards what was asked for as space frees up, looked at every `regrow_every_s`. A full
        tier looks for entries deleted behind its back at most every `audit_every_s`."""
        super().__init__(capacity_blocks or 0, policy, history)
        self._regrow_every = regrow_every_s
        self._regrow_at = 0.0
        self._audit_every = audit_every_s
        self._audit_at = time.monotonic() + audit_every_s
        # An entry is its header (well under 4 KiB) and one block: anything longer is not one.
        self._max_entry_bytes = block_bytes + 4096 if block_bytes else 1 << 30
        self.root = Path(root)
        self._auto_capacity = capacity_blocks is None
        self._lock_file = None
        self._root_id: tuple[int, int] | None = None  # (device, inode) of the directory this tier locked
        self._lost: str | None = None  # why this tier no longer owns its directory (see _reclaim)
        self.on_reclaim: Callable[[], None] | None = None  # after the lock was taken again (rewrites model.json)
        self._undeleted: set[bytes] = set()  # entries dropped from the index whose file could not be deleted
        self._shards_seen: set[str] = set()  # shard directories checked to be directories, not links
        self._undeleted_retry_at = 0.0
        # Temporaries are named by run, not judged by file time: a clock step back would make this
        # run's look old, and deleting one mid-write loses the block.
        self._tmp_tag = secrets.token_hex(4)
        self._indexed = threading.Event()
        self._stop = threading.Event()
        self._indexer: threading.Thread | None = None
        self._trimmed: set[bytes] = set()  # old entries past capacity, being deleted: never adopted
        self._pending: dict[bytes, int] | None = None  # old entries not yet indexed, oldest first, once listed
        try:
            self._lock_file = self._claim()
            if self._auto_capacity:  # half the free space, plus half of what the listing finds ours
                self.capacity = shutil.disk_usage(self.root).free // 2 // self._on_disk(block_bytes)
                if self.capacity > 0:
                    log.info("KV disk tier %s: no capacity given, using %d blocks (half the free space, and half "
                             "of what an earlier run's entries use once they are listed; set kv_disk_capacity to "
                             "choose)", self.root, self.capacity)
                else:  # as a full disk mid-run does: take half of what frees up (once)
                    self._wanted = _AUTO_CAPACITY
                    log.warning("KV disk tier %s: no capacity given, and its disk has no room for a block: it "
                                "holds nothing until space frees up, then takes half of the free space (checked "
                                "every %g s while blocks come down). Free space there, or set kv_disk_capacity",
                                self.root, self._regrow_every)
            earlier = any(self.root.glob("??"))
        except OSError as e:
            self.close()
            if e.errno not in _OUT_OF_SPACE:
                raise KVTierError(f"cannot use {self.root} as the KV disk directory ({e}); give a writable "
                                  "kv_disk_dir") from None
            # A full disk is no reason to refuse to serve: the tier is off for this run.
            log.warning("KV disk tier %s is off for this run: no space left to set up its directory (%s). Free "
                        "space there and restart to use it", self.root, e)
            self.capacity, self._auto_capacity, self._lost = 0, False, f"no space to set up {self.root}"
            self._indexed.set()
            return
        if not earlier:
            self._indexed.set()
            return
        self.policy = _RecordingPolicy(self.policy)
        if index_in_background:
            self._indexer = threading.Thread(target=self.index, name="tierlm-kv-disk-index", daemon=True)
            self._indexer.start()

    def _claim(self, patience_s: float = 0.25):
        """Take the directory's lock. Held by someone else for `patience_s` (not a moment's
        probe by `tierlm kv ls`): refused. A lock file renamed aside or deleted by `tierlm kv
        prune` between opening and locking it locks nothing: open the one at the path again."""
        deadline = time.monotonic() + patience_s
        while True:
            _private_dir(self.root)
            f = self._open_lock()
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                f.seek(0)
                owner = f.read(200).decode(errors="replace").strip() or "another engine"
                f.close()
                if time.monotonic() < deadline:
                    time.sleep(0.01)
                    continue
                if owner == f"tierlm pid {os.getpid()}":
                    raise KVTierError(f"KV disk directory {self.root} is in use by another engine of this process "
                                      "(the same checkpoint under the same name twice?); serve it once, or under "
                                      "another name") from None
                raise KVTierError(f"KV disk directory {self.root} is in use by {owner}; give each engine its own "
                                  "kv_disk_dir (engines share KV blocks through kv_remote)") from None
            try:
                current = os.path.samestat(os.fstat(f.fileno()), os.stat(self.root / ".lock"))
            except OSError:
                current = False
            if current:
                break
            f.close()
            time.sleep(0.001)
            if time.monotonic() >= deadline + 5.0:  # never for long: each round follows a prune's rename
                raise KVTierError(f"KV disk directory {self.root} keeps being moved or deleted while this engine "
                                  "takes it; stop whatever removes it (tierlm kv prune?) and start again")
        try:  # who holds it, for the next one refused; unbuffered, so a full disk fails here only
            f.truncate(0)
            f.write(f"tierlm pid {os.getpid()}\n".encode())
        except OSError as e:  # the flock holds all the same
            log.info("KV disk tier %s: could not write this engine's pid into .lock (%s)", self.root, e)
        DiskTier._locked_here.add(self.root)
        try:
            st = os.stat(self.root)
            self._root_id = (st.st_dev, st.st_ino)
        except OSError:
            self._root_id = None
        else:
            if st.st_mode & 0o077 and st.st_uid == os.getuid():  # made by a version that left it 0755
                try:
                    os.chmod(self.root, 0o700)
                    log.info("KV disk tier %s: made the directory private to its owner (was %o)", self.root,
                             stat.S_IMODE(st.st_mode))
                except OSError as e:
                    log.warning("KV disk tier %s: cannot make the directory private (%s); other local users "
                                "may read its KV blocks", self.root, e)
        return f

    def _open_lock(self):
        """The directory's lock file, opened without following a symbolic link (whose target the
        pid label would overwrite) and only if it is a regular file."""
        path = self.root / ".lock"
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, 0o600)
        except OSError as e:
            if e.errno == errno.ELOOP:
                raise KVTierError(f"{path} is a symbolic link; tierlm does not write through one (it would "
                                  "overwrite the link's target). Remove it and start again") from None
            raise
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            os.close(fd)
            raise KVTierError(f"{path} is not a regular file; remove it and start again")
        return os.fdopen(fd, "r+b", buffering=0)

    def _reclaim(self) -> None:
        """Take the lock again if its file went with a deleted directory (a /tmp cleaner): without
        it a second engine started on the recreated directory would not be refused. If one got
        there first, this tier stops storing (an OSError: blocks pass to the next tier)."""
        if self._lost:
            raise OSError(self._lost)
        f = self._lock_file
        if f is None:
            return
        try:
            if os.path.samestat(os.fstat(f.fileno()), os.stat(self.root / ".lock")):
                return  # the lock file is still where a second engine would look for it
        except OSError as e:
            if e.errno not in (errno.ENOENT, errno.ENOTDIR):
                raise  # cannot tell (permissions, I/O): this write fails, a later one looks again
        before = self._root_id
        try:
            self._lock_file = self._claim()
        except KVTierError as e:  # another engine holds the recreated directory now: it is theirs
            self._lost = str(e)
            raise OSError(self._lost) from None
        f.close()
        forgotten = self._forget_all() if before is None or before != self._root_id else 0
        log.warning("KV disk directory %s lost its lock file while in use (deleted, or the directory was moved or "
                    "deleted); took its lock again%s", self.root,
                    f", in a new directory: its {forgotten} entries went with the old one and are recomputed when "
                    "next asked for" if forgotten else ". Entries deleted with it are recomputed when next asked for")
        if self.on_reclaim is not None:
            self.on_reclaim()

    def _forget_all(self) -> int:
        """The directory was deleted and made anew: every entry indexed went with the old one
        (else the tier counted ghosts against capacity, and re-stored none of them). Hold `lock`."""
        n = len(self.parents)
        for h in list(self.parents):
            if h in self.policy:
                self.policy.remove(h)
            del self.parents[h]
        self.hints.clear()
        if self._pending:
            self._pending.clear()
        self._undeleted.clear()
        self._trimmed.clear()
        self.stats.count(lost=n)
        return n

    def close(self, timeout: float | None = None) -> None:
        """Stop indexing (what is not indexed stays on disk for the next run) and release the lock.

        The indexer is waited for at most `timeout` s: it may wait for the tier's lock, which a
        write stuck on a hung disk holds. From here on the directory is not this tier's: a write
        still under way finishes its one entry (a whole, valid one) but nothing more is deleted."""
        self._stop.set()
        if self._indexer is not None and self._indexer is not threading.current_thread():
            self._indexer.join(timeout)
            if self._indexer.is_alive():
                log.warning("KV disk tier %s: still indexing at shutdown, behind a disk operation that has not "
                            "returned (a hung disk?); not waiting for it", self.root)
        if self._lock_file is not None:
            self._lost = self._lost or f"KV disk tier {self.root} is closed"
            self._lock_file.close()  # releases the flock
            self._lock_file = None
            DiskTier._locked_here.discard(self.root)

    @property
    def indexed(self) -> bool:
        return self._indexed.is_set()

    def wait_indexed(self, timeout: float | None = None) -> bool:
        """Block until an earlier run's entries are indexed (True) or `timeout` seconds pass."""
        return self._indexed.wait(timeout)

    # -- while indexing: entries are found by name -----------------------------------------
    def __contains__(self, h: bytes) -> bool:
        with self.lock:
            return h in self.parents or self._unindexed_entry(h) is not None

    def _before_read(self, h: bytes) -> int | None:
        return self._adopt_on_demand(h)

    def put(self, h: bytes, parent: bytes | None, data: torch.Tensor, hint: int | None = None) -> list[Demoted]:
        if time.monotonic() >= self._audit_at and len(self.parents) >= self.capacity and self.indexed:
            self._audit()
        with self.lock:
            self._adopt_on_demand(h)  # already on disk from an earlier run: no second write
            if h not in self.parents:
                if self._wanted is not None and time.monotonic() >= self._regrow_at:
                    self._regrow(data.numel() * data.element_size())
                for old in self._trim_pending(room=1):
                    self._erase(old)
            return super().put(h, parent, data, hint)

    def _audit(self) -> None:
        """Forget the entries whose files something else deleted (a cleaner, a person): each took
        a place in a full tier until it was read or stored again, so a live entry was evicted in
        its stead. Lists the directory shard by shard outside the lock (on the disk writer's
        thread: about a second per 200,000 files; the next audit waits at least 20 times as
        long), then checks each indexed entry the listing lacks once more under the lock (it may
        have been written since its shard was listed)."""
        t0 = time.monotonic()
        self._audit_at = t0 + self._audit_every
        if self._lost:
            return
        by_shard: dict[str, list[bytes]] = {}
        with self.lock:
            for h in self.parents:
                by_shard.setdefault(h[:1].hex(), []).append(h)
        gone = []
        for shard, known in by_shard.items():  # one shard's names at a time, not the whole listing's
            self._yield()
            try:
                present = set(os.listdir(self.root / shard))
            except FileNotFoundError:
                present = set()
            except OSError:  # unreadable: the next store deals with that
                return
            gone += [h for h in known if f"{h.hex()}.kv" not in present]
        with self.lock:
            for h in gone:
                if h in self.parents and not self._still_there(h):
                    self._forget_deleted(h)
        self._audit_at = time.monotonic() + max(self._audit_every, 20 * (time.monotonic() - t0))

    def _regrow(self, block_bytes: int) -> None:
        """Lowered after the disk filled up: take back up to half of what is free now (as the
        default capacity does), up to the capacity asked for (hold `lock`)."""
        self._regrow_at = time.monotonic() + self._regrow_every
        try:
            st = os.statvfs(self.root)
        except OSError:
            return
        per = self._on_disk(block_bytes)
        granted = max(0, self.capacity - self._held())  # entries granted already, not yet written
        room = max(0, st.f_bavail * st.f_frsize - granted * per) // 2 // per
        if st.f_files:  # a file system with a fixed number of inodes (0: it has none): one per entry
            room = min(room, max(0, st.f_favail - granted) // 2)
        grown = min(self._wanted or 0, self.capacity + room)
        if grown > self.capacity:
            asked = "half the free space, no capacity given" if self._wanted == _AUTO_CAPACITY else \
                f"{self._wanted} asked for"
            log.info("KV disk tier %s has space again: capacity raised from %d to %d blocks (%s)",
                     self.root, self.capacity, grown, asked)
            self.capacity = grown
            if self._wanted == _AUTO_CAPACITY:  # half of the free space, once, as at a start with room
                self._wanted = None
        if self.capacity >= (self._wanted or 0):
            self._wanted = None

    def _held(self) -> int:
        return len(self.parents) + len(self._pending or ())

    def _on_disk(self, block_bytes: int) -> int:
        """Bytes one entry takes on this file system: the block, its header, rounded up to whole
        fragments (what free space goes down by)."""
        try:
            frag = os.statvfs(self.root).f_frsize or 4096
        except OSError:
            frag = 4096
        return -(-(max(block_bytes, 1) + ENTRY_HEADER_BYTES) // frag) * frag

    def _make_room_when_full(self, evicted: list[Demoted]) -> bool:
        """As for any tier, but files of entries dropped while deletes failed go first (they fill
        the disk for nothing; a full disk lowered capacity for good while they stayed), then an
        earlier run's entries not yet indexed."""
        if self._undeleted and self._erase_undeleted():
            return True
        if not self._pending:
            return super()._make_room_when_full(evicted)
        if self._held() < self.capacity:
            self._wanted = self._wanted or self.capacity
            self.capacity = self._held()
        gone = self._trim_pending(room=1)
        for old in gone:
            self._erase(old)
        return bool(gone) or super()._make_room_when_full(evicted)

    def _trim_pending(self, room: int) -> list[bytes]:
        """Mark the oldest unindexed entries for deletion until the listed old entries plus this
        run's leave `room` free (hold `lock`); returns their keys, for the caller to erase."""
        gone: list[bytes] = []
        pending = self._pending
        while pending and len(self.parents) + len(pending) + room > self.capacity:
            h = next(iter(pending))
            del pending[h]
            self._trimmed.add(h)
            gone.append(h)
        self.stats.count(evictions=len(gone))
        return gone

    def _unindexed_entry(self, h: bytes) -> Entry | None:
        if self._indexed.is_set() or h in self.parents or h in self._trimmed or self.capacity <= 0:
            return None
        if self._pending is not None and h not in self._pending:  # listed: no file to look for
            return None
        p = self.path(h)
        try:
            entry = self._entry(p)
        except OSError:  # unreadable for now, not damaged: neither adopted nor deleted
            return None
        if entry is None and p.exists():  # there, but damaged (or not a file): never served
            self.stats.count(corrupt=1)
            self._erase(h)  # (one that cannot be deleted, a directory, is tried again later)
        if entry is None and self._pending is not None:
            self._pending.pop(h, None)
        return entry

    def _adopt_on_demand(self, h: bytes) -> int | None:
        """An earlier run's entry for `h`, not yet indexed, joins the index now (hold `lock`);
        returns its hint, for the policy once the caller's access has made it tracked."""
        entry = self._unindexed_entry(h)
        if entry is None:
            return None
        _, _, parent, hint = entry
        if self._pending is not None:
            self._pending.pop(h, None)
        self.parents[h] = parent
        if hint is not None:
            self.hints[h] = hint
        return hint

    # -- indexing --------------------------------------------------------------------------
    def index(self) -> None:
        """Index an earlier run's entries (see the class docstring). Runs once."""
        try:
            self.list_earlier()
            self._index()
        except Exception:  # a broken index is a colder cache, not a dead server
            log.exception("KV disk tier %s: indexing the entries of an earlier run failed; they are ignored "
                          "(delete the directory if this repeats)", self.root)
            with self.lock:
                if isinstance(self.policy, _RecordingPolicy):
                    self.policy = self.policy.inner
                self._pending = {}
        finally:
            self._indexed.set()

    def list_earlier(self) -> None:
        """The scan's first step (`index()` starts with it): list an earlier run's entries with
        their file times. From here on they count against capacity; the oldest beyond it go now."""
        if self._indexed.is_set() or self._pending is not None or self._stop.is_set():
            return
        t0 = time.monotonic()
        listed = self._list()
        if self._stop.is_set():
            return
        with self.lock:
            self._pending = {h: t for t, h in listed if h not in self.parents}
            if self._auto_capacity:  # half of (free at start + an earlier run's): the same size each restart
                self.capacity += len(self._pending) // 2
            excess = self._trim_pending(room=0)
        for h in excess:  # a lock hold each, not one long one
            with self.lock:
                if h not in self.parents:  # else this run has just stored it again
                    self._erase(h)
        log.info("KV disk tier %s: found %d blocks of an earlier run in %.1f s%s; indexing them in the background",
                 self.root, len(listed), time.monotonic() - t0,
                 f", deleted the {len(excess)} oldest beyond its capacity of {self.capacity}" if excess else "")

    def _index(self) -> None:
        if self._indexed.is_set() or self._pending is None or self._stop.is_set():
            return
        t0 = time.monotonic()
        found = self._read_headers()
        if self._stop.is_set():
            return
        t_read = time.monotonic()
        # Private until swapped in: built without the lock.
        rebuilt = make_policy(self._policy_args[0], history=self._policy_args[1])
        for t, (_, h, parent, hint) in enumerate(found, 1):
            if t % 64 == 0:
                self._yield()
                if self._stop.is_set():
                    return
            if h not in self._trimmed:
                rebuilt.access(h, parent, t)
                if hint is not None:
                    rebuilt.finished([h], hint)
        shift = len(found)
        t_built = time.monotonic()
        with self.lock:
            recorder = self.policy
            for event in recorder.log:  # what this run did meanwhile, after the old entries
                if event[0] == "access":
                    rebuilt.access(event[1], event[2], event[3] + shift)
                elif event[0] == "remove":
                    rebuilt.remove(event[1])
                else:
                    rebuilt.finished(event[1], event[2])
            old = []
            for entry in found:
                h = entry[1]
                if h in self._pending:  # neither adopted by this run nor deleted for room
                    old.append(entry)
                elif h in rebuilt and h not in self.parents:  # deleted for room after the build
                    rebuilt.remove(h)
            for _, h, parent, hint in old:
                self.parents[h] = parent
                if hint is not None:
                    self.hints[h] = hint
            self.policy = rebuilt
            self._shift += shift
            self._trimmed.clear()
            self._pending = {}
            self._indexed.set()
            while len(self.parents) > self.capacity:  # a safety net: listing and stores keep old + new within it
                victim = self.policy.victim()
                if victim is None:
                    break
                self._drop(victim)
                self.stats.count(evictions=1)
            t_swapped = time.monotonic()
        log.info("KV disk tier %s: indexed %d blocks from an earlier run in %.1f s (headers %.1f s, policy %.1f s, "
                 "swap %.2f s)", self.root, len(old), t_swapped - t0, t_read - t0, t_built - t_read,
                 t_swapped - t_built)

    @staticmethod
    def _yield() -> None:
        """Let the model loop run. Indexing is pure Python between file reads: without pauses the
        loop's thread waits for the GIL at each of its ops (one request took 3 s instead of 0.06 s
        while 300,000 entries were indexed); with them, indexing takes a little longer."""
        time.sleep(0.001)

    def _list(self) -> list[tuple[int, bytes]]:
        """(file time, key) of every entry an earlier run left, oldest first. Its half-written
        temporaries are deleted; other files are left alone."""
        t0 = time.monotonic()
        listed, dropped, i = [], 0, 0
        for shard in os.scandir(self.root):
            if len(shard.name) != 2 or not shard.is_dir(follow_symlinks=False):  # a link leads elsewhere
                continue
            try:
                files = os.scandir(shard.path)
            except FileNotFoundError:  # emptied and removed meanwhile (the writer, once space ran out)
                continue
            for f in files:
                i += 1
                if i % 256 == 0:
                    self._yield()
                    if self._stop.is_set():
                        return []
                    if i % 200_000 == 0:
                        log.info("KV disk tier %s: listing, %d files in %.0f s", self.root, i, time.monotonic() - t0)
                match = ENTRY_NAME.fullmatch(f.name)
                if match is None or f.name[:2] != shard.name:
                    continue
                try:
                    if match.group(1) != "kv":
                        if not match.group(1).startswith(f"tmp{self._tmp_tag}"):  # not being written by us
                            os.unlink(f.path)
                            dropped += 1
                        continue
                    mtime = f.stat().st_mtime_ns  # a time in the future (a clock stepped back) sorts newest
                except OSError:
                    continue
                listed.append((mtime, bytes.fromhex(f.name[:64])))
        listed.sort()
        if dropped:
            log.info("KV disk tier %s: deleted %d half-written files of an earlier run", self.root, dropped)
        return listed

    def _read_headers(self) -> list[Entry]:
        """The listed entries still pending, with the parent and hint from their headers, oldest
        first. An unreadable one is deleted."""
        t0 = time.monotonic()
        with self.lock:
            todo = list(self._pending)
        found, dropped = [], 0
        for i, h in enumerate(todo, 1):
            if i % 64 == 0:
                self._yield()
                if self._stop.is_set():
                    return []
                if i % 100_000 == 0:
                    log.info("KV disk tier %s: indexing, %d of %d entries in %.0f s", self.root, i, len(todo),
                             time.monotonic() - t0)
            if h not in self._pending:  # adopted or deleted meanwhile
                continue
            try:
                entry = self._entry(self.path(h), self._pending.get(h, 0))
            except OSError:  # unreadable for now, not damaged: left for the next run to index
                continue
            if entry is not None:
                found.append(entry)
                continue
            with self.lock:
                if self._pending.pop(h, None) is not None:  # still unindexed, so damaged: never served
                    self._erase(h)
                    dropped += 1
        if dropped:
            log.info("KV disk tier %s: deleted %d unreadable entries of an earlier run", self.root, dropped)
        return found

    @staticmethod
    def _entry(p: Path, mtime: int = 0) -> Entry | None:
        """The entry at `p` from its header; `mtime` is the file time the listing read."""
        head = read_regular(p, 4096, whole=False, strict=True, nofollow=True)
        parsed = None if head is None else _header(head)
        if parsed is None or "parent" not in parsed[0]:
            return None  # damaged, or written before headers named the parent
        parent, hint = parsed[0]["parent"], parsed[0].get("output_tokens")
        try:
            return (mtime, bytes.fromhex(p.stem), bytes.fromhex(parent) if parent else None,
                    hint if isinstance(hint, int) else None)
        except (TypeError, ValueError):
            return None

    def path(self, h: bytes) -> Path:
        hx = h.hex()
        return self.root / hx[:2] / f"{hx}.kv"

    def _write(self, h, parent, data, hint):
        self._undeleted.discard(h)  # its file is about to be this block again, not a leftover
        p = self.path(h)
        tmp = p.with_suffix(f".tmp{self._tmp_tag}{threading.get_ident():x}")
        self._reclaim()  # an fstat and a stat: is the lock file at its path still ours?
        raw = encode_block(data, parent, hint, key=h)
        if p.parent.name not in self._shards_seen:
            self._check_shard(p.parent)
        try:
            try:
                _write_new(tmp, raw)
            except FileNotFoundError:  # a new shard directory
                _private_dir(p.parent)
                _write_new(tmp, raw)
            os.replace(tmp, p)
        except OSError:
            try:
                tmp.unlink(missing_ok=True)
            except OSError:
                pass
            raise
        if self._undeleted and time.monotonic() >= self._undeleted_retry_at:
            self._erase_undeleted()

    def _rehint(self, h, parent, data, hint):
        """Put the new hint into the entry, so it outlives a restart (a block written through to
        disk when it was computed had none yet: its request had not finished). A few bytes in
        place; an entry without a hint slot (an older format) is rewritten whole, once."""
        try:
            # Never wait on a FIFO put there, nor write through a link to a file elsewhere.
            fd = os.open(self.path(h), os.O_RDWR | os.O_NONBLOCK | os.O_NOFOLLOW)
            with os.fdopen(fd, "r+b") as f:
                if stat.S_ISREG(os.fstat(fd).st_mode) and patch_hint(f, hint):
                    return
            self._write(h, parent, data, hint)
        except OSError:
            self.stats.count(errors=1)  # the old entry stays, without the new hint

    def _read(self, h):
        raw = read_regular(self.path(h), self._max_entry_bytes, strict=True, absent_raises=True, nofollow=True,
                           mutable=True)
        return None if raw is None else decode_block(raw, h, self.layout)

    def _still_there(self, h):
        try:
            os.stat(self.path(h))
        except FileNotFoundError:
            return False
        except OSError:  # cannot tell: keep it (a read that fails for this reason keeps it too)
            return True
        return True

    def _erase(self, h):
        if self._lost:
            return  # another engine owns the directory now: its files are not ours to delete
        p = self.path(h)
        try:
            p.unlink()
        except FileNotFoundError:
            pass
        except OSError:  # a read-only directory: tried again once writes work, so files stay within capacity
            self._undeleted.add(h)
            return
        if self._wanted is not None:  # short of space: a shard emptied gives its inode back
            self._drop_empty_shard(p.parent)

    def _check_shard(self, shard: Path) -> None:
        """A shard directory is written into only if it is a directory of its own: one replaced
        by a link would send entries, and their deletes, to wherever it points. Checked once per
        shard and run (an lstat); a shard this tier makes is its own."""
        try:
            st = os.lstat(shard)
        except FileNotFoundError:
            return  # made by the write
        if not stat.S_ISDIR(st.st_mode):
            raise OSError(errno.ENOTDIR, "a KV disk shard is not a directory (a link or a file put there)", str(shard))
        self._shards_seen.add(shard.name)

    def _drop_empty_shard(self, shard: Path) -> None:
        """Remove a shard directory left empty. Only once space ran out: on a file system short of
        inodes, each new shard took the inode an evicted entry freed, until all 256 existed and no
        entry fitted (a tester's find); otherwise the rmdir would cost a call per eviction."""
        try:
            shard.rmdir()
        except OSError:
            return  # not empty (the usual case), or gone
        self._shards_seen.discard(shard.name)

    def _erase_undeleted(self) -> int:
        """Delete the files of entries dropped while deletes failed (hold `lock`); one stored
        again since is the tier's again and stays. Files that still cannot go are tried again
        on a write at least `_regrow_every` seconds later, not on every write (or when the disk
        is full). Returns how many files were deleted."""
        self._undeleted_retry_at = time.monotonic() + self._regrow_every
        if self._lost:
            return 0  # not ours to delete in any more (closed, or another engine owns the directory)
        deleted = 0
        for h in list(self._undeleted):
            if h not in self.parents and h not in (self._pending or ()):
                try:
                    self.path(h).unlink()
                    deleted += 1
                except FileNotFoundError:
                    pass
                except OSError:
                    continue
            self._undeleted.discard(h)
        return deleted


def _private_dir(path: Path) -> None:
    """`path` and any missing parents, made 0700: entries hold the KV of clients' prompts, which
    other local users must not read (a umask only ever removes bits from 0700)."""
    missing = []
    while not path.exists() and path.parent != path:
        missing.append(path)
        path = path.parent
    for d in reversed(missing):
        try:
            d.mkdir(mode=0o700)
        except FileExistsError:  # made meanwhile (another thread's shard); not a file or dangling link
            if not d.is_dir():
                raise


def _write_new(path: Path, raw: bytes) -> None:
    """Write `raw` to a file created at `path` (0600: see `_private_dir`), never through a link or
    file put there."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    try:
        fd = os.open(path, flags, 0o600)
    except FileExistsError:  # left by a write that failed and could not clean up: the name is ours
        os.unlink(path)  # the link or file itself, never a link's target
        fd = os.open(path, flags, 0o600)
    try:
        view = memoryview(raw)
        while view:
            view = view[os.write(fd, view):]
    finally:
        os.close(fd)


def _refusal_advice(e: Exception) -> str | None:
    """What to do about a Redis refusal that is configuration, not load or memory."""
    kind, text = type(e).__name__, str(e)  # redis-py strips the error code into the exception's class
    if kind == "ReadOnlyError" or "READONLY" in text or "read only replica" in text:
        return "it is a read-only replica: point kv_remote at the primary"
    if kind == "NoPermissionError" or "NOPERM" in text or "no permissions" in text:
        return ("its user lacks a permission tierlm needs (GET, SET, MGET, EXISTS, PING; INFO and CONFIG for "
                "kv_remote_capacity): grant them, e.g. ACL SETUSER <user> +@read +@write +ping on ~tierlm:kv:*")
    if kind in ("MovedError", "AskError", "ClusterDownError", "ClusterCrossSlotError") or "CROSSSLOT" in text \
            or "hash to the same slot" in text:
        return "it is a Redis Cluster node, which tierlm does not support: use a standalone Redis (or its primary)"
    if kind == "AuthenticationError" or "NOAUTH" in text or "WRONGPASS" in text or "must be called with the client " \
            "already authenticated" in text:
        return ("it wants other credentials than the URL gives: put the password in the URL, "
                "redis://:PASSWORD@host:port/db or redis://USER:PASSWORD@host:port/db")
    return None


DEFAULT_TTL_S = 7 * 86400  # a key's lifetime in Redis without kv_remote_ttl
_KEY_FORMAT = "v3:"  # the entry format (_MAGIC) in every Redis key: tierlm:kv:v3:<block hash>


class RedisTier:
    """A remote tier shared by several engine processes. Any Redis failure is a miss or a
    dropped write. An outage is logged once when it starts and once when it ends; meanwhile the
    tier is skipped and retried after a back-off that doubles from `retry_after_s` up to
    `max_retry_after_s`, so a long outage costs a connection attempt (up to its 0.2 s timeout,
    for a host that does not answer) every 15 s rather than every second.

    Its size is the Redis server's: several engines write it, so no one process can run its
    eviction. The server's `maxmemory` with an `allkeys-*` policy bounds it; `capacity_bytes`
    sets maxmemory (the server's overhead now + 1 MiB + capacity, so about that many bytes of
    blocks fit; for a Redis dedicated to the KV cache) with `volatile-lru`, so only keys with a
    TTL are evicted, never another application's persistent ones, and it is refused on a server
    seen to hold other keys. Without it a server that would grow without bound or refuse writes
    when full is named in a warning. Every entry expires after `ttl_s` (default 7 days), with a
    capacity or not, so a volatile-lru server can evict every engine's entries. A write the
    server refuses (full under `noeviction`) is dropped and counted; it is not an outage, so
    reads go on.
    """

    name = "redis"
    layout: Layout | None = None  # what a block read back must be (set by the TieredStore), if known

    def __init__(self, url: str, prefix: str = "tierlm:kv:", ttl_s: int | None = None, retry_after_s: float = 1.0,
                 capacity_bytes: int | None = None, max_retry_after_s: float = 15.0):
        import redis

        self.url = redact_url(url)  # for logs and errors
        self.client = redis.Redis.from_url(lower_scheme(url), socket_connect_timeout=0.2, socket_timeout=0.5)
        self.prefix = prefix
        # Keys name the entry format, so engines of two tierlm versions sharing one Redis during a
        # rolling upgrade neither read nor delete (nor overwrite) each other's values.
        self._keys = prefix + _KEY_FORMAT
        # With kv_remote_capacity the server evicts volatile-lru, among keys with a TTL: every
        # tierlm key gets one, so another application's keys (which mostly have none) are never
        # evicted for tierlm's, even where the check for them at start missed some. Engines
        # without a capacity give theirs one too: another engine's kv_remote_capacity may make the
        # server volatile-lru at any time, and keys without a TTL could never be evicted (they
        # filled it, and every write of the engine with the capacity was refused).
        self.ttl = ttl_s or DEFAULT_TTL_S
        self.retry_after = retry_after_s
        self.max_retry_after = max(max_retry_after_s, retry_after_s)
        self.down_until = 0.0
        self.backoff = 0.0  # the current outage's wait before the next try; 0 while Redis answers
        self._down_since = 0.0
        self._failed_tries = 0
        self.stats = TierStats()
        self._errors = (redis.exceptions.RedisError, OSError)
        self._refused = redis.exceptions.ResponseError  # the server answered, and said no
        self._garbled = redis.exceptions.InvalidResponse  # the server answered, not in Redis's protocol
        self._warned_refusal = False
        self._capacity_set = False  # maxmemory and volatile-lru set by us (kv_remote_capacity)
        self._capacity_bytes = capacity_bytes
        # A server restarted quickly is never an outage here (redis-py reconnects on the next
        # call), yet it has forgotten the limit: its run id, looked at every `restart_check_s`
        # while it answers, tells.
        self._run_id: str | None = None
        self._run_id_seen = 0.0
        self.restart_check_s = 10.0
        self._bad_credentials = redis.exceptions.AuthenticationError
        # A round trip slower than this is an outage (the store sets it to its read timeout): the
        # socket timeout bounds each read from the socket, not a reply that trickles in.
        self.slow_after_s: float | None = None
        self._warned_at: dict[str, float] = {}  # kind of trouble -> when last warned about
        self._started = False
        self._check_memory(capacity_bytes, self._bad_credentials)
        self._started = True

    def _foreign_data(self) -> str | None:
        """Keys on this server that are not tierlm's, from a sample of 16 random keys in each
        database that has any (INFO keyspace): other engines' KV blocks in other databases are
        tierlm's too. None if none were seen."""
        import redis

        kwargs = self.client.connection_pool.connection_kwargs
        own = int(kwargs.get("db", 0) or 0)
        prefix = self.prefix.encode()
        for name, v in sorted(self.client.info("keyspace").items()):
            if not (name.startswith("db") and name[2:].isdigit() and isinstance(v, dict) and v.get("keys", 0)):
                continue
            db = int(name[2:])
            pool = None if db == own else redis.ConnectionPool(
                connection_class=self.client.connection_pool.connection_class, **{**kwargs, "db": db})
            client = self.client if pool is None else redis.Redis(connection_pool=pool)
            try:
                for _ in range(16):
                    key = client.randomkey()
                    if key is None:
                        break
                    if not key.startswith(prefix):
                        return f"keys such as {key[:40]!r} in {name}"
            finally:
                if pool is not None:
                    pool.disconnect()  # a client given a pool leaves its sockets open on close()
        return None

    def _check_memory(self, capacity_bytes: int | None, bad_credentials: type[Exception]) -> None:
        try:
            if capacity_bytes:
                foreign = self._foreign_data()
                if foreign is not None:
                    self._refuse_capacity(foreign)
                    return
                # On top of what the server needs with no data (its overhead now: clients, buffers,
                # key tables), not counting keys already there (ours, from an earlier run), so
                # restarts do not grow the limit; plus 1 MiB, as client buffers and allocator
                # rounding move used memory by hundreds of KB (without it, a small capacity on an
                # empty server refused every write).
                mem = self.client.info("memory")
                base = max(int(mem.get("used_memory_overhead", 0)), int(mem.get("used_memory_startup", 0))) + (1 << 20)
                want = base + capacity_bytes
                now = int(self.client.config_get("maxmemory").get("maxmemory", 0) or 0)
                if now > want + (1 << 20):  # beyond the overhead's drift between engines
                    log.warning("Redis KV tier %s: lowering its maxmemory from %d to %d bytes for kv_remote_capacity. "
                                "If other engines share this Redis with a larger kv_remote_capacity, the last one "
                                "to start wins: give them all the same", self.url, now, want)
                self.client.config_set("maxmemory", want)
                self.client.config_set("maxmemory-policy", "volatile-lru")
                self._capacity_set = True
                self._run_id, self._run_id_seen = self._server_run_id(), time.monotonic()
                return
            conf = self.client.config_get("maxmemory*")
        except bad_credentials as e:  # a configuration error, not an outage: retrying cannot fix it
            self.close()
            raise KVTierError(f"Redis KV tier {self.url} refused the credentials ({e}); put the password in the "
                              "URL: redis://:PASSWORD@host:port/db, or redis://USER:PASSWORD@host:port/db") from None
        except self._refused as e:  # CONFIG renamed or disabled, as on many managed services
            if "DB index is out of range" in str(e):  # the URL's database does not exist: configuration
                self.close()
                raise KVTierError(f"Redis KV tier {self.url}: the server has no such database ({e}); use a "
                                  "database number below its `databases` setting (default 16), e.g. "
                                  "redis://host:6379/0") from None
            log.warning("cannot read or set the memory limit of Redis KV tier %s (%s); set maxmemory and "
                        "maxmemory-policy allkeys-lru on the server itself", self.url, e)
            return
        except self._errors as e:
            if not self._started and isinstance(e, self._garbled):  # it answered, in another protocol
                self.close()
                raise KVTierError(f"Redis KV tier {self.url} does not answer like a Redis server ({e}: another "
                                  "service, such as HTTP or SSH, listens there); check the host and port in "
                                  "kv_remote") from None
            if isinstance(e.__context__, ssl.SSLCertVerificationError):  # configuration too: refuse now
                self.close()
                raise KVTierError(f"Redis KV tier {self.url}: its TLS certificate was not accepted "
                                  f"({e.__context__.verify_message}); for a private CA add "
                                  "?ssl_ca_certs=/path/ca.pem to the URL") from None
            self._failed(e)
            return
        except KVTierError:  # a refusal of ours (data that is not tierlm's), already worded
            raise
        except Exception as e:  # the client could not make sense of the answers: not a Redis server
            unknown = re.search(r"unexpected keyword argument '([^']+)'", str(e)) if isinstance(e, TypeError) else None
            if unknown is not None:  # redis-py passes a URL's query parameters on as connection settings
                self.close()
                raise KVTierError(f"Redis KV tier {self.url}: the URL parameter '{unknown.group(1)}' is not a "
                                  "connection setting redis-py knows; remove it from kv_remote (settings it "
                                  "takes include ?ssl_ca_certs=, ?socket_timeout=, ?db=)") from None
            if self._started:
                self._failed(e)
                return
            self.close()
            raise KVTierError(f"Redis KV tier {self.url} does not answer like a Redis server ({type(e).__name__}: "
                              f"{e}); check the host and port in kv_remote") from None
        policy = str(conf.get("maxmemory-policy", ""))
        if int(conf.get("maxmemory", 0) or 0) == 0:
            log.warning("Redis KV tier %s has no maxmemory: it grows without bound. Set maxmemory and "
                        "maxmemory-policy allkeys-lru on the server, or give kv_remote_capacity", self.url)
        elif not policy.startswith(("allkeys", "volatile")):  # (every tierlm key has a TTL)
            log.warning("Redis KV tier %s uses maxmemory-policy %s, which evicts nothing, so writes are refused "
                        "once it is full. Use allkeys-lru (or give kv_remote_capacity)", self.url, policy)

    def _refuse_capacity(self, foreign: str) -> None:
        """kv_remote_capacity on a server holding other data: refused at start; after an outage
        (the limit set again) a warning, and the tier serves on without a limit of its own."""
        said = (f"Redis KV tier {self.url} holds data that is not tierlm's ({foreign}); kv_remote_capacity "
                "sets the whole server's maxmemory, which would evict that data (if it has TTLs) or refuse its "
                "writes once full. Give tierlm a Redis of its own, or leave kv_remote_capacity unset and set "
                "maxmemory on the server yourself")
        if not self._started:
            self.close()
            raise KVTierError(said)
        log.warning("%s; the limit is not set again", said)

    def key(self, h: bytes) -> str:
        """The Redis key of block `h`."""
        return self._keys + h.hex()

    def close(self, timeout: float | None = None) -> None:
        try:
            self.client.close()
        except Exception:
            pass

    def _available(self) -> bool:
        return time.monotonic() >= self.down_until

    def too_slow(self, waited_s: float) -> None:
        """A read has been under way for `waited_s`, longer than a request may wait: an outage
        (the next requests skip this tier for the back-off), not a wait for everyone. Its
        connections are closed, so reader threads stuck on a reply that trickles in are freed
        for the reads queued behind them (the disk's too)."""
        self._failed(TimeoutError(f"a read has taken {waited_s:.1f} s, over kv_read_timeout"))
        try:
            self.client.connection_pool.disconnect()  # in-use ones too: their blocked reads fail now
        except Exception:
            pass

    def _took(self, t0: float) -> bool:
        """Whether the round trip begun at `t0` was slow enough to count as an outage."""
        took = time.monotonic() - t0
        if self.slow_after_s is None or took <= self.slow_after_s:
            return False
        self._failed(TimeoutError(f"a round trip took {took:.1f} s, over kv_read_timeout"))
        return True

    def _corrupt(self, key: str) -> None:
        """A value under one of tierlm's keys is not an intact entry for that key: delete it, so
        it is not read and counted again on every request, and say so (at most every 5 minutes)."""
        try:
            if not self.client.delete(key):
                return  # a concurrent read of the same value deleted and counted it already
        except Exception:  # a miss all the same
            pass
        self.stats.count(corrupt=1)
        if warn_due(self._warned_at, "corrupt"):
            log.warning("Redis KV tier %s held a damaged or foreign value at %s (%d so far; said again at most "
                        "every %d s); deleted it, the block is recomputed. Something other than tierlm may be "
                        "writing tierlm's keys", self.url, key, self.stats.corrupt, WRITE_WARN_EVERY_S)

    def _failed(self, e: Exception) -> None:
        now = time.monotonic()
        if not self.backoff:
            advice = _refusal_advice(e)
            log.warning("Redis KV tier %s %s (%s)%s; reading it as misses and dropping writes to it until it "
                        "answers again (retrying after %g s, then less often, up to every %g s)",
                        self.url, "refused" if advice else "unavailable", e, f": {advice}" if advice else "",
                        self.retry_after, self.max_retry_after)
            self._down_since, self._failed_tries = now, 0
            self.backoff = self.retry_after
        elif self._available():  # a retry that failed too
            self.backoff = min(2 * self.backoff, self.max_retry_after)
        self._failed_tries += 1
        self.down_until = now + self.backoff
        self.stats.count(errors=1)

    def _answered(self, since: float) -> None:
        """Redis answered a request sent at `since`: if an outage was on, it is over, unless the
        request was sent before the outage was called (readers and the writer ask concurrently:
        such an answer ended an outage just called, and the next failure began a new one, its
        back-off reset instead of doubled). A restarted server has forgotten the memory limit
        set at start (CONFIG SET does not persist), so kv_remote_capacity is set again; without
        that it grew without bound after the first restart."""
        if self.backoff:
            if since < self._down_since:
                return
            log.info("Redis KV tier %s is back after %.1f s (%d failed tries); using it again", self.url,
                        time.monotonic() - self._down_since, self._failed_tries)
            self.backoff = 0.0
            if self._capacity_bytes:
                self._reapply_capacity()
        elif self._run_id is not None and time.monotonic() - self._run_id_seen > self.restart_check_s:
            self._check_restart()

    def _server_run_id(self) -> str | None:
        return self.client.info("server").get("run_id")

    def _check_restart(self) -> None:
        """Set kv_remote_capacity again on a server restarted without tierlm seeing an outage (a
        quick `systemctl restart`): it came back with no limit and grew without bound."""
        self._run_id_seen = time.monotonic()
        try:
            run_id = self._server_run_id()
        except self._refused:  # INFO refused (renamed or an ACL): no restart can be told; not an outage
            self._run_id = None
            return
        except Exception as e:  # any failure of the client is an outage, never an error
            self._failed(e)
            return
        if self._run_id is None or run_id == self._run_id:  # (None: the limit is not ours to set again)
            return
        log.info("Redis KV tier %s was restarted (its run id changed); setting kv_remote_capacity again", self.url)
        self._run_id = run_id
        self._reapply_capacity()

    def _reapply_capacity(self) -> None:
        self._run_id = None  # set again if the limit is set; else there is nothing to watch for
        try:
            self._check_memory(self._capacity_bytes, self._bad_credentials)
        except KVTierError as e:  # credentials changed while it was down: this tier is now misses
            log.warning("%s; reading the Redis KV tier as misses until the next outage ends", e)
            self.down_until, self.backoff = time.monotonic() + self.max_retry_after, self.max_retry_after

    def __contains__(self, h: bytes) -> bool:
        if not self._available():
            return False
        t0 = time.monotonic()
        try:
            found = bool(self.client.exists(self.key(h)))
        except Exception as e:  # any failure of the client is a miss, never an error
            self._failed(e)
            return False
        self._answered(t0)
        return found

    def put(self, h: bytes, parent: bytes | None, data: torch.Tensor, hint: int | None = None) -> list:
        """Store a block (with its hint in the entry's header, for whichever engine reads it)."""
        if not self._available():
            return []
        raw = encode_block(data, parent, hint, key=h)
        t0 = time.monotonic()
        try:
            self.client.set(self.key(h), raw, ex=self.ttl)
            self.stats.count(stores=1, bytes_in=data.numel() * data.element_size())  # K/V bytes, as the other tiers count
            if not self._took(t0):
                self._answered(t0)
        except self._refused as e:  # e.g. OOM under noeviction: drop this write, keep the tier
            self._answered(t0)
            self.stats.count(errors=1)
            if not self._warned_refusal:
                self._warned_refusal = True
                advice = _refusal_advice(e)
                if advice:
                    log.warning("Redis KV tier %s refused a write (%s): %s; dropping such writes", self.url, e, advice)
                elif self._capacity_set:  # the eviction policy is ours: the block does not fit even after evicting
                    log.warning("Redis KV tier %s refused a write (%s); dropping such writes. Its maxmemory "
                                "leaves no room for a block even after evicting: raise kv_remote_capacity",
                                self.url, e)
                else:
                    log.warning("Redis KV tier %s refused a write (%s); dropping such writes. If the server's "
                                "maxmemory-policy is not allkeys-lru, set it so the server evicts instead; if "
                                "it is, its maxmemory leaves no room for a block: raise maxmemory", self.url, e)
        except Exception as e:  # any failure of the client is a dropped write, never an error
            self._failed(e)
        return []

    def get(self, h: bytes) -> torch.Tensor | None:
        found = self.fetch(h)
        return None if found is None else found[0]

    def fetch(self, h: bytes) -> tuple[torch.Tensor, int | None] | None:
        """A hit as (block, the output-length hint its writer knew), or None; never raises."""
        run = self.fetch_run([h])
        return run[0] if run else None

    def fetch_run(self, hashes: list[bytes]) -> list[tuple[torch.Tensor, int | None]]:
        """The blocks of `hashes` up to the first one Redis lacks (or holds damaged), in one round
        trip (MGET); never raises. Counts a hit per block of the run and one miss if it ends early."""
        if not hashes:
            return []
        if not self._available():
            self.stats.count(misses=1)
            return []
        keys = [self.key(h) for h in hashes]
        t0 = time.monotonic()
        try:
            raws = self.client.mget(keys)
            if not isinstance(raws, list) or len(raws) != len(keys):
                raise TypeError(f"MGET of {len(keys)} keys answered {type(raws).__name__}")
        except Exception as e:  # any failure of the client is a miss, never an error
            self._failed(e)
            self.stats.count(misses=1)
            return []
        if self._took(t0):  # a reply that trickled in: the blocks are good, the server is not
            self.stats.count(misses=1)
            return []
        self._answered(t0)
        run = []
        for key, h, raw in zip(keys, hashes, raws):
            decoded = None if raw is None else decode_entry(raw, h, self.layout)
            if decoded is None:
                if raw is not None:
                    self._corrupt(key)
                self.stats.count(misses=1)
                break
            self.stats.count(hits=1, bytes_out=decoded[0].numel() * decoded[0].element_size())
            run.append(decoded)
        return run
