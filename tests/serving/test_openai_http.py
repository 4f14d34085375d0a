"""The OpenAI Chat Completions and Completions APIs over real HTTP, against the real engine
running scripted models (tiny real checkpoints whose answers are known; see scripted_model.py)."""
from __future__ import annotations

import json

import httpx
import pytest

from tests.serving.harness import API_KEY, fail_after_steps, parse_sse, wait_until
from tests.serving.scripted_model import (
    CALL_MODEL,
    COMPLETION_PROMPT,
    COMPLETION_REPLY,
    REPLY,
    TEXT_MODEL,
    TOOL_PROSE,
    TOOLS_MODEL,
)

MODEL = TEXT_MODEL
WEATHER_TOOL = {"type": "function", "function": {"name": "get_weather", "description": "Weather for a city",
                                                 "parameters": {"type": "object"}}}
USER = [{"role": "user", "content": "Hi there"}]


@pytest.fixture
def client(scripted_server):
    with httpx.Client(base_url=scripted_server.url, timeout=30, headers={"authorization": f"Bearer {API_KEY}"}) as c:
        yield c


@pytest.fixture
def engine(scripted_engines):
    return scripted_engines[MODEL]


@pytest.fixture
def asked(requests_to):
    """The requests the text model's engine admits during the test."""
    return requests_to(MODEL)


@pytest.fixture
def reply_len(scripted_models):
    """Tokens the text model generates for `text` (one of its scripted replies)."""
    return lambda text: len(scripted_models[MODEL].reply_tokens(text))


def chat(**fields):
    return {"model": MODEL, "messages": USER, **fields}


def test_chat_completion_shape(client, asked, reply_len):
    r = client.post("/v1/chat/completions", json=chat(max_tokens=50, seed=3, temperature=0.2))
    assert r.status_code == 200 and r.headers["x-request-id"].startswith("req_")
    data = r.json()
    assert data["id"].startswith("chatcmpl-") and data["object"] == "chat.completion"
    choice = data["choices"][0]
    assert choice["message"] == {"role": "assistant", "content": REPLY, "tool_calls": None}
    assert choice["finish_reason"] == "stop"
    usage = data["usage"]
    assert usage["prompt_tokens"] == len(asked[-1].prompt_token_ids)
    assert usage["completion_tokens"] == reply_len(REPLY) + 1  # + EOS
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    params = asked[-1].params
    assert (params.seed, params.temperature, params.max_tokens) == (3, 0.2, 50)


def test_max_completion_tokens_wins_and_length_finish(client):
    data = client.post("/v1/chat/completions", json=chat(max_tokens=50, max_completion_tokens=2)).json()
    assert data["choices"][0]["finish_reason"] == "length" and data["usage"]["completion_tokens"] == 2


def test_default_max_tokens_fills_the_context(client, engine, asked):
    client.post("/v1/chat/completions", json=chat())
    assert asked[-1].params.max_tokens == engine.max_model_len - len(asked[-1].prompt_token_ids)


def test_developer_role_and_stop(client, engine, asked):
    assert REPLY.startswith("alpha beta STOP gamma;")
    data = client.post("/v1/chat/completions", json=chat(
        messages=[{"role": "developer", "content": "Count."}, *USER], stop=";")).json()
    assert "<|im_start|>system\nCount.<|im_end|>" in engine.tokenizer.decode(asked[-1].prompt_token_ids)
    assert data["choices"][0]["message"]["content"] == "alpha beta STOP gamma"
    assert data["choices"][0]["finish_reason"] == "stop"


def test_chat_streaming_with_usage(client, reply_len):
    r = client.post("/v1/chat/completions", json=chat(stream=True, stream_options={"include_usage": True}))
    frames = [d for _, d in parse_sse(r.text)]
    assert frames[-1] == "[DONE]"
    chunks = frames[:-1]
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
    assert text == REPLY
    assert chunks[-2]["choices"][0]["finish_reason"] == "stop"
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == reply_len(REPLY) + 1
    assert all(c["usage"] is None for c in chunks[:-1])


def test_chat_logprobs(client, asked, reply_len):
    data = client.post("/v1/chat/completions", json=chat(logprobs=True, top_logprobs=2)).json()
    content = data["choices"][0]["logprobs"]["content"]
    assert len(content) == reply_len(REPLY) + 1
    assert "".join(t["token"] for t in content[:-1]) == REPLY
    first = content[0]
    assert len(first["top_logprobs"]) == 2 and first["bytes"] == list(first["token"].encode())
    # the scripted model is sure of its next token: it is the top alternative, at ~probability 1
    assert first["top_logprobs"][0] == {"token": first["token"], "logprob": first["logprob"],
                                        "bytes": first["bytes"]}
    assert -1e-3 < first["logprob"] <= 0 and first["top_logprobs"][1]["logprob"] < -10
    assert asked[-1].params.logprobs == 2


def test_chat_tool_calls(client):
    data = client.post("/v1/chat/completions", json=chat(model=CALL_MODEL, tools=[WEATHER_TOOL])).json()
    choice = data["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
    call = choice["message"]["tool_calls"][0]
    assert call["id"].startswith("call_") and call["type"] == "function"
    assert call["function"]["name"] == "get_weather" and json.loads(call["function"]["arguments"]) == {"city": "Paris"}


def test_chat_tool_calls_streaming(client):
    frames = [d for _, d in parse_sse(client.post("/v1/chat/completions",
                                                   json=chat(model=TOOLS_MODEL, tools=[WEATHER_TOOL],
                                                             stream=True)).text)]
    chunks = frames[:-1]
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks)
    assert text.strip() == TOOL_PROSE
    calls = [c["choices"][0]["delta"]["tool_calls"][0] for c in chunks if "tool_calls" in c["choices"][0]["delta"]]
    assert calls[0]["index"] == 0 and calls[0]["function"]["name"] == "get_weather"
    assert json.loads(calls[0]["function"]["arguments"]) == {"city": "Paris"}
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"


@pytest.mark.parametrize("tool_choice, city", [
    ("required", "Paris"),  # the server starts the assistant turn with `<tool_call>`
    ({"type": "function", "function": {"name": "get_weather"}}, "Oslo"),  # ... and the function's name
])
def test_chat_tool_choice_starts_the_call(client, scripted_engines, requests_to, tool_choice, city):
    asked = requests_to(TOOLS_MODEL)
    data = client.post("/v1/chat/completions", json=chat(model=TOOLS_MODEL, tools=[WEATHER_TOOL],
                                                         tool_choice=tool_choice)).json()
    prompt = scripted_engines[TOOLS_MODEL].tokenizer.decode(asked[-1].prompt_token_ids)
    assert prompt.endswith("<|im_start|>assistant\n<tool_call>\n" if tool_choice == "required"
                           else '<tool_call>\n{"name": "get_weather", "arguments": ')
    choice = data["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
    (call,) = choice["message"]["tool_calls"]
    assert call["function"]["name"] == "get_weather" and json.loads(call["function"]["arguments"]) == {"city": city}


def test_assistant_tool_call_history_renders(client, engine, asked):
    client.post("/v1/chat/completions", json=chat(tools=[WEATHER_TOOL], messages=[
        *USER,
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "rainy"},
    ]))
    prompt = engine.tokenizer.decode(asked[-1].prompt_token_ids)
    assert '"arguments": {"city": "Rome"}' in prompt and "<tool_response>\nrainy\n</tool_response>" in prompt


def test_completions(client, engine, asked):
    data = client.post("/v1/completions", json={"model": MODEL, "prompt": COMPLETION_PROMPT, "max_tokens": 10,
                                                "echo": True}).json()
    assert data["object"] == "text_completion" and data["id"].startswith("cmpl-")
    assert data["choices"][0]["text"] == "Hello world" == COMPLETION_PROMPT + COMPLETION_REPLY
    assert data["choices"][0]["finish_reason"] == "stop"
    assert asked[-1].prompt_token_ids == engine.encode(COMPLETION_PROMPT)
    assert data["usage"]["prompt_tokens"] == len(engine.encode(COMPLETION_PROMPT))


def test_completions_token_prompt_logprobs_and_stream(client, engine, reply_len):
    ids = engine.encode(COMPLETION_PROMPT)
    data = client.post("/v1/completions", json={"model": MODEL, "prompt": ids, "logprobs": 1}).json()
    lp = data["choices"][0]["logprobs"]
    assert "".join(lp["tokens"][:-1]) == COMPLETION_REPLY and lp["text_offset"][0] == 0 and len(lp["top_logprobs"][0]) == 1
    r = client.post("/v1/completions", json={"model": MODEL, "prompt": COMPLETION_PROMPT, "stream": True,
                                             "stream_options": {"include_usage": True}})
    frames = [d for _, d in parse_sse(r.text)]
    assert frames[-1] == "[DONE]"
    assert "".join(c["choices"][0]["text"] for c in frames[:-1] if c["choices"]) == COMPLETION_REPLY
    assert frames[-2]["usage"]["completion_tokens"] == reply_len(COMPLETION_REPLY) + 1


def test_out_of_vocab_token_prompt_is_400(client):
    r = client.post("/v1/completions", json={"model": MODEL, "prompt": [10**9]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"


@pytest.mark.parametrize("path, payload, status, param", [
    ("/v1/chat/completions", chat(model="nope"), 404, "model"),
    ("/v1/chat/completions", chat(n=3), 400, "n"),
    ("/v1/chat/completions", chat(messages=[]), 400, "messages"),
    ("/v1/chat/completions", chat(max_tokens=10**6), 400, "max_tokens"),
    ("/v1/chat/completions", chat(messages=[{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}]), 400, "messages.0.content.0"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "echo": True, "logprobs": 1}, 400, "echo"),
    ("/v1/completions", {"model": MODEL}, 400, "prompt"),
    ("/v1/chat/completions", chat(seed=10**20), 400, "seed"),  # beyond 64 bits: was a 500
    ("/v1/completions", {"model": MODEL, "prompt": "x", "seed": -(2**63) - 1}, 400, "seed"),
    ("/v1/chat/completions", chat(cache_salt=""), 400, "cache_salt"),
    ("/v1/chat/completions", chat(top_k=-5), 400, "top_k"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "top_k": -2}, 400, "top_k"),
])
def test_openai_error_shape(client, path, payload, status, param):
    r = client.post(path, json=payload)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["param"] == param
    assert "type" not in r.json() or r.json().get("type") != "error"


@pytest.mark.parametrize("top_k, sent", [(-1, -1), (0, -1), (1, 1), (40, 40), (10**6, -1), (2**70, -1)])
def test_top_k_follows_vllm(client, asked, top_k, sent):
    """-1 and 0 mean no limit, and so do values past the vocabulary (however large)."""
    for path, payload in (("/v1/chat/completions", chat(top_k=top_k, max_tokens=2)),
                          ("/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 2, "top_k": top_k})):
        assert client.post(path, json=payload).status_code == 200
        assert asked[-1].params.top_k == sent


def test_negative_top_k_is_refused_naming_the_rule(client):
    error = client.post("/v1/chat/completions", json=chat(top_k=-5)).json()["error"]
    assert error["message"] == "top_k: must be -1 or 0 (no limit) or at least 1 (got -5)"


def test_openai_auth_error_shape(scripted_server):
    r = httpx.post(scripted_server.url + "/v1/chat/completions", json=chat(), headers={"authorization": "Bearer nope"})
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"


def test_mid_stream_failure_is_an_error_chunk(client, engine, monkeypatch):
    fail_after_steps(engine, monkeypatch, 2)  # prefill + 1 decode, then the device faults
    frames = [d for _, d in parse_sse(client.post("/v1/chat/completions", json=chat(stream=True)).text)]
    assert frames[-1] == "[DONE]" and frames[-2]["error"]["type"] == "server_error"
    assert any(f["choices"] and f["choices"][0]["delta"].get("content") for f in frames[:-2])  # output had started
    assert wait_until(lambda: engine.stats().kv_blocks_used == 0)
