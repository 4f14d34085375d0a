"""The Anthropic Messages API over real HTTP, against the real engine running scripted models
(tiny real checkpoints whose answers are known; see scripted_model.py)."""
from __future__ import annotations

import json
import uuid

import httpx
import pytest

from tests.serving.harness import (
    API_KEY,
    SMALL_BODY_LIMIT,
    fail_after_steps,
    parse_sse,
    wait_until,
)
from tests.serving.scripted_model import (
    FORCED_ANY_REPLY,
    FORCED_REPLY,
    PREFILL,
    PREFILL_REPLY,
    REPLY,
    TEXT_MODEL,
    TOOL_PROSE,
    TOOLS_MODEL,
    TOOLS_REPLY,
)

MODEL = TEXT_MODEL
WEATHER_TOOL = {"name": "get_weather", "description": "Weather for a city",
                "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}}}


@pytest.fixture
def client(scripted_server):
    with httpx.Client(base_url=scripted_server.url, timeout=30,
                      headers={"x-api-key": API_KEY, "anthropic-version": "2023-06-01"}) as c:
        yield c


@pytest.fixture
def engine(scripted_engines):
    return scripted_engines[MODEL]


def prompt_text(engine, request) -> str:
    return engine.tokenizer.decode(request.prompt_token_ids)


def num_reply_tokens(scripted_models, model: str, reply: str) -> int:
    return len(scripted_models[model].reply_tokens(reply))


def body(**fields):
    return {"model": MODEL, "max_tokens": 64, "messages": [{"role": "user", "content": "Hi there"}], **fields}


def test_message_shape_and_request_id(client, requests_to, scripted_models):
    asked = requests_to(MODEL)
    r = client.post("/v1/messages", json=body(), headers={"anthropic-version": "2099-01-01", "x-unknown": "1"})
    assert r.status_code == 200
    msg = r.json()
    assert msg["id"].startswith("msg_") and msg["type"] == "message" and msg["role"] == "assistant"
    assert msg["content"] == [{"type": "text", "text": REPLY}]
    assert msg["model"] == MODEL and msg["stop_reason"] == "end_turn" and msg["stop_sequence"] is None
    assert r.headers["request-id"].startswith("req_")
    usage = msg["usage"]
    prompt_len = len(asked[-1].prompt_token_ids)
    assert usage["input_tokens"] + usage["cache_read_input_tokens"] + usage["cache_creation_input_tokens"] == prompt_len
    assert usage["output_tokens"] == num_reply_tokens(scripted_models, MODEL, REPLY) + 1  # + EOS


def test_prefix_cache_hits_are_cache_reads(client, requests_to):
    asked = requests_to(MODEL)
    long_prompt = f"{uuid.uuid4().hex} Repeat after me: " + "lorem ipsum " * 20  # new to the cache
    first = client.post("/v1/messages", json=body(messages=[{"role": "user", "content": long_prompt}])).json()
    second = client.post("/v1/messages", json=body(messages=[{"role": "user", "content": long_prompt}])).json()
    prompt_len = len(asked[-1].prompt_token_ids)
    assert first["usage"]["cache_read_input_tokens"] == 0
    assert second["usage"]["cache_read_input_tokens"] > 0
    u = second["usage"]
    assert u["input_tokens"] + u["cache_read_input_tokens"] == prompt_len and u["cache_creation_input_tokens"] == 0


def test_sampling_fields_reach_the_engine(client, requests_to):
    asked = requests_to(MODEL)
    client.post("/v1/messages", json=body(temperature=0.5, top_p=0.9, top_k=7, max_tokens=9,
                                          metadata={"user_id": "u-1"}))
    params = asked[-1].params
    assert (params.temperature, params.top_p, params.top_k, params.max_tokens) == (0.5, 0.9, 7, 9)
    assert asked[-1].request_id.startswith("req_")


def test_max_tokens_stop(client, engine, scripted_models):
    msg = client.post("/v1/messages", json=body(max_tokens=3)).json()
    assert msg["stop_reason"] == "max_tokens" and msg["usage"]["output_tokens"] == 3
    first_three = scripted_models[MODEL].reply_tokens(REPLY)[:3]
    assert msg["content"] == [{"type": "text", "text": engine.tokenizer.decode(first_three)}]


def test_stop_sequence_is_reported_and_excluded(client):
    assert REPLY.startswith("alpha beta STOP")
    msg = client.post("/v1/messages", json=body(stop_sequences=["never", "STOP"])).json()
    assert msg["content"][0]["text"] == "alpha beta "
    assert (msg["stop_reason"], msg["stop_sequence"]) == ("stop_sequence", "STOP")


def test_prefill_continues_the_assistant_turn(client, engine, requests_to):
    asked = requests_to(MODEL)
    msg = client.post("/v1/messages", json=body(messages=[
        {"role": "user", "content": "Greek name for the Sun? (A) Sol (B) Helios"},
        {"role": "assistant", "content": PREFILL},
    ])).json()
    assert prompt_text(engine, asked[-1]).endswith("<|im_start|>assistant\nThe answer is (")
    assert msg["content"][0]["text"] == PREFILL_REPLY == "B) Helios"


@pytest.mark.parametrize("prefill", ["The answer is ", "The answer is\n", "The answer is (\t", [
    {"type": "text", "text": "The answer"}, {"type": "text", "text": "is "}]])
@pytest.mark.parametrize("path", ["/v1/messages", "/v1/messages/count_tokens"])
def test_prefill_ending_in_whitespace_is_refused(client, requests_to, prefill, path):
    """As Anthropic's API does: the model would continue after a space no tokenizer puts there."""
    asked = requests_to(MODEL)
    r = client.post(path, json=body(messages=[{"role": "user", "content": "Hi"},
                                              {"role": "assistant", "content": prefill}]))
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    assert r.json()["error"]["message"] == (
        "messages.1.content: final assistant content cannot end with trailing whitespace; remove it from the prefill")
    assert asked == []


def test_whitespace_inside_or_before_the_last_turn_is_fine(client):
    messages = [{"role": "user", "content": "Hi "}, {"role": "assistant", "content": "Sure. "},
                {"role": "user", "content": "Go on\n"}]
    assert client.post("/v1/messages", json=body(messages=messages)).status_code == 200
    prefill = [*messages, {"role": "assistant", "content": "Well, the answer is ("}]
    assert client.post("/v1/messages", json=body(messages=prefill)).status_code == 200


def test_huge_top_k_means_no_limit(client, requests_to):
    asked = requests_to(MODEL)
    assert client.post("/v1/messages", json=body(top_k=2**70, max_tokens=2)).status_code == 200
    assert asked[-1].params.top_k == -1


def test_same_role_turns_merge_and_system_blocks_join(client, engine, requests_to):
    asked = requests_to(MODEL)
    client.post("/v1/messages", json=body(
        system=[{"type": "text", "text": "Be brief."}, {"type": "text", "text": "Be kind."}],
        messages=[{"role": "user", "content": "first"},
                  {"role": "user", "content": [{"type": "text", "text": "second"}, {"type": "text", "text": "third"}]}],
    ))
    prompt = prompt_text(engine, asked[-1])
    assert "<|im_start|>system\nBe brief.\nBe kind.<|im_end|>" in prompt
    assert "<|im_start|>user\nfirst\n\nsecond\nthird<|im_end|>" in prompt
    assert prompt.count("<|im_start|>user") == 1


def test_streaming_event_sequence(client, scripted_models):
    r = client.post("/v1/messages", json=body(stream=True))
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    assert r.headers["request-id"].startswith("req_")
    frames = parse_sse(r.text)
    for event, data in frames:
        assert event == data["type"]
    names = [e for e, _ in frames]
    assert names[:3] == ["message_start", "content_block_start", "ping"]
    assert set(names[3:-3]) == {"content_block_delta"}
    assert names[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    start = frames[0][1]["message"]
    assert start["id"].startswith("msg_") and start["content"] == [] and start["stop_reason"] is None
    assert frames[1][1]["index"] == 0 and frames[1][1]["content_block"] == {"type": "text", "text": ""}
    text = "".join(d["delta"]["text"] for e, d in frames if e == "content_block_delta")
    assert text == REPLY
    delta = frames[-2][1]
    assert delta["delta"] == {"stop_reason": "end_turn", "stop_sequence": None}
    assert delta["usage"]["output_tokens"] == num_reply_tokens(scripted_models, MODEL, REPLY) + 1


def test_streaming_stop_sequence(client):
    frames = parse_sse(client.post("/v1/messages", json=body(stream=True, stop_sequences=["STOP"])).text)
    text = "".join(d["delta"]["text"] for e, d in frames if e == "content_block_delta")
    assert text == "alpha beta "
    assert frames[-2][1]["delta"] == {"stop_reason": "stop_sequence", "stop_sequence": "STOP"}


def test_tool_use_non_streaming(client, scripted_engines, requests_to):
    asked = requests_to(TOOLS_MODEL)
    msg = client.post("/v1/messages", json=body(model=TOOLS_MODEL, tools=[WEATHER_TOOL])).json()
    prompt = prompt_text(scripted_engines[TOOLS_MODEL], asked[-1])
    assert "get_weather" in prompt and "# Tools" in prompt
    assert msg["stop_reason"] == "tool_use"
    assert msg["content"][0] == {"type": "text", "text": TOOL_PROSE}
    call = msg["content"][1]
    assert call["type"] == "tool_use" and call["id"].startswith("toolu_")
    assert (call["name"], call["input"]) == ("get_weather", {"city": "Paris"})
    assert len(msg["content"]) == 2


def test_tool_use_streaming(client):
    frames = parse_sse(client.post("/v1/messages", json=body(model=TOOLS_MODEL, tools=[WEATHER_TOOL],
                                                             stream=True)).text)
    starts = [d for e, d in frames if e == "content_block_start"]
    assert [s["index"] for s in starts] == [0, 1]
    assert starts[0]["content_block"]["type"] == "text"
    assert starts[1]["content_block"]["type"] == "tool_use" and starts[1]["content_block"]["name"] == "get_weather"
    text = "".join(d["delta"]["text"] for e, d in frames if e == "content_block_delta" and d["index"] == 0)
    assert text == TOOL_PROSE  # as when not streamed: the newline before the call is not shown
    partial = "".join(d["delta"]["partial_json"] for e, d in frames
                      if e == "content_block_delta" and d["delta"]["type"] == "input_json_delta")
    assert json.loads(partial) == {"city": "Paris"}
    assert [d["index"] for e, d in frames if e == "content_block_stop"] == [0, 1]
    assert frames[-2][1]["delta"]["stop_reason"] == "tool_use"


def test_tool_choice_tool_starts_the_call(client, scripted_engines, requests_to):
    asked = requests_to(TOOLS_MODEL)
    msg = client.post("/v1/messages", json=body(model=TOOLS_MODEL, tools=[WEATHER_TOOL],
                                                tool_choice={"type": "tool", "name": "get_weather"})).json()
    prompt = prompt_text(scripted_engines[TOOLS_MODEL], asked[-1])
    assert prompt.endswith('<tool_call>\n{"name": "get_weather", "arguments": ')
    assert FORCED_REPLY.startswith('{"city": "Oslo"}}')  # what the model adds to the started call
    assert msg["stop_reason"] == "tool_use"
    assert msg["content"] == [{"type": "tool_use", "id": msg["content"][0]["id"], "name": "get_weather",
                               "input": {"city": "Oslo"}}]


def test_tool_choice_any_starts_a_call(client, scripted_engines, requests_to):
    asked = requests_to(TOOLS_MODEL)
    msg = client.post("/v1/messages", json=body(model=TOOLS_MODEL, tools=[WEATHER_TOOL],
                                                tool_choice={"type": "any"})).json()
    prompt = prompt_text(scripted_engines[TOOLS_MODEL], asked[-1])
    assert prompt.endswith("<|im_start|>assistant\n<tool_call>\n")
    assert FORCED_ANY_REPLY.startswith('{"name": "get_weather", "arguments": {"city": "Paris"}}')
    assert msg["stop_reason"] == "tool_use"
    assert msg["content"] == [{"type": "tool_use", "id": msg["content"][0]["id"], "name": "get_weather",
                               "input": {"city": "Paris"}}]


def test_required_tool_call_cannot_follow_a_prefill(client, requests_to):
    asked = requests_to(TOOLS_MODEL)
    r = client.post("/v1/messages", json=body(model=TOOLS_MODEL, tools=[WEATHER_TOOL], tool_choice={"type": "any"},
                                              messages=[{"role": "user", "content": "Weather?"},
                                                        {"role": "assistant", "content": "Let me"}]))
    message = error_of(r, 400, "invalid_request_error")
    assert "tool_choice 'any'" in message and "prefill" in message
    assert asked == []


def test_tool_choice_none_hides_tools(client, scripted_engines, requests_to):
    asked = requests_to(TOOLS_MODEL)
    msg = client.post("/v1/messages", json=body(model=TOOLS_MODEL, tools=[WEATHER_TOOL],
                                                tool_choice={"type": "none"})).json()
    assert "# Tools" not in prompt_text(scripted_engines[TOOLS_MODEL], asked[-1])
    # the model still writes a call, but with tools off it is plain text
    assert msg["stop_reason"] == "end_turn" and msg["content"] == [{"type": "text", "text": TOOLS_REPLY}]


def test_tool_results_are_rendered(client, engine, requests_to):
    asked = requests_to(MODEL)
    client.post("/v1/messages", json=body(tools=[WEATHER_TOOL], messages=[
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1", "name": "get_weather",
                                           "input": {"city": "Paris"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "sunny, 21C"}]},
    ]))
    prompt = prompt_text(engine, asked[-1])
    assert '"arguments": {"city": "Paris"}' in prompt
    assert "<tool_response>\nsunny, 21C\n</tool_response>" in prompt


NOTES = {"type": "document", "title": "Minutes", "context": "from the March meeting",
         "source": {"type": "text", "media_type": "text/plain", "data": "The budget passed."}}
AGENDA = {"type": "document", "source": {"type": "content", "content": [{"type": "text", "text": "Item one"},
                                                                        {"type": "text", "text": "Item two"}]}}
HIT = {"type": "search_result", "title": "Budget 2025", "source": "https://example.com/budget",
       "content": [{"type": "text", "text": "First hit"}, {"type": "text", "text": "Second hit"}],
       "citations": {"enabled": True}}
READ_AS_TEXT = ("Minutes\nfrom the March meeting\nThe budget passed.\nItem one\nItem two\n"
                "Budget 2025\nhttps://example.com/budget\nFirst hit\nSecond hit")


def test_text_documents_and_search_results_are_read_as_text(client, engine, requests_to):
    """Plain-text documents and search results were a 400 (documents: "text-only"; search results:
    pydantic's "does not match any of the expected tags"), though a text model can read both."""
    asked = requests_to(MODEL)
    messages = [{"role": "user", "content": [NOTES, AGENDA, HIT, {"type": "text", "text": "Summarise."}]}]
    count = client.post("/v1/messages/count_tokens", json={"model": MODEL, "messages": messages})
    r = client.post("/v1/messages", json=body(messages=messages))
    assert r.status_code == 200 and count.status_code == 200, (r.text, count.text)
    prompt = prompt_text(engine, asked[-1])
    assert f"<|im_start|>user\n{READ_AS_TEXT}\nSummarise.<|im_end|>" in prompt
    assert count.json() == {"input_tokens": len(asked[-1].prompt_token_ids)}


def test_tool_results_read_documents_and_search_results(client, engine, requests_to):
    asked = requests_to(MODEL)
    r = client.post("/v1/messages", json=body(max_tokens=8, tools=[WEATHER_TOOL], messages=[
        {"role": "user", "content": "Find the budget"},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1",
                                      "content": [NOTES, AGENDA, HIT]}]},
    ]))
    assert r.status_code == 200, r.text
    assert f"<tool_response>\n{READ_AS_TEXT}\n</tool_response>" in prompt_text(engine, asked[-1])


def test_count_tokens_matches_the_rendered_prompt(client, requests_to):
    asked = requests_to(MODEL)
    b = body(system="Be brief.")
    count = client.post("/v1/messages/count_tokens", json={k: b[k] for k in ("model", "messages", "system")})
    assert count.status_code == 200
    assert asked == []  # counting runs no generation
    client.post("/v1/messages", json=b)
    assert count.json() == {"input_tokens": len(asked[-1].prompt_token_ids)}


# ---- errors ------------------------------------------------------------------------------


def error_of(r: httpx.Response, status: int, kind: str) -> str:
    assert r.status_code == status, r.text
    data = r.json()
    assert data["type"] == "error" and data["error"]["type"] == kind
    assert data["request_id"] == r.headers["request-id"]
    return data["error"]["message"]


def test_image_blocks_are_refused_clearly(client):
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AAAA"}}
    r = client.post("/v1/messages", json=body(messages=[{"role": "user", "content": [
        {"type": "text", "text": "what is this?"}, image]}]))
    message = error_of(r, 400, "invalid_request_error")
    assert "messages.0.content.1" in message and "text-only" in message


def test_unknown_model_is_404(client):
    message = error_of(client.post("/v1/messages", json=body(model="nope")), 404, "not_found_error")
    assert "nope" in message and MODEL in message


def test_authentication(scripted_server):
    url = scripted_server.url + "/v1/messages"
    assert "x-api-key" in error_of(httpx.post(url, json=body()), 401, "authentication_error")
    error_of(httpx.post(url, json=body(), headers={"x-api-key": "wrong"}), 401, "authentication_error")
    assert httpx.post(url, json=body(), headers={"authorization": f"Bearer {API_KEY}"}).status_code == 200


def test_body_over_the_limit_is_413(client):
    huge = "x" * (SMALL_BODY_LIMIT + 10)
    error_of(client.post("/v1/messages", json=body(messages=[{"role": "user", "content": huge}])),
             413, "request_too_large")


def count(client, b) -> int:
    return client.post("/v1/messages/count_tokens", json={k: b[k] for k in ("model", "messages")}).json()["input_tokens"]


def test_max_tokens_beyond_context_in_anthropics_words(client, engine):
    b = body(max_tokens=engine.max_model_len)
    message = error_of(client.post("/v1/messages", json=b), 400, "invalid_request_error")
    assert message == (f"input length and `max_tokens` exceed context limit: {count(client, b)} + {engine.max_model_len} "
                       f"> {engine.max_model_len}, decrease input length or `max_tokens` and try again")


def test_prompt_beyond_context_in_anthropics_words(client, engine):
    b = body(messages=[{"role": "user", "content": "word " * (engine.max_model_len + 10)}])
    message = error_of(client.post("/v1/messages", json=b), 400, "invalid_request_error")
    assert message == f"prompt is too long: {count(client, b)} tokens > {engine.max_model_len} maximum"


def test_malformed_json_and_wrong_method(client):
    r = client.post("/v1/messages", content=b'{"model": ', headers={"content-type": "application/json"})
    assert "not valid JSON" in error_of(r, 400, "invalid_request_error")
    r = client.get("/v1/messages")
    assert r.status_code == 405 and r.json()["error"]["type"] == "invalid_request_error"


def test_engine_failure_mid_stream_is_an_error_event(client, engine, monkeypatch):
    fail_after_steps(engine, monkeypatch, 3)  # prefill + 2 decodes, then the device faults
    frames = parse_sse(client.post("/v1/messages", json=body(stream=True)).text)
    assert frames[0][0] == "message_start"
    assert any(e == "content_block_delta" for e, _ in frames)  # output had started
    event, data = frames[-1]
    assert event == "error" and data["type"] == "error" and data["error"]["type"] == "api_error"
    assert "message_stop" not in [e for e, _ in frames]
    assert wait_until(lambda: engine.stats().kv_blocks_used == 0)


def test_engine_failure_before_output_is_500_without_trace(client, engine, monkeypatch):
    fail_after_steps(engine, monkeypatch, 0)
    message = error_of(client.post("/v1/messages", json=body()), 500, "api_error")
    assert "Traceback" not in message and "retry" in message
    assert wait_until(lambda: engine.stats().kv_blocks_used == 0)
    monkeypatch.undo()  # the fault is gone: the same engine serves the retry
    assert client.post("/v1/messages", json=body()).status_code == 200


# ---- fidelity to Anthropic's API ----------------------------------------------------------


@pytest.mark.parametrize("empty", ["", []])
def test_an_empty_final_assistant_message_is_no_prefill(client, engine, requests_to, empty):
    asked = requests_to(MODEL)
    messages = [{"role": "user", "content": "Hi there"}, {"role": "assistant", "content": empty}]
    msg = client.post("/v1/messages", json=body(messages=messages))
    assert msg.status_code == 200, msg.text
    assert msg.json()["content"] == [{"type": "text", "text": REPLY}]  # the answer to a fresh assistant turn
    assert prompt_text(engine, asked[-1]).endswith("<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n")
    assert count(client, body(messages=messages)) == count(client, body(messages=messages[:1]))


@pytest.mark.parametrize("messages, where", [
    ([{"role": "user", "content": ""}], "messages.0"),
    ([{"role": "user", "content": []}], "messages.0"),
    ([{"role": "user", "content": "Hi"}, {"role": "assistant", "content": ""}, {"role": "user", "content": "?"}],
     "messages.1"),
    ([{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Ok"}, {"role": "user", "content": []}],
     "messages.2"),
])
@pytest.mark.parametrize("path", ["/v1/messages", "/v1/messages/count_tokens"])
def test_other_empty_messages_are_refused_in_anthropics_words(client, requests_to, messages, where, path):
    asked = requests_to(MODEL)
    message = error_of(client.post(path, json=body(messages=messages)), 400, "invalid_request_error")
    assert message == f"{where}: all messages must have non-empty content except for the optional final assistant message"
    assert asked == []


def test_top_p_zero_keeps_the_top_token(client, requests_to):
    asked = requests_to(MODEL)
    r = client.post("/v1/messages", json=body(top_p=0, temperature=1.0))
    assert r.status_code == 200, r.text
    assert r.json()["content"] == [{"type": "text", "text": REPLY}] and 0 < asked[-1].params.top_p <= 1e-9


def test_a_call_cut_off_by_max_tokens_is_text(client, scripted_models, scripted_engines):
    ids = scripted_models[TOOLS_MODEL].reply_tokens(TOOLS_REPLY)
    decode = scripted_engines[TOOLS_MODEL].tokenizer.decode
    n = next(k for k in range(len(ids)) if decode(ids[:k]).endswith('"Paris"}}\n'))  # JSON done, tag not closed
    text = decode(ids[:n])
    b = body(model=TOOLS_MODEL, tools=[WEATHER_TOOL], max_tokens=n)
    msg = client.post("/v1/messages", json=b).json()
    assert (msg["stop_reason"], msg["content"]) == ("max_tokens", [{"type": "text", "text": text}])
    frames = parse_sse(client.post("/v1/messages", json={**b, "stream": True}).text)
    assert [d["content_block"]["type"] for e, d in frames if e == "content_block_start"] == ["text"]
    assert "".join(d["delta"]["text"] for e, d in frames if e == "content_block_delta") == text
    assert frames[-2][1]["delta"]["stop_reason"] == "max_tokens"
