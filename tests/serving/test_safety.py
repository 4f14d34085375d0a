"""The safety layer end to end (tierlm/serving/safety.py): a real server over scripted models,
policies per tier and tenant, through the official SDKs, streamed and not.

The text model answers every chat with REPLY ("alpha beta STOP gamma; one, two"), the loop
model repeats "tick tock, " until max_tokens. Policies: "STOP gamma" stops bronze answers,
"beta" is redacted for the tenant acme, "tock" stops bronze answers, and a prompt holding
"forbidden phrase" is refused for everyone."""
from __future__ import annotations

import anthropic
import httpx
import openai
import pytest

from tests.serving.harness import ServerThread, parse_sse, record_requests, wait_until
from tests.serving.scripted_model import LOOP_MODEL, REPLY, TEXT_MODEL, chat_prompt_ids
from tests.serving.test_cli import free_port, serve
from tests.serving.test_telemetry import value
from tierlm.serving.app import build_app
from tierlm.serving.auth import ApiKeyAuth, keys_file_line
from tierlm.serving.safety import SafetyPolicies
from tierlm.serving.tenancy import Tenancy

KEYS = {"acme": "sk-acme", "zeta": "sk-zeta"}
TENANTS = """
[tenants.acme]
tier = "gold"
keys = ["acme"]

[tenants.zeta]
tier = "bronze"
keys = ["zeta"]
"""
POLICIES = """
[policies.stop_word]
phrases = ["stop  GAMMA"]
check = "output"
tiers = ["bronze"]

[policies.codename]
phrases = ["beta"]
action = "redact"
replacement = "[x]"
whole_word = true
tenants = ["acme"]

[policies.prompt_words]
phrases = ["forbidden phrase"]
check = "input"

[policies.tock]
phrases = ["tock"]
check = "output"
whole_word = true
tiers = ["bronze"]
"""
HI = [{"role": "user", "content": "Hi"}]
BAD = [{"role": "user", "content": "tell me the Forbidden\n phrase please"}]


@pytest.fixture(scope="module")
def engines(scripted_models):
    return {name: scripted_models[name].engine(name) for name in (TEXT_MODEL, LOOP_MODEL)}


@pytest.fixture(scope="module")
def server(engines, tmp_path_factory):
    root = tmp_path_factory.mktemp("safety")
    (root / "tenants.toml").write_text(TENANTS)
    (root / "policies.toml").write_text(POLICIES)
    tenancy = Tenancy.from_file(root / "tenants.toml", KEYS)
    safety = SafetyPolicies.from_file(root / "policies.toml", tiers=set(tenancy.config.tiers),
                                      tenants=set(tenancy.config.tenants))
    srv = ServerThread(build_app(engines, ApiKeyAuth.from_keys(KEYS), tenancy=tenancy, safety=safety)).start()
    yield srv
    srv.stop()


def clients(server, key: str) -> tuple[anthropic.Anthropic, openai.OpenAI]:
    return (anthropic.Anthropic(base_url=server.url, api_key=KEYS[key], max_retries=0, timeout=60),
            openai.OpenAI(base_url=server.url + "/v1", api_key=KEYS[key], max_retries=0, timeout=60))


def test_an_answer_that_writes_a_blocked_phrase_stops_before_it_in_every_api(server):
    claude, oai = clients(server, "zeta")
    cut = REPLY[:REPLY.index("STOP")]  # "alpha beta "
    message = claude.messages.create(model=TEXT_MODEL, max_tokens=50, messages=HI)
    assert message.stop_reason == "refusal" and message.stop_sequence is None
    text = "".join(b.text for b in message.content)
    assert cut.startswith(text) and text.strip() == cut.strip() and message.usage.output_tokens > 0

    with claude.messages.stream(model=TEXT_MODEL, max_tokens=50, messages=HI) as stream:
        streamed = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert streamed == text and final.stop_reason == "refusal"

    chat = oai.chat.completions.create(model=TEXT_MODEL, max_tokens=50, messages=HI)
    assert chat.choices[0].finish_reason == "content_filter" and chat.choices[0].message.content == text

    chunks = list(oai.chat.completions.create(model=TEXT_MODEL, max_tokens=50, messages=HI, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["content_filter"]

    response = oai.responses.create(model=TEXT_MODEL, max_output_tokens=50, input="Hi")
    assert response.status == "incomplete" and response.incomplete_details.reason == "content_filter"
    assert response.output_text == text
    events = list(oai.responses.create(model=TEXT_MODEL, max_output_tokens=50, input="Hi", stream=True))
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == text
    assert events[-1].type == "response.incomplete"
    assert events[-1].response.incomplete_details.reason == "content_filter"


def test_a_redacted_phrase_is_masked_and_the_answer_goes_on(server, engines):
    claude, oai = clients(server, "acme")  # gold: "STOP gamma" is not its tier's policy
    want = REPLY.replace("beta", "[x]")
    message = claude.messages.create(model=TEXT_MODEL, max_tokens=50, messages=HI)
    assert message.stop_reason == "end_turn" and message.content[0].text == want
    with claude.messages.stream(model=TEXT_MODEL, max_tokens=50, messages=HI) as stream:
        assert "".join(stream.text_stream) == want

    chunks = list(oai.chat.completions.create(model=TEXT_MODEL, max_tokens=50, messages=HI, stream=True,
                                              logprobs=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == want
    tokens = [t.token for c in chunks if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.content]
    assert tokens and not any("beta" in t for t in tokens)  # the masked token's logprob would spell it
    chat = oai.chat.completions.create(model=TEXT_MODEL, max_tokens=50, messages=HI, logprobs=True)
    assert chat.choices[0].message.content == want and chat.choices[0].finish_reason == "stop"
    assert not any("beta" in t.token for t in chat.choices[0].logprobs.content)
    # vLLM's return_token_ids: no ids that spell the phrase either, streamed or not (nor before a block)
    tok = engines[TEXT_MODEL].tokenizer
    chat = oai.chat.completions.create(model=TEXT_MODEL, max_tokens=50, messages=HI, extra_body={"return_token_ids": True})
    assert chat.choices[0].message.content == want and "beta" not in tok.decode(chat.choices[0].token_ids)
    chunks = list(oai.chat.completions.create(model=TEXT_MODEL, max_tokens=50, messages=HI, stream=True,
                                              extra_body={"return_token_ids": True}))
    ids = [i for c in chunks if c.choices for i in (c.choices[0].model_extra.get("token_ids") or [])]
    assert ids and "beta" not in tok.decode(ids)


def test_a_prompt_that_breaks_an_input_policy_never_reaches_the_engine(server, engines, monkeypatch):
    seen = record_requests(engines[TEXT_MODEL], monkeypatch)
    for key in KEYS:
        claude, oai = clients(server, key)
        message = claude.messages.create(model=TEXT_MODEL, max_tokens=50, messages=BAD)
        assert (message.stop_reason, message.content, message.usage.output_tokens) == ("refusal", [], 0)
        assert message.usage.input_tokens > 0
        with claude.messages.stream(model=TEXT_MODEL, max_tokens=50, messages=BAD) as stream:
            assert "".join(stream.text_stream) == "" and stream.get_final_message().stop_reason == "refusal"
        chat = oai.chat.completions.create(model=TEXT_MODEL, max_tokens=50, messages=BAD)
        assert chat.choices[0].finish_reason == "content_filter" and not chat.choices[0].message.content
        completion = oai.completions.create(model=TEXT_MODEL, max_tokens=5, prompt="a forbidden phrase")
        warm = claude.messages.create(model=TEXT_MODEL, max_tokens=0, messages=BAD)  # a cache warm: refused too
        assert (warm.stop_reason, warm.content) == ("refusal", [])
        assert completion.choices[0].finish_reason == "content_filter" and completion.choices[0].text == ""
    assert seen == []
    claude, _ = clients(server, "zeta")  # the same words apart are no phrase
    message = claude.messages.create(model=TEXT_MODEL, max_tokens=50,
                                     messages=[{"role": "user", "content": "forbidden, a phrase"}])
    assert message.stop_reason == "refusal" and len(seen) == 1  # (bronze: its answer's "STOP gamma")


def test_a_refused_prompt_echoed_with_logprobs_has_null_ones_on_every_choice(server):
    """Echo with logprobs, n = 2, of a prompt an input policy refuses: nothing scored it, so each
    choice echoes it with null logprobs, columns as long as its tokens (token_logprobs came empty
    beside 6 tokens); streamed, every choice's first chunk is that echo (the first choice, which
    would have scored it, sent none, the second one did)."""
    body = {"model": TEXT_MODEL, "prompt": "a forbidden phrase", "echo": True, "logprobs": 0, "max_tokens": 5, "n": 2}
    with httpx.Client(base_url=server.url, headers={"authorization": f"Bearer {KEYS['acme']}"}, timeout=60) as c:
        done = c.post("/v1/completions", json=body).json()
        raw = c.post("/v1/completions", json={**body, "stream": True}).text
    first = {}
    for _, data in parse_sse(raw):
        for choice in [] if data == "[DONE]" else data["choices"]:
            first.setdefault(choice["index"], choice)
    for choice in [*done["choices"], *first.values()]:
        lp = choice["logprobs"]
        assert choice["text"] == body["prompt"] and len(lp["tokens"]) > 1
        assert lp["token_logprobs"] == lp["top_logprobs"] == [None] * len(lp["tokens"]) == [None] * len(lp["text_offset"])
    assert sorted(first) == [0, 1]


def test_a_refused_prompts_log_line_reports_the_usage_its_client_got(server, caplog):
    """The refused prompt never ran, but its client is told its input tokens: the request's log
    line (and span, and prompt-length histogram) say the same, not 0; the token counters,
    which count prompts the engine ran, leave it out."""
    import json
    import logging

    metrics = lambda: httpx.get(server.url + "/metrics").text  # noqa: E731
    before = metrics()
    claude, oai = clients(server, "zeta")
    with caplog.at_level(logging.INFO, logger="tierlm.requests"):
        message = claude.messages.create(model=TEXT_MODEL, max_tokens=50, messages=BAD)
        chat = oai.chat.completions.create(model=TEXT_MODEL, max_tokens=50, messages=BAD)
        told = [message.usage.input_tokens, chat.usage.prompt_tokens]
        lines = lambda: [json.loads(r.getMessage()) for r in caplog.records if r.name == "tierlm.requests"]  # noqa: E731
        assert wait_until(lambda: len(lines()) == 2)  # each is written just after its last byte is sent
    assert told[0] > 0 and told[1] > 0
    lines = lines()
    assert [(ln["prompt_tokens"], ln["finish_reason"]) for ln in lines] == [(n, "content_filter") for n in told]
    after = metrics()

    def delta(name: str) -> float:
        return value(after, name, model=TEXT_MODEL, tenant="zeta") - value(before, name, model=TEXT_MODEL, tenant="zeta")

    assert delta("tierlm:request_prompt_tokens_sum") == sum(told)
    assert delta("tierlm:prompt_tokens_total") == 0


def test_a_stopped_endless_answer_frees_the_engine_at_once(server, engines):
    _, oai = clients(server, "zeta")
    chunks = list(oai.chat.completions.create(model=LOOP_MODEL, max_tokens=400, messages=HI, stream=True,
                                              stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert "tock" not in text and text.startswith("tick")
    assert chunks[-1].usage.completion_tokens < 20  # stopped, not run to 400
    engine = engines[LOOP_MODEL].engine
    assert not engine.has_unfinished()  # aborted: its KV blocks are free
    acme, _ = clients(server, "acme")  # gold has no "tock" policy: the whole answer
    message = acme.messages.create(model=LOOP_MODEL, max_tokens=30, messages=HI)
    assert message.stop_reason == "max_tokens" and message.content[0].text.count("tock") >= 5


def test_every_action_is_counted_per_policy(server):
    metrics = lambda: httpx.get(server.url + "/metrics").text  # noqa: E731
    before = metrics()
    claude, _ = clients(server, "zeta")
    claude.messages.create(model=TEXT_MODEL, max_tokens=50, messages=HI)
    claude.messages.create(model=TEXT_MODEL, max_tokens=50, messages=BAD)
    acme, _ = clients(server, "acme")
    acme.messages.create(model=TEXT_MODEL, max_tokens=50, messages=HI)
    after = metrics()
    for policy, action, tenant in (("stop_word", "output", "zeta"), ("prompt_words", "input", "zeta"),
                                   ("codename", "redact", "acme")):
        name = "tierlm:safety_actions_total"
        got = value(after, name, policy=policy, action=action, tenant=tenant, model=TEXT_MODEL) - \
            value(before, name, policy=policy, action=action, tenant=tenant, model=TEXT_MODEL)
        assert got == 1, (policy, action)
    assert value(after, "tierlm:request_success_total", finished_reason="content_filter") >= 2


def test_serve_refuses_a_bad_policies_file_before_the_model_loads(tmp_path):
    keys = tmp_path / "keys.txt"
    keys.write_text(keys_file_line("ci", "sk-cli") + "\n")
    policies = tmp_path / "policies.toml"
    policies.write_text('[policies.team]\nphrases = ["x"]\ntenants = ["ci"]\n')
    proc = serve("--port", str(free_port()), "--api-keys", str(keys), "--safety-policies", str(policies))
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 2, out
    assert f"error: safety policies file {policies}: policy 'team': lists tenants, which come from a tenants " \
           "file; pass --tenants" in out
    assert "Traceback" not in out and "engine ready" not in out


def test_serve_compiles_every_tenants_and_lone_keys_policies_at_start(tmp_path):
    from tierlm.serving.cli import _safety_policies
    (tmp_path / "tenants.toml").write_text('default_tier = "bronze"\n' + TENANTS)
    (tmp_path / "policies.toml").write_text(POLICIES)
    keys = {**KEYS, "lone": "sk-lone"}  # in no tenant: a tenant of its own, of the default tier
    auth = ApiKeyAuth.from_keys(keys)
    tenancy = Tenancy.from_file(tmp_path / "tenants.toml", keys)
    policies = _safety_policies(str(tmp_path / "policies.toml"), tenancy, auth)
    compiled = dict(policies._compiled)
    lone = tenancy.tenant_of("lone")
    assert policies.for_request(lone.tier, lone.id) is compiled[tuple(
        p.name for p in policies.policies if p.applies_to(lone.tier, lone.id))]
    assert policies._compiled == compiled  # nothing left to compile once serving
    assert lone.tier == "bronze" and policies.for_request(lone.tier, lone.id).check_prompt("a forbidden phrase")
    assert {p.name for p in policies.policies if p.applies_to("bronze", "zeta")} == {"stop_word", "prompt_words", "tock"}


def test_a_policy_naming_a_key_of_a_grouped_tenant_is_refused_naming_the_tenant(tmp_path):
    """Policies apply per tenant: a key id inside a tenant, listed under a policy's `tenants`, was
    accepted and matched no request (the rule silently did nothing). A key in no tenant is a
    tenant of its own, and may be listed."""
    from tierlm.serving.cli import _safety_policies
    from tierlm.serving.safety import PolicyFileError
    keys = {"acme": "sk-acme", "acme-prod": "sk-prod", "zeta": "sk-zeta", "lone": "sk-lone"}
    (tmp_path / "tenants.toml").write_text(TENANTS.replace('keys = ["acme"]', 'keys = ["acme", "acme-prod"]'))
    tenancy = Tenancy.from_file(tmp_path / "tenants.toml", keys)
    auth = ApiKeyAuth.from_keys(keys)
    (tmp_path / "p.toml").write_text('[policies.z]\nphrases = ["zebra"]\ntenants = ["acme-prod"]\n')
    with pytest.raises(PolicyFileError, match="policy 'z': lists key id\\(s\\) \\['acme-prod'\\] under 'tenants', "
                                              "but 'acme-prod' is a key of tenant 'acme'.*list 'acme' instead"):
        _safety_policies(str(tmp_path / "p.toml"), tenancy, auth)
    (tmp_path / "p.toml").write_text('[policies.z]\nphrases = ["zebra"]\ntenants = ["nobody"]\n')
    with pytest.raises(PolicyFileError, match="the tenants file has \\['acme', 'lone', 'zeta'\\]"):  # no grouped keys
        _safety_policies(str(tmp_path / "p.toml"), tenancy, auth)
    (tmp_path / "p.toml").write_text('[policies.z]\nphrases = ["zebra"]\ntenants = ["lone", "acme"]\n')
    policies = _safety_policies(str(tmp_path / "p.toml"), tenancy, auth)
    for key in ("acme-prod", "lone"):
        tenant = tenancy.tenant_of(key)
        assert policies.for_request(tenant.tier, tenant.id).check_prompt("a zebra")
    assert policies.for_request("bronze", "zeta") is None or not policies.for_request("bronze", "zeta").check_prompt(
        "a zebra")


DETECTORS = """
[policies.shapes]
patterns = ['(?i)beta\\s+stop']        # "alpha beta STOP gamma; one, two"
check = "output"
action = "redact"
replacement = "[pii]"

[policies.personal_data]
detect = ["email", "aws_access_key_id"]
check = "input"
"""


def test_detectors_and_patterns_redact_answers_and_refuse_prompts(scripted_models, tmp_path, monkeypatch):
    (tmp_path / "policies.toml").write_text(DETECTORS)
    safety = SafetyPolicies.from_file(tmp_path / "policies.toml")
    engine = scripted_models[TEXT_MODEL].engine(TEXT_MODEL)  # (an engine serves one server's event loop)
    seen = record_requests(engine, monkeypatch)
    srv = ServerThread(build_app({TEXT_MODEL: engine}, ApiKeyAuth.from_keys(KEYS), safety=safety)).start()
    try:
        claude, oai = clients(srv, "acme")
        want = REPLY.replace("beta STOP", "[pii]")
        with claude.messages.stream(model=TEXT_MODEL, max_tokens=50, messages=HI) as stream:
            assert "".join(stream.text_stream) == want
        chat = oai.chat.completions.create(model=TEXT_MODEL, max_tokens=50, messages=HI)
        assert chat.choices[0].message.content == want and chat.choices[0].finish_reason == "stop"
        asked = len(seen)
        mail = [{"role": "user", "content": "write to jane.doe@example.com for me"}]
        assert claude.messages.create(model=TEXT_MODEL, max_tokens=50, messages=mail).stop_reason == "refusal"
        chat = oai.chat.completions.create(model=TEXT_MODEL, max_tokens=50, messages=mail)
        assert chat.choices[0].finish_reason == "content_filter" and len(seen) == asked  # no engine request
        metrics = httpx.get(srv.url + "/metrics").text
        assert value(metrics, "tierlm:safety_actions_total", policy="personal_data", action="input") == 2
        assert value(metrics, "tierlm:safety_actions_total", policy="shapes", action="redact") == 2
    finally:
        srv.stop()


def test_an_answer_stopped_while_its_first_words_were_held_still_echoes_the_scored_prompt(scripted_models, tmp_path):
    """The first delta brings the prompt's logprobs; held back by a phrase it might begin
    ("alpha" of "alpha beta") and then stopped, it took them along: the echo came without its
    logprobs (columns of unequal length), streamed without its text, and since a prompt's first
    choice alone scores it, its other choices lost theirs too."""
    (tmp_path / "policies.toml").write_text('[policies.opening]\nphrases = ["alpha beta"]\ncheck = "output"\n')
    engine = scripted_models[TEXT_MODEL].engine(TEXT_MODEL)
    srv = ServerThread(build_app({TEXT_MODEL: engine}, ApiKeyAuth.from_keys(KEYS),
                                 safety=SafetyPolicies.from_file(tmp_path / "policies.toml"))).start()
    try:
        ids = chat_prompt_ids(engine.tokenizer)
        echo = engine.tokenizer.decode(ids)
        body = {"model": TEXT_MODEL, "prompt": ids, "echo": True, "logprobs": 0, "max_tokens": 20, "n": 2}
        with httpx.Client(base_url=srv.url, headers={"authorization": f"Bearer {KEYS['acme']}"}, timeout=60) as c:
            done = c.post("/v1/completions", json=body).json()
            raw = c.post("/v1/completions", json={**body, "stream": True}).text
        for choice in done["choices"]:
            lp = choice["logprobs"]
            assert choice["finish_reason"] == "content_filter" and choice["text"] == echo
            assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(ids) and lp["token_logprobs"][0] is None
        first = {}
        for _, data in parse_sse(raw):
            for c in [] if data == "[DONE]" else data["choices"]:
                first.setdefault(c["index"], c)
        for k in range(2):
            assert first[k]["text"] == echo and len(first[k]["logprobs"]["token_logprobs"]) == len(ids)
    finally:
        srv.stop()


SLOW_PATTERNS = """
[policies.ticks]
patterns = ['(?:tick |tock, |tick tock, )+y']   # passes the start-up probe; exponential on the loop's answer
check = "output"
action = "redact"

[policies.xs]
patterns = ['(?:x|xx)+y']                       # the same on a run of x's
check = "input"
"""


def test_patterns_that_run_out_of_time_stop_the_answer_or_refuse_the_prompt(scripted_models, tmp_path):
    """An operator's pattern that backtracks for ever on what the model writes, or on what a
    client sends, would hold the server's event loop for minutes per request; past the scan's
    time budget it counts as a match instead: the answer stops (content_filter) and the prompt
    is refused, each counted under its policy, and the server answers on."""
    import time

    (tmp_path / "policies.toml").write_text(SLOW_PATTERNS)
    safety = SafetyPolicies.from_file(tmp_path / "policies.toml")
    engines = {LOOP_MODEL: scripted_models[LOOP_MODEL].engine(LOOP_MODEL)}
    srv = ServerThread(build_app(engines, ApiKeyAuth.from_keys(KEYS), safety=safety)).start()
    try:
        claude, oai = clients(srv, "acme")
        started = time.monotonic()
        with claude.messages.stream(model=LOOP_MODEL, max_tokens=400, messages=HI) as stream:
            text = "".join(stream.text_stream)
            final = stream.get_final_message()
        assert final.stop_reason == "refusal" and final.usage.output_tokens < 400
        assert text.startswith("tick tock") or text == ""
        chat = oai.chat.completions.create(model=LOOP_MODEL, max_tokens=400, messages=HI)
        assert chat.choices[0].finish_reason == "content_filter"
        refused = claude.messages.create(model=LOOP_MODEL, max_tokens=5,
                                         messages=[{"role": "user", "content": "x" * 60}])
        assert refused.stop_reason == "refusal" and refused.usage.output_tokens == 0
        assert time.monotonic() - started < 60  # (unbounded, the first answer alone would take hours)
        assert httpx.get(srv.url + "/health", timeout=5).status_code == 200
        ok = claude.messages.create(model=LOOP_MODEL, max_tokens=4, messages=HI)  # short: matched in time
        assert ok.stop_reason == "max_tokens" and ok.content[0].text.startswith("tick")
        metrics = httpx.get(srv.url + "/metrics").text
        assert value(metrics, "tierlm:safety_actions_total", policy="ticks", action="output") == 2
        assert value(metrics, "tierlm:safety_actions_total", policy="xs", action="input") == 1
    finally:
        srv.stop()


def test_input_policies_read_the_clients_words_not_the_chat_templates(scripted_models, tmp_path):
    """A phrase the chat template writes itself ("assistant", the role it opens for the answer;
    gpt-oss's template names OpenAI and ChatGPT in every system message) refused every chat
    prompt: the guard read the rendered prompt. It reads what the client sent now: messages,
    tool definitions and results; a raw completion prompt is read whole, as it is all the client's."""
    (tmp_path / "policies.toml").write_text(
        '[policies.role_word]\nphrases = ["assistant"]\nwhole_word = true\ncheck = "input"\n')
    safety = SafetyPolicies.from_file(tmp_path / "policies.toml", tiers=set(), tenants=set())
    engine = scripted_models[TEXT_MODEL].engine(TEXT_MODEL)  # (an engine serves one server's event loop)
    srv = ServerThread(build_app({TEXT_MODEL: engine}, ApiKeyAuth.from_keys(KEYS), safety=safety)).start()
    try:
        claude, oai = clients(srv, "acme")
        assert claude.messages.create(model=TEXT_MODEL, max_tokens=20, messages=HI).stop_reason != "refusal"
        chat = oai.chat.completions.create(model=TEXT_MODEL, max_tokens=20, messages=HI)
        assert chat.choices[0].finish_reason != "content_filter"
        words = [{"role": "user", "content": [{"type": "text", "text": "Hi"}]},
                 {"role": "assistant", "content": "Hello"},
                 {"role": "user", "content": "call my Assistant"}]
        assert claude.messages.create(model=TEXT_MODEL, max_tokens=20, messages=words).stop_reason == "refusal"
        chat = oai.chat.completions.create(model=TEXT_MODEL, max_tokens=20, messages=words)
        assert chat.choices[0].finish_reason == "content_filter"
        system = claude.messages.create(model=TEXT_MODEL, max_tokens=20, messages=HI, system="You are an assistant")
        assert system.stop_reason == "refusal"
        tool = {"name": "assistant", "description": "d", "input_schema": {"type": "object", "properties": {}}}
        assert claude.messages.create(model=TEXT_MODEL, max_tokens=20, messages=HI, tools=[tool]).stop_reason == "refusal"
        completion = oai.completions.create(model=TEXT_MODEL, max_tokens=5, prompt="the assistant")
        assert completion.choices[0].finish_reason == "content_filter"
    finally:
        srv.stop()
