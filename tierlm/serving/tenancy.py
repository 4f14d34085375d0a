"""Tenants: who owns which API keys, at what tier, within which limits.

A tenants file (`tierlm serve --tenants FILE`, TOML) groups the keys file's key ids into tenants:

    default_tier = "bronze"            # the tier of keys no tenant names (each its own tenant)

    [tiers.gold]                       # gold, silver and bronze exist with priorities 0, 1, 2;
    priority = 0                       # a table here changes them or adds a tier
    requests_per_minute = 600          # limits set on a tier are its tenants' defaults
    ttft_target_ms = 2000              # the SLA guard sheds what would wait longer (sla.py)
    breaker = { min_outcomes = 4 }     # its breaker's own settings (breaker.py); false: none

    [tenants.acme]
    tier = "gold"
    keys = ["acme-prod", "acme-dev"]   # key ids from the keys file; a key belongs to one tenant
    tokens_per_minute = 100000         # overrides the tier's
    max_concurrent = 8
    weight = 2                         # twice the share of a weight-1 tenant of its tier (default 1)
    kv_share = 0.5                     # its running requests hold at most half the KV cache
    kv_cache_share = 0.2               # its cached prefixes keep a fifth of it as their own partition
    max_batch_requests = 100000        # its batches' requests not yet finished, at most (a tier may set it too)
    models = ["base", "acme-support"]  # the models (LoRA adapters too) it may use; others are a 404 to it

A request is admitted for its key's tenant: the engine runs it at the tier's priority (a lower
number runs first, and is preempted last), in fair shares with the other tenants of its tier
(engine/fairness.py: the least-served tenant goes next), its prefix cache is salted per tenant (a
tenant's keys share cached prefixes, tenants never do), and the tenant's limits are checked:

- requests_per_minute and tokens_per_minute are token buckets holding a minute's worth and
  refilled continuously. A request takes one request. Tokens (the whole prompt, cached part
  included, plus every choice's output) are charged post-paid, when the request ends, because
  only then are they known: a tenant may overshoot by what its requests in flight use, and is
  then refused until the bucket has refilled past that debt.
- max_concurrent counts requests in flight, from admission until the response has ended (a
  stream's last event, a client gone, an error).
- max_batch_requests counts the requests of the tenant's batches (Anthropic's message batches and
  OpenAI's batches, batches.py) that have not finished; a batch that would pass it is refused
  whole (429) when it is created. Batches' requests are not charged to the other limits.

A refused request is a 429 in its API's shape with `retry-after` (and `retry-after-ms`): the
seconds until the limit would admit it. Limited tenants' responses carry the rate-limit headers
of the client's SDK family (Anthropic's `anthropic-ratelimit-*`, OpenAI's `x-ratelimit-*`).

The limits are each process's own, unless `--limits-store redis://...` names a Redis that every
server (or router) serving the tenants shares: then each limit holds across all of them
(limit_store.py), and falls back to each process's own while that Redis does not answer.

Only requests that run the model (`GENERATION_ROUTES`: generation and embeddings) are limited;
every request is attributed.
Without a tenants file each key is a tenant of its own at priority 0, with no limits.
"""
from __future__ import annotations

import asyncio
import math
import time
import tomllib
import uuid
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping

from starlette.datastructures import MutableHeaders
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from tierlm.serving.breaker import BreakerSettings
from tierlm.serving.errors import ApiStyle, RateLimited
from tierlm.serving.limit_store import LimitStore, LimitStoreUnavailable

DEFAULT_TIERS = {"gold": 0, "silver": 1, "bronze": 2}  # tier → engine priority (lower runs first)
LIMIT_FIELDS = ("requests_per_minute", "tokens_per_minute", "max_concurrent")


@dataclass(frozen=True)
class Limits:
    """A tenant's limits (None: unlimited)."""

    requests_per_minute: int | None = None
    tokens_per_minute: int | None = None
    max_concurrent: int | None = None

    def over(self, defaults: "Limits") -> "Limits":
        """These limits, each unset one taken from `defaults` (a tenant's over its tier's)."""
        return Limits(*(getattr(self, f) if getattr(self, f) is not None else getattr(defaults, f)
                        for f in LIMIT_FIELDS))

    @property
    def any(self) -> bool:
        return any(getattr(self, f) is not None for f in LIMIT_FIELDS)


@dataclass(frozen=True)
class Tier:
    name: str
    priority: int
    limits: Limits = Limits()
    weight: float = 1.0  # each tenant's share among the tenants of this priority, unless it sets its own
    kv_share: float | None = None  # each tenant's KV quota, unless it sets its own
    ttft_target_s: float | None = None  # the SLA guard's time-to-first-token target (serving/sla.py)
    # Its requests' circuit breaker (serving/breaker.py): own settings, False for none, None for
    # the server's (--sla-breaker).
    breaker: BreakerSettings | bool | None = None
    max_batch_requests: int | None = None  # each tenant's, unless it sets its own
    models: frozenset[str] | None = None  # each tenant's, unless it sets its own (None: every model)
    kv_cache_share: float | None = None  # each tenant's cache partition, unless it sets its own


@dataclass(frozen=True)
class Tenant:
    """`id` None: no tenants file and no key (--no-auth): the request is nobody's."""

    id: str | None
    tier: str | None
    priority: int
    cache_salt: str | None
    limits: Limits = Limits()
    weight: float = 1.0  # its share of the engine among the tenants of its priority (engine/fairness.py)
    kv_share: float | None = None  # the most of each engine's device KV pool it may hold (engine/quotas.py)
    ttft_target_s: float | None = None  # its tier's time-to-first-token target (serving/sla.py)
    breaker: BreakerSettings | bool | None = None  # its tier's breaker settings (Tier.breaker)
    #: The most requests of its batches (both batch APIs) not yet finished, across all of them
    max_batch_requests: int | None = None
    #: The models it may use (names of base models and LoRA adapters); None: every one served
    models: frozenset[str] | None = None
    #: The share of each engine's device KV pool its cached prefixes keep as a partition of their
    #: own, safe from other tenants' traffic (kv/block_pool.py); None: ranked with everyone's
    kv_cache_share: float | None = None


@dataclass(frozen=True)
class TenantsConfig:
    tiers: dict[str, Tier]
    tenants: dict[str, Tenant]
    key_owner: dict[str, str]  # key id → tenant id (only keys a tenant names)
    default_tier: str

    @classmethod
    def from_file(cls, path: str | Path, key_ids: Iterable[str]) -> "TenantsConfig":
        path = Path(path)
        try:
            raw = path.read_bytes()
            data = tomllib.loads(raw.decode("utf-8"))  # TOML is UTF-8, whatever the locale says
        except OSError as exc:
            raise ValueError(f"cannot read tenants file {path}: {exc.strerror}") from None
        except UnicodeDecodeError as exc:  # (a ValueError: it said which byte, not which file)
            line = raw.count(b"\n", 0, exc.start) + 1
            column = exc.start - raw.rfind(b"\n", 0, exc.start)
            raise ValueError(f"{path}: not valid TOML: a TOML file is UTF-8; this one is not (byte "
                             f"0x{raw[exc.start]:02x} at line {line}, column {column}): save it as UTF-8") from None
        except tomllib.TOMLDecodeError as exc:  # its message names the line and column
            raise ValueError(f"{path}: not valid TOML: {exc}") from None
        return cls.parse(data, key_ids, source=str(path))

    @classmethod
    def parse(cls, data: Mapping[str, Any], key_ids: Iterable[str], source: str = "tenants file") -> "TenantsConfig":
        """A checked config; a mistake is a ValueError naming the file, the field and the fix."""

        def fail(where: str, what: str) -> ValueError:
            return ValueError(f"{source}: {where}: {what}")

        known_keys = set(key_ids)
        _only(data, {"default_tier", "tiers", "tenants"}, "", fail)
        tiers = {name: Tier(name, priority) for name, priority in DEFAULT_TIERS.items()}
        for name, table in _table(data, "tiers", fail).items():
            if not name:
                raise fail('tiers.""', "a tier needs a name (429s name it); write [tiers.NAME]")
            where = f"tiers.{name}"
            table = _as_table(table, where, fail)
            _only(table, {"priority", "weight", "kv_share", "kv_cache_share", "ttft_target_ms", "breaker",
                          "max_batch_requests", "models", *LIMIT_FIELDS}, where, fail)
            priority = table.get("priority", DEFAULT_TIERS.get(name))
            if priority is None:
                raise fail(f"{where}.priority", "a tier other than gold, silver and bronze needs a priority "
                                                 "(an integer; lower runs first: gold is 0, bronze 2)")
            if isinstance(priority, bool) or not isinstance(priority, int):
                raise fail(f"{where}.priority", f"must be an integer (got {priority!r}); lower runs first")
            tiers[name] = Tier(name, priority, _limits(table, where, fail), _weight(table, where, fail, 1.0),
                               _kv_share(table, where, fail, None), _ttft_target(table, where, fail),
                               _breaker(table, where, fail), _max_batch_requests(table, where, fail, None),
                               _models(table, where, fail, None),
                               _kv_share(table, where, fail, None, "kv_cache_share"))
        default_tier = _tier_name(data.get("default_tier", "bronze"), "default_tier", tiers, fail)

        tenants: dict[str, Tenant] = {}
        key_owner: dict[str, str] = {}
        for name, table in _table(data, "tenants", fail).items():
            if not name:  # (telemetry reads "" as no tenant: `default`)
                raise fail('tenants.""', "a tenant needs a name (429s, logs and the tenant label of /metrics name "
                                         "it); write [tenants.NAME]")
            if name == "default":  # (the tenant label of requests without one: 401s, --no-auth)
                raise fail("tenants.default", "'default' is the metrics label of requests that have no tenant; "
                                              "give this tenant another name")
            where = f"tenants.{name}"
            table = _as_table(table, where, fail)
            _only(table, {"tier", "keys", "weight", "kv_share", "kv_cache_share", "max_batch_requests", "models",
                          *LIMIT_FIELDS}, where, fail)
            tier_name = _tier_name(table.get("tier", default_tier), f"{where}.tier", tiers, fail,
                                   " or define it under [tiers]")
            keys = table.get("keys")
            if not isinstance(keys, list) or not keys or not all(isinstance(k, str) for k in keys):
                raise fail(f"{where}.keys", "list the ids of the keys this tenant owns, e.g. keys = [\"acme-prod\"] "
                                            "(ids from the keys file)")
            for key in keys:
                if key not in known_keys:
                    raise fail(f"{where}.keys", f"key id {key!r} is not in the keys file; add its line there "
                                                f"(`echo -n \"$KEY\" | python -m tierlm.serving.auth {key}`) or "
                                                "remove it here")
                if key_owner.get(key) == name:
                    raise fail(f"{where}.keys", f"key id {key!r} is listed twice; list each key once")
                if key in key_owner:
                    raise fail(f"{where}.keys", f"key id {key!r} already belongs to tenant {key_owner[key]!r}; "
                                                "a key belongs to one tenant: remove it from one of them")
                key_owner[key] = name
            tier = tiers[tier_name]
            tenants[name] = Tenant(name, tier_name, tier.priority, f"tenant\x1f{name}",
                                   _limits(table, where, fail).over(tier.limits),
                                   _weight(table, where, fail, tier.weight), _kv_share(table, where, fail, tier.kv_share),
                                   tier.ttft_target_s, tier.breaker,
                                   _max_batch_requests(table, where, fail, tier.max_batch_requests),
                                   _models(table, where, fail, tier.models),
                                   _kv_share(table, where, fail, tier.kv_cache_share, "kv_cache_share"))
        for key in sorted(known_keys - key_owner.keys()):
            if key in tenants:  # a lone key is the tenant named after it: one id, two tenants
                raise fail(f"tenants.{key}", f"this tenant has the name of key {key!r}, which is in no tenant "
                                             f"(and so would be a tenant of its own named {key!r}); add the key to "
                                             "its keys, or rename the tenant")
            if key == "default":  # as for [tenants.default]: its requests and 401s would count as one
                raise fail("tenants", "key 'default' is in no tenant, so it would be a tenant of its own named "
                                   "'default', the metrics label of requests that have no tenant; add it to a "
                                   "tenant's keys")
        config = cls(tiers, tenants, key_owner, default_tier)
        _check_cache_shares(config, known_keys, fail)
        return config

    def tenant_of(self, key_id: str) -> Tenant:
        owner = self.key_owner.get(key_id)
        if owner is not None:
            return self.tenants[owner]
        tier = self.tiers[self.default_tier]  # a key no tenant names: a tenant of its own
        return Tenant(key_id, tier.name, tier.priority, _key_salt(key_id), tier.limits, tier.weight, tier.kv_share,
                      tier.ttft_target_s, tier.breaker, tier.max_batch_requests, tier.models, tier.kv_cache_share)


def _check_cache_shares(config: TenantsConfig, key_ids: set[str], fail: Callable[[str, str], ValueError]) -> None:
    """Cache partitions are carved out of one pool: together they may take all of it, not more
    (each partition's blocks are safe from the others' traffic only while they all fit). Keys no
    tenant names are each a tenant of the default tier, with its share."""
    shares = {name: t.kv_cache_share for name, t in config.tenants.items() if t.kv_cache_share is not None}
    lone = len(key_ids - config.key_owner.keys())
    default = config.tiers[config.default_tier].kv_cache_share
    total = sum(shares.values()) + (lone * default if default is not None else 0.0)
    if total > 1 + 1e-9:
        parts = [f"{name} {v:g}" for name, v in sorted(shares.items())]
        if lone and default is not None:
            parts.append(f"{lone} key(s) in no tenant, {default:g} each (tier {config.default_tier})")
        raise fail("kv_cache_share", f"the tenants' cache partitions add up to {total:g} of the KV pool ("
                                     f"{', '.join(parts)}); they must fit in it together (at most 1): lower them")


def _key_salt(key_id: str) -> str:
    # A lone key's salt is the one each key had before tenants existed, so its cached prefixes
    # (disk and Redis tiers outlive the process) stay its own; "key" and "tenant" salts never meet.
    return f"key\x1f{key_id}"


def _tier_name(value: Any, where: str, tiers: Mapping[str, Tier], fail: Callable[[str, str], ValueError],
               hint: str = "") -> str:
    names = ", ".join(sorted(tiers))
    if not isinstance(value, str):  # (a list or table is no dict key: checked before the lookup)
        raise fail(where, f"must be the name of a tier (a string) such as \"bronze\" (got {value!r}); "
                          f"use one of {names}{hint}")
    if value not in tiers:
        raise fail(where, f"no tier named {value!r}; use one of {names}{hint}")
    return value


def _table(data: Mapping[str, Any], name: str, fail: Callable[[str, str], ValueError]) -> dict[str, Any]:
    value = data.get(name, {})
    if not isinstance(value, dict):
        raise fail(name, f"must be a table ([{name}.NAME] sections)")
    return value


def _as_table(value: Any, where: str, fail: Callable[[str, str], ValueError]) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise fail(where, f"must be a table: write it as a [{where}] section")
    return value


def _only(table: Mapping[str, Any], allowed: set[str], where: str, fail: Callable[[str, str], ValueError]) -> None:
    for name in table:
        if name not in allowed:
            raise fail(f"{where}.{name}" if where else name,
                       f"unknown field; use {', '.join(sorted(allowed))}")


def _limits(table: Mapping[str, Any], where: str, fail: Callable[[str, str], ValueError]) -> Limits:
    values: dict[str, int] = {}
    for name in LIMIT_FIELDS:
        if name in table:
            value = table[name]
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise fail(f"{where}.{name}", f"must be a whole number of at least 1 (got {value!r}); "
                                              "leave it out for no limit")
            values[name] = value
    return Limits(**values)


def _weight(table: Mapping[str, Any], where: str, fail: Callable[[str, str], ValueError], default: float) -> float:
    value = table.get("weight", default)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.01 <= value <= 100:
        raise fail(f"{where}.weight", f"must be a number from 0.01 to 100 (got {value!r}); a tenant of weight 2 "
                                      "gets twice the share of one of weight 1 among the tenants of its priority")
    return float(value)


def _max_batch_requests(table: Mapping[str, Any], where: str, fail: Callable[[str, str], ValueError],
                        default: int | None) -> int | None:
    value = table.get("max_batch_requests", default)
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        raise fail(f"{where}.max_batch_requests", f"must be a whole number of at least 1 (got {value!r}): the most "
                                                  "requests of the tenant's batches not yet finished at once")
    return value


def _models(table: Mapping[str, Any], where: str, fail: Callable[[str, str], ValueError],
            default: frozenset[str] | None) -> frozenset[str] | None:
    """The model names a tenant may use. Not checked against what is served: adapters may be
    loaded later (/v1/load_lora_adapter), and a name served by nobody just finds nothing."""
    if "models" not in table:
        return default
    value = table["models"]
    if not isinstance(value, list) or not value or not all(isinstance(m, str) and m for m in value):
        raise fail(f"{where}.models", f"list the names of the models (and LoRA adapters) it may use, e.g. models = "
                                      f"[\"base\", \"acme-support\"] (got {value!r}); leave it out for every model")
    return frozenset(value)


_SHARE_MEANS = {"kv_share": "the most of each model's KV cache the tenant's running requests may hold",
                "kv_cache_share": "the part of each model's KV cache the tenant's cached prefixes keep as their own"}


def _kv_share(table: Mapping[str, Any], where: str, fail: Callable[[str, str], ValueError],
              default: float | None, field: str = "kv_share") -> float | None:
    value = table.get(field, default)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= 1:
        raise fail(f"{where}.{field}", f"must be a fraction above 0 and at most 1 (got {value!r}): "
                                       f"{_SHARE_MEANS[field]}")
    return float(value)


def _ttft_target(table: Mapping[str, Any], where: str, fail: Callable[[str, str], ValueError]) -> float | None:
    value = table.get("ttft_target_ms")
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 1 <= value <= 3_600_000:
        raise fail(f"{where}.ttft_target_ms", f"must be a number of milliseconds from 1 to 3600000 (got {value!r}): "
                                              "the time to first token this tier's requests are promised")
    return value / 1000.0


# A tier's `breaker` table: its keys, as BreakerSettings' fields (times in ms in the file).
_BREAKER_FIELDS = {"window": "window", "horizon_ms": "horizon_s", "min_outcomes": "min_outcomes",
                   "trip_fraction": "trip_fraction", "cooldown_ms": "cooldown_s", "max_cooldown_ms": "max_cooldown_s",
                   "probes": "probes"}


def _breaker(table: Mapping[str, Any], where: str, fail: Callable[[str, str], ValueError]) -> BreakerSettings | bool | None:
    """A tier's circuit breaker: `breaker = false` (none), a table of the settings to change
    from the defaults, or nothing (the server's)."""
    value = table.get("breaker")
    where = f"{where}.breaker"
    if value is None:
        return None
    if value is False:
        return False
    if not isinstance(value, dict):
        raise fail(where, f"must be false (no breaker for this tier) or a table of settings such as "
                          f"{{ min_outcomes = 4, cooldown_ms = 500 }} (got {value!r})")
    _only(value, set(_BREAKER_FIELDS), where, fail)
    settings: dict[str, Any] = {}
    for key, name in _BREAKER_FIELDS.items():
        if key not in value:
            continue
        v = value[key]
        if name in ("window", "min_outcomes", "probes"):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise fail(f"{where}.{key}", f"must be a whole number of at least 1 (got {v!r})")
        elif isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
            raise fail(f"{where}.{key}", f"must be a number above 0 (got {v!r})")
        settings[name] = v / 1000.0 if key.endswith("_ms") else v
    merged = {**BreakerSettings().__dict__, **settings}
    if merged["min_outcomes"] > merged["window"]:
        raise fail(where, f"min_outcomes ({merged['min_outcomes']}) must be at most window ({merged['window']}, "
                          "the outcomes kept)")
    if merged["trip_fraction"] > 1:
        raise fail(f"{where}.trip_fraction", f"must be a share above 0 and at most 1 (got {merged['trip_fraction']!r})")
    if merged["cooldown_s"] > merged["max_cooldown_s"]:
        raise fail(where, f"cooldown_ms ({merged['cooldown_s'] * 1000:g}) must be at most max_cooldown_ms "
                          f"({merged['max_cooldown_s'] * 1000:g})")
    return BreakerSettings(**settings)


# ---- limiting ----------------------------------------------------------------------------


class TokenBucket:
    """`per_minute` units, refilled continuously up to per_minute. Its level may go below zero:
    post-paid charges are debts the refill pays off. (Rates are kept as per-minute integers, so
    a bucket of 2 a minute is due exactly 30 s after it emptied.)"""

    def __init__(self, per_minute: int, now: float) -> None:
        self.per_minute = per_minute
        self._level = float(per_minute)
        self._at = now

    def level(self, now: float) -> float:
        if now > self._at:
            self._level = min(float(self.per_minute), self._level + (now - self._at) * self.per_minute / 60.0)
            self._at = now
        return self._level

    def take(self, amount: float, now: float) -> None:
        self._level = self.level(now) - amount

    def give_back(self, amount: float, now: float) -> None:
        """Undo a `take` of `amount` (never past a full bucket)."""
        self._level = min(float(self.per_minute), self.level(now) + amount)

    def wait(self, now: float) -> float:
        """Seconds until the bucket holds a whole unit (0: it does now)."""
        return max(0.0, (1.0 - self.level(now)) * 60.0 / self.per_minute)


@dataclass
class _Usage:
    """One tenant's buckets and requests in flight."""

    requests: TokenBucket | None
    tokens: TokenBucket | None
    in_flight: int = 0


@dataclass
class Ticket:
    """An admitted request's hold on its tenant's limits; `release` once, when it has ended.
    `shared`: its id in the limits store, when the store admitted it."""

    tenancy: "Tenancy"
    tenant: Tenant
    headers: dict[str, str] = field(default_factory=dict)  # rate-limit headers for its response
    shared: str | None = None
    released: bool = False

    async def release(self, tokens: int, refund_request: bool = False) -> None:
        """`refund_request`: the server refused it for its own load (the SLA guard shed it), so
        its requests_per_minute unit is given back: a client that retries after each 529 / 503,
        as both SDKs do, would otherwise spend its minute's requests on refusals."""
        if self.released:
            return
        self.released = True
        await self.tenancy._release(self, tokens, refund_request)


class TenantRateLimited(RateLimited):
    """A 429 for a tenant over one of its limits (`reason`: requests, tokens or concurrency)."""

    def __init__(self, message: str, *, tenant: str, reason: str, retry_after: float,
                 headers: dict[str, str]) -> None:
        retry_after = round(retry_after, 3)  # (30.000000000000004 s is 30 s, not 31)
        super().__init__(message, retry_after=math.ceil(retry_after),
                         headers={**headers, "retry-after-ms": str(max(1, math.ceil(retry_after * 1000)))})
        self.tenant, self.reason = tenant, reason


class Tenancy:
    """Maps keys to tenants and holds each tenant's limits; lives as long as the server.

    The limits are this process's own, or, with a `store` (limit_store.LimitStore: one Redis),
    shared with every process pointed at it; while the store does not answer, this process's
    own again. `clock` (monotonic seconds) drives the in-process buckets: tests pass one they
    can move. Everything runs on the event loop, so no lock is needed.
    """

    def __init__(self, config: TenantsConfig | None = None, *, clock: Callable[[], float] = time.monotonic,
                 wall_clock: Callable[[], float] = time.time, store: "LimitStore | None" = None) -> None:
        self.config = config
        self.clock = clock
        self.wall_clock = wall_clock
        self.store = store
        self._usage: dict[str, _Usage] = {}
        self._shared_in_flight: dict[str, int] = {}  # tenant id → this process's requests the store holds
        self._releasing: set[asyncio.Task] = set()
        # Told of every refusal (tenant id, reason): build_app counts them in /metrics.
        self.on_refused: Callable[[str, str], None] | None = None

    @classmethod
    def from_file(cls, path: str | Path, key_ids: Iterable[str], **kwargs: Any) -> "Tenancy":
        return cls(TenantsConfig.from_file(path, key_ids), **kwargs)

    def tenant_of(self, api_key_id: str | None) -> Tenant:
        if self.config is None or api_key_id is None:
            # No tenants file: each key a tenant of its own for the cache, unnamed and unlimited
            # (the label `default` in /metrics), as before tenants existed.
            return Tenant(None, None, 0, None if api_key_id is None else _key_salt(api_key_id))
        return self.config.tenant_of(api_key_id)

    def in_flight(self, tenant_id: str) -> int:
        """This process's requests of `tenant_id` that hold a slot (in the store or here)."""
        usage = self._usage.get(tenant_id)
        return (usage.in_flight if usage is not None else 0) + self._shared_in_flight.get(tenant_id, 0)

    async def admit(self, tenant: Tenant, style: ApiStyle) -> Ticket | None:
        """Take one request of `tenant`'s limits, or raise TenantRateLimited (nothing taken).
        None: the tenant has no limits."""
        limits = tenant.limits
        if tenant.id is None or not limits.any:
            return None
        if self.store is not None and self.store.available:
            ticket_id = uuid.uuid4().hex
            try:
                said = await self.store.admit(tenant.id, limits.requests_per_minute, limits.tokens_per_minute,
                                              limits.max_concurrent, ticket_id)
            except LimitStoreUnavailable:
                pass  # logged by the store: this process's own limits until it answers again
            else:
                headers = self._headers(limits, style, said.requests_level, said.tokens_level)
                if not said.admitted:
                    raise self._refusal(tenant, said.reason, said.wait, headers)
                self._shared_in_flight[tenant.id] = self._shared_in_flight.get(tenant.id, 0) + 1
                return Ticket(self, tenant, headers, shared=ticket_id)
        return self.admit_here(tenant, style)

    def admit_here(self, tenant: Tenant, style: ApiStyle) -> Ticket | None:
        """`admit` against this process's own limits only."""
        limits = tenant.limits
        if tenant.id is None or not limits.any:
            return None
        usage = self._usage_of(tenant)
        now = self.clock()
        waits: list[tuple[str, float]] = []  # (reason, seconds)
        if usage.requests is not None and (wait := usage.requests.wait(now)) > 0:
            waits.append(("requests", wait))
        if usage.tokens is not None and (wait := usage.tokens.wait(now)) > 0:
            waits.append(("tokens", wait))
        if limits.max_concurrent is not None and usage.in_flight >= limits.max_concurrent:
            # When a slot frees is not known: a second is a guess that costs a client little.
            waits.append(("concurrency", 1.0))
        if waits:
            # The limit that holds the request longest is the one named, with the wait the
            # retry-after header gives (whole seconds, at least 1).
            reason, retry_after = max(waits, key=lambda w: w[1])
            raise self._refusal(tenant, reason, retry_after, self._local_headers(usage, limits, style, now))
        if usage.requests is not None:
            usage.requests.take(1, now)
        usage.in_flight += 1
        return Ticket(self, tenant, self._local_headers(usage, limits, style, now))

    def _refusal(self, tenant: Tenant, reason: str, retry_after: float, headers: dict[str, str]) -> TenantRateLimited:
        assert tenant.id is not None
        limits = tenant.limits
        what = {"requests": f"{limits.requests_per_minute} requests per minute",
                "tokens": f"{limits.tokens_per_minute} tokens per minute (prompt and output, charged when each "
                          "request ends)",
                "concurrency": f"{limits.max_concurrent} requests at a time"}[reason]
        if self.on_refused is not None:
            self.on_refused(tenant.id, reason)
        return TenantRateLimited(
            f"tenant '{tenant.id}' ({tenant.tier} tier) is over its limit of {what}; retry after "
            f"{max(1, math.ceil(round(retry_after, 3)))} s", tenant=tenant.id, reason=reason,
            retry_after=retry_after, headers=headers)

    def _usage_of(self, tenant: Tenant) -> _Usage:
        assert tenant.id is not None
        usage = self._usage.get(tenant.id)
        if usage is None:
            now = self.clock()
            limits = tenant.limits
            usage = self._usage[tenant.id] = _Usage(
                TokenBucket(limits.requests_per_minute, now) if limits.requests_per_minute else None,
                TokenBucket(limits.tokens_per_minute, now) if limits.tokens_per_minute else None)
        return usage

    async def _release(self, ticket: Ticket, tokens: int, refund_request: bool = False) -> None:
        tenant = ticket.tenant
        assert tenant.id is not None
        if ticket.shared is None:
            usage = self._usage[tenant.id]
            usage.in_flight -= 1
            if usage.tokens is not None and tokens > 0:
                usage.tokens.take(tokens, self.clock())
            if usage.requests is not None and refund_request:
                usage.requests.give_back(1, self.clock())
            return
        self._shared_in_flight[tenant.id] -= 1
        assert self.store is not None
        # Shielded: a request cancelled as it ends (its client gone) still frees its slot in the
        # store, and pays for its tokens, rather than holding the slot until its lease lapses.
        task = asyncio.ensure_future(self._release_shared(ticket, tokens, refund_request))
        self._releasing.add(task)
        task.add_done_callback(self._releasing.discard)
        await asyncio.shield(task)

    async def _release_shared(self, ticket: Ticket, tokens: int, refund_request: bool = False) -> None:
        assert self.store is not None and ticket.shared is not None and ticket.tenant.id is not None
        limits = ticket.tenant.limits
        try:
            await self.store.release(ticket.tenant.id, limits.tokens_per_minute, ticket.shared, tokens,
                                     refund_rpm=limits.requests_per_minute if refund_request else None)
        except LimitStoreUnavailable:
            pass  # the slot's lease lapses in the store; these tokens go uncharged

    async def close(self) -> None:
        """Finish releases under way and close the store's connection (at shutdown)."""
        if self._releasing:
            await asyncio.gather(*self._releasing, return_exceptions=True)
        if self.store is not None:
            await self.store.close()

    def _local_headers(self, usage: _Usage, limits: Limits, style: ApiStyle, now: float) -> dict[str, str]:
        return self._headers(limits, style, usage.requests.level(now) if usage.requests is not None else None,
                             usage.tokens.level(now) if usage.tokens is not None else None)

    def _headers(self, limits: Limits, style: ApiStyle, requests_level: float | None,
                 tokens_level: float | None) -> dict[str, str]:
        """The rate-limit headers of the client's SDK family: limit, what remains now, and when
        the bucket is full again (Anthropic: an RFC 3339 time; OpenAI: a duration, "6m0s")."""
        headers: dict[str, str] = {}
        for kind, level, limit in (("requests", requests_level, limits.requests_per_minute),
                                   ("tokens", tokens_level, limits.tokens_per_minute)):
            if level is None or limit is None:
                continue
            # (never past the limit: a float level rounds a limit past 2**53 up)
            remaining = str(min(limit, max(0, math.floor(level))))
            full_in = max(0.0, (limit - level) * 60.0 / limit)
            if style == "anthropic":
                headers[f"anthropic-ratelimit-{kind}-limit"] = str(limit)
                headers[f"anthropic-ratelimit-{kind}-remaining"] = remaining
                headers[f"anthropic-ratelimit-{kind}-reset"] = _rfc3339(self.wall_clock() + full_in)
            else:
                headers[f"x-ratelimit-limit-{kind}"] = str(limit)
                headers[f"x-ratelimit-remaining-{kind}"] = remaining
                headers[f"x-ratelimit-reset-{kind}"] = _duration(full_in)
        return headers


def _rfc3339(epoch: float) -> str:
    return datetime.fromtimestamp(math.ceil(epoch), timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def _duration(seconds: float) -> str:
    """OpenAI's reset format: "20ms", "1.5s", "6m0s"."""
    if seconds < 1:
        return f"{math.ceil(seconds * 1000)}ms"
    minutes, rest = divmod(round(seconds, 3), 60)
    return f"{int(minutes)}m{rest:g}s" if minutes else f"{rest:g}s"


class TenancyMiddleware:
    """Ends each admitted request's hold on its tenant's limits when its response ends, charging
    the tokens telemetry counted for it, and adds the ticket's rate-limit headers to the response.

    The hold ends just before the response's last bytes are sent, so a client that reads a whole
    answer and at once sends the next request finds its slot free; a response that never gets
    there (a client gone, an error, a cancellation) ends it when the app returns or raises.
    It must sit inside `TelemetryMiddleware`, whose per-request counts it reads.
    """

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        state = scope.setdefault("state", {})

        async def release() -> None:
            ticket = state.pop(TICKET, None)
            if ticket is not None:
                # Usage as the response reports it: the prompt once, every choice's output; a
                # request that ended before its first token (queued, in a long prefill, its
                # client gone) still pays for the prompt it handed the engine.
                observed = state.get("telemetry")
                prompt = max(observed.num_prompt_tokens, getattr(observed, "submitted_prompt_tokens", 0)) if observed else 0
                await ticket.release((prompt + observed.num_output_tokens) if observed else 0,
                                     refund_request=bool(observed and observed.shed))

        async def send_and_release(message: Message) -> None:
            ticket = state.get(TICKET)
            if ticket is not None:
                if message["type"] == "http.response.start" and ticket.headers:
                    headers = MutableHeaders(scope=message)
                    for name, value in ticket.headers.items():
                        headers[name] = value
                elif message["type"] == "http.response.body" and not message.get("more_body", False):
                    await release()
            await send(message)

        try:
            await self.app(scope, receive, send_and_release)
        finally:
            await release()


TICKET = "tenancy_ticket"  # where ServerState.admit leaves a request's Ticket in the ASGI scope's state
