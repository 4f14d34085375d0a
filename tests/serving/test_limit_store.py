"""Tenants' limits shared through a real redis-server (tierlm/serving/limit_store.py,
`--limits-store`): the store's scripts against an exact reference of the buckets and leases,
admissions racing from two processes' worth of clients, leases that lapse when their holder
dies, an outage (and a Redis that never answers) falling back to per-process limits without
failing a request, and two real servers holding one tenant to one limit through both SDKs."""
from __future__ import annotations

import asyncio
import logging
import socket
import threading
import time
import tomllib
import uuid
from dataclasses import dataclass, field
from typing import Any

import anthropic
import httpx
import openai
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.conftest import RedisServer
from tests.serving.harness import ServerThread, slow_steps, wait_until
from tests.serving.scripted_model import LOOP_MODEL, TEXT_MODEL
from tests.serving.test_cli import free_port, serve
from tests.serving.test_telemetry import value
from tierlm.serving.app import build_app
from tierlm.serving.auth import ApiKeyAuth
from tierlm.serving.limit_store import UNIT, LimitStore, StoreAdmission
from tierlm.serving.tenancy import Tenancy, TenantRateLimited, TenantsConfig

KEYS = {"a": "sk-tenant-a", "b": "sk-tenant-b"}
HI = [{"role": "user", "content": "Hi"}]


class Clock:
    def __init__(self, now: float = 1_000_000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


@pytest.fixture(scope="module")
def redis_url(tmp_path_factory) -> Any:
    srv = RedisServer(tmp_path_factory.mktemp("limits-redis"))
    srv.start()
    yield srv.url
    srv.stop()


def tenancy(toml: str, **kwargs: Any) -> Tenancy:
    return Tenancy(TenantsConfig.parse(tomllib.loads(toml), list(KEYS), source="t.toml"), **kwargs)


# ---- the scripts against an exact reference --------------------------------------------------


@dataclass
class Reference:
    """The store's rules in plain Python integers: buckets in 1/60,000 units, time in ms, leases."""

    lease_ms: int
    buckets: dict[str, tuple[int, int]] = field(default_factory=dict)  # kind → (units, at ms)
    holds: dict[str, int] = field(default_factory=dict)  # ticket → lease end (ms)

    def level(self, kind: str, per_minute: int, now: int) -> int:
        if kind not in self.buckets:
            return per_minute * UNIT
        u, at = self.buckets[kind]
        return min(per_minute * UNIT, u + (now - at) * per_minute) if now > at else u

    def admit(self, rpm: int, tpm: int, maxc: int, ticket: str, now: int) -> tuple:
        req = self.level("requests", rpm, now) if rpm else 0
        tok = self.level("tokens", tpm, now) if tpm else 0
        if maxc:
            self.holds = {t: end for t, end in self.holds.items() if end > now}
        held = len(self.holds)
        reason, wait = "", 0.0
        for r, w in (("requests", (UNIT - req) / rpm if rpm and req < UNIT else 0),
                     ("tokens", (UNIT - tok) / tpm if tpm and tok < UNIT else 0),
                     ("concurrency", 1000 if maxc and held >= maxc else 0)):
            if w > wait:
                reason, wait = r, w
        if reason:
            return (False, reason, wait / 1000, req, tok, held)
        if rpm:
            req -= UNIT
            self.buckets["requests"] = (req, now)
        if maxc:
            self.holds[ticket] = now + self.lease_ms
            held += 1
        return (True, "", 0.0, req, tok, held)

    def release(self, tpm: int, ticket: str, tokens: int, now: int) -> None:
        self.holds.pop(ticket, None)
        if tpm and tokens > 0:
            self.buckets["tokens"] = (self.level("tokens", tpm, now) - tokens * UNIT, now)


def _said(a: StoreAdmission, rpm: int, tpm: int) -> tuple:
    return (a.admitted, a.reason, a.wait, round(a.requests_level * UNIT) if rpm else 0,
            round(a.tokens_level * UNIT) if tpm else 0, a.in_flight)


OPS = st.lists(st.one_of(
    st.tuples(st.just("admit")),
    st.tuples(st.just("release"), st.integers(0, 7), st.integers(0, 400)),
    st.tuples(st.just("advance"), st.integers(0, 40_000)),
), min_size=1, max_size=40)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(rpm=st.sampled_from([0, 1, 2, 7, 60]), tpm=st.sampled_from([0, 5, 97, 1000]),
       maxc=st.sampled_from([0, 1, 3]), ops=OPS)
def test_the_stores_scripts_equal_an_exact_reference(redis_url, rpm, tpm, maxc, ops):
    """Any sequence of admissions, releases (any tokens, tickets held or not) and waits: each
    admission's verdict, reason, wait, levels and count in flight equal the reference's, to the
    last unit (no float drift: the buckets are whole units), leases lapsing included."""
    clock = Clock(1_000.0)
    store = LimitStore(redis_url, role=f"test-{uuid.uuid4().hex}", clock=clock, lease=20.0, renew_every=1e9)
    ref = Reference(lease_ms=20_000)
    tickets: list[str] = []

    async def run() -> None:
        for op in ops:
            now = int(clock() * 1000)
            if op[0] == "admit":
                ticket = uuid.uuid4().hex
                said = await store.admit("t", rpm or None, tpm or None, maxc or None, ticket)
                assert _said(said, rpm, tpm) == ref.admit(rpm, tpm, maxc, ticket, now)
                if said.admitted:
                    tickets.append(ticket)
            elif op[0] == "release":
                ticket = tickets[op[1] % len(tickets)] if tickets else "never-held"
                await store.release("t", tpm or None, ticket, op[2])
                ref.release(tpm, ticket, op[2], now)
            else:
                clock.advance(op[1] / 1000)
        await store.close()

    asyncio.run(run())


def test_refusals_and_headers_equal_the_in_process_limits(redis_url):
    """The same requests against a shared store and against one process's own limits give the
    same 429s, messages, retry-after and rate-limit headers."""
    toml = '[tenants.t]\nkeys = ["a"]\nrequests_per_minute = 2\ntokens_per_minute = 7\nmax_concurrent = 2\n'
    clock = Clock()
    wall = Clock(1.8e9)
    shared = tenancy(toml, clock=clock, wall_clock=wall,
                     store=LimitStore(redis_url, role=f"test-{uuid.uuid4().hex}", clock=clock))
    local = tenancy(toml, clock=clock, wall_clock=wall)
    tenant = local.tenant_of("a")

    async def step(t: Tenancy, style: str) -> tuple:
        try:
            ticket = await t.admit(tenant, style)
        except TenantRateLimited as e:
            return ("429", e.reason, e.message, e.headers), None
        return ("ok", ticket.headers), ticket

    async def run() -> list[str]:
        outcomes = []
        # (seconds later, API, tokens the admitted request then used)
        for seconds, style, tokens in ((0, "anthropic", 9), (1.5, "openai", 0), (0.2, "openai", 0),
                                       (20, "anthropic", 0), (13.3, "openai", 0), (4.0, "anthropic", 0),
                                       (0.1, "openai", 0)):
            clock.advance(seconds)
            (said, ticket), (local_said, local_ticket) = await step(shared, style), await step(local, style)
            assert said == local_said
            outcomes.append(said[0] if said[0] == "ok" else said[1])
            for t in (ticket, local_ticket):
                if t is not None:
                    await t.release(tokens)
        await shared.close()
        return outcomes

    # 9 tokens against 7 a minute: in debt until 3 tokens refill (25.7 s); then 2 requests a minute
    assert asyncio.run(run()) == ["ok", "tokens", "tokens", "tokens", "ok", "ok", "requests"]


def test_a_shed_requests_unit_is_given_back_in_the_store_as_in_process(redis_url):
    """A request the SLA guard shed gives its requests_per_minute unit back (a client retrying
    each 529 would spend its minute on refusals), never past a full bucket: the same in the
    shared store as in one process's own limits."""
    toml = '[tenants.t]\nkeys = ["a"]\nrequests_per_minute = 2\n'
    clock = Clock()
    shared = tenancy(toml, clock=clock, store=LimitStore(redis_url, role=f"test-{uuid.uuid4().hex}", clock=clock))
    local = tenancy(toml, clock=clock)
    tenant = local.tenant_of("a")

    async def run(t: Tenancy) -> None:
        for _ in range(5):  # shed five times, each given back: both units are still there
            await (await t.admit(tenant, "openai")).release(0, refund_request=True)
        first = await t.admit(tenant, "openai")
        clock.advance(30)  # half a minute refills the unit `first` took: the bucket is full again
        await first.release(0, refund_request=True)  # not to 3 units
        kept = [await t.admit(tenant, "openai") for _ in range(2)]
        assert kept[-1].headers["x-ratelimit-remaining-requests"] == "0"
        with pytest.raises(TenantRateLimited):
            await t.admit(tenant, "openai")
        for ticket in kept:
            await ticket.release(0)  # served: their units stay spent
        with pytest.raises(TenantRateLimited):
            await t.admit(tenant, "openai")
        clock.advance(60)
        await t.close()

    asyncio.run(run(shared))
    asyncio.run(run(local))


# ---- several processes, one store --------------------------------------------------------------


def test_racing_admissions_from_two_processes_never_exceed_a_limit(redis_url):
    """30 admissions at once through two Tenancy objects (two servers' worth) with Redis's own
    clock: exactly 5 of a 5-a-minute tenant get in, and of a 3-at-a-time tenant 3, until one
    of them is released by the other process."""
    role = f"test-{uuid.uuid4().hex}"
    toml = ('[tenants.rpm]\nkeys = ["a"]\nrequests_per_minute = 5\n'
            '[tenants.conc]\nkeys = ["b"]\nmax_concurrent = 3\n')
    one, two = (tenancy(toml, store=LimitStore(redis_url, role=role)) for _ in range(2))

    async def admitted(tenant_key: str) -> list:
        tenant = one.tenant_of(tenant_key)

        async def attempt(t: Tenancy):
            try:
                return await t.admit(tenant, "openai")
            except TenantRateLimited:
                return None

        results = await asyncio.gather(*(attempt(one if i % 2 else two) for i in range(30)))
        return [r for r in results if r is not None]

    async def run() -> None:
        assert len(await admitted("a")) == 5
        held = await admitted("b")
        assert len(held) == 3
        assert await one.store.in_flight("conc") == 3
        await held[0].release(0)
        assert len(await admitted("b")) == 1
        assert await two.store.in_flight("conc") == 3
        await one.close()
        await two.close()

    asyncio.run(run())


def test_a_dead_holders_slot_lapses_and_a_live_one_is_renewed(redis_url):
    """A holder renews its tickets' leases; one that stops (a process gone without releasing)
    leaves a slot the tenant gets back when the lease runs out, not never."""
    role = f"test-{uuid.uuid4().hex}"
    clock = Clock()
    toml = '[tenants.t]\nkeys = ["a"]\nmax_concurrent = 1\n'
    holder = tenancy(toml, store=LimitStore(redis_url, role=role, clock=clock, lease=20.0, renew_every=1e9))
    other = tenancy(toml, store=LimitStore(redis_url, role=role, clock=clock, lease=20.0, renew_every=1e9))
    tenant = holder.tenant_of("a")

    async def refused() -> bool:
        try:
            ticket = await other.admit(tenant, "anthropic")
        except TenantRateLimited as e:
            assert e.reason == "concurrency"
            return True
        await ticket.release(0)
        return False

    async def run() -> None:
        ticket = await holder.admit(tenant, "anthropic")
        clock.advance(15)
        await holder.store.renew()  # alive: the lease now ends at 35 s
        clock.advance(10)
        assert await refused()
        holder.store._held.clear()  # the holder dies: nothing renews it any more
        clock.advance(9.9)
        assert await refused()
        clock.advance(0.2)
        assert not await refused()  # lapsed at 35 s
        await ticket.release(0)  # a late release of a lapsed ticket harms nothing
        assert not await refused()

    asyncio.run(run())


def test_the_renewer_keeps_leases_alive_in_real_time(redis_url):
    store = LimitStore(redis_url, role=f"test-{uuid.uuid4().hex}", lease=1.0, renew_every=0.1)

    async def run() -> None:
        said = await store.admit("t", None, None, 1, "ticket-1")
        assert said.admitted
        await asyncio.sleep(2.5)  # 2.5 leases
        assert await store.in_flight("t") == 1
        await store.close()  # the renewer stops, the ticket is never released
        store._held.clear()
        await asyncio.sleep(1.3)
        assert await store.in_flight("t") == 0

    asyncio.run(run())


def test_a_release_cancelled_midway_still_frees_the_slot_and_pays(redis_url):
    """A request task cancelled while its release is on its way to Redis (a client gone as its
    response ends): the release still lands, rather than the slot staying taken until its lease
    lapses and the tokens going unpaid."""
    t = tenancy('[tenants.t]\nkeys = ["a"]\nmax_concurrent = 1\ntokens_per_minute = 1000\n',
                store=LimitStore(redis_url, role=f"test-{uuid.uuid4().hex}"))
    tenant = t.tenant_of("a")

    async def run() -> None:
        ticket = await t.admit(tenant, "openai")
        await t.store._client.connection_pool.disconnect()  # the release must connect first
        release = asyncio.ensure_future(ticket.release(400))
        await asyncio.sleep(0)  # under way: connecting, nothing sent yet
        release.cancel()
        with pytest.raises(asyncio.CancelledError):
            await release
        await t.close()  # waits for releases still under way
        again = await t.admit(tenant, "openai")  # the slot is free
        assert 590 <= int(again.headers["x-ratelimit-remaining-tokens"]) <= 610  # and 400 were paid
        await again.release(0)
        await t.close()

    asyncio.run(run())


# ---- Redis gone, slow or back --------------------------------------------------------------------


def test_an_outage_falls_back_to_each_processs_own_limits_and_recovers(tmp_path, caplog):
    srv = RedisServer(tmp_path)
    srv.start()
    toml = '[tenants.t]\nkeys = ["a"]\nrequests_per_minute = 2\n'
    store = LimitStore(srv.url, role="test", retry_after=0.3)
    t = tenancy(toml, store=store)
    tenant = t.tenant_of("a")

    async def run() -> None:
        first = await t.admit(tenant, "openai")
        assert first.shared is not None  # the store admitted it
        srv.stop()
        with caplog.at_level(logging.WARNING, logger="tierlm.serving"):
            started = time.monotonic()
            local = [await t.admit(tenant, "openai") for _ in range(2)]  # this process's own 2 a minute
            assert time.monotonic() - started < 2
            assert all(ticket.shared is None for ticket in local)
            with pytest.raises(TenantRateLimited):
                await t.admit(tenant, "openai")
        failures = store.failures
        assert failures == 1  # one failed call; then no tries until retry_after
        warnings = [r.getMessage() for r in caplog.records if "limits store" in r.getMessage()]
        assert len(warnings) == 1 and "each process limits its tenants on its own" in warnings[0]
        assert srv.url in warnings[0]
        await first.release(100)  # Redis gone: the release is lost, not an error
        for ticket in local:
            await ticket.release(0)
        assert t.in_flight("t") == 0
        srv.start()  # empty again (no persistence): a full bucket
        await asyncio.sleep(0.35)
        back = await t.admit(tenant, "openai")
        assert back.shared is not None and back.headers["x-ratelimit-remaining-requests"] == "1"
        await back.release(0)
        await t.close()

    try:
        asyncio.run(run())
    finally:
        srv.stop()


def test_calls_a_frozen_redis_runs_late_leave_no_slot_or_unit_taken(tmp_path):
    """A Redis that stops answering for a while (frozen: a stall, a fork, SIGSTOP) still runs
    the admissions that timed out once it thaws. Those requests were admitted under the
    process's own limits and have ended, so what Redis ran late must not count: their holds
    kept the tenant at its max_concurrent with nothing in flight until their leases lapsed
    (20 s), and their request units were spent twice."""
    import signal

    srv = RedisServer(tmp_path)
    srv.start()
    store = LimitStore(srv.url, role="test", timeout=0.3, retry_after=0.2)
    t = tenancy('[tenants.t]\nkeys = ["a"]\nmax_concurrent = 1\nrequests_per_minute = 10\n', store=store)
    tenant = t.tenant_of("a")

    async def run() -> None:
        await (await t.admit(tenant, "openai")).release(0)  # connected: the next call is sent whole
        srv.proc.send_signal(signal.SIGSTOP)
        try:
            local = await t.admit(tenant, "openai")  # times out: admitted under this process's limits
            assert local.shared is None
        finally:
            srv.proc.send_signal(signal.SIGCONT)
        await local.release(0)
        await asyncio.sleep(0.3)  # the store is tried again
        back = await t.admit(tenant, "openai")  # refused before: the late admission's hold
        assert back.shared is not None
        assert back.headers["x-ratelimit-remaining-requests"] == "8"  # the first's unit and its own only
        await back.release(0)
        assert await store.in_flight("t") == 0
        await t.close()

    try:
        asyncio.run(run())
    finally:
        srv.stop()


def test_an_admission_that_reaches_redis_after_its_void_takes_nothing(redis_url):
    """Voided first (its caller gave up and the store answered again), then run (it was still
    on its way): the admission takes no slot and no request unit."""
    store = LimitStore(redis_url, role=f"test-{uuid.uuid4().hex}")

    async def run() -> None:
        store._remember_void("late", "t", 10)
        await store._void_all()
        late = await store.admit("t", 10, None, 1, "late")
        assert not late.admitted and late.reason == "void"
        fresh = await store.admit("t", 10, None, 1, "fresh")
        assert fresh.admitted and fresh.in_flight == 1 and fresh.requests_level == 9
        await store.release("t", None, "fresh", 0)
        await store.close()

    asyncio.run(run())


def test_a_redis_that_never_answers_costs_one_timeout_then_nothing():
    """A listener that accepts and never replies (a hung Redis): the first admission waits
    out the store's timeout and is admitted under local limits; the next ones do not wait."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(16)
    port = listener.getsockname()[1]
    accepted: list[socket.socket] = []
    threading.Thread(target=lambda: [accepted.append(listener.accept()[0]) for _ in range(4)], daemon=True).start()
    store = LimitStore(f"redis://127.0.0.1:{port}/0", timeout=0.3, retry_after=60)
    t = tenancy('[tenants.t]\nkeys = ["a"]\nmax_concurrent = 5\n', store=store)

    async def run() -> list[float]:
        waits = []
        for _ in range(3):
            started = time.monotonic()
            ticket = await t.admit(t.tenant_of("a"), "anthropic")
            waits.append(time.monotonic() - started)
            assert ticket is not None and ticket.shared is None
        await t.close()
        return waits

    try:
        waits = asyncio.run(run())
    finally:
        listener.close()
        for s in accepted:
            s.close()
    assert 0.25 <= waits[0] < 2 and max(waits[1:]) < 0.05
    assert store.failures == 1


# ---- two real servers, one tenant --------------------------------------------------------------


@pytest.fixture(scope="module")
def two_servers(scripted_models, redis_url):
    toml = ('[tenants.rpm]\nkeys = ["a"]\nrequests_per_minute = 3\ntokens_per_minute = 600\n'
            '[tenants.conc]\nkeys = ["b"]\nmax_concurrent = 1\n')
    role = f"test-{uuid.uuid4().hex}"
    servers = []
    for _ in range(2):
        engines = {TEXT_MODEL: scripted_models[TEXT_MODEL].engine(), LOOP_MODEL: scripted_models[LOOP_MODEL].engine()}
        app = build_app(engines, ApiKeyAuth.from_keys(KEYS),
                        tenancy=tenancy(toml, store=LimitStore(redis_url, role=role)))
        servers.append(ServerThread(app).start())
    yield servers
    for s in servers:
        s.stop()


def test_two_servers_hold_a_tenant_to_one_limit_through_both_sdks(two_servers):
    one, two = two_servers
    c1 = anthropic.Anthropic(base_url=one.url, api_key=KEYS["a"], max_retries=0, timeout=60)
    o2 = openai.OpenAI(base_url=two.url + "/v1", api_key=KEYS["a"], max_retries=0, timeout=60)
    long = [{"role": "user", "content": "Hi there, " * 25}]  # ~60 tokens a request: far more than refills
    first = c1.messages.with_raw_response.create(model=TEXT_MODEL, max_tokens=2, messages=long)
    assert first.headers["anthropic-ratelimit-requests-remaining"] == "2"
    second = o2.chat.completions.with_raw_response.create(model=TEXT_MODEL, max_tokens=2, messages=long)
    assert second.headers["x-ratelimit-remaining-requests"] == "1"  # counts server one's request
    usage = first.parse().usage
    on_one = usage.input_tokens + (usage.cache_read_input_tokens or 0) + usage.output_tokens
    on_two = second.parse().usage.total_tokens
    assert min(on_one, on_two) > 40
    third = c1.messages.with_raw_response.create(model=TEXT_MODEL, max_tokens=2, messages=HI)
    assert third.headers["anthropic-ratelimit-requests-remaining"] == "0"
    # both servers charged their tokens to the one bucket (600 a minute refill 10 a second: a
    # few since), not each to its own (server one alone would show 600 - on_one)
    remaining = int(third.headers["anthropic-ratelimit-tokens-remaining"])
    assert 600 - on_one - on_two <= remaining <= 600 - on_one - on_two + 30 < 600 - on_one
    with pytest.raises(openai.RateLimitError) as refused:
        o2.chat.completions.create(model=TEXT_MODEL, max_tokens=2, messages=HI)
    assert "tenant 'rpm'" in refused.value.body["message"] and "3 requests per minute" in refused.value.body["message"]
    assert 1 <= int(refused.value.response.headers["retry-after"]) <= 20
    with pytest.raises(anthropic.RateLimitError):
        c1.messages.create(model=TEXT_MODEL, max_tokens=2, messages=HI)
    text = httpx.get(two.url + "/metrics").text
    assert value(text, "tierlm:rate_limited_requests_total", tenant="rpm", reason="requests") == 1
    assert value(text, "tierlm:limits_store_failures_total") == 0


def test_a_stream_on_one_server_holds_the_tenants_only_slot_on_the_other(two_servers, monkeypatch):
    one, two = two_servers
    for server in two_servers:
        slow_steps(server.app.state.tierlm.models.get(LOOP_MODEL), monkeypatch, 0.02)
    headers = {"x-api-key": KEYS["b"], "anthropic-version": "2023-06-01"}
    body = {"model": LOOP_MODEL, "max_tokens": 300, "stream": True, "messages": HI}
    with httpx.stream("POST", one.url + "/v1/messages", json=body, headers=headers, timeout=60) as r:
        lines = r.iter_lines()  # kept: a generator dropped closes the response
        next(line for line in lines if "text_delta" in line)
        refused = httpx.post(two.url + "/v1/messages", json={**body, "stream": False}, headers=headers, timeout=60)
        assert refused.status_code == 429 and "1 requests at a time" in refused.json()["error"]["message"]
    # the client left: server one aborted the request and freed the slot in the store
    store = two.app.state.tierlm.tenancy.store
    assert wait_until(lambda: asyncio.run(store_in_flight(store, "conc")) == 0, timeout=10)
    ok = httpx.post(two.url + "/v1/messages", json={**body, "stream": False, "max_tokens": 2}, headers=headers,
                    timeout=60)
    assert ok.status_code == 200


async def store_in_flight(store: LimitStore, tenant: str) -> int:
    probe = LimitStore(store.url, role=store.role)
    try:
        return await probe.in_flight(tenant)
    finally:
        await probe.close()


# ---- the command line --------------------------------------------------------------------------


def test_serve_refuses_a_limits_store_without_tenants_or_with_a_bad_url(tmp_path):
    from tierlm.serving.auth import keys_file_line

    keys = tmp_path / "keys.txt"
    keys.write_text(keys_file_line("a", KEYS["a"]) + "\n")
    tenants = tmp_path / "tenants.toml"
    tenants.write_text('[tenants.t]\nkeys = ["a"]\nrequests_per_minute = 5\n')
    for extra, error in (([], "error: --limits-store needs --tenants"),
                         (["--tenants", str(tenants)], "error: --limits-store 'redis://h:6379/zero': the path names "
                                                       "the database and must be a number")):
        proc = serve("--port", str(free_port()), "--api-keys", str(keys), "--limits-store", "redis://h:6379/zero",
                     *extra)
        out, _ = proc.communicate(timeout=120)
        assert proc.returncode == 2 and error in out, out
        assert "Traceback" not in out


def test_router_refuses_a_limits_store_without_tenants(tmp_path, capsys):
    from tierlm.cli import main
    from tierlm.serving.auth import keys_file_line

    keys = tmp_path / "keys.txt"
    keys.write_text(keys_file_line("a", KEYS["a"]) + "\n")
    for extra in ([], ["--api-keys", str(keys)]):
        assert main(["router", "--replica", "http://127.0.0.1:1", "--limits-store", "redis://127.0.0.1:1/0",
                     *extra]) == 2
        assert "error: --limits-store needs --tenants" in capsys.readouterr().err


def test_serve_refuses_a_limits_store_on_the_kv_cache_s_redis_server(tmp_path, redis_server):
    """The KV tier fills its Redis server and leans on its eviction (kv_remote_capacity sets
    volatile-lru), which took the limits' keys too: a tenant held to 3 requests a minute got a
    4th once KV writes had evicted its bucket. The same server in another database, or under
    another loopback name, is the same server."""
    from tierlm.serving.auth import keys_file_line

    keys = tmp_path / "keys.txt"
    keys.write_text(keys_file_line("a", KEYS["a"]) + "\n")
    tenants = tmp_path / "tenants.toml"
    tenants.write_text('[tenants.t]\nkeys = ["a"]\nrequests_per_minute = 3\n')
    proc = serve("--port", str(free_port()), "--api-keys", str(keys), "--tenants", str(tenants),
                 "--limits-store", f"redis://localhost:{redis_server.port}/1", "--kv-remote", redis_server.url,
                 "--kv-remote-capacity", "1MiB")
    try:
        out, _ = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 2 and "is on the Redis server of --kv-remote" in out, out
    assert "Traceback" not in out


def test_a_limits_store_on_a_server_that_evicts_is_warned_about(redis_server, caplog):
    """A KV cache's kv_remote_capacity, set by a server elsewhere, makes the Redis evict; a
    limits store started there says its limits may be lost. One that never evicts: no warning."""
    from tierlm.kv.tiers import RedisTier
    from tierlm.serving.limit_store import limit_store_from_args

    url = f"redis://127.0.0.1:{redis_server.port}/1"
    with caplog.at_level(logging.WARNING, logger="tierlm.serving"):
        limit_store_from_args(url, "server", True)
        assert not [r for r in caplog.records if "evicts keys when full" in r.getMessage()]
        RedisTier(redis_server.url, capacity_bytes=1 << 20).close()
        limit_store_from_args(url, "server", True)
    said = [r.getMessage() for r in caplog.records if "evicts keys when full" in r.getMessage()]
    assert len(said) == 1 and "volatile-lru" in said[0] and "noeviction" in said[0]
