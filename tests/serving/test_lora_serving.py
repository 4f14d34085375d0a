"""LoRA adapters over HTTP, as vLLM serves them: each adapter a model of its own name on both
APIs (official SDKs), listed with its base in /v1/models, loaded and unloaded at run time by
admin keys only, answers checked against transformers + peft."""
from __future__ import annotations

import argparse
import json
import tomllib

import anthropic
import httpx
import openai
import pytest
import torch

from tests.lora_adapters import greedy, peft_model, standard_adapters
from tests.serving.harness import ServerThread, slow_steps
from tests.serving.test_telemetry import value
from tierlm.engine.async_engine import AsyncEngine
from tierlm.serving.app import build_app
from tierlm.serving.auth import ApiKeyAuth, NoAuth
from tierlm.serving.cli import lora_updates_from_args, parse_lora_modules
from tierlm.serving.lora_admin import LoRAUpdates
from tierlm.serving.tenancy import Tenancy, TenantsConfig

ADMIN, TENANT, OTHER = "sk-lora-admin", "sk-lora-tenant", "sk-lora-other"
# acme may use the base model and its adapter a1 (and a2 once loaded); globex the base alone.
TENANTS = """
[tenants.acme]
keys = ["tenant"]
models = ["base", "a1", "a2"]
[tenants.globex]
keys = ["other"]
models = ["base"]
"""


@pytest.fixture(scope="module")
def setup(checkpoints, tmp_path_factory):
    base = checkpoints["llama"]
    ads = standard_adapters(base, "llama", tmp_path_factory.mktemp("lora-serving"))
    engine = AsyncEngine.from_model(str(base), dtype="float32", block_size=8, load_progress=False,
                                    served_model_name="base", lora_modules={"a1": str(ads["a1"])})
    keys = {"admin": ADMIN, "tenant": TENANT, "other": OTHER}
    app = build_app({"base": engine}, ApiKeyAuth.from_keys(keys),
                    tenancy=Tenancy(TenantsConfig.parse(tomllib.loads(TENANTS), list(keys))),
                    lora_updates=LoRAUpdates(frozenset({"admin"})))
    server = ServerThread(app).start()
    yield server, base, ads
    server.stop()


def _client(server, key=TENANT) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=key, max_retries=0, timeout=60)


def _ids(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 500, (n,), generator=g).tolist()


def test_an_adapter_is_a_model_of_its_own_name_on_both_apis(setup):
    server, base, ads = setup
    oai = _client(server)
    listed = {m.id: m for m in oai.models.list().data}
    assert set(listed) == {"base", "a1"}
    assert listed["a1"].model_extra["parent"] == "base" and listed["a1"].model_extra["root"] == str(ads["a1"])
    assert listed["base"].model_extra["parent"] is None and listed["base"].model_extra["root"] == str(base)  # as vLLM
    ids = _ids(17, 1)
    got = oai.completions.create(model="a1", prompt=ids, max_tokens=8, temperature=0)
    ref = peft_model(base, "llama", ads["a1"])
    want = greedy(ref, ids, 8)
    assert got.choices[0].text == ref_text(server, want)
    base_answer = oai.completions.create(model="base", prompt=ids, max_tokens=8, temperature=0).choices[0].text
    assert base_answer != got.choices[0].text
    # The Anthropic SDK, streaming, on the adapter: the answer the OpenAI chat route gives it.
    ant = anthropic.Anthropic(base_url=server.url, api_key=TENANT, max_retries=0, timeout=60)
    with ant.messages.stream(model="a1", max_tokens=8, extra_body={"temperature": 0},
                             messages=[{"role": "user", "content": "hello there"}]) as stream:
        streamed = "".join(stream.text_stream)
        final = stream.get_final_message()
    chat = oai.chat.completions.create(model="a1", max_tokens=8, temperature=0,
                                       messages=[{"role": "user", "content": "hello there"}])
    assert final.model == "a1" and streamed == chat.choices[0].message.content
    assert final.usage.input_tokens == chat.usage.prompt_tokens
    # /metrics: the adapter's requests under its own model label, and its queue gauges.
    metrics = httpx.get(server.url + "/metrics").text
    assert value(metrics, "tierlm:requests_total", model="a1", route="/v1/completions") == 1
    assert value(metrics, "tierlm:requests_total", model="base", route="/v1/completions") == 1
    assert 'tierlm:lora_requests{adapter="a1",model="base",state="running"} 0.0' in metrics


def ref_text(server, ids: list[int]) -> str:
    r = httpx.post(server.url + "/detokenize", json={"model": "base", "tokens": ids},
                   headers={"Authorization": f"Bearer {TENANT}"})
    return r.json()["prompt"]


def test_admin_keys_load_and_unload_adapters_at_run_time(setup):
    server, base, ads = setup
    hdr = {"Authorization": f"Bearer {ADMIN}"}
    body = {"lora_name": "a2", "lora_path": str(ads["a2"])}
    denied = httpx.post(server.url + "/v1/load_lora_adapter", json=body, headers={"Authorization": f"Bearer {TENANT}"})
    assert denied.status_code == 403 and denied.json()["error"]["type"] == "permission_error"
    bad = httpx.post(server.url + "/v1/load_lora_adapter", json={"lora_name": "a3", "lora_path": "/nowhere"},
                     headers=hdr)
    assert bad.status_code == 400 and "not a directory" in bad.json()["error"]["message"]
    taken = httpx.post(server.url + "/v1/load_lora_adapter", json={"lora_name": "base", "lora_path": str(ads["a2"])},
                       headers=hdr)
    assert taken.status_code == 400 and "already served" in taken.json()["error"]["message"]
    oai = _client(server)
    assert {m.id for m in oai.models.list().data} == {"base", "a1"}  # none of that changed anything
    ok = httpx.post(server.url + "/v1/load_lora_adapter", json=body, headers=hdr)
    assert ok.status_code == 200 and "a2" in ok.text
    same = httpx.post(server.url + "/v1/load_lora_adapter", json={**body, "lora_path": str(ads["a2"]) + "/"},
                      headers=hdr)
    assert same.status_code == 200 and "already loaded" in same.text  # the same directory: nothing to do
    assert {m.id for m in oai.models.list().data} == {"base", "a1", "a2"}
    ids = _ids(12, 2)
    got = oai.completions.create(model="a2", prompt=ids, max_tokens=6, temperature=0).choices[0].text
    assert got == ref_text(server, greedy(peft_model(base, "llama", ads["a2"]), ids, 6))
    gone = httpx.post(server.url + "/v1/unload_lora_adapter", json={"lora_name": "a2"}, headers=hdr)
    assert gone.status_code == 200
    with pytest.raises(openai.NotFoundError, match="model 'a2' is not served here"):
        oai.completions.create(model="a2", prompt=ids, max_tokens=2)
    again = httpx.post(server.url + "/v1/unload_lora_adapter", json={"lora_name": "a2"}, headers=hdr)
    assert again.status_code == 404


def test_an_adapter_replaced_under_its_name_while_it_streams(setup, monkeypatch):
    """Unload "x" and load other weights as "x" while a stream of x runs: the stream ends with
    the old weights' answer (its request holds them), and the next request for x gets the new
    weights' answer with 0 cached tokens, though its prompt was just cached under the old ones."""
    _, base, ads = setup
    engine = AsyncEngine.from_model(str(base), dtype="float32", block_size=8, load_progress=False,
                                    served_model_name="base", lora_modules={"x": str(ads["a1"])})
    server = ServerThread(build_app({"base": engine}, NoAuth(), lora_updates=LoRAUpdates())).start()
    slow_steps(engine, monkeypatch, 0.05)
    ids = _ids(41, 3)
    want = {n: greedy(peft_model(base, "llama", ads[n]), ids, 12) for n in ("a1", "a2")}
    body = {"model": "x", "prompt": ids, "max_tokens": 12, "temperature": 0, "ignore_eos": True, "logprobs": 0,
            "return_tokens_as_token_ids": True}

    def tokens(choices: list[dict]) -> list[int]:
        return [int(t.split(":")[1]) for c in choices for t in (c.get("logprobs") or {}).get("tokens", [])]
    try:
        with httpx.stream("POST", server.url + "/v1/completions", json={**body, "stream": True}, timeout=60) as r:
            lines = r.iter_lines()
            first = next(line for line in lines if line.startswith("data: {"))
            for path, args in (("unload", {"lora_name": "x"}), ("load", {"lora_name": "x", "lora_path": str(ads["a2"])})):
                assert httpx.post(f"{server.url}/v1/{path}_lora_adapter", json=args).status_code == 200
            old = [q.lora for q in engine.engine.scheduler.running if q.lora is not None]
            assert old and old[0] is not engine.engine.loras.require("x")  # still running, on the old weights
            events = [json.loads(line[len("data: "):]) for line in [first, *lines] if line.startswith("data: {")]
        assert tokens([c for e in events for c in e["choices"]]) == want["a1"]
        after = httpx.post(server.url + "/v1/completions", json=body, timeout=60).json()
        assert tokens(after["choices"]) == want["a2"] != want["a1"]
        assert (after["usage"].get("prompt_tokens_details") or {}).get("cached_tokens", 0) == 0
    finally:
        server.stop()


def test_runtime_updates_are_off_unless_the_server_allows_them(llama_dir):
    engine = AsyncEngine.from_model(str(llama_dir), dtype="float32", load_progress=False, enable_lora=True)
    server = ServerThread(build_app({"m": engine}, NoAuth())).start()
    try:
        r = httpx.post(server.url + "/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": "/x"})
        assert r.status_code == 404 and "--allow-runtime-lora-updating" in r.json()["error"]["message"]
    finally:
        server.stop()


def test_lora_command_line_forms_and_admin_key_rules(tmp_path):
    assert parse_lora_modules(["a=/x", '{"name": "b", "path": "/y", "base_model_name": "m"}']) == [
        ("a", "/x", None), ("b", "/y", "m")]
    for bad, says in ((["a"], "NAME=DIR"), (["a=/x", "a=/y"], "given twice"), (['{"name": 1}'], "needs"),
                      (["{oops"], "not valid JSON")):
        with pytest.raises(ValueError, match=says):
            parse_lora_modules(bad)
    keys = ApiKeyAuth.from_keys({"admin": ADMIN})
    with pytest.raises(ValueError, match="needs --lora-admin-key"):
        lora_updates_from_args(argparse.Namespace(lora_admin_keys=[], api_keys="k"), keys)
    with pytest.raises(ValueError, match="no such key id"):
        lora_updates_from_args(argparse.Namespace(lora_admin_keys=["eve"], api_keys="k"), keys)
    assert lora_updates_from_args(argparse.Namespace(lora_admin_keys=["admin"], api_keys="k"), keys).admin_keys == {"admin"}
    assert lora_updates_from_args(argparse.Namespace(lora_admin_keys=[]), NoAuth()).admin_keys is None


def test_a_tenant_sees_and_uses_only_the_models_its_tenants_entry_lists(setup):
    """globex may use the base model only: a1 is a 404 to it on every route, exactly as a model
    that is not served (the list of what is available names only what it may use)."""
    server, _, _ = setup
    other = _client(server, OTHER)
    assert [m.id for m in other.models.list().data] == ["base"]
    with pytest.raises(openai.NotFoundError, match="model 'a1' is not served here; available: base$"):
        other.completions.create(model="a1", prompt=[5, 6, 7], max_tokens=2)
    with pytest.raises(openai.NotFoundError):
        other.models.retrieve("a1")
    with pytest.raises(openai.NotFoundError):
        other.embeddings.create(model="a1", input="hi")
    ant = anthropic.Anthropic(base_url=server.url, api_key=OTHER, max_retries=0, timeout=60)
    with pytest.raises(anthropic.NotFoundError, match="model 'a1' is not served here"):
        ant.messages.create(model="a1", max_tokens=2, messages=[{"role": "user", "content": "hi"}])
    r = httpx.post(server.url + "/tokenize", json={"model": "a1", "prompt": "hi"},
                   headers={"Authorization": f"Bearer {OTHER}"})
    assert r.status_code == 404
    assert other.completions.create(model="base", prompt=[5, 6, 7], max_tokens=2).choices[0].text is not None
    assert {m.id for m in _client(server, TENANT).models.list().data} >= {"base", "a1"}


def test_adapters_loaded_and_unloaded_leave_no_per_name_state(setup):
    """The registry worked out each model's tool-call and reasoning formats once per name, an
    adapter's too, and /metrics kept each name's series: every adapter name loaded, used and
    unloaded at run time left its entries and ~230 lines of /metrics behind."""
    server, _, ads = setup
    hdr = {"Authorization": f"Bearer {ADMIN}"}
    models = server.app.state.tierlm.models
    for n in range(4):
        name = f"churn{n}"
        assert httpx.post(server.url + "/v1/load_lora_adapter", json={"lora_name": name, "lora_path": str(ads["a2"])},
                          headers=hdr).status_code == 200
        said = httpx.post(server.url + "/tokenize", headers=hdr,
                          json={"model": name, "messages": [{"role": "user", "content": "hi"}]})
        assert said.status_code == 200 and said.json()["count"] > 0
        ran = httpx.post(server.url + "/v1/completions", headers=hdr, timeout=60,
                         json={"model": name, "prompt": "hi", "max_tokens": 2})
        assert ran.status_code == 200 and f'model="{name}"' in httpx.get(server.url + "/metrics").text
        assert httpx.post(server.url + "/v1/unload_lora_adapter", json={"lora_name": name},
                          headers=hdr).status_code == 200
    assert set(models._tool_calls) <= {"base"} and set(models._reasoning) <= {"base"}
    assert 'model="churn' not in httpx.get(server.url + "/metrics").text  # (each name's series went with it)


def test_an_unloaded_adapter_leaves_no_sla_breaker(llama_dir, tmp_path):
    """The SLA guard keeps a breaker per (model, tier with a TTFT target): each adapter name that
    had such traffic kept one after it was unloaded, and the same name loaded again found the old
    adapter's outcomes (an open breaker refused the new one)."""
    ads = standard_adapters(llama_dir, "llama", tmp_path)
    engine = AsyncEngine.from_model(str(llama_dir), dtype="float32", block_size=8, load_progress=False,
                                    served_model_name="base", enable_lora=True)
    tenants = '[tiers.gold]\nttft_target_ms = 3600000\n[tenants.acme]\ntier = "gold"\nkeys = ["admin"]\n'
    app = build_app({"base": engine}, ApiKeyAuth.from_keys({"admin": ADMIN}),
                    tenancy=Tenancy(TenantsConfig.parse(tomllib.loads(tenants), ["admin"])),
                    lora_updates=LoRAUpdates(frozenset({"admin"})))
    server = ServerThread(app).start()
    hdr, guard = {"Authorization": f"Bearer {ADMIN}"}, app.state.tierlm.sla
    try:
        seen = []
        for _ in range(2):
            assert httpx.post(server.url + "/v1/load_lora_adapter", headers=hdr,
                              json={"lora_name": "sla1", "lora_path": str(ads["a2"])}).status_code == 200
            for _ in range(2):
                assert httpx.post(server.url + "/v1/completions", headers=hdr, timeout=60,
                                  json={"model": "sla1", "prompt": "hi", "max_tokens": 2}).status_code == 200
            [(key, breaker)] = [(k, b) for k, b in guard._breakers.items() if k[0] == "sla1"]
            assert key == ("sla1", "gold") and len(breaker._outcomes) == 2  # this adapter's two requests only
            seen.append(breaker)
            assert httpx.post(server.url + "/v1/unload_lora_adapter", json={"lora_name": "sla1"},
                              headers=hdr).status_code == 200
            assert not [k for k in guard._breakers if k[0] == "sla1"]  # gone with the adapter
        assert seen[0] is not seen[1]
    finally:
        server.stop()
