"""vLLM's /tokenize and /detokenize against the real server on the demo model: a prompt's ids as
the model's tokenizer gives them, a conversation's as the chat route runs it, ids back to text,
and bad bodies refused in OpenAI's shape."""
from __future__ import annotations

import httpx
import pytest

from tests.serving.harness import API_KEY, record_requests

MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is a KV cache?"}]


@pytest.fixture
def http(demo_server):
    with httpx.Client(base_url=demo_server.url, timeout=30, headers={"authorization": f"Bearer {API_KEY}"}) as c:
        yield c


def test_a_prompt_tokenizes_as_the_model_does_and_detokenizes_back(http, demo_engine):
    text = "The quick brown fox jumps over the lazy dog."
    got = http.post("/tokenize", json={"prompt": text, "return_token_strs": True}).json()  # model: the only one
    ids = demo_engine.tokenizer.encode(text)
    assert got["tokens"] == ids and got["count"] == len(ids) and got["max_model_len"] == demo_engine.max_model_len
    assert got["token_strs"] == demo_engine.tokenizer.convert_ids_to_tokens(ids)
    plain = http.post("/tokenize", json={"model": demo_engine.model_name, "prompt": text}).json()
    assert plain["tokens"] == ids and plain["token_strs"] is None
    assert http.post("/detokenize", json={"tokens": ids}).json() == {"prompt": demo_engine.tokenizer.decode(ids)}


def test_a_conversation_tokenizes_to_the_prompt_the_chat_route_runs(http, demo_engine, monkeypatch):
    admitted = record_requests(demo_engine, monkeypatch)
    model = demo_engine.model_name
    got = http.post("/tokenize", json={"model": model, "messages": MESSAGES}).json()
    assert admitted == []  # counting runs nothing
    r = http.post("/v1/chat/completions", json={"model": model, "messages": MESSAGES, "max_tokens": 1})
    assert r.status_code == 200
    assert got["tokens"] == admitted[0].prompt_token_ids and got["count"] == r.json()["usage"]["prompt_tokens"]
    cont = http.post("/tokenize", json={"model": model, "add_generation_prompt": False,
                                        "messages": [*MESSAGES, {"role": "assistant", "content": "A cache"}],
                                        "continue_final_message": True}).json()
    assert demo_engine.tokenizer.decode(cont["tokens"]).endswith("A cache")


@pytest.mark.parametrize("path, body, status, param", [
    ("/tokenize", {"prompt": "x", "messages": MESSAGES}, 400, None),
    ("/tokenize", {}, 400, None),
    ("/tokenize", {"messages": [{"role": "tool", "content": "x"}]}, 400, "messages.0"),
    ("/tokenize", {"messages": MESSAGES, "add_special_tokens": True}, 400, "add_special_tokens"),
    ("/tokenize", {"model": "nope", "prompt": "x"}, 404, "model"),
    ("/detokenize", {"tokens": [1, 10**7]}, 400, "tokens"),
    ("/detokenize", {"tokens": "12"}, 400, "tokens"),
])
def test_bad_bodies_are_refused_in_openais_shape(http, path, body, status, param):
    r = http.post(path, json=body)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) >= {"message", "type", "param", "code"}
    if param is not None:
        assert error["param"] == param


def test_tokenize_needs_a_key(demo_server):
    r = httpx.post(demo_server.url + "/tokenize", json={"prompt": "x"}, headers={"authorization": "Bearer nope"})
    assert r.status_code == 401 and "error" in r.json()
