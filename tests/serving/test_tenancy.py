"""Tenants (tierlm/serving/tenancy.py): the tenants file, the cache each tenant shares only with
itself, limits refused with 429 through both official SDKs, slots released however a response
ends, tier priority in a real engine, and `tierlm serve --tenants`.

The server's tenancy runs on a clock the tests move (`Clock`), so a minute's refill takes no
time and retry-after values are exact."""
from __future__ import annotations

import asyncio
import math
import time
import uuid
from typing import Any

import anthropic
import httpx
import openai
import pytest

from tests.serving.harness import ServerThread, record_requests, slow_steps, until, wait_until
from tests.serving.scripted_model import ENGINE_OPTIONS, LOOP_MODEL, TEXT_MODEL
from tests.serving.test_cli import SMALL_ENGINE, free_port, serve, wait_ready
from tests.serving.test_telemetry import value
from tierlm.serving.app import build_app
from tierlm.serving.auth import ApiKeyAuth, keys_file_line
from tierlm.serving.tenancy import Limits, Tenancy, TenantsConfig

KEYS = {name: f"sk-{name}" for name in ("acme-a", "acme-b", "globex", "rpm", "tpm", "conc", "vip", "lone")}
TENANTS = """
[tiers.silver]
requests_per_minute = 1000      # a tier's default for its tenants
weight = 0.5
kv_share = 0.75

[tenants.acme]
tier = "gold"
keys = ["acme-a", "acme-b"]

[tenants.globex]
tier = "silver"
keys = ["globex"]

[tenants.rpm]
keys = ["rpm"]
requests_per_minute = 2

[tenants.tpm]
keys = ["tpm"]
tokens_per_minute = 5

[tenants.conc]
keys = ["conc"]
max_concurrent = 1

[tenants.vip]
tier = "gold"
keys = ["vip"]
weight = 3
kv_share = 0.5
kv_cache_share = 0.3
"""  # "lone" is in no tenant: a bronze tenant of its own
ONE_SEQ = "loop-one-seq"  # the looping model on an engine that runs one request at a time
HI = [{"role": "user", "content": "Hi"}]


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


# ---- the tenants file ----------------------------------------------------------------------


def parse(text: str, keys: Any = KEYS) -> TenantsConfig:
    import tomllib
    return TenantsConfig.parse(tomllib.loads(text), keys, source="t.toml")


def test_tenants_file_tiers_limits_and_keys_in_no_tenant():
    config = parse('default_tier = "silver"\n' + TENANTS + '[tiers.gold]\npriority = -5\n'
                   '[tiers.platinum]\npriority = -9\nmax_concurrent = 3\n'
                   '[tenants.plat]\ntier = "platinum"\nkeys = ["lone"]\n')
    assert {n: t.priority for n, t in config.tiers.items()} == {"gold": -5, "silver": 1, "bronze": 2, "platinum": -9}
    acme_a, acme_b = config.tenant_of("acme-a"), config.tenant_of("acme-b")
    assert acme_a == acme_b and acme_a.id == "acme" and acme_a.priority == -5 and acme_a.limits == Limits()
    assert config.tenant_of("globex").limits == Limits(requests_per_minute=1000)  # its tier's default
    assert config.tenant_of("rpm").tier == "silver"  # no tier: default_tier
    assert config.tenant_of("rpm").limits == Limits(requests_per_minute=2)  # its own over the tier's
    assert config.tenant_of("lone").limits == Limits(max_concurrent=3)
    # weights: a tenant's own, else its tier's, else 1
    assert (config.tenant_of("vip").weight, config.tenant_of("globex").weight, config.tenant_of("rpm").weight,
            acme_a.weight, config.tenant_of("lone").weight) == (3.0, 0.5, 0.5, 1.0, 1.0)
    assert parse(TENANTS).tenant_of("lone").weight == 1.0  # bronze, no weight set
    # breakers: a tier's own settings (times in ms), none, or the server's
    from tierlm.serving.breaker import BreakerSettings
    tiers = parse('[tiers.gold]\nbreaker = { min_outcomes = 4, cooldown_ms = 500, horizon_ms = 10000 }\n'
                  '[tiers.silver]\nbreaker = false\n[tenants.t]\ntier = "gold"\nkeys = ["rpm"]\n')
    assert tiers.tenant_of("rpm").breaker == BreakerSettings(min_outcomes=4, cooldown_s=0.5, horizon_s=10.0)
    assert tiers.tiers["silver"].breaker is False and tiers.tiers["bronze"].breaker is None
    assert tiers.tenant_of("lone").breaker is None  # a lone key: the default tier's (bronze)
    # batch caps likewise
    caps = parse('[tiers.gold]\nmax_batch_requests = 50\n[tenants.t]\ntier = "gold"\nkeys = ["rpm"]\n'
                 '[tenants.u]\ntier = "gold"\nkeys = ["tpm"]\nmax_batch_requests = 7\n')
    assert (caps.tenant_of("rpm").max_batch_requests, caps.tenant_of("tpm").max_batch_requests,
            caps.tenant_of("lone").max_batch_requests) == (50, 7, None)
    # KV quotas likewise: a tenant's own, else its tier's, else none
    assert (config.tenant_of("vip").kv_share, config.tenant_of("globex").kv_share, acme_a.kv_share,
            parse(TENANTS).tenant_of("lone").kv_share) == (0.5, 0.75, None, None)
    # cache partitions likewise (a tenant's own, else its tier's), and several fit together
    shares = parse('[tiers.gold]\nkv_cache_share = 0.25\n[tenants.a]\nkeys = ["rpm"]\ntier = "gold"\n'
                   '[tenants.b]\nkeys = ["tpm"]\ntier = "gold"\nkv_cache_share = 0.5\n', {"rpm": 1, "tpm": 1})
    assert (shares.tenant_of("rpm").kv_cache_share, shares.tenant_of("tpm").kv_cache_share) == (0.25, 0.5)
    assert (parse(TENANTS).tenant_of("vip").kv_cache_share, parse(TENANTS).tenant_of("acme-a").kv_cache_share) == \
        (0.3, None)
    # a key no tenant names: a tenant of its own, of the default tier, with a salt apart from every tenant's
    lone = parse(TENANTS).tenant_of("lone")
    assert (lone.id, lone.tier, lone.priority, lone.limits) == ("lone", "bronze", 2, Limits())
    salts = {parse(TENANTS).tenant_of(k).cache_salt for k in KEYS}
    assert len(salts) == len(KEYS) - 1  # acme's two keys share one


@pytest.mark.parametrize("text, error", [
    ('[tenants.a]\nkeys = ["rpm"]\n[tenants.b]\nkeys = ["rpm"]',
     "t.toml: tenants.b.keys: key id 'rpm' already belongs to tenant 'a'; a key belongs to one tenant"),
    ('[tenants.a]\nkeys = ["nobody"]', "t.toml: tenants.a.keys: key id 'nobody' is not in the keys file; add its line"),
    ('[tenants.a]\nkeys = []', "tenants.a.keys: list the ids of the keys this tenant owns"),
    ('[tenants.a]\ntier = "tin"\nkeys = ["rpm"]', "tenants.a.tier: no tier named 'tin'; use one of bronze, gold, silver"),
    ('[tenants.a]\nkeys = ["rpm"]\nrpm = 5', "tenants.a.rpm: unknown field; use keys, kv_cache_share, kv_share, max_batch_requests, max_concurrent, models, requests_per_minute, tier, tokens_per_minute, weight"),
    ('[tenants.a]\nkeys = ["rpm"]\nkv_cache_share = 0', "tenants.a.kv_cache_share: must be a fraction above 0 and "
                                                      "at most 1 (got 0): the part of each model's KV cache"),
    ('[tenants.a]\nkeys = ["rpm"]\nkv_cache_share = 0.6\n[tenants.b]\nkeys = ["tpm"]\nkv_cache_share = 0.5',
     "t.toml: kv_cache_share: the tenants' cache partitions add up to 1.1 of the KV pool (a 0.6, b 0.5)"),
    ('[tiers.bronze]\nkv_cache_share = 0.2', "kv_cache_share: the tenants' cache partitions add up to 1.6 of the KV "
                                             "pool (8 key(s) in no tenant, 0.2 each (tier bronze))"),
    ('[tenants.a]\nkeys = ["rpm"]\nmodels = []', "tenants.a.models: list the names of the models (and LoRA adapters)"),
    ('[tiers.gold]\nmodels = "base"', "tiers.gold.models: list the names of the models"),
    ('[tenants.a]\nkeys = ["rpm"]\nmodels = ["base", 3]', "tenants.a.models: list the names"),
    ('[tenants.a]\nkeys = ["rpm"]\nmax_batch_requests = 0', "tenants.a.max_batch_requests: must be a whole number of "
                                                          "at least 1 (got 0)"),
    ('[tiers.gold]\nmax_batch_requests = 2.5', "tiers.gold.max_batch_requests: must be a whole number of at least 1"),
    ('[tenants.a]\nkeys = ["rpm"]\nmax_concurrent = 0', "tenants.a.max_concurrent: must be a whole number of at least 1"),
    ('[tenants.a]\nkeys = ["rpm"]\nweight = 0', "tenants.a.weight: must be a number from 0.01 to 100 (got 0)"),
    ('[tenants.a]\nkeys = ["rpm"]\nweight = "2"', "tenants.a.weight: must be a number from 0.01 to 100"),
    ('[tenants.a]\nkeys = ["rpm"]\nweight = nan', "tenants.a.weight: must be a number from 0.01 to 100 (got nan)"),
    ('[tiers.gold]\nweight = true', "tiers.gold.weight: must be a number from 0.01 to 100 (got True)"),
    ('[tenants.a]\nkeys = ["rpm"]\nkv_share = 0', "tenants.a.kv_share: must be a fraction above 0 and at most 1 (got 0)"),
    ('[tiers.gold]\nkv_share = 1.5', "tiers.gold.kv_share: must be a fraction above 0 and at most 1 (got 1.5)"),
    ('[tenants.a]\nkeys = ["rpm"]\nkv_share = "half"', "tenants.a.kv_share: must be a fraction"),
    ('[tiers.gold]\ntokens_per_minute = "lots"', "tiers.gold.tokens_per_minute: must be a whole number of at least 1"),
    ('[tiers.tin]\nmax_concurrent = 1', "tiers.tin.priority: a tier other than gold, silver and bronze needs a priority"),
    ('default_tier = "tin"', "default_tier: no tier named 'tin'"),
    ('[tenants.rpm]\nkeys = ["tpm"]', "tenants.rpm: this tenant has the name of key 'rpm', which is in no tenant"),
    ('tenants = 3', "tenants: must be a table"),
    ('[tiers.gold]\nbreaker = true', "tiers.gold.breaker: must be false (no breaker for this tier) or a table"),
    ('[tiers.gold]\nbreaker = { min_outcomes = 30 }', "tiers.gold.breaker: min_outcomes (30) must be at most window (20"),
    ('[tiers.gold]\nbreaker = { cooldown_ms = 0 }', "tiers.gold.breaker.cooldown_ms: must be a number above 0 (got 0)"),
    ('[tiers.gold]\nbreaker = { cooldown_ms = 60000 }', "tiers.gold.breaker: cooldown_ms (60000) must be at most "
                                                      "max_cooldown_ms (30000)"),
    ('[tiers.gold]\nbreaker = { trip_fraction = 2 }', "tiers.gold.breaker.trip_fraction: must be a share above 0"),
    ('[tiers.gold]\nbreaker = { probes = 1.5 }', "tiers.gold.breaker.probes: must be a whole number of at least 1"),
    ('[tiers.gold]\nbreaker = { cool = 1 }', "tiers.gold.breaker.cool: unknown field; use cooldown_ms, horizon_ms"),
    ('[tenants.a]\nkeys = ["rpm"]\nbreaker = false', "tenants.a.breaker: unknown field"),  # a tier's, not a tenant's
])
def test_tenants_file_mistakes_name_the_field_and_the_fix(text, error):
    with pytest.raises(ValueError) as e:
        parse(text)
    assert error in str(e.value)


def test_a_key_named_default_in_no_tenant_is_refused_as_a_tenant_named_default_is():
    """A key in no tenant is a tenant named after it: key "default" was tenant "default", the
    metrics label of requests without a tenant (401s), so its requests, rate limits and cache
    partition were counted with those in /metrics; a tenant of that name is refused for this."""
    with pytest.raises(ValueError, match="t.toml: tenants: key 'default' is in no tenant, so it would be a tenant "
                                         "of its own named 'default', the metrics label"):
        parse('[tenants.a]\nkeys = ["rpm"]\n', {"rpm": 1, "default": 1})
    assert parse('[tenants.a]\nkeys = ["rpm", "default"]\n', {"rpm": 1, "default": 1}).tenant_of("default").id == "a"


def test_tenants_file_syntax_error_names_the_line(tmp_path):
    path = tmp_path / "tenants.toml"
    path.write_text('[tenants.a]\nkeys = ["rpm"]\ntier = gold\n')
    with pytest.raises(ValueError, match=r"tenants.toml: not valid TOML: .*line 3"):
        TenantsConfig.from_file(path, KEYS)
    with pytest.raises(ValueError, match="cannot read tenants file"):
        TenantsConfig.from_file(tmp_path / "missing.toml", KEYS)


# ---- a server with tenants -----------------------------------------------------------------


@pytest.fixture(scope="module")
def clock() -> Clock:
    return Clock()


@pytest.fixture(scope="module")
def tenancy(clock, tmp_path_factory) -> Tenancy:
    path = tmp_path_factory.mktemp("tenants") / "tenants.toml"
    path.write_text(TENANTS)
    return Tenancy.from_file(path, KEYS, clock=clock)


@pytest.fixture(scope="module")
def engines(scripted_models) -> dict:
    from tierlm.engine.async_engine import AsyncEngine

    loop = scripted_models[LOOP_MODEL]
    return {TEXT_MODEL: scripted_models[TEXT_MODEL].engine(), LOOP_MODEL: loop.engine(),
            ONE_SEQ: AsyncEngine.from_model(str(loop.path), served_model_name=ONE_SEQ,
                                            **{**ENGINE_OPTIONS, "max_num_seqs": 1})}


@pytest.fixture(scope="module")
def server(engines, tenancy):
    app = build_app(engines, ApiKeyAuth.from_keys(KEYS), tenancy=tenancy)
    srv = ServerThread(app).start()
    yield srv
    srv.stop()


def claude(server: ServerThread, key: str) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.url, api_key=KEYS[key], max_retries=0, timeout=60)


def oai(server: ServerThread, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEYS[key], max_retries=0, timeout=60)


def metrics(server: ServerThread) -> str:
    return httpx.get(server.url + "/metrics").text


def test_keys_of_one_tenant_share_cached_prefixes_and_tenants_never_do(server, engines):
    messages = [{"role": "user", "content": uuid.uuid4().hex + " the same long preamble, again and again" * 6}]

    def cached(key: str) -> int:
        usage = claude(server, key).messages.create(model=TEXT_MODEL, max_tokens=4, messages=messages).usage
        return usage.cache_read_input_tokens

    assert cached("globex") == 0
    assert cached("acme-a") == 0  # globex sent it, acme never did
    assert cached("acme-b") > 0  # acme-a did: the same tenant
    assert cached("lone") == 0  # a key in no tenant is a tenant of its own
    answer = oai(server, "acme-a").chat.completions.create(model=TEXT_MODEL, max_tokens=4, messages=messages)
    assert answer.usage.prompt_tokens_details.cached_tokens > 0
    answer = oai(server, "vip").chat.completions.create(model=TEXT_MODEL, max_tokens=4, messages=messages)
    assert answer.usage.prompt_tokens_details.cached_tokens == 0  # gold like acme, yet another tenant
    # vip's kv_cache_share: what its requests cached is ranked in a partition of its own
    pool = engines[TEXT_MODEL].engine.pool
    part = pool.partitions["vip"]
    assert part.cap == int(0.3 * pool.num_blocks) and part.evictable > 0
    assert {blk.owner for blk in pool.cached.values()} >= {None, "vip"} and len(pool.partitions) == 1
    assert value(metrics(server), "tierlm:kv_partition_capacity_blocks", model=TEXT_MODEL, tenant="vip") == part.cap
    assert value(metrics(server), "tierlm:kv_partition_blocks", model=TEXT_MODEL, tenant="vip") == part.evictable
    text = metrics(server)  # the tenant label names the tenant
    assert value(text, "tierlm:requests_total", model=TEXT_MODEL, tenant="acme", status="200") >= 3
    assert value(text, "tierlm:requests_total", model=TEXT_MODEL, tenant="lone", status="200") >= 1


def test_requests_per_minute_429_through_both_sdks_then_admits_after_refill(server, clock):
    c, o = claude(server, "rpm"), oai(server, "rpm")
    first = c.messages.with_raw_response.create(model=TEXT_MODEL, max_tokens=2, messages=HI)
    assert first.headers["anthropic-ratelimit-requests-limit"] == "2"
    assert first.headers["anthropic-ratelimit-requests-remaining"] == "1"
    assert first.headers["anthropic-ratelimit-requests-reset"].endswith("Z")  # RFC 3339
    assert "x-ratelimit-limit-requests" not in first.headers
    second = o.chat.completions.with_raw_response.create(model=TEXT_MODEL, max_tokens=2, messages=HI)
    assert (second.headers["x-ratelimit-limit-requests"], second.headers["x-ratelimit-remaining-requests"],
            second.headers["x-ratelimit-reset-requests"]) == ("2", "0", "1m0s")  # a minute to refill both
    with pytest.raises(anthropic.RateLimitError) as refused:
        c.messages.create(model=TEXT_MODEL, max_tokens=2, messages=HI)
    assert refused.value.response.headers["retry-after"] == "30"  # one request refills in 30 s
    assert refused.value.response.headers["retry-after-ms"] == "30000"
    assert refused.value.response.headers["anthropic-ratelimit-requests-remaining"] == "0"
    error = refused.value.response.json()
    assert error["error"]["type"] == "rate_limit_error"
    assert "tenant 'rpm' (bronze tier) is over its limit of 2 requests per minute" in error["error"]["message"]
    with pytest.raises(openai.RateLimitError) as refused:
        o.chat.completions.create(model=TEXT_MODEL, max_tokens=2, messages=HI, stream=True)
    assert refused.value.code == "rate_limit_exceeded" and refused.value.type == "rate_limit_error"
    assert refused.value.response.headers["retry-after"] == "30"
    assert refused.value.response.headers["x-ratelimit-remaining-requests"] == "0"

    clock.advance(29)
    with pytest.raises(anthropic.RateLimitError) as refused:
        c.messages.create(model=TEXT_MODEL, max_tokens=2, messages=HI)
    assert refused.value.response.headers["retry-after"] == "1"
    clock.advance(1)
    assert o.chat.completions.create(model=TEXT_MODEL, max_tokens=2, messages=HI).choices[0].message.content
    with pytest.raises(openai.RateLimitError):
        o.completions.create(model=TEXT_MODEL, max_tokens=2, prompt="Hi")
    assert value(metrics(server), "tierlm:rate_limited_requests_total", tenant="rpm", reason="requests") == 4
    # count_tokens and the model list are not generation requests: never limited
    assert c.messages.count_tokens(model=TEXT_MODEL, messages=HI).input_tokens > 0
    assert [m.id for m in o.models.list()]


def _seconds(wait: float) -> str:
    """A wait as retry-after gives it: whole seconds, rounded up (past float noise)."""
    return str(math.ceil(round(wait, 3)))


def test_tokens_per_minute_are_charged_when_a_request_ends(server, clock, tenancy):
    tpm = 5  # tokens a minute: one every 12 s
    c, o = claude(server, "tpm"), oai(server, "tpm")
    raw = c.messages.with_raw_response.create(model=TEXT_MODEL, max_tokens=3, messages=HI)
    assert raw.headers["anthropic-ratelimit-tokens-limit"] == str(tpm)
    assert raw.headers["anthropic-ratelimit-tokens-remaining"] == str(tpm)  # post-paid: nothing taken yet
    usage = raw.parse().usage
    used = usage.input_tokens + usage.cache_read_input_tokens + usage.output_tokens
    assert used > tpm  # the bucket is in debt now
    level = tpm - used
    with pytest.raises(anthropic.RateLimitError) as refused:
        c.messages.create(model=TEXT_MODEL, max_tokens=3, messages=HI)
    debt_wait = (1 - level) * 60 / tpm  # until it holds a token again
    assert refused.value.response.headers["retry-after"] == _seconds(debt_wait)
    assert f"{tpm} tokens per minute" in refused.value.response.json()["error"]["message"]
    with pytest.raises(openai.RateLimitError) as refused:
        o.chat.completions.create(model=TEXT_MODEL, max_tokens=3, messages=HI)
    assert refused.value.response.headers["retry-after"] == _seconds(debt_wait)
    assert refused.value.response.headers["x-ratelimit-limit-tokens"] == str(tpm)
    clock.advance(int(_seconds(debt_wait)))
    level += int(_seconds(debt_wait)) * tpm / 60
    # n = 2, streamed: the prompt once and both choices' output are charged
    with o.chat.completions.create(model=TEXT_MODEL, max_tokens=3, messages=HI, n=2, stream=True,
                                   stream_options={"include_usage": True}) as stream:
        chunks = list(stream)
    usage = chunks[-1].usage
    assert usage.completion_tokens == 6 and usage.total_tokens == usage.prompt_tokens + 6
    level -= usage.total_tokens
    with pytest.raises(openai.RateLimitError) as refused:
        o.chat.completions.create(model=TEXT_MODEL, max_tokens=3, messages=HI)
    assert refused.value.response.headers["retry-after"] == _seconds((1 - level) * 60 / tpm)
    assert value(metrics(server), "tierlm:rate_limited_requests_total", tenant="tpm", reason="tokens") == 3
    assert tenancy.in_flight("tpm") == 0


def test_max_concurrent_slots_are_released_however_a_response_ends(server, tenancy, engines, monkeypatch):
    c, o = claude(server, "conc"), oai(server, "conc")
    slow_steps(engines[LOOP_MODEL], monkeypatch, 0.05)  # 480 tokens: 24 s at least, until the client leaves
    body = {"model": LOOP_MODEL, "max_tokens": 480, "messages": HI}
    headers = {"x-api-key": KEYS["conc"]}
    # a stream holds the slot until its client leaves
    with httpx.stream("POST", server.url + "/v1/messages", headers=headers, json={**body, "stream": True},
                      timeout=60) as r:
        assert r.status_code == 200
        # (the lines iterator held: dropped, it was finalized at once, which closed the stream, and
        # the server then saw its client gone, racing the checks below)
        lines = r.iter_lines()
        next(line for line in lines if "text_delta" in line)
        assert tenancy.in_flight("conc") == 1
        with pytest.raises(anthropic.RateLimitError) as refused:
            c.messages.create(model=TEXT_MODEL, max_tokens=2, messages=HI)
        assert refused.value.response.headers["retry-after"] == "1"
        assert "over its limit of 1 requests at a time" in refused.value.response.json()["error"]["message"]
        with pytest.raises(openai.RateLimitError):
            o.chat.completions.create(model=TEXT_MODEL, max_tokens=2, messages=HI)
    assert wait_until(lambda: tenancy.in_flight("conc") == 0)
    # a stream read to its end: free before its last bytes arrive, so the next request is admitted at once
    with c.messages.stream(model=LOOP_MODEL, max_tokens=5, messages=HI) as stream:
        assert stream.get_final_message().usage.output_tokens == 5
    assert tenancy.in_flight("conc") == 0
    assert o.chat.completions.create(model=TEXT_MODEL, max_tokens=2, messages=HI).choices
    # errors after admission: a 400 the engine finds, a model not served, a bad body
    with pytest.raises(anthropic.BadRequestError):
        c.messages.create(model=TEXT_MODEL, max_tokens=1000, messages=HI)
    with pytest.raises(openai.NotFoundError):
        o.chat.completions.create(model="no-such-model", max_tokens=2, messages=HI)
    assert httpx.post(server.url + "/v1/messages", headers=headers, content=b"{").status_code == 400
    assert tenancy.in_flight("conc") == 0

    async def abandoned() -> None:  # a non-streaming request whose client leaves
        async with httpx.AsyncClient(base_url=server.url, headers=headers, timeout=60) as client:
            task = asyncio.ensure_future(client.post("/v1/messages", json=body))
            await until(lambda: tenancy.in_flight("conc") == 1)
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

    asyncio.run(abandoned())
    assert wait_until(lambda: tenancy.in_flight("conc") == 0)
    assert c.messages.create(model=TEXT_MODEL, max_tokens=2, messages=HI).content
    assert value(metrics(server), "tierlm:rate_limited_requests_total", tenant="conc", reason="concurrency") == 2


def _post_one_seq(client: httpx.AsyncClient, key: str, max_tokens: int) -> Any:
    return client.post("/v1/messages", headers={"x-api-key": KEYS[key]},
                       json={"model": ONE_SEQ, "max_tokens": max_tokens, "messages": HI})


def test_a_queued_gold_request_runs_before_queued_bronze_ones(server, engines, monkeypatch):
    """One sequence at a time: while a bronze request runs, a bronze one queues, then a gold one;
    when the first ends, gold goes next, though it came last."""
    engine = engines[ONE_SEQ]
    seen = record_requests(engine, monkeypatch)
    slow_steps(engine, monkeypatch, 0.05)  # the busy request (24 s at least) outlasts the others' queueing

    async def run() -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=server.url, timeout=120) as client:
            busy = asyncio.ensure_future(_post_one_seq(client, "lone", 480))
            await until(lambda: engine.stats().num_running == 1)
            bronze = asyncio.ensure_future(_post_one_seq(client, "lone", 3))
            await until(lambda: engine.stats().num_waiting == 1)
            gold = asyncio.ensure_future(_post_one_seq(client, "vip", 3))
            await until(lambda: engine.stats().num_waiting == 2)
            busy.cancel()  # its client leaves: the engine's one slot frees
            await asyncio.gather(busy, return_exceptions=True)
            return list(await asyncio.gather(bronze, gold))

    responses = asyncio.run(run())
    assert [r.status_code for r in responses] == [200, 200]
    busy, bronze, gold = seen
    assert [busy.priority, bronze.priority, gold.priority] == [2, 2, 0]  # bronze, bronze, gold
    assert bronze.arrival_time < gold.arrival_time
    assert gold.first_scheduled_time < bronze.first_scheduled_time


def test_a_tenant_is_not_queued_behind_another_tenants_burst_in_its_tier(server, engines, monkeypatch):
    """Fair shares within a tier: while acme's long request runs, acme queues three more, then
    vip (also gold) one. vip has had no service, acme plenty: when the slot frees, vip goes
    next, though it came last (first come first served would run it fourth)."""
    engine = engines[ONE_SEQ]
    seen = record_requests(engine, monkeypatch)
    slow_steps(engine, monkeypatch, 0.05)
    fair = engine.engine.scheduler.fair

    async def run() -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=server.url, timeout=120) as client:
            busy = asyncio.ensure_future(_post_one_seq(client, "acme-a", 480))
            await until(lambda: engine.stats().num_running == 1)
            burst = []
            for i, key in enumerate(("acme-a", "acme-b", "acme-a")):
                burst.append(asyncio.ensure_future(_post_one_seq(client, key, 3)))
                await until(lambda: engine.stats().num_waiting == i + 1)
            late = asyncio.ensure_future(_post_one_seq(client, "vip", 3))
            await until(lambda: engine.stats().num_waiting == 4)
            # vip starts level with acme (no credit for the time it was away); acme's running
            # request then keeps adding to acme's share.
            await until(lambda: fair.counters.get("acme", 0) > fair.counters.get("vip", 0) > 0)
            busy.cancel()
            await asyncio.gather(busy, return_exceptions=True)
            return list(await asyncio.gather(*burst, late))

    responses = asyncio.run(run())
    assert [r.status_code for r in responses] == [200] * 4
    busy, *burst, late = seen
    assert {r.tenant_id for r in (busy, *burst)} == {"acme"} and late.tenant_id == "vip"
    # the tenants file's weights and KV quotas reach the engine
    assert (late.tenant_weight, late.kv_share, busy.tenant_weight, busy.kv_share) == (3.0, 0.5, 1.0, None)
    assert busy.priority == late.priority == 0
    assert all(late.arrival_time > r.arrival_time and late.first_scheduled_time < r.first_scheduled_time
               for r in burst)


def test_a_request_that_ends_before_its_first_token_pays_for_its_prompt(server, engines, tenancy, clock, monkeypatch):
    """Queued behind a busy request, its client gone before any output: it was charged nothing
    (its usage is only known from the first token on), so large prefills abandoned early were free."""
    engine = engines[ONE_SEQ]
    seen = record_requests(engine, monkeypatch)
    slow_steps(engine, monkeypatch, 0.05)
    clock.advance(3600)  # the tpm tenant's bucket full again: 5 tokens

    async def run() -> None:
        async with httpx.AsyncClient(base_url=server.url, timeout=120) as client:
            busy = asyncio.ensure_future(_post_one_seq(client, "lone", 480))
            await until(lambda: engine.stats().num_running == 1)
            queued = asyncio.ensure_future(_post_one_seq(client, "tpm", 3))
            await until(lambda: engine.stats().num_waiting == 1)
            queued.cancel()  # its client leaves while it waits
            await asyncio.gather(queued, return_exceptions=True)
            await until(lambda: tenancy.in_flight("tpm") == 0)
            busy.cancel()
            await asyncio.gather(busy, return_exceptions=True)

    asyncio.run(run())
    prompt = len(seen[1].prompt_token_ids)
    assert prompt > 5 and tenancy._usage["tpm"].tokens.level(clock()) == 5 - prompt


# ---- tierlm serve --tenants ----------------------------------------------------------------


def test_serve_refuses_a_bad_tenants_file_or_tenants_without_keys(tmp_path):
    keys = tmp_path / "keys.txt"
    keys.write_text(keys_file_line("ci", "sk-cli") + "\n")
    tenants = tmp_path / "tenants.toml"
    tenants.write_text('[tenants.team]\nkeys = ["ci", "cd"]\n')
    proc = serve("--port", str(free_port()), "--api-keys", str(keys), "--tenants", str(tenants))
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 2, out
    assert f"error: {tenants}: tenants.team.keys: key id 'cd' is not in the keys file" in out
    assert "Traceback" not in out and "engine ready" not in out
    proc = serve("--port", str(free_port()), "--no-auth", "--tenants", str(tenants))
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 2 and "error: --tenants needs --api-keys" in out, out


@pytest.mark.slow
def test_serve_with_tenants_limits_and_labels_requests(tmp_path):
    keys = tmp_path / "keys.txt"
    keys.write_text(keys_file_line("ci", "sk-cli") + "\n")
    tenants = tmp_path / "tenants.toml"
    tenants.write_text('[tenants.team]\ntier = "gold"\nkeys = ["ci"]\nrequests_per_minute = 1\n')
    port = free_port()
    proc = serve("--port", str(port), "--api-keys", str(keys), "--tenants", str(tenants))
    url = f"http://127.0.0.1:{port}"
    try:
        wait_ready(proc, port, time.monotonic() + 120)
        model = httpx.get(url + "/v1/models", headers={"x-api-key": "sk-cli"}).json()["data"][0]["id"]
        body = {"model": model, "max_tokens": 2, "messages": HI}
        ok = httpx.post(url + "/v1/messages", headers={"x-api-key": "sk-cli"}, json=body, timeout=60)
        assert ok.status_code == 200 and ok.headers["anthropic-ratelimit-requests-remaining"] == "0"
        refused = httpx.post(url + "/v1/messages", headers={"x-api-key": "sk-cli"}, json=body, timeout=60)
        assert refused.status_code == 429 and 1 <= int(refused.headers["retry-after"]) <= 60
        text = httpx.get(url + "/metrics").text
        assert value(text, "tierlm:rate_limited_requests_total", tenant="team", reason="requests") == 1
        assert value(text, "tierlm:requests_total", tenant="team", status="200") == 1
    finally:
        proc.terminate()
        out, _ = proc.communicate(timeout=60)
    assert "tenants from" in out and "team (gold)" in out


def test_a_429_names_the_limit_that_holds_it_longest_with_the_headers_wait():
    """Over 7 requests a minute (a short wait) and deep in token debt (a long one): the message
    named the first limit with the longest wait; and a wait under half a millisecond read 0 s
    beside a retry-after of 1."""
    from tierlm.serving.tenancy import TenantRateLimited

    clock = Clock()
    tenancy = Tenancy(parse('[tenants.t]\nkeys = ["rpm"]\nrequests_per_minute = 7\ntokens_per_minute = 10'),
                      clock=clock)
    tenant = tenancy.tenant_of("rpm")
    for _ in range(7):
        asyncio.run(tenancy.admit_here(tenant, "openai").release(100 if _ == 6 else 0))  # the last one runs 100 tokens
    with pytest.raises(TenantRateLimited) as refused:
        tenancy.admit_here(tenant, "openai")
    assert refused.value.reason == "tokens" and "10 tokens per minute" in refused.value.message
    seconds = refused.value.headers["retry-after"]
    assert f"retry after {seconds} s" in refused.value.message and int(seconds) > 60
    fresh = Tenancy(parse('[tenants.t]\nkeys = ["rpm"]\nrequests_per_minute = 7'), clock=clock)
    tenant = fresh.tenant_of("rpm")
    for _ in range(7):
        fresh.admit_here(tenant, "openai")
    clock.advance(60 / 7 - 1e-5)  # a hundredth of a millisecond short of the next request
    with pytest.raises(TenantRateLimited) as refused:
        fresh.admit_here(tenant, "openai")
    assert "retry after 1 s" in refused.value.message and refused.value.headers["retry-after"] == "1"


def test_a_tenant_s_models_come_from_its_own_entry_else_its_tier_else_every_model():
    config = parse('default_tier = "silver"\n[tiers.silver]\nmodels = ["base"]\n'
                   '[tenants.a]\ntier = "silver"\nkeys = ["rpm"]\nmodels = ["base", "a-lora"]\n'
                   '[tenants.b]\ntier = "silver"\nkeys = ["tpm"]\n[tenants.c]\ntier = "gold"\nkeys = ["conc"]')
    assert config.tenant_of("rpm").models == {"base", "a-lora"}
    assert config.tenant_of("tpm").models == {"base"}
    assert config.tenant_of("lone").models == {"base"}  # a lone key: the default tier's
    assert config.tenant_of("conc").models is None  # gold sets none: every model
