"""The OpenAI Chat Completions and Completions APIs over real HTTP, against the scripted engine."""
from __future__ import annotations

import json

import httpx
import pytest

from tests.serving.fakes import API_KEY, parse_sse

MODEL = "fake-model"
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
WEATHER_TOOL = {"type": "function", "function": {"name": "get_weather", "description": "Weather for a city",
                                                 "parameters": {"type": "object"}}}
USER = [{"role": "user", "content": "Hi there"}]


@pytest.fixture
def client(fake_server, fake):
    with httpx.Client(base_url=fake_server.url, timeout=30, headers={"authorization": f"Bearer {API_KEY}"}) as c:
        yield c


def chat(**fields):
    return {"model": MODEL, "messages": USER, **fields}


def test_chat_completion_shape(client, fake):
    r = client.post("/v1/chat/completions", json=chat(max_tokens=50, seed=3, temperature=0.2))
    assert r.status_code == 200 and r.headers["x-request-id"].startswith("req_")
    data = r.json()
    assert data["id"].startswith("chatcmpl-") and data["object"] == "chat.completion"
    choice = data["choices"][0]
    assert choice["message"] == {"role": "assistant", "content": fake.reply(""), "tool_calls": None}
    assert choice["finish_reason"] == "stop"
    usage = data["usage"]
    assert usage["prompt_tokens"] == len(fake.calls[-1].prompt_token_ids)
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    params = fake.calls[-1].params
    assert (params.seed, params.temperature, params.max_tokens) == (3, 0.2, 50)


def test_max_completion_tokens_wins_and_length_finish(client, fake):
    data = client.post("/v1/chat/completions", json=chat(max_tokens=50, max_completion_tokens=2)).json()
    assert data["choices"][0]["finish_reason"] == "length" and data["usage"]["completion_tokens"] == 2


def test_default_max_tokens_fills_the_context(client, fake):
    client.post("/v1/chat/completions", json=chat())
    assert fake.calls[-1].params.max_tokens == fake.max_model_len - len(fake.calls[-1].prompt_token_ids)


def test_developer_role_and_stop(client, fake):
    fake.reply = lambda prompt: "one, two; three"
    data = client.post("/v1/chat/completions", json=chat(
        messages=[{"role": "developer", "content": "Count."}, *USER], stop=";")).json()
    assert "<|im_start|>system\nCount.<|im_end|>" in fake.calls[-1].prompt_text
    assert data["choices"][0]["message"]["content"] == "one, two"
    assert data["choices"][0]["finish_reason"] == "stop"


def test_chat_streaming_with_usage(client, fake):
    fake.reply = lambda prompt: "streamed words"
    r = client.post("/v1/chat/completions", json=chat(stream=True, stream_options={"include_usage": True}))
    frames = [d for _, d in parse_sse(r.text)]
    assert frames[-1] == "[DONE]"
    chunks = frames[:-1]
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
    assert text == "streamed words"
    assert chunks[-2]["choices"][0]["finish_reason"] == "stop"
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == len(fake.encode(text)) + 1
    assert all(c["usage"] is None for c in chunks[:-1])


def test_chat_logprobs(client, fake):
    fake.reply = lambda prompt: "ab"
    data = client.post("/v1/chat/completions", json=chat(logprobs=True, top_logprobs=2)).json()
    content = data["choices"][0]["logprobs"]["content"]
    assert len(content) == len(fake.encode("ab")) + 1
    first = content[0]
    assert first["logprob"] == -0.25 and len(first["top_logprobs"]) == 2 and isinstance(first["bytes"], list)
    assert fake.calls[-1].params.logprobs == 2


def test_chat_tool_calls(client, fake):
    fake.reply = lambda prompt: CALL
    data = client.post("/v1/chat/completions", json=chat(tools=[WEATHER_TOOL])).json()
    choice = data["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
    call = choice["message"]["tool_calls"][0]
    assert call["id"].startswith("call_") and call["type"] == "function"
    assert call["function"]["name"] == "get_weather" and json.loads(call["function"]["arguments"]) == {"city": "Paris"}


def test_chat_tool_calls_streaming(client, fake):
    fake.reply = lambda prompt: "Sure. " + CALL
    frames = [d for _, d in parse_sse(client.post("/v1/chat/completions",
                                                   json=chat(tools=[WEATHER_TOOL], stream=True)).text)]
    chunks = frames[:-1]
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks)
    assert text.strip() == "Sure."
    calls = [c["choices"][0]["delta"]["tool_calls"][0] for c in chunks if "tool_calls" in c["choices"][0]["delta"]]
    assert calls[0]["index"] == 0 and calls[0]["function"]["name"] == "get_weather"
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"


def test_assistant_tool_call_history_renders(client, fake):
    client.post("/v1/chat/completions", json=chat(tools=[WEATHER_TOOL], messages=[
        *USER,
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "rainy"},
    ]))
    prompt = fake.calls[-1].prompt_text
    assert '"arguments": {"city": "Rome"}' in prompt and "<tool_response>\nrainy\n</tool_response>" in prompt


def test_completions(client, fake):
    fake.reply = lambda prompt: " world"
    data = client.post("/v1/completions", json={"model": MODEL, "prompt": "Hello", "max_tokens": 10,
                                                "echo": True}).json()
    assert data["object"] == "text_completion" and data["id"].startswith("cmpl-")
    assert data["choices"][0]["text"] == "Hello world" and data["choices"][0]["finish_reason"] == "stop"
    assert fake.calls[-1].prompt_token_ids == fake.encode("Hello")
    assert data["usage"]["prompt_tokens"] == len(fake.encode("Hello"))


def test_completions_token_prompt_logprobs_and_stream(client, fake):
    fake.reply = lambda prompt: "abc"
    ids = fake.encode("Hello")
    data = client.post("/v1/completions", json={"model": MODEL, "prompt": ids, "logprobs": 1}).json()
    lp = data["choices"][0]["logprobs"]
    assert "".join(lp["tokens"][:-1]) == "abc" and lp["text_offset"][0] == 0 and len(lp["top_logprobs"][0]) == 1
    r = client.post("/v1/completions", json={"model": MODEL, "prompt": "Hi", "stream": True,
                                             "stream_options": {"include_usage": True}})
    frames = [d for _, d in parse_sse(r.text)]
    assert frames[-1] == "[DONE]"
    assert "".join(c["choices"][0]["text"] for c in frames[:-1] if c["choices"]) == "abc"
    assert frames[-2]["usage"]["completion_tokens"] == 4


def test_out_of_vocab_token_prompt_is_400(client, fake):
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
])
def test_openai_error_shape(client, path, payload, status, param):
    r = client.post(path, json=payload)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["param"] == param
    assert "type" not in r.json() or r.json().get("type") != "error"


def test_openai_auth_error_shape(fake_server, fake):
    r = httpx.post(fake_server.url + "/v1/chat/completions", json=chat(), headers={"authorization": "Bearer nope"})
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"


def test_mid_stream_failure_is_an_error_chunk(client, fake):
    fake.fail_after = 2
    frames = [d for _, d in parse_sse(client.post("/v1/chat/completions", json=chat(stream=True)).text)]
    assert frames[-1] == "[DONE]" and frames[-2]["error"]["type"] == "server_error"
