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

import fcntl
import hashlib
import json
import logging
import os
import re
import shutil
import struct
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from tierlm.errors import KVTierError
from tierlm.kv.policies import DEFAULT_POLICY, make_policy

log = logging.getLogger(__name__)

_MAGIC = b"TLKV1"
_ENTRY_NAME = re.compile(r"[0-9a-f]{64}\.(kv|tmp\d+)")  # a disk entry, or one being written


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
    errors: int = 0
    dropped: int = 0  # writes for this tier dropped because the writer was too far behind


def encode_block(data: torch.Tensor, parent: bytes | None = None, hint: int | None = None) -> bytes:
    """Self-describing bytes: magic, header length, JSON header (dtype, shape, sha256; the parent
    hash and output-length hint, which a disk tier re-reads on restart), payload."""
    payload = data.contiguous().view(torch.uint8).numpy().tobytes()
    header = json.dumps({"dtype": str(data.dtype).replace("torch.", ""), "shape": list(data.shape),
                         "sha256": hashlib.sha256(payload).hexdigest(),
                         "parent": parent.hex() if parent else None, "output_tokens": hint}).encode()
    return _MAGIC + struct.pack("<I", len(header)) + header + payload


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


def decode_block(raw: bytes) -> torch.Tensor | None:
    """The block, or None if the bytes are not a whole, intact entry."""
    try:
        parsed = _header(raw)
        if parsed is None:
            return None
        header, start = parsed
        payload = raw[start:]
        if hashlib.sha256(payload).hexdigest() != header["sha256"]:
            return None
        dtype = getattr(torch, header["dtype"])
        return torch.frombuffer(bytearray(payload), dtype=torch.uint8).view(dtype).reshape(header["shape"])
    except (ValueError, KeyError, struct.error, json.JSONDecodeError, RuntimeError, TypeError, AttributeError):
        return None


def parse_capacity(value: int | str | None, block_bytes: int) -> int:
    """Blocks from "1000 blocks" / "1000b" / "2GiB" / "512MiB" / a byte count."""
    if value is None:
        return 0
    if isinstance(value, int):
        return value // block_bytes
    s = str(value).strip().lower().replace(" ", "")
    for suffix in ("blocks", "block", "b"):
        if s.endswith(suffix) and s[: -len(suffix)].isdigit():
            return int(s[: -len(suffix)])
    units = {"kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "kb": 10**3, "mb": 10**6, "gb": 10**9}
    for u, mult in units.items():
        if s.endswith(u):
            return int(float(s[: -len(u)]) * mult) // block_bytes
    if s.isdigit():
        return int(s) // block_bytes
    raise ValueError(f"cannot read KV tier capacity '{value}'; use e.g. '1000 blocks', '2GiB' or a byte count")


Demoted = tuple[bytes, "bytes | None", torch.Tensor, "int | None"]  # (key, parent, K/V, output-length hint)


class _CapacityTier:
    """A tier of fixed capacity in blocks with an eviction policy; subclasses store the bytes.

    A block may come with a hint, the output length of the last finished request that used it
    (what `gittins_hint` learns from): the tier hands it to its policy, keeps it while it holds
    the block, and passes it on when the block moves down or back up to the device.
    """

    name = "tier"

    def __init__(self, capacity_blocks: int, policy: str) -> None:
        self.capacity = capacity_blocks
        self.policy = make_policy(policy)
        self.parents: dict[bytes, bytes | None] = {}
        self.hints: dict[bytes, int] = {}
        self.stats = TierStats()
        self.lock = threading.RLock()
        self.clock = 0
        self._write_failing = False

    def __contains__(self, h: bytes) -> bool:
        with self.lock:
            return h in self.parents

    def __len__(self) -> int:
        return len(self.parents)

    def put(self, h: bytes, parent: bytes | None, data: torch.Tensor, hint: int | None = None) -> list[Demoted]:
        """Store a block; returns what had to be evicted to make room (to demote further)."""
        if self.capacity <= 0:
            return [(h, parent, data, hint)]
        evicted: list[Demoted] = []
        with self.lock:
            self.clock += 1
            if h in self.parents:
                self.policy.access(h, parent, self.clock)
                self._hint(h, hint)
                return []
            while len(self.parents) >= self.capacity:
                victim = self.policy.victim()
                if victim is None:
                    break
                taken = self.take(victim)
                self.stats.evictions += 1
                if taken is not None:
                    evicted.append(taken)
            if len(self.parents) >= self.capacity:
                return evicted + [(h, parent, data, hint)]
            try:
                self._write(h, parent, data, hint)
            except OSError as e:  # disk full, permissions, ...: pass the block on, keep serving
                self.stats.errors += 1
                if not self._write_failing:
                    log.warning("KV %s tier cannot store blocks (%s); passing them to the next tier until "
                                "writes succeed again. Free space or fix the cache directory", self.name, e)
                self._write_failing = True
                return evicted + [(h, parent, data, hint)]
            self._write_failing = False
            self.parents[h] = parent
            self.policy.access(h, parent, self.clock)
            self._hint(h, hint)
            self.stats.stores += 1
            self.stats.bytes_in += data.numel() * data.element_size()
        return evicted

    def get(self, h: bytes) -> torch.Tensor | None:
        with self.lock:
            if h not in self.parents:
                self.stats.misses += 1
                return None
            data = self._read(h)
            if data is None:  # corrupt or vanished: drop it, the caller recomputes
                self.stats.corrupt += 1
                self.stats.misses += 1
                self._drop(h)
                return None
            self.clock += 1
            self.policy.access(h, self.parents[h], self.clock)
            self.stats.hits += 1
            self.stats.bytes_out += data.numel() * data.element_size()
            return data

    def _hint(self, h: bytes, hint: int | None) -> None:
        if hint is not None:
            self.hints[h] = hint
            self.policy.finished([h], hint)

    def hint_of(self, h: bytes) -> int | None:
        with self.lock:
            return self.hints.get(h)

    def take(self, h: bytes) -> Demoted | None:
        """Remove `h` and return it as it moves down (None if its bytes are gone); hold `lock`."""
        data, hint = self._read(h), self.hints.get(h)
        parent = self._drop(h)
        return None if data is None else (h, parent, data, hint)

    def _drop(self, h: bytes) -> bytes | None:
        self.hints.pop(h, None)
        self.policy.remove(h)
        self._erase(h)
        return self.parents.pop(h, None)

    def close(self) -> None:
        """Release what the tier holds outside this process (nothing, unless overridden)."""

    # storage hooks
    def _write(self, h: bytes, parent: bytes | None, data: torch.Tensor, hint: int | None) -> None: ...
    def _read(self, h: bytes) -> torch.Tensor | None: ...
    def _erase(self, h: bytes) -> None: ...


class HostTier(_CapacityTier):
    """Blocks in host RAM (pinned when the device is CUDA, so copies back can overlap)."""

    name = "host"

    def __init__(self, capacity_blocks: int, policy: str = DEFAULT_POLICY, pin: bool = False) -> None:
        super().__init__(capacity_blocks, policy)
        self.pin = pin
        self.data: dict[bytes, torch.Tensor] = {}

    def _write(self, h, parent, data, hint):
        self.data[h] = data.pin_memory() if self.pin and not data.is_pinned() else data

    def _read(self, h):
        return self.data.get(h)

    def _erase(self, h):
        self.data.pop(h, None)


class DiskTier(_CapacityTier):
    """One checksummed file per block under a cache directory; written atomically (tmp + rename).

    The directory outlives the process: on start the tier re-indexes the entries an earlier run
    left (their headers name the parent block; newest kept up to capacity, the rest deleted, as
    are half-written temporaries), so a restarted server is warm and the directory never grows
    past its capacity across restarts. Block keys cover the model and dtypes, so an entry can
    only be found by an engine that would compute the same K/V. One engine owns a directory at
    a time (an advisory lock): two processes sharing one would each evict the other's files
    unseen. Engines share blocks through the Redis tier instead.
    """

    name = "disk"

    def __init__(self, root: str | Path, capacity_blocks: int | None, policy: str = DEFAULT_POLICY,
                 block_bytes: int = 0) -> None:
        super().__init__(capacity_blocks or 0, policy)
        self.root = Path(root)
        self._lock_file = None
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            self._lock_file = self._claim()
        except OSError as e:
            raise KVTierError(f"cannot use {self.root} as the KV disk directory ({e}); give a writable "
                              "kv_disk_dir") from None
        try:
            found = self._scan()
            if capacity_blocks is None:  # half the free space, on top of what is already ours
                self.capacity = len(found) + shutil.disk_usage(self.root).free // 2 // max(block_bytes, 1)
                log.info("KV disk tier %s: no capacity given, using %d blocks (half the free space; set "
                         "kv_disk_capacity to choose)", self.root, self.capacity)
            self._adopt(found)
        except BaseException:
            self.close()
            raise

    def _claim(self):
        f = open(self.root / ".lock", "a+")
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            f.seek(0)
            owner = f.read().strip() or "another engine"
            f.close()
            raise KVTierError(f"KV disk directory {self.root} is in use by {owner}; give each engine its own "
                              "kv_disk_dir (engines share KV blocks through kv_remote)") from None
        f.truncate(0)
        f.write(f"tierlm pid {os.getpid()}\n")
        f.flush()
        return f

    def close(self) -> None:
        if self._lock_file is not None:
            self._lock_file.close()  # releases the flock
            self._lock_file = None

    def _scan(self) -> list[tuple[int, bytes, bytes | None, int | None]]:
        """(mtime, key, parent, hint) of every intact-looking entry, oldest first. Debris of ours
        (half-written temporaries, unreadable entries) is deleted; other files are left alone."""
        t0 = time.monotonic()
        found, dropped = [], 0
        for i, p in enumerate(self.root.glob("??/*"), 1):
            if not _ENTRY_NAME.fullmatch(p.name) or p.parent.name != p.name[:2]:
                continue
            entry = self._entry(p) if p.suffix == ".kv" else None
            if entry is None:
                p.unlink(missing_ok=True)
                dropped += 1
            else:
                found.append(entry)
            if i % 100_000 == 0:
                log.info("KV disk tier %s: %d files looked at", self.root, i)
        found.sort()
        if found or dropped:
            log.info("KV disk tier %s: found %d blocks from an earlier run in %.1f s (%d unreadable or "
                     "half-written files deleted)", self.root, len(found), time.monotonic() - t0, dropped)
        return found

    @staticmethod
    def _entry(p: Path) -> tuple[int, bytes, bytes | None, int | None] | None:
        try:
            with open(p, "rb") as f:
                parsed = _header(f.read(4096))
            mtime = p.stat().st_mtime_ns
        except OSError:
            return None
        if parsed is None or "parent" not in parsed[0]:
            return None  # damaged, or written before headers named the parent
        parent, hint = parsed[0]["parent"], parsed[0].get("output_tokens")
        try:
            return (mtime, bytes.fromhex(p.stem), bytes.fromhex(parent) if parent else None,
                    hint if isinstance(hint, int) else None)
        except (TypeError, ValueError):
            return None

    def _adopt(self, found: list[tuple[int, bytes, bytes | None, int | None]]) -> None:
        """Index the newest `capacity` entries in age order (so recency policies start right)."""
        excess = max(0, len(found) - self.capacity)
        for _, h, _, _ in found[:excess]:
            self._erase(h)
        for _, h, parent, hint in found[excess:]:
            self.clock += 1
            self.parents[h] = parent
            self.policy.access(h, parent, self.clock)
            self._hint(h, hint)
        if excess:
            log.info("KV disk tier %s: deleted the %d oldest blocks beyond its capacity of %d",
                     self.root, excess, self.capacity)

    def path(self, h: bytes) -> Path:
        hx = h.hex()
        return self.root / hx[:2] / f"{hx}.kv"

    def _write(self, h, parent, data, hint):
        p = self.path(h)
        p.parent.mkdir(exist_ok=True)
        tmp = p.with_suffix(f".tmp{threading.get_ident()}")
        try:
            tmp.write_bytes(encode_block(data, parent, hint))
            os.replace(tmp, p)
        except OSError:
            try:
                tmp.unlink(missing_ok=True)
            except OSError:
                pass
            raise

    def _read(self, h):
        try:
            return decode_block(self.path(h).read_bytes())
        except OSError:
            return None

    def _erase(self, h):
        try:
            self.path(h).unlink()
        except OSError:
            pass


class RedisTier:
    """A remote tier shared by several engine processes. Any Redis failure is a miss or a
    dropped write, logged once per outage, with a short back-off so an outage costs nothing.

    Its size is the Redis server's: several engines write it, so no one process can run its
    eviction. The server's `maxmemory` with an `allkeys-*` policy bounds it; `capacity_bytes`
    sets those (maxmemory = the server's overhead now + capacity, so about that many bytes of
    blocks fit; for a Redis dedicated to the KV cache), and without it a server that would grow
    without bound or refuse writes when full is named in a warning. Entries may also expire
    (`ttl_s`). A write the server refuses (full under `noeviction`) is dropped and counted; it
    is not an outage, so reads go on.
    """

    name = "redis"

    def __init__(self, url: str, prefix: str = "tierlm:kv:", ttl_s: int | None = None, retry_after_s: float = 1.0,
                 capacity_bytes: int | None = None):
        import redis

        self.url = url
        self.client = redis.Redis.from_url(url, socket_connect_timeout=0.2, socket_timeout=0.5)
        self.prefix = prefix
        self.ttl = ttl_s
        self.retry_after = retry_after_s
        self.down_until = 0.0
        self.stats = TierStats()
        self._errors = (redis.exceptions.RedisError, OSError)
        self._refused = redis.exceptions.ResponseError  # the server answered, and said no
        self._warned_refusal = False
        self._check_memory(capacity_bytes)

    def _check_memory(self, capacity_bytes: int | None) -> None:
        try:
            if capacity_bytes:  # on top of the server's own overhead (clients, buffers, key tables)
                base = int(self.client.info("memory").get("used_memory_overhead", 0))
                self.client.config_set("maxmemory", base + capacity_bytes)
                self.client.config_set("maxmemory-policy", "allkeys-lru")
                return
            conf = self.client.config_get("maxmemory*")
        except self._refused as e:  # CONFIG renamed or disabled, as on many managed services
            log.warning("cannot read or set the memory limit of Redis KV tier %s (%s); set maxmemory and "
                        "maxmemory-policy allkeys-lru on the server itself", self.url, e)
            return
        except self._errors as e:
            self._failed(e)
            return
        if int(conf.get("maxmemory", 0) or 0) == 0:
            log.warning("Redis KV tier %s has no maxmemory: it grows without bound. Set maxmemory and "
                        "maxmemory-policy allkeys-lru on the server, or give kv_remote_capacity", self.url)
        elif not str(conf.get("maxmemory-policy", "")).startswith("allkeys"):
            log.warning("Redis KV tier %s uses maxmemory-policy %s: tierlm's keys have no TTL, so writes are "
                        "refused once it is full. Use allkeys-lru (or give kv_remote_capacity)",
                        self.url, conf.get("maxmemory-policy"))

    def close(self) -> None:
        try:
            self.client.close()
        except self._errors:
            pass

    def _available(self) -> bool:
        return time.monotonic() >= self.down_until

    def _failed(self, e: Exception) -> None:
        if self._available():
            log.warning("Redis KV tier %s unavailable (%s); treating it as a miss for %.1fs",
                        self.url, e, self.retry_after)
        self.down_until = time.monotonic() + self.retry_after
        self.stats.errors += 1

    def __contains__(self, h: bytes) -> bool:
        if not self._available():
            return False
        try:
            return bool(self.client.exists(self.prefix + h.hex()))
        except self._errors as e:
            self._failed(e)
            return False

    def hint_of(self, h: bytes) -> None:
        return None  # entries are shared by engines and evicted by Redis: no per-block policy state

    def put(self, h: bytes, parent: bytes | None, data: torch.Tensor, hint: int | None = None) -> list:
        if not self._available():
            return []
        raw = encode_block(data, parent)
        try:
            self.client.set(self.prefix + h.hex(), raw, ex=self.ttl)
            self.stats.stores += 1
            self.stats.bytes_in += len(raw)
        except self._refused as e:  # e.g. OOM under noeviction: drop this write, keep the tier
            self.stats.errors += 1
            if not self._warned_refusal:
                self._warned_refusal = True
                log.warning("Redis KV tier %s refused a write (%s); dropping such writes. Give the server "
                            "maxmemory-policy allkeys-lru so it evicts instead", self.url, e)
        except self._errors as e:
            self._failed(e)
        return []

    def get(self, h: bytes) -> torch.Tensor | None:
        if not self._available():
            self.stats.misses += 1
            return None
        try:
            raw = self.client.get(self.prefix + h.hex())
        except self._errors as e:
            self._failed(e)
            self.stats.misses += 1
            return None
        if raw is None:
            self.stats.misses += 1
            return None
        data = decode_block(raw)
        if data is None:
            self.stats.corrupt += 1
            self.stats.misses += 1
            return None
        self.stats.hits += 1
        self.stats.bytes_out += len(raw)
        return data
