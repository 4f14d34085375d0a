"""OpenAI's Responses API (/v1/responses) through the official `openai` SDK, against scripted
models (exact answers; see scripted_model.py), a reasoning model and the demo model.

The reference for what a request means is the chat path: a Responses request must render the
very prompt its conversation renders as chat messages, and answer what chat answers.
"""
from __future__ import annotations

import json

import httpx
import openai
import pytest

from tests.serving.harness import API_KEY, ServerThread, parse_sse, sdk_clients
from tests.serving.scripted_model import (CALL_MODEL, LOOP_MODEL, REPLY, TEXT_MODEL, TOOL_PROSE, TOOLS_MODEL,
                                          build_templated_models)
from tests.serving.test_reasoning import THINK_TEMPLATE, THINKING_REPLY, THOUGHT, ANSWER, HISTORY_TEMPLATE
from tierlm.serving.app import build_app
from tierlm.serving.auth import ApiKeyAuth
from tierlm.serving.response_store import ResponseStore

TOOL = {"type": "function", "name": "get_weather", "description": "Weather for a city",
        "parameters": {"type": "object"}}
CHAT_TOOL = {"type": "function", "function": {"name": "get_weather", "description": "Weather for a city",
                                              "parameters": {"type": "object"}}}
OTHER_KEY = "sk-tierlm-other-key"


@pytest.fixture(scope="module")
def oai(scripted_server) -> openai.OpenAI:
    return sdk_clients(scripted_server.url)[1]


def post(server, path: str, body: dict, key: str = API_KEY) -> httpx.Response:
    return httpx.post(server.url + path, json=body, headers={"authorization": f"Bearer {key}"}, timeout=60)


# ---- answers ---------------------------------------------------------------------------------


def test_a_text_answer_created_and_streamed_is_the_chat_answer(oai):
    chat = oai.chat.completions.create(model=TEXT_MODEL, messages=[{"role": "user", "content": "Hi there"}])
    created = oai.responses.create(model=TEXT_MODEL, input="Hi there")
    assert created.status == "completed" and created.output_text == REPLY == chat.choices[0].message.content
    [item] = created.output
    assert (item.type, item.role, item.status, item.content[0].type) == ("message", "assistant", "completed",
                                                                         "output_text")
    assert created.id.startswith("resp_") and created.object == "response" and created.model == TEXT_MODEL
    usage = created.usage
    assert (usage.input_tokens, usage.output_tokens) == (chat.usage.prompt_tokens, chat.usage.completion_tokens)
    assert usage.total_tokens == usage.input_tokens + usage.output_tokens
    assert usage.output_tokens_details.reasoning_tokens == 0

    with oai.responses.stream(model=TEXT_MODEL, input="Hi there") as stream:
        events = list(stream)
        final = stream.get_final_response()
    assert final.output_text == REPLY and final.status == "completed"
    assert [e.sequence_number for e in events] == list(range(len(events)))
    types = [e.type for e in events]
    assert types[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert types[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.completed"]
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == REPLY
    assert final.usage.output_tokens == usage.output_tokens
    ids = {e.item_id for e in events if hasattr(e, "item_id")}
    assert ids == {final.output[0].id}  # every event names the one message item


def test_prose_and_a_call_come_back_as_a_message_and_a_function_call_item(oai):
    created = oai.responses.create(model=TOOLS_MODEL, input="Weather in Paris?", tools=[TOOL])
    with oai.responses.stream(model=TOOLS_MODEL, input="Weather in Paris?", tools=[TOOL]) as stream:
        events = list(stream)
        final = stream.get_final_response()
    for response in (created, final):
        assert [i.type for i in response.output] == ["message", "function_call"]
        assert response.output_text == TOOL_PROSE
        call = response.output[1]
        assert (call.name, json.loads(call.arguments), call.status) == ("get_weather", {"city": "Paris"}, "completed")
        assert call.call_id.startswith("call_") and call.id.startswith("fc_")
    args = [e for e in events if e.type.startswith("response.function_call_arguments")]
    assert [e.type for e in args] == ["response.function_call_arguments.delta", "response.function_call_arguments.done"]
    assert json.loads(args[1].arguments) == {"city": "Paris"} and args[1].output_index == 1


def test_a_call_alone_has_no_message_item(oai):
    created = oai.responses.create(model=CALL_MODEL, input="Hi", tools=[TOOL], tool_choice="auto")
    assert [i.type for i in created.output] == ["function_call"] and created.output_text == ""


def test_max_output_tokens_ends_the_response_incomplete(oai, scripted_server):
    created = oai.responses.create(model=LOOP_MODEL, input="Hi", max_output_tokens=5)
    assert created.status == "incomplete" and created.incomplete_details.reason == "max_output_tokens"
    assert created.usage.output_tokens == 5 and created.output[0].status == "incomplete"
    r = post(scripted_server, "/v1/responses", {"model": LOOP_MODEL, "input": "Hi", "max_output_tokens": 5,
                                                "stream": True})
    frames = parse_sse(r.text)
    assert frames[-1][0] == "response.incomplete" == frames[-1][1]["type"]
    assert frames[-1][1]["response"]["incomplete_details"] == {"reason": "max_output_tokens"}
    assert all(event == data["type"] for event, data in frames)  # the event line names the data's type


# ---- the prompt: items render as the chat messages they are ------------------------------------------


def test_items_render_the_prompt_their_chat_messages_render(oai, requests_to):
    seen = requests_to(TOOLS_MODEL)
    oai.responses.create(model=TOOLS_MODEL, instructions="Be brief.", tools=[TOOL], input=[
        {"role": "user", "content": "Weather in Paris?"},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": TOOL_PROSE}]},
        {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city": "Paris"}'},
        {"type": "function_call", "call_id": "call_2", "name": "get_weather", "arguments": '{"city": "Oslo"}'},
        {"type": "function_call_output", "call_id": "call_1", "output": "sunny"},
        {"type": "function_call_output", "call_id": "call_2", "output": [{"type": "input_text", "text": "rain"}]},
        {"role": "user", "content": [{"type": "input_text", "text": "Thanks"}]},
    ])
    oai.chat.completions.create(model=TOOLS_MODEL, tools=[CHAT_TOOL], messages=[
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": TOOL_PROSE, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
            {"id": "call_2", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
        {"role": "tool", "tool_call_id": "call_2", "content": "rain"},
        {"role": "user", "content": "Thanks"},
    ])
    assert len(seen) == 2 and seen[0].prompt_token_ids == seen[1].prompt_token_ids
    assert seen[0].params.max_tokens == seen[1].params.max_tokens


def test_a_tool_loop_continues_from_the_previous_response(oai, requests_to, scripted_engines):
    first = oai.responses.create(model=TOOLS_MODEL, input="Weather in Paris?", tools=[TOOL])
    call = first.output[1]
    seen = requests_to(TOOLS_MODEL)
    second = oai.responses.create(model=TOOLS_MODEL, previous_response_id=first.id, tools=[TOOL],
                                  input=[{"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}])
    assert second.previous_response_id == first.id and second.output_text == TOOL_PROSE
    # the same conversation sent whole, as a stateless client would
    oai.responses.create(model=TOOLS_MODEL, tools=[TOOL], input=[
        {"role": "user", "content": "Weather in Paris?"}, *[i.model_dump(exclude_none=True) for i in first.output],
        {"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}])
    assert seen[0].prompt_token_ids == seen[1].prompt_token_ids
    text = scripted_engines[TOOLS_MODEL].tokenizer.decode(seen[0].prompt_token_ids)
    assert "sunny" in text and "Weather in Paris?" in text and TOOL_PROSE in text
    # a streamed response is stored too, and continues alike
    with oai.responses.stream(model=TOOLS_MODEL, input="Weather in Paris?", tools=[TOOL]) as stream:
        streamed = stream.get_final_response()
    third = oai.responses.create(model=TOOLS_MODEL, previous_response_id=streamed.id, tools=[TOOL], input=[
        {"type": "function_call_output", "call_id": streamed.output[1].call_id, "output": "sunny"}])
    assert third.status == "completed"
    items = list(oai.responses.input_items.list(second.id, order="asc"))
    assert [i.type for i in items] == ["message", "message", "function_call", "function_call_output"]
    assert items[2].call_id == call.call_id and all(i.id for i in items)


def test_instructions_are_not_carried_to_the_next_response(oai, requests_to, scripted_engines):
    first = oai.responses.create(model=TEXT_MODEL, instructions="Speak like a pirate.", input="Hi")
    seen = requests_to(TEXT_MODEL)
    oai.responses.create(model=TEXT_MODEL, previous_response_id=first.id, input="Again")
    text = scripted_engines[TEXT_MODEL].tokenizer.decode(seen[0].prompt_token_ids)
    assert "pirate" not in text and "Hi" in text and REPLY in text and "Again" in text  # (the rest is carried)


# ---- stored responses -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def two_keys(scripted_models):
    """A server with two keys (an engine serves one event loop: a fresh one here)."""
    engines = {TEXT_MODEL: scripted_models[TEXT_MODEL].engine(TEXT_MODEL)}
    app = build_app(engines, ApiKeyAuth.from_keys({"alice": API_KEY, "bob": OTHER_KEY}))
    server = ServerThread(app).start()
    yield server
    server.stop()


def test_a_stored_response_is_retrieved_listed_and_deleted_by_its_key_alone(two_keys):
    alice, bob = (openai.OpenAI(base_url=two_keys.url + "/v1", api_key=k, max_retries=0) for k in (API_KEY, OTHER_KEY))
    created = alice.responses.create(model=TEXT_MODEL, input="Hi", metadata={"run": "7"})
    got = alice.responses.retrieve(created.id)
    assert got.model_dump() == created.model_dump() and got.metadata == {"run": "7"}
    with pytest.raises(openai.NotFoundError):
        bob.responses.retrieve(created.id)
    with pytest.raises(openai.BadRequestError) as bad:  # nor can bob continue it
        bob.responses.create(model=TEXT_MODEL, input="Hi", previous_response_id=created.id)
    assert bad.value.code == "previous_response_not_found"
    with pytest.raises(openai.NotFoundError):
        bob.responses.delete(created.id)
    alice.responses.delete(created.id)
    with pytest.raises(openai.NotFoundError):
        alice.responses.retrieve(created.id)
    with pytest.raises(openai.NotFoundError):
        alice.responses.input_items.list(created.id)


def test_store_false_keeps_nothing(oai):
    created = oai.responses.create(model=TEXT_MODEL, input="Hi", store=False)
    assert created.store is False
    with pytest.raises(openai.NotFoundError):
        oai.responses.retrieve(created.id)
    with pytest.raises(openai.BadRequestError) as bad:
        oai.responses.create(model=TEXT_MODEL, input="Hi", previous_response_id=created.id)
    assert bad.value.code == "previous_response_not_found" and bad.value.param == "previous_response_id"


def test_input_items_are_paged_in_either_order(oai):
    created = oai.responses.create(model=TEXT_MODEL, input=[{"role": "user", "content": f"m{i}"} for i in range(5)])
    asc = [i.id for i in oai.responses.input_items.list(created.id, order="asc", limit=2)]  # (the SDK pages on)
    desc = [i.id for i in oai.responses.input_items.list(created.id, limit=2)]
    assert len(asc) == 5 and desc == asc[::-1]
    page = oai.responses.input_items.list(created.id, order="asc", limit=2, after=asc[1])
    assert [i.id for i in page.data] == asc[2:4] and page.has_more


def test_the_store_drops_least_recently_used_responses_past_its_bounds():
    store = ResponseStore(max_bytes=10_000, max_responses=3)
    for i in range(3):
        assert store.put("k", {"id": f"r{i}", "output": []}, [])
    store.get("k", "r0")  # used: r1 is now the oldest
    store.put("k", {"id": "r3", "output": []}, [])
    assert [store.get("k", f"r{i}") is not None for i in range(4)] == [True, False, True, True]
    assert store.get("other", "r0") is None and len(store) == 3
    assert not store.put("k", {"id": "big", "output": ["x" * 20_000]}, [])  # alone past the bound: not kept
    store.put("k", {"id": "half", "output": ["x" * 6_000]}, [])
    store.put("k", {"id": "half2", "output": ["x" * 6_000]}, [])
    assert store.get("k", "half") is None and store.get("k", "half2") is not None and store.bytes <= 10_000
    assert not ResponseStore(max_bytes=0).put("k", {"id": "r", "output": []}, [])  # --responses-store-mb 0


def test_past_the_count_bound_the_key_with_most_entries_pays_and_a_new_entry_is_never_the_victim():
    store = ResponseStore(max_bytes=10**9, max_responses=10)
    for i in range(3):
        store.put("agent", {"id": f"a{i}", "output": ["x" * 3_000]}, [])  # few, large
    for i in range(20):
        store.put("batch", {"id": f"b{i}", "output": []}, [])  # many, small
    assert all(store.get("agent", f"a{i}") is not None for i in range(3)) and len(store) == 10
    small = ResponseStore(max_bytes=10_000)
    small.put("b", {"id": "old", "output": ["x" * 4_000]}, [])
    assert small.put("a", {"id": "new", "output": ["x" * 7_000]}, [])  # the heaviest now: b's goes instead
    assert small.get("a", "new") is not None and small.get("b", "old") is None


def test_a_busy_key_loses_its_own_responses_first():
    """The bound is shared, eviction is not: the key holding the most pays for the room."""
    store = ResponseStore(max_bytes=20_000)
    store.put("quiet", {"id": "q", "output": ["x" * 2_000]}, [])
    for i in range(10):
        store.put("busy", {"id": f"b{i}", "output": ["x" * 3_000]}, [])
    assert store.get("quiet", "q") is not None and store.bytes <= 20_000
    assert store.get("busy", "b0") is None and store.get("busy", "b9") is not None


# ---- bad requests ------------------------------------------------------------------------------


@pytest.mark.parametrize("body, param, says", [
    ({"tools": [{"type": "web_search"}]}, "tools", "built-in tool"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x/y.png"}]}]},
     "input", "text only"),
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input", "item references"),
    ({"input": [{"type": "function_call_output", "call_id": "c9", "output": "x"}]}, "input.0", "no function_call"),
    ({"input": [{"role": "user", "content": "Hi"},
                {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"}]},
     "input.1", "No tool output found for function call c1"),
    ({"input": [{"role": "user", "content": "Hi"},
                {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "[1]"},
                {"type": "function_call_output", "call_id": "c1", "output": "x"}]}, "input.1.arguments", "JSON object"),
    ({"background": True}, "background", "background"),
    ({"conversation": "conv_1"}, "conversation", "previous_response_id"),
    ({"tool_choice": {"type": "function", "name": "nope"}, "tools": [TOOL]}, "tool_choice", "not in tools"),
    ({"tool_choice": "required"}, "tool_choice", "non-empty 'tools'"),
    ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format", "schema"),
    ({"previous_response_id": "resp_nope"}, "previous_response_id", "not found"),
    ({"max_output_tokens": 0}, "max_output_tokens", "greater than or equal to 1"),
    ({"max_output_tokens": 100_000}, "input", "max_output_tokens can be at most"),
    ({"input": [{"role": "system", "content": "Only this."}]}, "input", "besides instructions"),
    ({"metadata": {str(i): "v" for i in range(17)}}, "metadata", "at most 16"),
])
def test_bad_requests_are_400s_in_openai_shape_naming_the_field(scripted_server, body, param, says):
    r = post(scripted_server, "/v1/responses", {"model": TEXT_MODEL, "input": "Hi", **body})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error" and (error["param"] or "").startswith(param), error
    assert says in error["message"], error


def test_unknown_model_and_route_are_openai_404s(scripted_server):
    r = post(scripted_server, "/v1/responses", {"model": "nope", "input": "Hi"})
    assert r.status_code == 404 and "nope" in r.json()["error"]["message"]
    r = httpx.get(scripted_server.url + "/v1/responses/resp_x", headers={"authorization": f"Bearer {API_KEY}"})
    assert r.status_code == 404 and r.json()["error"]["param"] == "response_id"
    r = httpx.get(scripted_server.url + "/v1/responses/resp_x")
    assert r.status_code == 401 and "error" in r.json()


def test_cancel_is_refused_for_a_finished_response(oai):
    created = oai.responses.create(model=TEXT_MODEL, input="Hi")
    with pytest.raises(openai.BadRequestError, match="background"):
        oai.responses.cancel(created.id)


# ---- reasoning -------------------------------------------------------------------------------

THINKER, HISTORY, BLANK = "r-thinker", "r-history", "r-blank"
BLANK_REPLY = f"<think></think>\n\n{ANSWER}"  # an empty think block, then the answer


@pytest.fixture(scope="module")
def reasoning_server(demo_tokenizer, tmp_path_factory):
    models = build_templated_models(tmp_path_factory.mktemp("responses-reasoning"), demo_tokenizer, [
        (THINKER, THINK_TEMPLATE, THINKING_REPLY, ("<think>", "</think>")), (HISTORY, HISTORY_TEMPLATE, ANSWER, ()),
        (BLANK, THINK_TEMPLATE, BLANK_REPLY, ("<think>", "</think>")),
    ])
    engines = {name: model.engine(name) for name, model in models.items()}
    server = ServerThread(build_app(engines, ApiKeyAuth.from_keys({"alice": API_KEY}))).start()
    yield server, engines
    server.stop()


def test_a_think_block_is_a_reasoning_item_before_the_message(reasoning_server):
    server, engines = reasoning_server
    oai = sdk_clients(server.url)[1]
    created = oai.responses.create(model=THINKER, input="Hi")
    with oai.responses.stream(model=THINKER, input="Hi") as stream:
        events = list(stream)
        final = stream.get_final_response()
    for response in (created, final):
        assert [i.type for i in response.output] == ["reasoning", "message"]
        assert response.output[0].content[0].text == THOUGHT and response.output_text == ANSWER
        # Up to and with </think> (one token here): the block's tokens, counted as the engine ran them
        thought_ids = engines[THINKER].tokenizer.encode(THINKING_REPLY.split("</think>")[0], add_special_tokens=False)
        assert response.usage.output_tokens_details.reasoning_tokens == len(thought_ids) + 1
    assert "".join(e.delta for e in events if e.type == "response.reasoning_text.delta") == THOUGHT
    done = [e.type for e in events if e.type.endswith(".done")]
    assert done[:3] == ["response.reasoning_text.done", "response.content_part.done", "response.output_item.done"]


def test_reasoning_sent_back_reaches_the_template_even_as_encrypted_content(reasoning_server, monkeypatch):
    from tests.serving.harness import record_requests

    server, engines = reasoning_server
    oai = sdk_clients(server.url)[1]
    seen = record_requests(engines[HISTORY], monkeypatch)
    first = oai.responses.create(model=THINKER, input="Hi", include=["reasoning.encrypted_content"])
    carried = first.output[0].encrypted_content
    assert carried
    turn = {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": ANSWER}]}
    for reasoning in ({"type": "reasoning", "summary": [], "content": [{"type": "reasoning_text", "text": THOUGHT}]},
                      {"type": "reasoning", "summary": [], "encrypted_content": carried}):
        oai.responses.create(model=HISTORY, input=[{"role": "user", "content": "Hi"}, reasoning, turn,
                                                   {"role": "user", "content": "Again"}])
    texts = [engines[HISTORY].tokenizer.decode(r.prompt_token_ids) for r in seen]
    assert texts[0] == texts[1] and f"<think>\n{THOUGHT}\n</think>" in texts[0]


# ---- logprobs, structured output, telemetry (demo model) -----------------------------------------------


def test_logprobs_come_with_the_text_they_belong_to(demo_server, demo_engine):
    oai = sdk_clients(demo_server.url)[1]
    kwargs = dict(model=demo_engine.model_name, input="Hi", max_output_tokens=12, temperature=0.0,
                  include=["message.output_text.logprobs"], top_logprobs=2)
    created = oai.responses.create(**kwargs)
    part = created.output[0].content[0]
    assert part.logprobs and all(len(lp.top_logprobs) == 2 for lp in part.logprobs)
    assert b"".join(bytes(lp.bytes) for lp in part.logprobs).decode(errors="replace") == part.text
    with oai.responses.stream(**kwargs) as stream:
        events = list(stream)
    final = events[-1].response  # (response.incomplete, at max_output_tokens, or completed)
    streamed = [lp for e in events if e.type == "response.output_text.delta" for lp in e.logprobs]
    assert final.output_text == created.output_text
    assert [lp.token for lp in streamed] == [lp.token for lp in part.logprobs]
    plain = oai.responses.create(**{**kwargs, "include": None})
    assert plain.output[0].content[0].logprobs is None


SCHEMA = {"type": "object", "additionalProperties": False, "required": ["city"],
          "properties": {"city": {"type": "string", "maxLength": 8}}}


def test_text_format_json_schema_is_followed(demo_server, demo_engine):
    oai = sdk_clients(demo_server.url)[1]
    fmt = {"type": "json_schema", "name": "city", "schema": SCHEMA, "strict": True}
    for seed in range(3):
        created = oai.responses.create(model=demo_engine.model_name, input="A city?", max_output_tokens=40,
                                       text={"format": fmt}, extra_body={"seed": seed})
        value = json.loads(created.output_text)
        assert set(value) == {"city"} and len(value["city"]) <= 8
        assert created.text.format.type == "json_schema"


def test_responses_are_counted_by_route_in_metrics(oai, scripted_server):
    oai.responses.create(model=TEXT_MODEL, input="Hi")
    metrics = httpx.get(scripted_server.url + "/metrics").text
    assert any('route="/v1/responses"' in line and 'status="200"' in line for line in metrics.splitlines()
               if line.startswith("tierlm:requests_total"))


def test_a_reasoning_answers_logprobs_are_the_messages_tokens_alone(reasoning_server):
    server, _ = reasoning_server
    oai = sdk_clients(server.url)[1]
    kwargs = dict(model=THINKER, input="Hi", include=["message.output_text.logprobs"])
    created = oai.responses.create(**kwargs)
    with oai.responses.stream(**kwargs) as stream:
        events = list(stream)
        final = stream.get_final_response()
    tokens = [lp.token for lp in created.output[1].content[0].logprobs]
    assert "".join(tokens).strip() == ANSWER  # (no token of the think block or its markers)
    assert [lp.token for e in events if e.type == "response.output_text.delta" for lp in e.logprobs] == tokens
    assert [lp.token for lp in final.output[1].content[0].logprobs] == tokens


def test_logprobs_of_prose_before_a_call_are_the_proses_alone(oai):
    kwargs = dict(model=TOOLS_MODEL, input="Weather in Paris?", tools=[TOOL], include=["message.output_text.logprobs"])
    created = oai.responses.create(**kwargs)
    with oai.responses.stream(**kwargs) as stream:
        events = list(stream)
        final = stream.get_final_response()
    tokens = [lp.token for lp in created.output[0].content[0].logprobs]
    assert "".join(tokens).strip() == TOOL_PROSE  # (not the call's markup, which the message does not hold)
    assert [lp.token for e in events if e.type == "response.output_text.delta" for lp in e.logprobs] == tokens
    assert [lp.token for lp in final.output[0].content[0].logprobs] == tokens


def test_a_streamed_response_with_store_false_keeps_nothing(oai):
    with oai.responses.stream(model=TEXT_MODEL, input="Hi", store=False) as stream:
        final = stream.get_final_response()
    assert final.store is False and final.output_text == REPLY
    with pytest.raises(openai.NotFoundError):
        oai.responses.retrieve(final.id)


def test_an_answer_cut_off_while_thinking_is_its_reasoning_item_alone(reasoning_server):
    server, _ = reasoning_server
    oai = sdk_clients(server.url)[1]
    created = oai.responses.create(model=THINKER, input="Hi", max_output_tokens=3)
    r = httpx.post(server.url + "/v1/responses", json={"model": THINKER, "input": "Hi", "max_output_tokens": 3,
                                                      "stream": True}, headers={"x-api-key": API_KEY}, timeout=60)
    streamed = parse_sse(r.text)[-1][1]["response"]
    for response in (created.model_dump(), streamed):
        assert response["status"] == "incomplete" and [i["type"] for i in response["output"]] == ["reasoning"]
        assert response["usage"]["output_tokens_details"]["reasoning_tokens"] == 3


def test_an_answer_that_was_reasoning_alone_is_continued_as_an_assistant_turn(reasoning_server, monkeypatch):
    """Cut off while thinking, the answer is its reasoning item alone; the next turn's prompt
    holds it as the assistant's turn, not two user turns in a row."""
    from tests.serving.harness import record_requests

    server, engines = reasoning_server
    oai = sdk_clients(server.url)[1]
    cut = oai.responses.create(model=THINKER, input="Hi", max_output_tokens=3)
    seen = record_requests(engines[HISTORY], monkeypatch)
    oai.responses.create(model=HISTORY, previous_response_id=cut.id, input="Go on")
    text = engines[HISTORY].tokenizer.decode(seen[0].prompt_token_ids)
    thought = cut.output[0].content[0].text
    assert thought and f"<|im_start|>assistant\n<think>\n{thought}\n</think>" in text
    assert text.index(thought) < text.index("Go on")


def test_an_empty_think_blocks_markers_are_not_the_messages_logprobs(reasoning_server):
    server, _ = reasoning_server
    oai = sdk_clients(server.url)[1]
    kwargs = dict(model=BLANK, input="Hi", include=["message.output_text.logprobs"])
    created = oai.responses.create(**kwargs)
    with oai.responses.stream(**kwargs) as stream:
        events = list(stream)
    tokens = [lp.token for lp in created.output[-1].content[0].logprobs]
    assert created.output_text == ANSWER and "".join(tokens).strip() == ANSWER
    assert [lp.token for e in events if e.type == "response.output_text.delta" for lp in e.logprobs] == tokens


def test_more_items_than_the_context_holds_are_refused_before_validation_whatever_else_the_body_holds(
        scripted_server):
    """The raw JSON's items are counted before validation (each renders to a token at least): a
    stray `messages` key beside `input` made the count skip `input`, and 200,000 items then held
    the event loop for seconds in validation."""
    items = [{"role": "user", "content": "x"}] * 600  # past the scripted models' 512-token context
    for extra in ({}, {"messages": []}):
        r = post(scripted_server, "/v1/responses", {"model": TEXT_MODEL, "input": items, **extra})
        assert r.status_code == 400 and r.json()["error"]["param"] == "input", r.text
        assert "input: the request has 600 tools, messages and content blocks" in r.json()["error"]["message"]
