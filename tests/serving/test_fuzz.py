"""Property: whatever the body, the server answers 2xx or a well-formed 4xx — never a 5xx,
never a stack trace — and stays healthy with no KV blocks left behind. Valid bodies really
generate, on the real engine (a scripted model: tiny, so hundreds of requests stay fast)."""
from __future__ import annotations

import copy
import json

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.serving.harness import API_KEY, wait_until
from tests.serving.scripted_model import TEXT_MODEL

ANTHROPIC_TYPES = {"invalid_request_error", "authentication_error", "permission_error", "not_found_error",
                   "request_too_large", "rate_limit_error"}
PATHS = ["/v1/messages", "/v1/messages/count_tokens", "/v1/chat/completions", "/v1/completions"]
FUZZ = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])

json_scalars = st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=12)
json_values = st.recursive(json_scalars, lambda inner: st.lists(inner, max_size=4)
                           | st.dictionaries(st.text(max_size=8), inner, max_size=4), max_leaves=12)

text = st.text(max_size=20)
words = st.text(min_size=1, max_size=20)
tool = st.fixed_dictionaries({"name": st.from_regex(r"[a-z_]{1,10}", fullmatch=True),
                              "input_schema": st.just({"type": "object"})}, optional={"description": text})
anthropic_message = st.fixed_dictionaries({
    "role": st.sampled_from(["user", "assistant"]),
    "content": words | st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": words}), min_size=1, max_size=3),
})
anthropic_body = st.fixed_dictionaries(
    {"model": st.just(TEXT_MODEL), "max_tokens": st.integers(1, 12),
     "messages": st.lists(anthropic_message, min_size=1, max_size=3)},
    optional={"system": words | st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": words}), max_size=2),
              "stop_sequences": st.lists(words, max_size=3), "temperature": st.floats(0, 1),
              "top_p": st.floats(0.01, 1), "top_k": st.integers(0, 50), "stream": st.booleans(),
              "metadata": st.fixed_dictionaries({"user_id": text}), "tools": st.lists(tool, min_size=1, max_size=2),
              "tool_choice": st.sampled_from([{"type": "auto"}, {"type": "none"}])},
)
openai_message = st.fixed_dictionaries({"role": st.sampled_from(["system", "developer", "user", "assistant"]),
                                        "content": words})
openai_body = st.fixed_dictionaries(
    {"model": st.just(TEXT_MODEL), "messages": st.lists(openai_message, min_size=1, max_size=3),
     "prompt": words | st.lists(st.integers(0, 900), min_size=1, max_size=8)},
    optional={"max_tokens": st.integers(1, 12), "stop": words | st.lists(words, max_size=3),
              "temperature": st.floats(0, 2), "top_p": st.floats(0.01, 1),
              "seed": st.integers(0, 2**31) | st.integers(-(2**70), 2**70),
              "stream": st.booleans(), "logprobs": st.booleans(), "echo": st.booleans(), "n": st.just(1),
              "presence_penalty": st.floats(-2, 2), "frequency_penalty": st.floats(-2, 2)},
)


def _slots(value, out: list) -> list:
    """Every (container, key) inside a JSON value, depth first."""
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for key, inner in items:
        out.append((value, key))
        _slots(inner, out)
    return out


@st.composite
def mutated(draw, valid):
    """A valid body with one top-level field dropped, replaced by junk, or junk added; or one
    value anywhere inside it (a message's role, a block's type, ...) replaced by junk; or none."""
    body = copy.deepcopy(draw(valid))
    how = draw(st.sampled_from(["keep", "drop", "replace", "replace", "add", "nested", "nested"]))
    if how == "nested":
        container, key = draw(st.sampled_from(_slots(body, [])))
        container[key] = draw(json_values)
        return body
    if how == "drop" and body:
        body.pop(draw(st.sampled_from(sorted(body))))
    elif how == "replace" and body:
        body[draw(st.sampled_from(sorted(body)))] = draw(json_values)
    elif how == "add":
        body[draw(st.sampled_from(["stream_options", "tool_choice", "tools", "n", "top_logprobs", "suffix",
                                   "logit_bias", "response_format", "max_completion_tokens", "x"]))] = draw(json_values)
    return body


@pytest.fixture(scope="module")
def client(scripted_server):
    with httpx.Client(base_url=scripted_server.url, timeout=30, headers={"x-api-key": API_KEY}) as c:
        yield c


def check(r: httpx.Response, path: str) -> None:
    assert r.status_code < 500, (r.status_code, r.text)
    assert "Traceback" not in r.text
    if r.status_code < 400:
        return
    data = r.json()
    if path in ("/v1/chat/completions", "/v1/completions"):
        error = data["error"]
        assert isinstance(error["message"], str) and error["message"] and isinstance(error["type"], str)
    else:
        assert data["type"] == "error" and data["error"]["type"] in ANTHROPIC_TYPES
        assert isinstance(data["error"]["message"], str) and data["error"]["message"]
        assert data["request_id"] == r.headers["request-id"]


@pytest.mark.slow
@FUZZ
@given(path=st.sampled_from(PATHS[:2]), payload=mutated(anthropic_body))
def test_anthropic_bodies(client, path, payload):
    check(client.post(path, json=payload), path)


@pytest.mark.slow
@FUZZ
@given(path=st.sampled_from(PATHS[2:]), payload=mutated(openai_body))
def test_openai_bodies(client, path, payload):
    check(client.post(path, json=payload), path)


@pytest.mark.slow
@FUZZ
@given(path=st.sampled_from(PATHS), payload=json_values)
def test_arbitrary_json(client, path, payload):
    check(client.post(path, content=json.dumps(payload), headers={"content-type": "application/json"}), path)


@pytest.mark.slow
@settings(max_examples=60, deadline=None)
@given(path=st.sampled_from(PATHS), raw=st.binary(max_size=64))
def test_arbitrary_bytes(client, path, raw):
    check(client.post(path, content=raw), path)


def test_server_is_healthy_afterwards(client, scripted_engines):
    assert client.get("/health").json() == {"status": "ok"}
    assert client.get("/ready").status_code == 200
    engine = scripted_engines[TEXT_MODEL]
    assert wait_until(lambda: engine.stats().kv_blocks_used == 0)
    stats = engine.stats()
    assert stats.num_running == 0 and stats.num_waiting == 0
    r = client.post("/v1/messages", json={"model": TEXT_MODEL, "max_tokens": 5,
                                         "messages": [{"role": "user", "content": "still there?"}]})
    assert r.status_code == 200
