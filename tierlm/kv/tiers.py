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

import hashlib
import json
import logging
import os
import struct
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from tierlm.kv.policies import DEFAULT_POLICY, make_policy

log = logging.getLogger(__name__)

_MAGIC = b"TLKV1"


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


def encode_block(data: torch.Tensor) -> bytes:
    """Self-describing bytes: magic, header length, JSON header (dtype, shape, sha256), payload."""
    payload = data.contiguous().view(torch.uint8).numpy().tobytes()
    header = json.dumps({"dtype": str(data.dtype).replace("torch.", ""), "shape": list(data.shape),
                         "sha256": hashlib.sha256(payload).hexdigest()}).encode()
    return _MAGIC + struct.pack("<I", len(header)) + header + payload


def decode_block(raw: bytes) -> torch.Tensor | None:
    """The block, or None if the bytes are not a whole, intact entry."""
    try:
        if raw[:5] != _MAGIC:
            return None
        (n,) = struct.unpack("<I", raw[5:9])
        header = json.loads(raw[9:9 + n])
        payload = raw[9 + n:]
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


class _CapacityTier:
    """A tier of fixed capacity in blocks with an eviction policy; subclasses store the bytes."""

    name = "tier"

    def __init__(self, capacity_blocks: int, policy: str) -> None:
        self.capacity = capacity_blocks
        self.policy = make_policy(policy)
        self.parents: dict[bytes, bytes | None] = {}
        self.stats = TierStats()
        self.lock = threading.RLock()
        self.clock = 0

    def __contains__(self, h: bytes) -> bool:
        with self.lock:
            return h in self.parents

    def __len__(self) -> int:
        return len(self.parents)

    def put(self, h: bytes, parent: bytes | None, data: torch.Tensor) -> list[tuple[bytes, bytes | None, torch.Tensor]]:
        """Store a block; returns what had to be evicted to make room (to demote further)."""
        if self.capacity <= 0:
            return [(h, parent, data)]
        evicted = []
        with self.lock:
            self.clock += 1
            if h in self.parents:
                self.policy.access(h, parent, self.clock)
                return []
            while len(self.parents) >= self.capacity:
                victim = self.policy.victim()
                if victim is None:
                    break
                vdata = self._read(victim)
                vparent = self._drop(victim)
                self.stats.evictions += 1
                if vdata is not None:
                    evicted.append((victim, vparent, vdata))
            if len(self.parents) >= self.capacity:
                return evicted + [(h, parent, data)]
            self._write(h, data)
            self.parents[h] = parent
            self.policy.access(h, parent, self.clock)
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

    def _drop(self, h: bytes) -> bytes | None:
        self.policy.remove(h)
        self._erase(h)
        return self.parents.pop(h, None)

    # storage hooks
    def _write(self, h: bytes, data: torch.Tensor) -> None: ...
    def _read(self, h: bytes) -> torch.Tensor | None: ...
    def _erase(self, h: bytes) -> None: ...


class HostTier(_CapacityTier):
    """Blocks in host RAM (pinned when the device is CUDA, so copies back can overlap)."""

    name = "host"

    def __init__(self, capacity_blocks: int, policy: str = DEFAULT_POLICY, pin: bool = False) -> None:
        super().__init__(capacity_blocks, policy)
        self.pin = pin
        self.data: dict[bytes, torch.Tensor] = {}

    def _write(self, h, data):
        self.data[h] = data.pin_memory() if self.pin and not data.is_pinned() else data

    def _read(self, h):
        return self.data.get(h)

    def _erase(self, h):
        self.data.pop(h, None)


class DiskTier(_CapacityTier):
    """One checksummed file per block under a cache directory; written atomically (tmp + rename)."""

    name = "disk"

    def __init__(self, root: str | Path, capacity_blocks: int, policy: str = DEFAULT_POLICY) -> None:
        super().__init__(capacity_blocks, policy)
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)

    def path(self, h: bytes) -> Path:
        hx = h.hex()
        return self.root / hx[:2] / f"{hx}.kv"

    def _write(self, h, data):
        p = self.path(h)
        p.parent.mkdir(exist_ok=True)
        tmp = p.with_suffix(f".tmp{threading.get_ident()}")
        tmp.write_bytes(encode_block(data))
        os.replace(tmp, p)

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

    def put(self, h: bytes, parent: bytes | None, data: torch.Tensor) -> list:
        if not self._available():
            return []
        raw = encode_block(data)
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
