"""The SLA guard (tierlm/serving/sla.py): a request whose tier's time-to-first-token target its
engine estimates it would miss is refused up front, in each API's overload shape, through the
official SDKs, and reaches nothing (no engine request, no tokens charged); a tier without a
target, or with one the estimate meets, is served."""
from __future__ import annotations

import asyncio
from typing import Any

import anthropic
import httpx
import openai
import pytest

from tests.serving.harness import ServerThread, record_requests, slow_steps, until
from tests.serving.scripted_model import ENGINE_OPTIONS, LOOP_MODEL
from tests.serving.test_telemetry import value
from tierlm.serving.app import build_app
from tierlm.serving.auth import ApiKeyAuth
from tierlm.serving.tenancy import Tenancy

KEYS = {name: f"sk-{name}" for name in ("strict", "relaxed", "plain", "busy", "lone", "metered")}
TENANTS = """
default_tier = "strict"        # "lone" is in no tenant: a tenant of its own, of this tier

[tiers.strict]
priority = 0
ttft_target_ms = 1             # nothing queued behind a running request can start this soon

[tiers.relaxed]
priority = 0
ttft_target_ms = 3600000

[tenants.strict]
tier = "strict"
keys = ["strict"]

[tenants.relaxed]
tier = "relaxed"
keys = ["relaxed"]

[tenants.metered]
tier = "strict"
keys = ["metered"]
requests_per_minute = 2

[tenants.plain]
tier = "gold"                  # no target: never shed
keys = ["plain"]

[tenants.busy]
tier = "bronze"
keys = ["busy"]
"""
MODEL = "loop-one-seq-sla"
HI = [{"role": "user", "content": "Hi"}]


@pytest.fixture(scope="module")
def engine(scripted_models):
    from tierlm.engine.async_engine import AsyncEngine
    return AsyncEngine.from_model(str(scripted_models[LOOP_MODEL].path), served_model_name=MODEL,
                                  **{**ENGINE_OPTIONS, "max_num_seqs": 1})


@pytest.fixture(scope="module")
def server(engine, tmp_path_factory):
    path = tmp_path_factory.mktemp("sla") / "tenants.toml"
    path.write_text(TENANTS)
    app = build_app({MODEL: engine}, ApiKeyAuth.from_keys(KEYS), tenancy=Tenancy.from_file(path, KEYS))
    srv = ServerThread(app).start()
    yield srv
    srv.stop()


def _post(client: httpx.AsyncClient, key: str, max_tokens: int) -> Any:
    return client.post("/v1/messages", headers={"x-api-key": KEYS[key]},
                       json={"model": MODEL, "max_tokens": max_tokens, "messages": HI})


def test_a_request_that_would_miss_its_tiers_target_is_shed_through_both_sdks(server, engine, monkeypatch):
    seen = record_requests(engine, monkeypatch)
    slow_steps(engine, monkeypatch, 0.05)  # the busy request holds the one slot for 24 s at least
    claude = anthropic.Anthropic(base_url=server.url, api_key=KEYS["strict"], max_retries=0, timeout=60)
    oai = openai.OpenAI(base_url=server.url + "/v1", api_key=KEYS["lone"], max_retries=0, timeout=60)

    def shed_both() -> tuple[anthropic.OverloadedError, openai.InternalServerError]:
        with pytest.raises(anthropic.OverloadedError) as a:
            claude.messages.create(model=MODEL, max_tokens=3, messages=HI)
        with pytest.raises(openai.InternalServerError) as o:
            oai.chat.completions.create(model=MODEL, max_tokens=3, messages=HI)
        return a.value, o.value

    async def run() -> tuple[Any, list[httpx.Response]]:
        async with httpx.AsyncClient(base_url=server.url, timeout=120) as client:
            busy = asyncio.ensure_future(_post(client, "busy", 480))
            await until(lambda: engine.stats().num_running == 1 and engine.engine.estimate_ttft(8) is not None)
            refused = await asyncio.to_thread(shed_both)
            assert engine.stats().num_waiting == 0  # the shed requests never reached the engine
            served = [asyncio.ensure_future(_post(client, key, 3)) for key in ("relaxed", "plain")]
            await until(lambda: engine.stats().num_waiting == 2)  # queued: their targets allow it
            busy.cancel()
            await asyncio.gather(busy, return_exceptions=True)
            return refused, list(await asyncio.gather(*served))

    (a, o), served = asyncio.run(run())
    assert a.status_code == 529 and a.body["error"]["type"] == "overloaded_error"
    assert "tier 'strict''s time-to-first-token target of 0.001 s" in a.message and "retry in" in a.message
    assert int(a.response.headers["retry-after"]) >= 1
    assert o.status_code == 503 and o.body["code"] == "sla_overloaded" and "tier 'strict'" in o.message
    assert [r.status_code for r in served] == [200, 200]
    # The relaxed tier's request (a target, admitted) taught the estimate how it did; gold has none.
    assert engine.engine.ttft_calibration.observed.get(0) == 1
    # nothing of the shed ones (the two served were sent together: either may reach the engine first)
    assert seen[0].tenant_id == "busy" and sorted(r.tenant_id for r in seen[1:]) == ["plain", "relaxed"]
    metrics = httpx.get(server.url + "/metrics").text
    assert value(metrics, "tierlm:sla_shed_requests_total", model=MODEL, tier="strict") == 2


def test_shed_requests_give_back_their_requests_per_minute(server, engine, monkeypatch):
    """The server refused them for its own load: a client that retries each 529 (as both SDKs
    do) kept none of its 2 requests a minute for when the overload ended, and got 429s then."""
    slow_steps(engine, monkeypatch, 0.05)

    async def run() -> tuple[list[httpx.Response], httpx.Response]:
        async with httpx.AsyncClient(base_url=server.url, timeout=120) as client:
            busy = asyncio.ensure_future(_post(client, "busy", 480))
            await until(lambda: engine.stats().num_running == 1 and engine.engine.estimate_ttft(8) is not None)
            shed = [await _post(client, "metered", 3) for _ in range(4)]
            busy.cancel()
            await asyncio.gather(busy, return_exceptions=True)
            await until(lambda: not engine.engine.has_unfinished())
            return shed, await _post(client, "metered", 3)

    shed, served = asyncio.run(run())
    assert [r.status_code for r in shed] == [529] * 4
    assert served.status_code == 200 and served.headers["anthropic-ratelimit-requests-remaining"] == "1"


def test_an_idle_engine_sheds_nothing(server, engine):
    """An engine that has run no step has no estimate: nothing is shed on a guess."""
    from tierlm.engine.load import StepTimeModel
    engine.engine.step_time = StepTimeModel()  # as a fresh engine
    claude = anthropic.Anthropic(base_url=server.url, api_key=KEYS["strict"], max_retries=0, timeout=60)
    assert claude.messages.create(model=MODEL, max_tokens=2, messages=HI).content


def test_an_idle_engine_admits_what_a_stale_estimate_would_shed_and_learns_from_it(server, engine):
    """After a slowdown (5 s steps) the step-time fit says any request is late. A tier whose only
    traffic that sheds was shed for good: the fit learns only from steps that run, and none ran.
    An idle engine admits it, and the steps it runs bring the estimate down."""
    from tierlm.engine.load import StepTimeModel
    eng = engine.engine
    try:
        for _ in range(20):
            eng.step_time.observe(8, 5.0)
            eng.step_time.observe(64, 5.5)
        assert not eng.has_unfinished() and eng.estimate_ttft(8) > 1.0
        before, steps = eng.estimate_ttft(8), eng.steps
        claude = anthropic.Anthropic(base_url=server.url, api_key=KEYS["strict"], max_retries=0, timeout=60)
        for _ in range(3):
            assert claude.messages.create(model=MODEL, max_tokens=4, messages=HI).content
        assert eng.steps > steps and eng.estimate_ttft(8) < before
    finally:
        eng.step_time = StepTimeModel()


def test_ttft_targets_in_the_tenants_file():
    import tomllib
    from tierlm.serving.tenancy import TenantsConfig
    config = TenantsConfig.parse(tomllib.loads(TENANTS), KEYS, source="t.toml")
    assert config.tenant_of("strict").ttft_target_s == 0.001
    assert config.tenant_of("relaxed").ttft_target_s == 3600.0
    assert config.tenant_of("plain").ttft_target_s is None
    assert config.tenant_of("lone").ttft_target_s == 0.001  # a lone key takes its default tier's
    for bad, says in (("0", "got 0"), ("-5", "got -5"), ('"fast"', "got 'fast'"), ("true", "got True"),
                      ("4000000", "got 4000000")):
        with pytest.raises(ValueError, match=f"t.toml: tiers.gold.ttft_target_ms: must be a number of "
                                             f"milliseconds from 1 to 3600000 \\({says}\\)"):
            TenantsConfig.parse(tomllib.loads(f"[tiers.gold]\nttft_target_ms = {bad}"), KEYS, source="t.toml")
    with pytest.raises(ValueError, match="tenants.a.ttft_target_ms: unknown field"):
        TenantsConfig.parse(tomllib.loads('[tenants.a]\nkeys = ["strict"]\nttft_target_ms = 5'), KEYS, source="t.toml")
