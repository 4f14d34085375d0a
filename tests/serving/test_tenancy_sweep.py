"""A hostile operator's and client's sweep of tenants (tierlm/serving/tenancy.py): odd tenants
files, what each route charges, slots under races, errors, disconnects and shutdown, and cache
isolation through every API's `cache_salt`. Tests of bugs found by the sweep say what was wrong.

The server's tenancy runs on a clock the tests move, so buckets only change when a test says."""
from __future__ import annotations

import asyncio
import threading
import tomllib
import uuid
from typing import Any

import anthropic
import httpx
import openai
import pytest

from tests.serving.harness import ServerThread, fail_after_steps, record_requests, slow_steps, wait_until
from tests.serving.scripted_model import LOOP_MODEL, TEXT_MODEL
from tests.serving.test_cli import free_port, serve
from tests.serving.test_telemetry import samples, value
from tierlm.serving.app import build_app
from tierlm.serving.auth import ApiKeyAuth, keys_file_line, load_keys_file
from tierlm.serving.tenancy import Tenancy, TenantsConfig

KEYS = {name: f"sk-{name}" for name in ("one-a", "one-b", "tok", "iso-a", "iso-b", "uni", "lone")}
UNICODE_TENANT = "租户 ✓"
TENANTS = f"""
[tiers.silver]
max_concurrent = 5              # its tenants' default, which "one" overrides

[tenants.one]
tier = "silver"
keys = ["one-a", "one-b"]
max_concurrent = 1

[tenants.tok]
keys = ["tok"]
tokens_per_minute = 100000

[tenants.iso-a]
keys = ["iso-a"]

[tenants.iso-b]
keys = ["iso-b"]

[tenants."{UNICODE_TENANT}"]
tier = "gold"
keys = ["uni"]
requests_per_minute = 1
"""
HI = [{"role": "user", "content": "Hi"}]


def parse(text: str, keys: Any = KEYS) -> TenantsConfig:
    return TenantsConfig.parse(tomllib.loads(text), keys, source="t.toml")


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


# ---- a server with tenants -----------------------------------------------------------------


@pytest.fixture(scope="module")
def clock() -> Clock:
    return Clock()


@pytest.fixture(scope="module")
def tenancy(clock) -> Tenancy:
    return Tenancy(parse(TENANTS), clock=clock)


@pytest.fixture(scope="module")
def engines(scripted_models) -> dict:
    return {TEXT_MODEL: scripted_models[TEXT_MODEL].engine(), LOOP_MODEL: scripted_models[LOOP_MODEL].engine()}


@pytest.fixture(scope="module")
def server(engines, tenancy):
    srv = ServerThread(build_app(engines, ApiKeyAuth.from_keys(KEYS), tenancy=tenancy)).start()
    yield srv
    srv.stop()


def claude(server: ServerThread, key: str) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.url, api_key=KEYS[key], max_retries=0, timeout=60)


def oai(server: ServerThread, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEYS[key], max_retries=0, timeout=60)


def tokens_left(tenancy: Tenancy, tenant: str) -> float:
    return tenancy._usage[tenant].tokens.level(tenancy.clock())


def test_every_generation_route_charges_the_tokens_its_usage_reports(server, tenancy):
    """Streamed or not, n > 1, cache warms, the Responses API: the bucket drops by exactly the
    usage the client is shown (prompt once, cached part included, plus every choice's output)."""
    c, o = claude(server, "tok"), oai(server, "tok")

    def anthropic_total(usage: Any) -> int:
        return usage.input_tokens + usage.output_tokens + (usage.cache_read_input_tokens or 0)

    def streamed_message(max_tokens: int) -> int:
        with c.messages.stream(model=TEXT_MODEL, max_tokens=max_tokens, messages=HI) as stream:
            return anthropic_total(stream.get_final_message().usage)

    def streamed_completions() -> int:
        chunks = list(o.completions.create(model=TEXT_MODEL, max_tokens=3, prompt="Hello", n=3, stream=True,
                                           stream_options={"include_usage": True}))
        return chunks[-1].usage.total_tokens

    def streamed_response() -> int:
        events = list(o.responses.create(model=TEXT_MODEL, max_output_tokens=3, input="Hi", stream=True))
        return events[-1].response.usage.total_tokens

    requests = {
        "messages": lambda: anthropic_total(c.messages.create(model=TEXT_MODEL, max_tokens=3, messages=HI).usage),
        "messages, streamed": lambda: streamed_message(3),
        "messages, cache warm (max_tokens 0)": lambda: anthropic_total(
            c.messages.create(model=TEXT_MODEL, max_tokens=0, messages=HI).usage),
        "messages, streamed cache warm": lambda: streamed_message(0),
        "completions n=3": lambda: o.completions.create(model=TEXT_MODEL, max_tokens=3, prompt="Hello",
                                                        n=3).usage.total_tokens,
        "completions n=3, streamed": streamed_completions,
        "chat n=4": lambda: o.chat.completions.create(model=TEXT_MODEL, max_tokens=3, messages=HI,
                                                      n=4).usage.total_tokens,
        "responses": lambda: o.responses.create(model=TEXT_MODEL, max_output_tokens=3,
                                                input="Hi").usage.total_tokens,
        "responses, streamed": streamed_response,
    }
    claude(server, "tok").messages.create(model=TEXT_MODEL, max_tokens=1, messages=HI)  # the bucket exists
    for name, send in requests.items():
        before = tokens_left(tenancy, "tok")
        used = send()
        assert (name, before - tokens_left(tenancy, "tok")) == (name, used)
    assert tenancy.in_flight("tok") == 0


def test_a_client_gone_or_an_engine_fault_mid_stream_is_charged_what_it_got(server, tenancy, engines, monkeypatch):
    slow_steps(engines[LOOP_MODEL], monkeypatch, 0.02)
    before = tokens_left(tenancy, "tok")
    with httpx.stream("POST", server.url + "/v1/chat/completions", headers={"authorization": f"Bearer {KEYS['tok']}"},
                      json={"model": LOOP_MODEL, "max_tokens": 400, "messages": HI, "n": 2, "stream": True},
                      timeout=60) as r:
        deltas = 0
        for line in r.iter_lines():
            deltas += '"delta"' in line
            if deltas > 10:
                break  # the client leaves mid-answer
    assert wait_until(lambda: tenancy.in_flight("tok") == 0)
    assert before - tokens_left(tenancy, "tok") > 10  # the prompt and the tokens it read, at least
    fail_after_steps(engines[LOOP_MODEL], monkeypatch, 5)
    before = tokens_left(tenancy, "tok")
    with httpx.stream("POST", server.url + "/v1/messages", headers={"x-api-key": KEYS["tok"]},
                      json={"model": LOOP_MODEL, "max_tokens": 400, "messages": HI, "stream": True},
                      timeout=60) as r:
        assert "event: error" in r.read().decode()
    assert tenancy.in_flight("tok") == 0
    assert before - tokens_left(tenancy, "tok") > 0


def test_max_concurrent_1_admits_one_request_at_a_time_under_a_rush_and_leaks_no_slot(server, tenancy, engines,
                                                                                       monkeypatch):
    """90 requests (both keys of the tenant, both APIs, streamed or not, n=2) sent 30 at a time:
    never two in flight, every refusal a 429, and the slot free afterwards."""
    slow_steps(engines[LOOP_MODEL], monkeypatch, 0.02)
    most = 0

    async def rush() -> list[int]:
        nonlocal most
        async with httpx.AsyncClient(base_url=server.url, timeout=120,
                                     limits=httpx.Limits(max_connections=64)) as client:
            async def send(i: int) -> int:
                body = {"model": LOOP_MODEL, "max_tokens": 20, "messages": HI, "stream": i % 3 == 0}
                if i % 2:
                    r = await client.post("/v1/messages", json=body, headers={"x-api-key": KEYS["one-a"]})
                else:
                    r = await client.post("/v1/chat/completions", json={**body, "n": 2},
                                          headers={"authorization": f"Bearer {KEYS['one-b']}"})
                return r.status_code

            async def watch() -> None:
                nonlocal most
                while True:
                    most = max(most, tenancy.in_flight("one"))
                    await asyncio.sleep(0.001)

            watcher = asyncio.ensure_future(watch())
            codes: list[int] = []
            for _ in range(3):
                codes += await asyncio.gather(*(send(i) for i in range(30)))
            watcher.cancel()
            return codes

    codes = asyncio.run(rush())
    assert set(codes) == {200, 429}
    assert most == 1
    assert tenancy.in_flight("one") == 0
    assert claude(server, "one-a").messages.create(model=TEXT_MODEL, max_tokens=2, messages=HI).content


def test_slots_come_back_after_warms_faults_n_choices_and_bad_requests(server, tenancy, engines, monkeypatch):
    c, o = claude(server, "one-a"), oai(server, "one-b")
    assert c.messages.create(model=TEXT_MODEL, max_tokens=0, messages=HI).usage.output_tokens == 0
    assert tenancy.in_flight("one") == 0
    with c.messages.stream(model=TEXT_MODEL, max_tokens=0, messages=HI) as stream:
        stream.get_final_message()
    assert tenancy.in_flight("one") == 0

    def fault_after_3_steps() -> None:
        monkeypatch.undo()
        fail_after_steps(engines[LOOP_MODEL], monkeypatch, 3)

    fault_after_3_steps()
    with pytest.raises(openai.InternalServerError):
        o.chat.completions.create(model=LOOP_MODEL, max_tokens=50, messages=HI, n=2)
    assert tenancy.in_flight("one") == 0
    fault_after_3_steps()
    with pytest.raises(openai.APIError):
        list(o.chat.completions.create(model=LOOP_MODEL, max_tokens=50, messages=HI, n=2, stream=True))
    assert wait_until(lambda: tenancy.in_flight("one") == 0)  # (the SDK raises at the error event, before [DONE])
    fault_after_3_steps()
    events = list(o.responses.create(model=LOOP_MODEL, max_output_tokens=50, input="Hi", stream=True))
    assert events[-1].type == "response.failed"
    assert tenancy.in_flight("one") == 0
    monkeypatch.undo()
    slow_steps(engines[LOOP_MODEL], monkeypatch, 0.02)
    with o.completions.create(model=LOOP_MODEL, max_tokens=300, prompt="Hi", n=3, stream=True) as stream:
        for i, _ in enumerate(stream):
            if i > 5:
                break  # the client leaves
    assert wait_until(lambda: tenancy.in_flight("one") == 0)

    async def bad_requests() -> list[int]:
        async with httpx.AsyncClient(base_url=server.url, timeout=60) as client:
            answers = await asyncio.gather(*(client.post("/v1/messages", headers={"x-api-key": KEYS["one-a"]},
                                                         json={"model": TEXT_MODEL, "max_tokens": -1, "messages": HI})
                                             for _ in range(20)))
            return [r.status_code for r in answers]

    assert set(asyncio.run(bad_requests())) <= {400, 429}
    assert tenancy.in_flight("one") == 0
    assert c.messages.create(model=TEXT_MODEL, max_tokens=2, messages=HI).content


def test_shutdown_ends_every_hold(scripted_models, monkeypatch):
    engine = scripted_models[LOOP_MODEL].engine()
    tenancy = Tenancy(parse(TENANTS))
    srv = ServerThread(build_app({LOOP_MODEL: engine}, ApiKeyAuth.from_keys(KEYS), tenancy=tenancy),
                       graceful_timeout=1.0).start()
    slow_steps(engine, monkeypatch, 0.05)  # 400 tokens: 20 s at least, past the graceful timeout
    outcomes: dict[str, Any] = {}

    def send(name: str, path: str, body: dict, headers: dict) -> None:
        with httpx.stream("POST", srv.url + path, headers=headers, json=body, timeout=60) as r:
            outcomes[name] = (r.status_code, r.read().decode())

    clients = [threading.Thread(target=send, args=("stream", "/v1/messages", {
                   "model": LOOP_MODEL, "max_tokens": 400, "messages": HI, "stream": True}, {"x-api-key": KEYS["one-a"]})),
               threading.Thread(target=send, args=("n=2", "/v1/chat/completions", {
                   "model": LOOP_MODEL, "max_tokens": 400, "messages": HI, "n": 2},
                   {"authorization": f"Bearer {KEYS['tok']}"}))]
    for client in clients:
        client.start()
    assert wait_until(lambda: tenancy.in_flight("one") == 1 and tenancy.in_flight("tok") == 1, 30)
    srv.stop()
    for client in clients:
        client.join(30)
    assert outcomes["stream"][0] == 200 and "overloaded_error" in outcomes["stream"][1]
    assert outcomes["n=2"][0] == 503
    assert tenancy.in_flight("one") == 0 and tenancy.in_flight("tok") == 0


def test_equal_prompts_and_equal_cache_salts_never_share_cached_prefixes_across_tenants(server):
    preamble = uuid.uuid4().hex + " a shared preamble that fills several blocks" * 6
    salted = {"cache_salt": "team-salt"}

    def chat(key: str, extra: dict) -> int:
        return oai(server, key).chat.completions.create(
            model=TEXT_MODEL, max_tokens=2, messages=[{"role": "user", "content": preamble}],
            extra_body=extra).usage.prompt_tokens_details.cached_tokens

    def respond(key: str, extra: dict) -> int:
        return oai(server, key).responses.create(model=TEXT_MODEL, max_output_tokens=2, input=preamble,
                                                 extra_body=extra).usage.input_tokens_details.cached_tokens

    def message(key: str, extra: dict) -> int:
        return claude(server, key).messages.create(
            model=TEXT_MODEL, max_tokens=2, messages=[{"role": "user", "content": preamble}],
            extra_body=extra).usage.cache_read_input_tokens

    assert chat("iso-a", salted) == 0
    assert chat("iso-b", salted) == 0  # the same prompt and salt, another tenant
    assert respond("iso-b", salted) > 0  # its own, through the Responses API
    assert respond("iso-a", {}) == 0  # its own prompt, but it was salted then
    assert message("iso-b", {}) == 0
    assert message("iso-a", {}) > 0
    assert message("lone", {}) == 0 and message("tok", salted) == 0


def test_a_unicode_tenant_through_the_responses_api_429_and_its_free_routes(server):
    o = oai(server, "uni")
    first = o.responses.create(model=TEXT_MODEL, max_output_tokens=3, input="Hi")
    for stream in (False, True):
        with pytest.raises(openai.RateLimitError) as refused:
            o.responses.create(model=TEXT_MODEL, max_output_tokens=3, input="Hi", stream=stream)
        assert refused.value.code == "rate_limit_exceeded" and refused.value.type == "rate_limit_error"
        assert f"tenant '{UNICODE_TENANT}' (gold tier)" in refused.value.message
        headers = refused.value.response.headers
        assert (headers["retry-after"], headers["retry-after-ms"], headers["x-ratelimit-remaining-requests"]) == (
            "60", "60000", "0")
    # stored responses, count_tokens and model lists are free
    assert o.responses.retrieve(first.id).id == first.id
    assert [item.type for item in o.responses.input_items.list(first.id)] == ["message"]
    with pytest.raises(openai.BadRequestError):
        o.responses.cancel(first.id)
    assert o.responses.delete(first.id) is None
    assert claude(server, "uni").messages.count_tokens(model=TEXT_MODEL, messages=HI).input_tokens > 0
    assert [m.id for m in o.models.list()]
    with pytest.raises(anthropic.RateLimitError) as refused:
        claude(server, "uni").messages.create(model=TEXT_MODEL, max_tokens=3, messages=HI)
    assert refused.value.response.headers["anthropic-ratelimit-requests-remaining"] == "0"
    metrics = httpx.get(server.url + "/metrics").text
    assert value(metrics, "tierlm:rate_limited_requests_total", tenant=UNICODE_TENANT, reason="requests") == 3
    assert value(metrics, "tierlm:requests_total", tenant=UNICODE_TENANT, status="200") == 1


def test_every_choice_and_route_runs_at_its_tiers_priority(server, engines, monkeypatch):
    seen = record_requests(engines[TEXT_MODEL], monkeypatch)
    o = oai(server, "one-a")  # silver: 1
    o.chat.completions.create(model=TEXT_MODEL, max_tokens=2, messages=HI, n=2)
    o.responses.create(model=TEXT_MODEL, max_output_tokens=2, input="Hi")
    o.completions.create(model=TEXT_MODEL, max_tokens=2, prompt="Hi", n=2)
    claude(server, "lone").messages.create(model=TEXT_MODEL, max_tokens=0, messages=HI)  # bronze: 2
    assert [(r.priority, r.tenant_id) for r in seen] == [(1, "one")] * 5 + [(2, "lone")]


def test_a_client_cannot_mint_metric_label_values(server):
    """Unknown models, keys, paths and body fields, each new every time, add no labelled series
    to /metrics: its labels come from the tenants file and what the server serves."""
    def series() -> set:
        text = httpx.get(server.url + "/metrics").text
        return {(name, labels) for name, labels in samples(text) if not name.endswith("_created")}

    def junk() -> None:
        new = uuid.uuid4().hex
        body = {"model": TEXT_MODEL, "max_tokens": 2, "messages": HI}
        with httpx.Client(base_url=server.url, timeout=30, headers={"x-api-key": KEYS["iso-a"]}) as client:
            client.post("/v1/messages", json={**body, "model": new})
            client.post("/v1/messages", json=body, headers={"x-api-key": "sk-" + new})
            client.post("/v1/messages", json=body, headers={"x-api-key": KEYS["uni"]})  # a 429 once its minute is used
            client.post("/v1/chat/completions", json={**body, "user": new, "metadata": {"tenant": new}},
                        headers={"authorization": f"Bearer {KEYS['iso-a']}", "x-tenant": new})
            client.post("/v1/" + new, json=body)
            client.post("/v1/messages?tenant=" + new, json={**body, "stop_sequences": [new]})
            client.post("/v1/messages", content=b"{" + new.encode())

    junk(), junk()  # every outcome once
    before = series()
    for _ in range(3):
        junk()
    assert series() == before


# ---- bugs the sweep found --------------------------------------------------------------------


@pytest.mark.parametrize("text, error", [
    ('default_tier = ["gold"]', "t.toml: default_tier: must be the name of a tier (a string) such as \"bronze\" "
                                "(got ['gold'])"),
    ('[tenants.t]\nkeys = ["lone"]\ntier = ["gold"]', "t.toml: tenants.t.tier: must be the name of a tier"),
    ('[tenants.t]\nkeys = ["lone"]\ntier = {name = "gold"}', "t.toml: tenants.t.tier: must be the name of a tier"),
    ('[tenants.t]\nkeys = ["lone"]\ntier = 0', "t.toml: tenants.t.tier: must be the name of a tier"),
])
def test_a_tier_that_is_not_a_string_is_named_not_a_crash(text, error):
    """Was: a list or table as a tier was a TypeError (unhashable) out of `serve`, a traceback."""
    with pytest.raises(ValueError) as e:
        parse(text)
    assert error in str(e.value)


def test_a_tenants_file_that_is_not_utf8_names_the_file(tmp_path):
    """Was: "'utf-8' codec can't decode byte 0xe9 in position 13: invalid continuation byte" alone."""
    path = tmp_path / "tenants.toml"
    path.write_bytes('[tenants."café"]\nkeys = ["lone"]\n'.encode("latin-1"))
    with pytest.raises(ValueError) as e:
        TenantsConfig.from_file(path, KEYS)
    assert str(e.value).startswith(f"{path}: not valid TOML: a TOML file is UTF-8; this one is not (byte 0xe9 at "
                                   "line 1, column 14): save it as UTF-8")
    path.write_bytes(f'[tenants."{UNICODE_TENANT}"]\nkeys = ["lone"]\n'.encode())  # UTF-8 whatever the locale
    assert TenantsConfig.from_file(path, KEYS).tenant_of("lone").id == UNICODE_TENANT


def test_a_key_listed_twice_by_one_tenant_is_named_as_such():
    """Was: "key id 'lone' already belongs to tenant 't' ... remove it from one of them", of one tenant."""
    with pytest.raises(ValueError) as e:
        parse('[tenants.t]\nkeys = ["lone", "tok", "lone"]')
    assert str(e.value) == "t.toml: tenants.t.keys: key id 'lone' is listed twice; list each key once"


@pytest.mark.parametrize("text, error", [
    ('[tenants.""]\nkeys = ["lone"]', 't.toml: tenants."": a tenant needs a name (429s, logs and the tenant label '
                                      'of /metrics name it); write [tenants.NAME]'),
    ('[tiers.""]\npriority = 1', 't.toml: tiers."": a tier needs a name (429s name it); write [tiers.NAME]'),
])
def test_empty_tenant_and_tier_names_are_refused(text, error):
    """Was: accepted; the tenant's served requests were labelled `default` in /metrics (the label
    of requests without a tenant) and its 429s `""`, and a 429 read "tenant '' (bronze tier)"."""
    with pytest.raises(ValueError) as e:
        parse(text)
    assert str(e.value) == error


def test_huge_limits_never_report_more_remaining_than_the_limit():
    """Was: with TOML's largest integer as a limit, `remaining` read 9223372036854775808, one past
    the limit and past a signed 64-bit integer, which clients parse headers into (a float bucket
    rounds the level up)."""
    biggest = 2**63 - 1
    config = parse(f'[tenants.t]\nkeys = ["lone"]\nrequests_per_minute = {biggest}\ntokens_per_minute = {biggest}')
    tenancy = Tenancy(config, clock=Clock())
    for style, remaining in (("openai", "x-ratelimit-remaining-{}"), ("anthropic", "anthropic-ratelimit-{}-remaining")):
        ticket = tenancy.admit_here(config.tenant_of("lone"), style)
        for kind in ("requests", "tokens"):
            assert 0 <= int(ticket.headers[remaining.format(kind)]) <= biggest
        asyncio.run(ticket.release(10**6))


def test_one_key_under_two_ids_in_the_keys_file_is_refused(tmp_path):
    """Was: accepted, and the key authenticated as the last of its ids: pasted once more under a
    second id, acme's key ran as globex, in globex's tier, limits and cache."""
    path = tmp_path / "keys.txt"
    path.write_text("\n".join([keys_file_line("acme-prod", "sk-acme"), keys_file_line("other", "sk-other"),
                               keys_file_line("globex", "sk-acme")]) + "\n")
    with pytest.raises(ValueError) as e:
        load_keys_file(path)
    assert str(e.value) == (f"{path}:3: key id 'globex' has the same key as 'acme-prod' (line 1); a key has one id: "
                            "remove one of the lines, or give globex a key of its own")


def test_serve_names_an_empty_tenants_flag(tmp_path):
    """Was: `--tenants "$UNSET"` said "cannot read tenants file .: Is a directory"."""
    keys = tmp_path / "keys.txt"
    keys.write_text(keys_file_line("ci", "sk-cli") + "\n")
    proc = serve("--port", str(free_port()), "--api-keys", str(keys), "--tenants", " ")
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 2, out
    assert ("error: --tenants is empty (an unset variable?); give the tenants file, or leave it out for no "
            "tenants (each key its own, no limits)") in out
    assert "Traceback" not in out
