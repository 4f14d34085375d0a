"""Tenants' limits shared through Redis (`--limits-store redis://HOST:PORT/DB`), so that every
server and router pointed at one Redis holds each tenant to one requests_per_minute, one
tokens_per_minute and one max_concurrent, not one each.

Why Redis and these shapes: a limit is only a limit if all the processes serving a tenant see
the same count, and a request must not wait on a consensus protocol to be admitted. Each
admission and each release is one Lua script, run atomically by Redis, against:

- a token bucket per tenant and kind, a hash {u, at}: the level at time `at` (ms); the level
  now is min(per_minute, level + elapsed × per_minute / 60 s), the same bucket as the
  in-process one (tenancy.TokenBucket), refilled from one anchor, in exact integer units. It expires once it would be
  full again (an absent bucket is a full one), so idle tenants leave nothing behind;
- a sorted set of the requests in flight: ticket id → the time its lease runs out. The process
  holding a ticket renews its lease (`renew_every`); a process that dies leaves holds that lapse
  after `lease` seconds instead of a tenant's slots lost for good.

Time is Redis's own (`TIME`), one clock for every host; tests pass theirs (`clock`).

Redis unreachable, slow (`timeout`) or refusing: the caller (tenancy.Tenancy) falls back to its
own per-process limits, logs it once, and tries Redis again after `retry_after` seconds. Limits
degrade to per server; requests are never refused, failed or delayed because of the store.
"""
from __future__ import annotations

import asyncio
import hashlib
import logging
import math
import time
from dataclasses import dataclass
from typing import Any, Callable

from tierlm.kv.tiers import lower_scheme, redact_url, redis_server_of

logger = logging.getLogger("tierlm.serving")

# A bucket's level is kept in units of 1/60,000 of a request or token, and time in whole
# milliseconds, so that a refill (elapsed ms × per_minute units) is whole and the arithmetic is
# exact (Lua's numbers are doubles: exact integers below 2**53). The scripts' numbers go back as
# strings: Redis would cut a Lua number to a 64-bit integer.
UNIT = 60_000
MAX_VOIDS = 10_000  # tickets kept to void (`LimitStore._void`) while the store does not answer
VOID_BATCH = 500  # of them per script call
_LUA_PRELUDE = """
if redis.replicate_commands then redis.replicate_commands() end  -- TIME before writes (Redis < 5)
local now
if ARGV[1] ~= '' then now = tonumber(ARGV[1]) else
  local t = redis.call('TIME'); now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000) end
local function level(key, per_minute)
  local v = redis.call('HMGET', key, 'u', 'at')
  local u, at = tonumber(v[1]), tonumber(v[2])
  if u == nil or at == nil then return per_minute * 60000 end
  if now > at then u = math.min(per_minute * 60000, u + (now - at) * per_minute) end
  return u
end
local function store(key, per_minute, u)
  redis.call('HSET', key, 'u', string.format('%.17g', u), 'at', string.format('%.17g', now))
  -- gone once it would be full again: an absent bucket reads as full
  redis.call('PEXPIRE', key, math.ceil((per_minute * 60000 - u) / per_minute) + 1000)
end
local function num(x) return string.format('%.17g', x) end
"""

# KEYS: requests bucket, tokens bucket, holds, the ticket's void mark. ARGV: now_ms ('' = Redis
# TIME), requests_per_minute, tokens_per_minute, max_concurrent (0 = none), ticket, lease_ms.
# Returns {admitted (1/0), reason, wait_ms, requests level, tokens level (units), in flight}.
# A ticket voided already (its caller gave up waiting: `_VOID`) takes nothing when it arrives.
_ADMIT = _LUA_PRELUDE + """
if redis.call('EXISTS', KEYS[4]) == 1 then return {0, 'void', '0', '0', '0', 0} end
local rpm, tpm, maxc = tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[4])
local req = rpm > 0 and level(KEYS[1], rpm) or 0
local tok = tpm > 0 and level(KEYS[2], tpm) or 0
local held = 0
if maxc > 0 then
  redis.call('ZREMRANGEBYSCORE', KEYS[3], '-inf', now)
  held = redis.call('ZCARD', KEYS[3])
end
local reason, wait = '', 0
local function consider(r, w) if w > wait then reason, wait = r, w end end
if rpm > 0 and req < 60000 then consider('requests', (60000 - req) / rpm) end
if tpm > 0 and tok < 60000 then consider('tokens', (60000 - tok) / tpm) end
if maxc > 0 and held >= maxc then consider('concurrency', 1000) end
if reason ~= '' then return {0, reason, num(wait), num(req), num(tok), held} end
if rpm > 0 then req = req - 60000; store(KEYS[1], rpm, req) end
if maxc > 0 then
  redis.call('ZADD', KEYS[3], now + tonumber(ARGV[6]), ARGV[5])
  redis.call('PEXPIRE', KEYS[3], tonumber(ARGV[6]))
  held = held + 1
end
return {1, '', '0', num(req), num(tok), held}
"""

# KEYS: tokens bucket, holds, requests bucket. ARGV: now_ms, tokens_per_minute (0 = none),
# ticket, tokens, requests_per_minute to give the request's unit back under (0 = keep it).
_RELEASE = _LUA_PRELUDE + """
redis.call('ZREM', KEYS[2], ARGV[3])
local tpm, tokens, refund = tonumber(ARGV[2]), tonumber(ARGV[4]), tonumber(ARGV[5])
if tpm > 0 and tokens > 0 then store(KEYS[1], tpm, level(KEYS[1], tpm) - tokens * 60000) end
if refund > 0 then store(KEYS[3], refund, math.min(refund * 60000, level(KEYS[3], refund) + 60000)) end
return 1
"""

# KEYS: per ticket: holds, requests bucket, its void mark. ARGV: now_ms, lease_ms, then per ticket:
# the ticket, requests_per_minute to give its unit back under (0 = keep it).
# Ends tickets whose calls timed out or failed, so whether Redis ran them is not known: each one's
# hold goes (where it was there, its admission ran: its request unit comes back), and its mark
# keeps an admission still on its way from taking anything when it arrives.
_VOID = _LUA_PRELUDE + """
local lease = tonumber(ARGV[2])
for k = 0, #KEYS / 3 - 1 do
  local ticket, refund = ARGV[3 + 2 * k], tonumber(ARGV[4 + 2 * k])
  local holds, requests, mark = KEYS[1 + 3 * k], KEYS[2 + 3 * k], KEYS[3 + 3 * k]
  redis.call('SET', mark, '1', 'PX', lease)
  if redis.call('ZREM', holds, ticket) == 1 and refund > 0 then
    store(requests, refund, math.min(refund * 60000, level(requests, refund) + 60000))
  end
end
return 1
"""

# KEYS: holds sets; ARGV: now_ms, lease_ms, then per key: how many tickets, the tickets.
# Renews the leases of tickets still held (XX: a ticket released meanwhile is not put back).
_RENEW = _LUA_PRELUDE + """
local lease, i = tonumber(ARGV[2]), 3
for k = 1, #KEYS do
  local n = tonumber(ARGV[i]); i = i + 1
  for j = 1, n do redis.call('ZADD', KEYS[k], 'XX', now + lease, ARGV[i]); i = i + 1 end
  redis.call('PEXPIRE', KEYS[k], lease)
end
return 1
"""


@dataclass(frozen=True)
class StoreAdmission:
    """What the store said of one request: admitted or not (then `reason` and `wait` seconds),
    and the buckets' levels after it, for the rate-limit headers (None: no such limit)."""

    admitted: bool
    reason: str
    wait: float
    requests_level: float | None
    tokens_level: float | None
    in_flight: int


class LimitStoreUnavailable(Exception):
    """Redis did not answer in time, or refused: the caller limits on its own for now."""


class LimitStore:
    """One Redis, shared by every process that enforces the same tenants' limits at one layer.

    `role` keeps layers apart: routers ("router") and servers ("server") each count a request
    once, so a store given to both never charges a request twice.
    """

    def __init__(self, url: str, *, role: str = "server", lease: float = 20.0, renew_every: float = 5.0,
                 timeout: float = 0.5, retry_after: float = 5.0, clock: Callable[[], float] | None = None) -> None:
        self.url = url
        self.shown = redact_url(url)
        self.role = role
        self.lease = lease
        self.renew_every = renew_every
        self.timeout = timeout
        self.retry_after = retry_after
        self.clock = clock  # seconds; None: Redis's own TIME
        self._loop: asyncio.AbstractEventLoop | None = None
        self._client: Any = None
        self._scripts: dict[str, Any] = {}
        self._down_until = 0.0  # monotonic: no tries before it
        self._down_since: float | None = None
        # Tickets this process holds: ticket id → holds key (renewed until released).
        self._held: dict[str, str] = {}
        # Tickets whose admission or release timed out or failed (Redis may yet run it, or may have
        # run it without the answer arriving): ticket id → (tenant id, requests_per_minute to give
        # back, 0 for a release), voided (`_VOID`) before the next admission the store answers. Else a frozen
        # Redis ran each admission that timed out once it thawed, and their holds kept the tenant
        # at its max_concurrent, with nothing in flight, until their leases lapsed.
        self._void: dict[str, tuple[str, int]] = {}
        self._renewer: asyncio.Task | None = None
        self.failures = 0
        self.on_failure: Callable[[], None] | None = None  # build_app counts failures in /metrics

    # ---- keys -----------------------------------------------------------------------------

    def _keys(self, tenant_id: str) -> tuple[str, str, str]:
        # The tenant id is any text (a TOML key): its digest keeps the keys short and printable.
        tag = hashlib.sha256(tenant_id.encode()).hexdigest()[:32]
        base = f"tierlm:limits:{self.role}:{tag}"
        return f"{base}:requests", f"{base}:tokens", f"{base}:holds"

    def _void_key(self, ticket: str) -> str:
        return f"tierlm:limits:{self.role}:void:{ticket}"

    # ---- calls ----------------------------------------------------------------------------

    @property
    def available(self) -> bool:
        """False while the store is taken for down (until its next try)."""
        return time.monotonic() >= self._down_until

    async def admit(self, tenant_id: str, requests_per_minute: int | None, tokens_per_minute: int | None,
                    max_concurrent: int | None, ticket: str) -> StoreAdmission:
        keys = self._keys(tenant_id)
        if self._void and self.available:
            await self._void_all()
        sent = self.available
        try:
            reply = await self._run("admit", [*keys, self._void_key(ticket)], [
                self._now(), requests_per_minute or 0, tokens_per_minute or 0, max_concurrent or 0, ticket,
                int(self.lease * 1000)])
        except LimitStoreUnavailable:
            if sent:  # it may have reached Redis, or may yet
                self._remember_void(ticket, tenant_id, requests_per_minute or 0)
            raise
        admitted = int(reply[0]) == 1
        if admitted and max_concurrent:
            self._held[ticket] = keys[2]
            self._start_renewing()
        return StoreAdmission(
            admitted=admitted, reason=_text(reply[1]), wait=float(reply[2]) / 1000.0,
            requests_level=float(reply[3]) / UNIT if requests_per_minute else None,
            tokens_level=float(reply[4]) / UNIT if tokens_per_minute else None, in_flight=int(reply[5]))

    async def release(self, tenant_id: str, tokens_per_minute: int | None, ticket: str, tokens: int,
                      refund_rpm: int | None = None) -> None:
        """End `ticket`'s hold and charge its `tokens`; `refund_rpm` (the tenant's
        requests_per_minute): give its request's unit back too (the server shed it)."""
        requests_key, tokens_key, holds = self._keys(tenant_id)
        self._held.pop(ticket, None)  # not renewed again, whatever Redis says now
        try:
            await self._run("release", [tokens_key, holds, requests_key],
                            [self._now(), tokens_per_minute or 0, ticket, max(0, tokens), refund_rpm or 0])
        except LimitStoreUnavailable:
            self._remember_void(ticket, tenant_id, 0)  # its slot freed once the store answers
            raise

    async def renew(self) -> None:
        """Renew the leases of every ticket this process holds (one script call)."""
        by_key: dict[str, list[str]] = {}
        for ticket, key in list(self._held.items()):
            by_key.setdefault(key, []).append(ticket)
        if not by_key:
            return
        args: list[Any] = [self._now(), int(self.lease * 1000)]
        for tickets in by_key.values():
            args += [len(tickets), *tickets]
        await self._run("renew", list(by_key), args)

    async def in_flight(self, tenant_id: str) -> int:
        """Requests of `tenant_id` in flight across every process (leases not yet lapsed)."""
        holds = self._keys(tenant_id)[2]
        client = self._client_here()
        now = self._now()
        if now == "":
            seconds, micros = await client.time()
            now = seconds * 1000 + micros // 1000
        return int(await asyncio.wait_for(client.zcount(holds, f"({now}", "+inf"), self.timeout))

    def _remember_void(self, ticket: str, tenant_id: str, refund_rpm: int) -> None:
        self._void[ticket] = (tenant_id, refund_rpm)
        while len(self._void) > MAX_VOIDS:  # a store away for long: the oldest lapse on their own
            del self._void[next(iter(self._void))]

    async def _void_all(self) -> None:
        """Void the tickets whose calls failed, before an admission reads the holds they may have
        left (raises LimitStoreUnavailable: kept for the next try)."""
        while self._void:
            batch = list(self._void.items())[:VOID_BATCH]
            keys: list[str] = []
            args: list[Any] = [self._now(), int(self.lease * 1000)]
            for ticket, (tenant_id, refund) in batch:
                requests_key, _, holds = self._keys(tenant_id)
                keys += [holds, requests_key, self._void_key(ticket)]
                args += [ticket, refund]
            await self._run("void", keys, args)
            for ticket, _ in batch:
                self._void.pop(ticket, None)

    async def close(self) -> None:
        if self._renewer is not None:
            self._renewer.cancel()
            await asyncio.gather(self._renewer, return_exceptions=True)
            self._renewer = None
        if self._client is not None and self._loop is asyncio.get_running_loop():
            try:
                await self._client.aclose()
            except Exception:  # closing a client of a Redis that is gone
                pass
        self._client = None

    # ---- internals ------------------------------------------------------------------------

    def _now(self) -> Any:
        """Now in whole ms for the scripts ('': Redis's TIME)."""
        return "" if self.clock is None else str(math.floor(self.clock() * 1000.0))

    def _client_here(self) -> Any:
        """The client of the running event loop (a redis.asyncio client serves one loop)."""
        loop = asyncio.get_running_loop()
        if self._client is None or self._loop is not loop:
            import redis.asyncio as aioredis

            self._client = aioredis.Redis.from_url(lower_scheme(self.url), socket_timeout=self.timeout,
                                                   socket_connect_timeout=self.timeout)
            self._scripts = {name: self._client.register_script(source) for name, source in
                             (("admit", _ADMIT), ("release", _RELEASE), ("renew", _RENEW), ("void", _VOID))}
            self._loop = loop
            self._renewer = None
        return self._client

    async def _run(self, script: str, keys: list[str], args: list[Any]) -> list:
        import redis

        if not self.available:
            raise LimitStoreUnavailable(f"the limits store {self.shown} is taken for down until its next try")
        self._client_here()
        try:
            reply = await asyncio.wait_for(self._scripts[script](keys=keys, args=args), self.timeout)
        except (redis.exceptions.RedisError, OSError, asyncio.TimeoutError) as e:
            self._failed(e)
            raise LimitStoreUnavailable(f"the limits store {self.shown} did not answer: {_describe(e)}") from None
        if self._down_since is not None:
            logger.info("limits store %s answers again after %.0f s: tenants' limits are shared again", self.shown,
                        time.monotonic() - self._down_since)
            self._down_since = None
        return reply

    def _failed(self, error: BaseException) -> None:
        self.failures += 1
        if self.on_failure is not None:
            self.on_failure()
        now = time.monotonic()
        self._down_until = now + self.retry_after
        if self._down_since is None:
            self._down_since = now
            logger.warning("limits store %s did not answer (%s): each process limits its tenants on its own until "
                           "it does (next try in %g s); check that Redis runs and this host reaches it",
                           self.shown, _describe(error), self.retry_after)

    def _start_renewing(self) -> None:
        if self._renewer is None or self._renewer.done():
            self._renewer = asyncio.get_running_loop().create_task(self._renew_forever())

    async def _renew_forever(self) -> None:
        while self._held:
            await asyncio.sleep(self.renew_every)
            try:
                await self.renew()
            except LimitStoreUnavailable:
                pass  # logged once by _failed; the leases lapse if Redis stays away
            except Exception:  # never let renewing end on a surprise: leases would lapse silently
                logger.exception("renewing the leases of requests in flight in %s failed", self.shown)


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _describe(error: BaseException) -> str:
    if isinstance(error, asyncio.TimeoutError):
        return "no answer in time"
    return f"{type(error).__name__}: {error}" if str(error) else type(error).__name__


def limit_store_from_args(url: str | None, role: str, has_tenants: bool) -> LimitStore | None:
    """The store `--limits-store URL` names (None without one), its URL checked and Redis asked
    once: a store that does not answer at start is a warning, not an error, since limits then
    work per process until it does."""
    if url is None:
        return None
    from tierlm.config import check_redis_url

    if not url.strip():
        raise ValueError("--limits-store is empty (an unset variable?); give redis://HOST:PORT/DB, or leave it "
                         "out for limits per process")
    if not has_tenants:
        raise ValueError("--limits-store needs --tenants: the limits it shares are the tenants file's")
    check_redis_url(url, option="--limits-store")
    store = LimitStore(url, role=role)
    import redis

    client = redis.Redis.from_url(lower_scheme(url), socket_timeout=store.timeout, socket_connect_timeout=store.timeout)
    try:
        client.ping()
    except (redis.exceptions.RedisError, OSError) as e:
        logger.warning("limits store %s does not answer now (%s): each process limits its tenants on its own "
                       "until it does", store.shown, _describe(e))
    else:
        logger.info("tenants' limits shared through %s", store.shown)
        _warn_if_it_evicts(client, store.shown)
    finally:
        client.close()
    return store


def check_apart_from_kv_cache(url: str | None, kv_remote: str | None) -> None:
    """Refuse a --limits-store on the Redis server that --kv-remote names (in any database:
    memory and eviction are the server's). The KV tier fills its server by design and is
    bounded by eviction, which takes the limits' keys too (they have TTLs): a tenant's bucket
    evicted reads as full, so one held to 3 requests a minute was let in a 4th time."""
    if url and kv_remote and redis_server_of(url) == redis_server_of(kv_remote):
        raise ValueError(f"--limits-store {redact_url(url)} is on the Redis server of --kv-remote "
                         f"{redact_url(kv_remote)}: the KV cache fills that server and its eviction would drop "
                         "tenants' limits; give --limits-store a Redis server of its own")


def _warn_if_it_evicts(client: Any, shown: str) -> None:
    """A limits store on a server that evicts when full (a KV cache's Redis started elsewhere,
    or an LRU policy) loses tenants' buckets and holds: say so at start."""
    import redis

    try:
        conf = client.config_get("maxmemory*")
    except (redis.exceptions.RedisError, OSError):  # CONFIG disabled (managed services): nothing to tell
        return
    policy = str(conf.get("maxmemory-policy", "noeviction"))
    if int(conf.get("maxmemory", 0) or 0) and policy != "noeviction":
        logger.warning("limits store %s: the server evicts keys when full (maxmemory-policy %s), and a tenant's "
                       "evicted limits read as unused, so tenants may exceed them; give the limits store a Redis "
                       "with maxmemory-policy noeviction, apart from any KV cache", shown, policy)
