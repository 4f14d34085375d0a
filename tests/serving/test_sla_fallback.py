"""The SLA guard's fallback model and circuit breaker through the real server and the official
SDKs (tierlm/serving/sla.py, breaker.py): a request its model's guard refuses is served by the
fallback model (its answer names that model, a header names the one asked for), on every route,
streamed or not; refused by both, it gets the first model's overload error, reaching neither
engine. A tier whose requests keep missing their target on a model is refused there until a
probe meets it again."""
from __future__ import annotations

import asyncio
import time
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
from tierlm.serving.breaker import BreakerSettings, BreakerState
from tierlm.serving.cli import parse_fallbacks
from tierlm.serving.sla import FALLBACK_HEADER, SlaGuard
from tierlm.serving.tenancy import Tenancy

KEYS = {name: f"sk-{name}" for name in ("firm", "tight", "steady", "loose", "twitchy")}
TENANTS = """
[tiers.firm]
priority = 0
ttft_target_ms = 2000

[tiers.tight]
priority = 0
ttft_target_ms = 1000

[tiers.steady]
priority = 0                   # no target: never refused, never sent elsewhere

[tiers.loose]
priority = 0
ttft_target_ms = 60000
breaker = false                # the estimate may shed it, its breaker never

[tiers.twitchy]
priority = 0
ttft_target_ms = 60000
breaker = { window = 2, min_outcomes = 2, cooldown_ms = 250 }

[tenants.loose]
tier = "loose"
keys = ["loose"]

[tenants.twitchy]
tier = "twitchy"
keys = ["twitchy"]

[tenants.firm]
tier = "firm"
keys = ["firm"]

[tenants.tight]
tier = "tight"
keys = ["tight"]

[tenants.steady]
tier = "steady"
keys = ["steady"]
"""
BIG, SMALL = "big-sla", "small-sla"
HI = [{"role": "user", "content": "Hi"}]
BREAKER = BreakerSettings(window=3, min_outcomes=3, trip_fraction=1.0, cooldown_s=0.5, probes=1)


def _engine(scripted_models: Any, name: str, max_model_len: int) -> Any:
    from tierlm.engine.async_engine import AsyncEngine
    return AsyncEngine.from_model(str(scripted_models[LOOP_MODEL].path), served_model_name=name,
                                  **{**ENGINE_OPTIONS, "max_num_seqs": 1, "max_model_len": max_model_len})


@pytest.fixture(scope="module")
def engines(scripted_models):
    return {BIG: _engine(scripted_models, BIG, 512), SMALL: _engine(scripted_models, SMALL, 128)}


@pytest.fixture(scope="module")
def server(engines, tmp_path_factory):
    path = tmp_path_factory.mktemp("sla-fallback") / "tenants.toml"
    path.write_text(TENANTS)
    app = build_app(engines, ApiKeyAuth.from_keys(KEYS), tenancy=Tenancy.from_file(path, KEYS),
                    sla=SlaGuard(fallbacks={BIG: SMALL}, breaker=BREAKER))
    srv = ServerThread(app).start()
    yield srv
    srv.stop()


def _busy(client: httpx.AsyncClient, model: str, max_tokens: int = 480) -> Any:
    """A long answer holding `model`'s one sequence slot (a tier without a target)."""
    return asyncio.ensure_future(client.post("/v1/messages", headers={"x-api-key": KEYS["steady"]},
                                             json={"model": model, "max_tokens": max_tokens, "messages": HI}))


async def _stop(task: Any) -> None:
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)


def _idle(engine: Any) -> bool:
    stats = engine.stats()
    return stats.num_running == stats.num_waiting == 0


def _fresh_estimates(engine: Any) -> None:
    """The engine's step-time fit as a fresh engine's: no estimate, nothing refused on one."""
    from tierlm.engine.load import StepTimeModel
    engine.engine.step_time = StepTimeModel()


def _no_finished_answers(engine: Any) -> None:
    """The engine's record of output lengths as a fresh engine's: a running answer is expected to
    take its max_tokens (not the few tokens of the earlier tests' answers)."""
    from tierlm.engine.load import OutputLengths
    engine.engine.output_lengths = OutputLengths()


def test_a_request_its_model_would_serve_late_is_served_by_the_fallback(server, engines, monkeypatch):
    big, small = engines[BIG], engines[SMALL]
    seen_big, seen_small = record_requests(big, monkeypatch), record_requests(small, monkeypatch)
    slow_steps(big, monkeypatch, 0.05)  # the busy answer holds big's slot for 24 s at least
    claude = anthropic.Anthropic(base_url=server.url, api_key=KEYS["firm"], max_retries=0, timeout=60)
    oai = openai.OpenAI(base_url=server.url + "/v1", api_key=KEYS["firm"], max_retries=0, timeout=60)

    def through_sdks() -> list[tuple[str, str | None]]:
        """(the model each answer names, the fallback header) on every route, streamed or not."""
        got = []
        raw = claude.messages.with_raw_response.create(model=BIG, max_tokens=3, messages=HI)
        got.append((raw.parse().model, raw.headers.get(FALLBACK_HEADER)))
        with claude.messages.stream(model=BIG, max_tokens=3, messages=HI) as stream:
            got.append((stream.get_final_message().model, stream.response.headers.get(FALLBACK_HEADER)))
        raw = oai.chat.completions.with_raw_response.create(model=BIG, max_tokens=3, messages=HI)
        got.append((raw.parse().model, raw.headers.get(FALLBACK_HEADER)))
        with oai.completions.with_streaming_response.create(model=BIG, prompt="Hi", max_tokens=3,
                                                            stream=True) as response:
            models = {chunk.model for chunk in response.parse()}
            got.append((models.pop() if len(models) == 1 else str(models), response.headers.get(FALLBACK_HEADER)))
        raw = oai.responses.with_raw_response.create(model=BIG, input="Hi", max_output_tokens=16)
        got.append((raw.parse().model, raw.headers.get(FALLBACK_HEADER)))
        # too long for the small model's context: the error is big's, not the small one's 400
        with pytest.raises(anthropic.OverloadedError) as refused:
            claude.messages.create(model=BIG, max_tokens=3, messages=[{"role": "user", "content": "Hi " * 60}])
        assert f"its fallback model '{SMALL}' cannot take this request" in refused.value.message
        assert "context" in refused.value.message
        return got

    async def run() -> list[tuple[str, str | None]]:
        async with httpx.AsyncClient(base_url=server.url, timeout=120) as client:
            busy = _busy(client, BIG)
            await until(lambda: big.stats().num_running == 1 and (big.engine.estimate_ttft(8) or 0) > 2)
            try:
                return await asyncio.to_thread(through_sdks)
            finally:
                await _stop(busy)

    assert asyncio.run(run()) == [(SMALL, BIG)] * 5
    assert len(seen_big) == 1 and seen_big[0].tenant_id == "steady"  # big saw none of them
    assert [r.tenant_id for r in seen_small] == ["firm"] * 5
    metrics = httpx.get(server.url + "/metrics").text
    assert value(metrics, "tierlm:sla_fallbacks_total", model=BIG, fallback=SMALL, tier="firm",
                 reason="estimate") == 5
    assert value(metrics, "tierlm:sla_shed_requests_total") == 1  # the long one
    # a request naming the small model itself is no fallback
    raw = claude.messages.with_raw_response.create(model=SMALL, max_tokens=3, messages=HI)
    assert raw.parse().model == SMALL and FALLBACK_HEADER not in raw.headers


def test_refused_by_both_it_gets_the_first_models_overload_error(server, engines, monkeypatch):
    big, small = engines[BIG], engines[SMALL]
    asyncio.run(until(lambda: all(_idle(e) for e in engines.values())))
    seen = record_requests(big, monkeypatch), record_requests(small, monkeypatch)
    for engine, seconds in ((big, 0.05), (small, 0.2)):  # each busy for 20 s at least
        slow_steps(engine, monkeypatch, seconds)
        _no_finished_answers(engine)
    claude = anthropic.Anthropic(base_url=server.url, api_key=KEYS["firm"], max_retries=0, timeout=60)
    oai = openai.OpenAI(base_url=server.url + "/v1", api_key=KEYS["firm"], max_retries=0, timeout=60)
    shed_before = _shed(server)

    def refused() -> tuple[anthropic.OverloadedError, openai.InternalServerError]:
        with pytest.raises(anthropic.OverloadedError) as a:
            claude.messages.create(model=BIG, max_tokens=3, messages=HI)
        with pytest.raises(openai.InternalServerError) as o:
            oai.chat.completions.create(model=BIG, max_tokens=3, messages=HI)
        return a.value, o.value

    async def run() -> tuple[Any, Any]:
        async with httpx.AsyncClient(base_url=server.url, timeout=120) as client:
            both = [_busy(client, BIG), _busy(client, SMALL, 100)]  # (small: a 128-token context)
            await until(lambda: all(e.stats().num_running == 1 and (e.engine.estimate_ttft(8) or 0) > 2
                                    for e in (big, small)))
            try:
                return await asyncio.to_thread(refused)
            finally:
                for task in both:
                    await _stop(task)

    a, o = asyncio.run(run())
    assert a.status_code == 529 and f"model '{BIG}' is too busy" in a.message
    assert f"its fallback model '{SMALL}' is too busy as well" in a.message
    assert int(a.response.headers["retry-after"]) >= 1
    assert o.status_code == 503 and o.body["code"] == "sla_overloaded" and SMALL in o.message
    assert [[r.tenant_id for r in s] for s in seen] == [["steady"], ["steady"]]  # neither saw them
    assert _shed(server) == shed_before + 2


def _shed(server: ServerThread) -> float:
    metrics = httpx.get(server.url + "/metrics").text
    return value(metrics, "tierlm:sla_shed_requests_total", model=BIG, tier="firm", reason="estimate")


def test_a_tier_that_keeps_missing_its_target_is_refused_until_a_probe_meets_it(server, engines, monkeypatch):
    small = engines[SMALL]  # (no fallback of its own)
    asyncio.run(until(lambda: all(_idle(e) for e in engines.values())))  # the busy answers before are gone
    execute = small.engine.runner.execute
    slow_steps(small, monkeypatch, 1.5)  # every first token comes after the tier's 1 s target
    _fresh_estimates(small)  # so the estimate lets them all in: only the breaker can refuse
    oai = openai.OpenAI(base_url=server.url + "/v1", api_key=KEYS["tight"], max_retries=0, timeout=60)

    def ask() -> Any:
        return oai.chat.completions.create(model=SMALL, max_tokens=1, messages=HI)

    async def run() -> Any:
        late = [asyncio.ensure_future(asyncio.to_thread(ask)) for _ in range(3)]
        breaker = server.app.state.tierlm.sla.breaker_for(SMALL, "tight")
        await until(lambda: breaker.state is BreakerState.OPEN)  # at 1 s, before any first token
        assert not any(t.done() for t in late)
        with pytest.raises(openai.InternalServerError) as refused:
            await asyncio.to_thread(ask)
        await asyncio.gather(*late)  # they are served, late
        return refused.value, breaker

    refused, breaker = asyncio.run(run())
    assert refused.status_code == 503 and "circuit breaker open" in refused.message
    assert "missed tier 'tight''s time-to-first-token target of 1 s for 3 of its last 3 requests" in refused.message
    monkeypatch.setattr(small.engine.runner, "execute", execute)  # the engine is fast again
    _fresh_estimates(small)
    asyncio.run(until(lambda: time.monotonic() >= breaker.refusing_until, timeout=5))  # the cool-down
    assert ask().choices  # the probe: in time, so the breaker closes
    assert breaker.state is BreakerState.CLOSED
    metrics = httpx.get(server.url + "/metrics").text
    assert value(metrics, "tierlm:sla_breaker_trips_total", model=SMALL, tier="tight") == 1
    assert value(metrics, "tierlm:sla_shed_requests_total", model=SMALL, tier="tight", reason="breaker") == 1


def test_fallbacks_name_served_models(engines):
    assert parse_fallbacks(["a=b", "c=b"], ["a", "b", "c"]) == {"a": "b", "c": "b"}
    for specs, says in ((["a"], "expects BIG=SMALL"), (["a=b", "a=c"], "two fallbacks"),
                        (["a=x"], "no model is served as 'x'; served: a, b, c")):
        with pytest.raises(ValueError, match=says):
            parse_fallbacks(specs, ["a", "b", "c"])
    with pytest.raises(ValueError, match=f"model 'nope' is not served here; serve it with --model nope=DIR"):
        build_app(engines, ApiKeyAuth.from_keys(KEYS), sla=SlaGuard(fallbacks={BIG: "nope"}))


def test_a_tiers_breaker_settings_from_the_tenants_file_reach_its_requests(server):
    """`breaker = false` on a tier: its requests have no breaker at all; a tier's own table:
    its breaker runs with those settings; the others keep the server's."""
    guard = server.app.state.tierlm.sla
    for key in ("loose", "twitchy", "firm"):
        oai = openai.OpenAI(base_url=server.url + "/v1", api_key=KEYS[key], max_retries=0, timeout=60)
        assert oai.chat.completions.create(model=SMALL, max_tokens=1, messages=HI).choices
    assert (SMALL, "loose") not in guard._breakers
    assert guard._breakers[(SMALL, "twitchy")].settings == BreakerSettings(window=2, min_outcomes=2, cooldown_s=0.25)
    assert guard._breakers[(SMALL, "firm")].settings == BREAKER
