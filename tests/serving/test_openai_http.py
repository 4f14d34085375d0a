"""The OpenAI Chat Completions and Completions APIs over real HTTP, against the real engine
running scripted models (tiny real checkpoints whose answers are known; see scripted_model.py)."""
from __future__ import annotations

import json

import httpx
import pytest

import tierlm

from tests.serving.harness import fail_after_steps, parse_sse, wait_until
from tests.serving.scripted_model import (
    CALL_MODEL,
    COMPLETION_PROMPT,
    COMPLETION_REPLY,
    REPLY,
    TEXT_MODEL,
    TOOL_PROSE,
    TOOLS_MODEL,
    TOOLS_REPLY,
    chat_prompt_ids,
)

MODEL = TEXT_MODEL
WEATHER_TOOL = {"type": "function", "function": {"name": "get_weather", "description": "Weather for a city",
                                                 "parameters": {"type": "object"}}}
USER = [{"role": "user", "content": "Hi there"}]


@pytest.fixture
def client(openai_client):
    return openai_client


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
    assert data["system_fingerprint"] == f"tierlm-{tierlm.__version__}"
    choice = data["choices"][0]
    assert choice["message"] == {"role": "assistant", "content": REPLY, "refusal": None, "annotations": [],
                                 "tool_calls": None}
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
    assert all(c["system_fingerprint"] == f"tierlm-{tierlm.__version__}" for c in chunks)
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}  # no tools: a text answer
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
    assert text == REPLY
    assert chunks[-2]["choices"][0]["finish_reason"] == "stop"
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == reply_len(REPLY) + 1
    assert all(c["usage"] is None for c in chunks[:-1])


def test_chat_logprobs(client, asked, reply_len):
    data = client.post("/v1/chat/completions", json=chat(logprobs=True, top_logprobs=2)).json()
    content = data["choices"][0]["logprobs"]["content"]
    assert len(content) == reply_len(REPLY)  # the text's tokens; not the EOS after it
    assert "".join(t["token"] for t in content) == REPLY
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
    assert text == TOOL_PROSE  # as when not streamed: the newline before the call is not shown
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
    # OpenAI (and vLLM) end a named tool_choice's call with `stop`, a required one with `tool_calls`
    assert choice["finish_reason"] == ("tool_calls" if tool_choice == "required" else "stop")
    assert choice["message"]["content"] is None
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


@pytest.mark.parametrize("arguments", ["[1, 2]", '"x"', "null", '{"a": NaN}', '{"a": Infinity}', '{"a": 1e400}',
                                       "{oops"])
def test_tool_call_history_arguments_must_be_a_json_object(client, arguments):
    r = client.post("/v1/chat/completions", json=chat(tools=[WEATHER_TOOL], messages=[
        *USER,
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": arguments}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "rainy"},
    ]))
    assert r.status_code == 400
    error = r.json()["error"]
    assert error["param"] == "messages.1.tool_calls.0.function.arguments"
    assert "must be a JSON object encoded as a string" in error["message"]


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
    assert "".join(lp["tokens"]) == COMPLETION_REPLY and lp["text_offset"][0] == 0 and len(lp["top_logprobs"][0]) == 1
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
    ("/v1/chat/completions", chat(n=129), 400, "n"),  # at most 128 choices, as OpenAI
    ("/v1/completions", {"model": MODEL, "prompt": "x", "n": 0}, 400, "n"),
    ("/v1/chat/completions", chat(messages=[]), 400, "messages"),
    ("/v1/chat/completions", chat(max_tokens=10**6), 400, "messages"),  # context_length_exceeded, as OpenAI
    ("/v1/chat/completions", chat(messages=[{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}]), 400, "messages.0.content.0"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 0}, 400, "max_tokens"),  # 0: echo only
    ("/v1/completions", {"model": MODEL, "prompt": ["x", ""]}, 400, "prompt"),
    ("/v1/chat/completions", chat(prompt_logprobs=21), 400, "prompt_logprobs"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "prompt_logprobs": 1, "stream": True}, 400, "prompt_logprobs"),
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


# ---- fidelity to OpenAI's API -------------------------------------------------------------


def test_context_length_exceeded_in_openais_words(client, engine):
    n = engine.max_model_len
    p = len(chat_prompt_ids(engine.tokenizer, messages=USER))
    error = client.post("/v1/chat/completions", json=chat(max_tokens=n)).json()["error"]
    assert (error["code"], error["param"], error["type"]) == ("context_length_exceeded", "messages",
                                                              "invalid_request_error")
    assert error["message"] == (f"This model's maximum context length is {n} tokens. However, you requested "
                                f"{p + n} tokens ({p} in the messages, {n} in the completion). Please reduce the "
                                f"length of the messages or completion. (max_tokens can be at most {n - p} for "
                                "these messages.)")
    long = [{"role": "user", "content": "word " * n}]
    p = len(chat_prompt_ids(engine.tokenizer, messages=long))
    r = client.post("/v1/chat/completions", json=chat(messages=long))
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
    assert r.json()["error"]["message"] == (f"This model's maximum context length is {n} tokens. However, your "
                                            f"messages resulted in {p} tokens. Please reduce the length of the messages.")
    ids = engine.encode(COMPLETION_PROMPT)
    for prompt, p, c in ((COMPLETION_PROMPT, len(ids), n), (ids * n, len(ids) * n, 16)):  # 16: the default
        body = {"model": MODEL, "prompt": prompt, **({"max_tokens": c} if c != 16 else {})}
        error = client.post("/v1/completions", json=body).json()["error"]
        assert (error["code"], error["param"]) == ("context_length_exceeded", "prompt")
        assert error["message"].startswith(f"This model's maximum context length is {n} tokens. However, you "
                                           f"requested {p + c} tokens ({p} in your prompt, {c} in the completion). "
                                           "Please reduce the length of the prompt or completion.")


def test_empty_content_is_accepted_as_openai_does(client, asked):
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": "{}"}}
    for messages in (
        [{"role": "system", "content": ""}, {"role": "user", "content": ""}, {"role": "assistant", "content": ""},
         {"role": "developer", "content": ""}, *USER],
        [*USER, {"role": "assistant", "content": None, "tool_calls": [call]},
         {"role": "tool", "tool_call_id": "call_1", "content": ""}],
    ):
        r = client.post("/v1/chat/completions", json=chat(messages=messages, tools=[WEATHER_TOOL]))
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["message"]["content"] == REPLY
    for message, param in (({"role": "user", "content": 5}, "messages.0.content"),
                           ({"role": "user", "content": []}, "messages.0.content"),
                           ({"role": "assistant", "content": None}, "messages.0")):
        error = client.post("/v1/chat/completions", json=chat(messages=[message])).json()["error"]
        assert error["param"] == param and error["message"].startswith(param + ": ")


def test_every_system_and_developer_text_reaches_the_prompt(client, engine, asked):
    """The template renders only a leading system message: all of them are merged into one."""
    messages = [{"role": "system", "content": "Rule one."}, *USER, {"role": "developer", "content": "Rule two."},
                {"role": "assistant", "content": "Ok."}, {"role": "system", "content": "Rule three."},
                {"role": "user", "content": "Go on"}]
    assert client.post("/v1/chat/completions", json=chat(messages=messages)).status_code == 200
    prompt = engine.tokenizer.decode(asked[-1].prompt_token_ids)
    assert prompt.startswith("<|im_start|>system\nRule one.\n\nRule two.\n\nRule three.<|im_end|>\n"
                             "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\nOk.<|im_end|>\n"
                             "<|im_start|>user\nGo on<|im_end|>")
    assert client.post("/v1/chat/completions", json=chat(
        messages=[*USER, {"role": "developer", "content": "Late rule."}])).status_code == 200
    prompt = engine.tokenizer.decode(asked[-1].prompt_token_ids)
    assert prompt.startswith("<|im_start|>system\nLate rule.<|im_end|>\n<|im_start|>user\nHi there")


def streamed_chat(client, **fields) -> tuple[str, list[dict], list[dict]]:
    """(content, logprobs.content entries, chunks) of a streamed chat completion."""
    frames = [d for _, d in parse_sse(client.post("/v1/chat/completions", json=chat(stream=True, **fields)).text)]
    assert frames[-1] == "[DONE]"
    chunks = [c for c in frames[:-1] if c["choices"]]
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks)
    logprobs = [t for c in chunks if c["choices"][0]["logprobs"] for t in c["choices"][0]["logprobs"]["content"]]
    return text, logprobs, chunks


def joined_bytes(logprobs: list[dict]) -> bytes:
    return b"".join(bytes(t["bytes"]) for t in logprobs)


@pytest.mark.parametrize("stop, content", [
    (None, REPLY),  # the EOS after the text is not in it
    ("STOP", "alpha beta "),  # the stop string's own tokens (S, T, O, P) are dropped
    (" STOP", "alpha beta"),
    (";", "alpha beta STOP gamma"),
])
def test_chat_logprobs_cover_the_returned_content(client, stop, content):
    data = client.post("/v1/chat/completions", json=chat(logprobs=True, top_logprobs=1, stop=stop)).json()
    assert data["choices"][0]["message"]["content"] == content
    assert joined_bytes(data["choices"][0]["logprobs"]["content"]) == content.encode()
    text, logprobs, _ = streamed_chat(client, logprobs=True, stop=stop)
    assert text == content and joined_bytes(logprobs) == content.encode()


def test_a_token_straddling_the_stop_string_is_kept(client):
    """'gamma' is generated as g|am|m|a: with stop 'mm' the text ends inside 'am', which stays."""
    data = client.post("/v1/chat/completions", json=chat(logprobs=True, stop="mm")).json()
    assert data["choices"][0]["message"]["content"] == "alpha beta STOP ga"
    assert joined_bytes(data["choices"][0]["logprobs"]["content"]) == b"alpha beta STOP gam"


def test_completion_logprobs_cover_the_returned_text(client, engine):
    prompt = chat_prompt_ids(engine.tokenizer)  # the text model answers it with REPLY
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 100, "logprobs": 1, "stop": "STOP"}
    data = client.post("/v1/completions", json=body).json()
    lp = data["choices"][0]["logprobs"]
    assert data["choices"][0]["text"] == "".join(lp["tokens"]) == "alpha beta "
    assert lp["text_offset"] == [len("".join(lp["tokens"][:i])) for i in range(len(lp["tokens"]))]
    frames = [d for _, d in parse_sse(client.post("/v1/completions", json={**body, "stream": True}).text)][:-1]
    assert "".join(c["choices"][0]["text"] for c in frames) == "alpha beta "
    streamed = {k: [v for c in frames if c["choices"][0]["logprobs"] for v in c["choices"][0]["logprobs"][k]]
                for k in ("tokens", "text_offset")}
    assert streamed == {"tokens": lp["tokens"], "text_offset": lp["text_offset"]}
    assert all(c["system_fingerprint"] == f"tierlm-{tierlm.__version__}" for c in frames)


def test_first_chunk_content_is_null_when_tools_may_answer(client):
    _, _, chunks = streamed_chat(client, model=CALL_MODEL, tools=[WEATHER_TOOL])
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": None}
    assert not any(c["choices"][0]["delta"].get("content") == "" for c in chunks)


def tools_cut_after_the_json(scripted_models, engine) -> tuple[int, str]:
    """(max_tokens, text) that cut the tools model's call after its JSON, before `</tool_call>`."""
    ids = scripted_models[TOOLS_MODEL].reply_tokens(TOOLS_REPLY)
    n = next(k for k in range(len(ids)) if engine.tokenizer.decode(ids[:k]).endswith('"Paris"}}\n'))
    return n, engine.tokenizer.decode(ids[:n])


def test_a_call_cut_off_by_max_tokens_is_text(client, scripted_models, engine):
    max_tokens, text = tools_cut_after_the_json(scripted_models, engine)
    assert text.endswith('{"name": "get_weather", "arguments": {"city": "Paris"}}\n')
    data = client.post("/v1/chat/completions", json=chat(model=TOOLS_MODEL, tools=[WEATHER_TOOL],
                                                         max_tokens=max_tokens)).json()
    choice = data["choices"][0]
    assert choice["finish_reason"] == "length" and choice["message"]["tool_calls"] is None
    assert choice["message"]["content"] == text
    streamed, _, chunks = streamed_chat(client, model=TOOLS_MODEL, tools=[WEATHER_TOOL], max_tokens=max_tokens)
    assert streamed == text and chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert not any("tool_calls" in c["choices"][0]["delta"] for c in chunks)


def test_top_p_zero_keeps_the_top_token(client, asked):
    for path, payload in (("/v1/chat/completions", chat(top_p=0, temperature=1.0, seed=1)),
                          ("/v1/completions", {"model": MODEL, "prompt": COMPLETION_PROMPT, "top_p": 0})):
        r = client.post(path, json=payload)
        assert r.status_code == 200, r.text
        assert 0 < asked[-1].params.top_p <= 1e-9
    assert r.json()["choices"][0]["text"] == COMPLETION_REPLY


def test_min_tokens_reaches_the_engine_and_is_checked_against_max_tokens(client, asked):
    r = client.post("/v1/chat/completions", json=chat(min_tokens=3, max_tokens=5))
    assert r.status_code == 200, r.text
    assert asked[-1].params.min_tokens == 3
    error = client.post("/v1/chat/completions", json=chat(min_tokens=6, max_tokens=5)).json()["error"]
    assert error["param"] == "min_tokens" and "max_tokens" in error["message"]
    assert client.post("/v1/completions", json={"model": MODEL, "prompt": "x", "min_tokens": -1}).status_code == 400


def test_models_list_pages(client, scripted_engines):
    names = list(scripted_engines)
    assert len(names) >= 3
    first = client.get("/v1/models", params={"limit": 2}).json()
    assert [m["id"] for m in first["data"]] == names[:2] and first["has_more"] is True
    assert (first["first_id"], first["last_id"]) == (names[0], names[1])
    rest = client.get("/v1/models", params={"after_id": names[1]}).json()
    assert [m["id"] for m in rest["data"]] == names[2:] and rest["has_more"] is False
    before = client.get("/v1/models", params={"before_id": names[-1], "limit": 1}).json()
    assert [m["id"] for m in before["data"]] == [names[-2]] and before["has_more"] is (len(names) > 2)
    assert [m["id"] for m in client.get("/v1/models").json()["data"]] == names
    for query, param in (({"limit": 0}, "limit"), ({"limit": "x"}, "limit"), ({"after_id": "nope"}, "after_id")):
        r = client.get("/v1/models", params=query)
        assert r.status_code == 400 and r.json()["error"]["param"] == param


def test_a_request_the_kv_pool_cannot_hold_is_context_length_exceeded(client, engine, monkeypatch):
    """The engine's own refusal (RequestTooLongError: here, more KV blocks than its whole pool)."""
    monkeypatch.setattr(engine.engine.kv, "blocks_needed", lambda num_tokens: engine.engine.pool.num_blocks + 1)
    r = client.post("/v1/chat/completions", json=chat(max_tokens=5))
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
    assert "KV blocks" in r.json()["error"]["message"] and r.json()["error"]["param"] == "max_tokens"


# ---- tool turns must pair up, as OpenAI's API requires -------------------------------------

def _call(call_id):
    return {"id": call_id, "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'}}


def _calls(*ids):
    return {"role": "assistant", "content": None, "tool_calls": [_call(i) for i in ids]}


def _result(call_id):
    return {"role": "tool", "tool_call_id": call_id, "content": "rainy"}


ORPHAN = "messages with role 'tool' must be a response to a preceding message with 'tool_calls'"
UNANSWERED = ("An assistant message with 'tool_calls' must be followed by tool messages responding to each "
              "'tool_call_id'. The following tool_call_ids did not have response messages: ")


@pytest.mark.parametrize("messages, param, words", [
    ([*USER, _result("call_1")], "messages.1", ORPHAN),  # no assistant call before it
    ([*USER, _calls("call_1"), _result("call_2")], "messages.2", ORPHAN),  # answers no call of that turn
    ([*USER, _calls("call_1"), _result("call_1"), {"role": "user", "content": "And?"}, _result("call_1")],
     "messages.4", ORPHAN),  # a user message ended the tool turns
    ([{"role": "system", "content": "Be brief."}, _result("call_1"), *USER], "messages.1", ORPHAN),
    ([*USER, _calls("call_1", "call_2"), _result("call_2"), {"role": "user", "content": "And?"}],
     "messages.1", UNANSWERED + "call_1"),
    ([*USER, _calls("call_1"), {"role": "user", "content": "Never mind"}, _result("call_1")],
     "messages.1", UNANSWERED + "call_1"),
    ([*USER, _calls("call_1", "call_2")], "messages.1", UNANSWERED + "call_1, call_2"),  # final, no results
])
def test_orphan_tool_turns_are_refused_in_openais_words(client, asked, messages, param, words):
    before = len(asked)
    r = client.post("/v1/chat/completions", json=chat(messages=messages, tools=[WEATHER_TOOL]))
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error"
    assert error["message"] == f"{param}: {words}"
    assert len(asked) == before  # refused before the engine was asked


def test_a_final_assistant_tool_call_is_refused_even_to_continue_it(client):
    """Continuing it, the template would end the prompt at its content and drop the call."""
    body = chat(messages=[*USER, {**_calls("call_1"), "content": "Let me check."}], tools=[WEATHER_TOOL],
                continue_final_message=True, add_generation_prompt=False)
    error = client.post("/v1/chat/completions", json=body).json()["error"]
    assert error["param"] == "messages.1" and error["message"].endswith(UNANSWERED + "call_1")


def test_a_complete_tool_round_trip_still_passes(client, engine, asked):
    """Results in any order, and a later call turn after the first is answered."""
    messages = [*USER, _calls("call_1", "call_2"), _result("call_2"), _result("call_1"),
                {"role": "user", "content": "Again"}, _calls("call_3"), _result("call_3")]
    r = client.post("/v1/chat/completions", json=chat(messages=messages, tools=[WEATHER_TOOL]))
    assert r.status_code == 200, r.text
    assert engine.tokenizer.decode(asked[-1].prompt_token_ids).count("<tool_response>\nrainy\n</tool_response>") == 3


# ---- refusal parts and the legacy function role --------------------------------------------


def test_an_assistant_refusal_part_is_rendered_as_its_text(client, engine, asked):
    messages = [*USER, {"role": "assistant", "content": [{"type": "refusal", "refusal": "I cannot help with that."}]},
                {"role": "user", "content": "Why?"}]
    r = client.post("/v1/chat/completions", json=chat(messages=messages))
    assert r.status_code == 200, r.text
    prompt = engine.tokenizer.decode(asked[-1].prompt_token_ids)
    assert "<|im_start|>assistant\nI cannot help with that.<|im_end|>" in prompt
    # the message's `refusal` field, as the SDK's response message carries it, too
    messages[1] = {"role": "assistant", "content": None, "refusal": "No."}
    assert client.post("/v1/chat/completions", json=chat(messages=messages)).status_code == 200
    assert "<|im_start|>assistant\nNo.<|im_end|>" in engine.tokenizer.decode(asked[-1].prompt_token_ids)
    # said in a part and in the field: once
    messages[1] = {"role": "assistant", "content": [{"type": "refusal", "refusal": "No."}], "refusal": "No."}
    assert client.post("/v1/chat/completions", json=chat(messages=messages)).status_code == 200
    assert "<|im_start|>assistant\nNo.<|im_end|>" in engine.tokenizer.decode(asked[-1].prompt_token_ids)
    # a user cannot send one; a `refusal` field on a user message is not OpenAI's and is not their text
    r = client.post("/v1/chat/completions", json=chat(messages=[
        {"role": "user", "content": [{"type": "refusal", "refusal": "x"}]}]))
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages.0.content"
    assert "only assistant messages" in r.json()["error"]["message"]
    r = client.post("/v1/chat/completions", json=chat(messages=[{"role": "user", "content": "hi", "refusal": "ZQX"}]))
    assert r.status_code == 200 and "ZQX" not in engine.tokenizer.decode(asked[-1].prompt_token_ids)


@pytest.mark.parametrize("content", ["Checking.", None])
def test_an_assistant_turns_legacy_function_call_is_refused_naming_it(client, content):
    """It was dropped: the model read "Checking." without the call it made (and with content
    null the 400 said content or tool_calls was missing)."""
    messages = [*USER, {"role": "assistant", "content": content,
                        "function_call": {"name": "get_weather", "arguments": "{}"}}, *USER]
    error = client.post("/v1/chat/completions", json=chat(messages=messages)).json()["error"]
    assert error["param"] == "messages.1.function_call", error
    assert "legacy function-calling API" in error["message"] and "tool_calls" in error["message"]
    messages[1]["function_call"] = None  # the SDK's model_dump() of a message sends it null
    messages[1]["content"] = "Checking."
    assert client.post("/v1/chat/completions", json=chat(messages=messages)).status_code == 200


def test_the_legacy_function_role_is_refused_naming_the_message(client):
    messages = [*USER, {"role": "assistant", "content": "Checking."},
                {"role": "function", "name": "get_weather", "content": "rainy"}]
    error = client.post("/v1/chat/completions", json=chat(messages=messages)).json()["error"]
    assert error["param"] == "messages.2.role"
    assert error["message"].startswith("messages.2.role: role 'function' (the legacy function-calling API) is not "
                                       "supported; send tool messages")
