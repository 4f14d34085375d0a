"""A client's sweep of OpenAI's Responses API (/v1/responses): what the official `openai` SDK
and raw HTTP clients depend on, bad input in every field, chains of previous_response_id, and
streams cut short, against the scripted models of scripted_model.py and a reasoning model.

Each test here was written for a bug the sweep found (its docstring says which), or checks
what a sweep must: no KV block left behind by a failed or abandoned request.
"""
from __future__ import annotations

import concurrent.futures

import httpx
import openai
import pytest

from tests.serving.harness import API_KEY, fail_after_steps, parse_sse, sdk_clients, slow_steps, wait_until
from tests.serving.scripted_model import LOOP_MODEL, REPLY, TEXT_MODEL, TOOL_PROSE, TOOLS_MODEL

TOOL = {"type": "function", "name": "get_weather", "parameters": {"type": "object"}}
HEADERS = {"authorization": f"Bearer {API_KEY}"}


@pytest.fixture(scope="module")
def oai(scripted_server) -> openai.OpenAI:
    return sdk_clients(scripted_server.url)[1]


def post(server, body: dict) -> httpx.Response:
    return httpx.post(server.url + "/v1/responses", json=body, headers=HEADERS, timeout=60)


def error_of(r: httpx.Response) -> dict:
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error", error
    return error


def call_item(call_id: str, arguments: str = "{}") -> dict:
    return {"type": "function_call", "call_id": call_id, "name": "get_weather", "arguments": arguments}


def output_item(call_id: str) -> dict:
    return {"type": "function_call_output", "call_id": call_id, "output": "sunny"}


USER = {"role": "user", "content": "Weather?"}


# ---- errors name the request's own fields ------------------------------------------------------


def test_item_indices_in_errors_count_the_requests_own_input_not_the_previous_responses(oai, scripted_server):
    """Was: with previous_response_id, an item's index counted the previous response's items
    too (`input.3` for the only item sent)."""
    first = oai.responses.create(model=TOOLS_MODEL, input="Weather?", tools=[TOOL])
    call = first.output[1]
    chained = {"model": TOOLS_MODEL, "previous_response_id": first.id, "tools": [TOOL]}
    error = error_of(post(scripted_server, {**chained, "input": [output_item("nope")]}))
    assert error["param"] == "input.0" and error["message"].startswith("input.0: "), error
    # the previous response's call sent again, as a call of its own
    error = error_of(post(scripted_server, {**chained, "input": [call_item(call.call_id), output_item(call.call_id)]}))
    assert error["param"] == "input.0" and "previous response" in error["message"], error
    # the previous response's call left unanswered (a new call answered instead)
    error = error_of(post(scripted_server, {**chained, "input": [call_item("c2"), output_item("c2")]}))
    assert error["param"] == "input" and call.call_id in error["message"], error
    assert "previous response" in error["message"] and "input.2" not in error["message"], error
    # an item of this request's own, after the history
    error = error_of(post(scripted_server, {**chained, "input": [output_item(call.call_id), USER,
                                                                 call_item("c2", "[1]"), output_item("c2")]}))
    assert error["param"] == "input.2.arguments", error


@pytest.mark.parametrize("items, param, names", [
    ([USER, call_item("c1"), {"role": "user", "content": "And?"}, output_item("c1")], "input.2", "input.1"),
    ([USER, call_item("c1"), {"role": "assistant", "content": "Hm."}, output_item("c1")], "input.2", "input.1"),
    ([USER, call_item("c1"), call_item("c2"), output_item("c1"), call_item("c3"), output_item("c2"),
      output_item("c3")], "input.4", "input.2"),
    ([USER, call_item("c1"), output_item("c1"), call_item("c2"), output_item("c1"), output_item("c2")],
     "input.4", "input.1"),
])
def test_outputs_out_of_their_calls_turn_are_refused_naming_input_items(scripted_server, items, param, names):
    """Was: the chat path refused these in its own words: "messages.1: An assistant message with
    'tool_calls' must be followed by tool messages", a message index no Responses client sent."""
    error = error_of(post(scripted_server, {"model": TOOLS_MODEL, "tools": [TOOL], "input": items}))
    assert error["param"] == param and error["message"].startswith(param + ": "), error
    assert names in error["message"] and "messages" not in error["message"], error


def test_a_message_after_the_previous_responses_unanswered_call_is_refused_naming_it(oai, scripted_server):
    first = oai.responses.create(model=TOOLS_MODEL, input="Weather?", tools=[TOOL])
    error = error_of(post(scripted_server, {"model": TOOLS_MODEL, "previous_response_id": first.id, "tools": [TOOL],
                                            "input": [{"role": "user", "content": "And?"}]}))
    assert error["param"] == "input.0" and first.output[1].call_id in error["message"], error
    assert "previous response" in error["message"] and "messages" not in error["message"], error


def test_non_standard_json_in_call_arguments_is_refused_as_input_arguments(scripted_server):
    """Was: NaN and Infinity passed the item's check, then the chat path refused them as
    `messages.1.tool_calls.0.function.arguments`."""
    for arguments in ('{"a": NaN}', '{"a": Infinity}', '{"a": 1e400}'):
        error = error_of(post(scripted_server, {"model": TEXT_MODEL, "input": [
            USER, call_item("c1", arguments), output_item("c1")]}))
        assert error["param"] == "input.1.arguments" and error["message"].startswith("input.1.arguments: "), error


def test_errors_of_the_chat_path_speak_of_the_responses_fields(scripted_server):
    """Was: the param was renamed (text.format, input) but the message still began with the chat
    field's name (`response_format: ...`, `messages: ...`)."""
    error = error_of(post(scripted_server, {"model": TEXT_MODEL, "input": "Hi", "text": {"format": {
        "type": "json_schema", "name": "x", "schema": {"type": "bogus"}}}}))
    assert error["param"] == "text.format" and error["message"].startswith("text.format: "), error
    # call arguments the tokenizer cannot take (a lone surrogate, escaped in the JSON text)
    error = error_of(post(scripted_server, {"model": TEXT_MODEL, "input": [
        USER, call_item("c1", '{"a": "\\ud800"}'), output_item("c1")]}))
    assert error["param"].startswith("input") and not error["message"].startswith("messages"), error


def test_unknown_include_values_are_refused(scripted_server):
    """Was: any `include` value was accepted, so a typo (`message.output_text.logprob`) silently
    returned no logprobs; OpenAI answers a 400 listing the values."""
    error = error_of(post(scripted_server, {"model": TEXT_MODEL, "input": "Hi",
                                            "include": ["message.output_text.logprob"]}))
    assert error["param"].startswith("include") and "message.output_text.logprobs" in error["message"], error
    # OpenAI's values for its built-in tools are still accepted (and have nothing to add here)
    r = post(scripted_server, {"model": TEXT_MODEL, "input": "Hi", "include": ["file_search_call.results"]})
    assert r.status_code == 200, r.text


# ---- stored responses --------------------------------------------------------------------------


def test_listed_input_messages_hold_content_parts_as_the_sdk_reads_them(oai):
    """Was: a message sent as a string (`input="Hi"`, or easy input messages) was listed with
    `content: "Hi"`; the SDK's ResponseInputMessageItem holds a list of parts, so
    `item.content[0].text` failed."""
    first = oai.responses.create(model=TEXT_MODEL, input="Hi")
    second = oai.responses.create(model=TEXT_MODEL, previous_response_id=first.id, input=[
        {"role": "assistant", "content": "Noted."}, {"role": "user", "content": "Again"}])
    items = list(oai.responses.input_items.list(second.id, order="asc"))
    assert [(i.role, i.content[0].type, i.content[0].text) for i in items] == [
        ("user", "input_text", "Hi"), ("assistant", "output_text", REPLY),
        ("assistant", "output_text", "Noted."), ("user", "input_text", "Again")]


def test_an_item_id_sent_twice_is_refused(oai, scripted_server):
    """Was: the previous response's output sent again beside previous_response_id (a common
    mistake) was read twice, and its input_items listed the same id twice: a page `after` that
    id started over at its first copy, so the SDK's auto-paging never ended. OpenAI refuses
    such input ("Duplicate item found with id ...")."""
    first = oai.responses.create(model=TEXT_MODEL, input="Hi")
    again = first.output[0].model_dump(exclude_none=True)
    error = error_of(post(scripted_server, {"model": TEXT_MODEL, "previous_response_id": first.id,
                                            "input": [again, {"role": "user", "content": "More"}]}))
    assert error["param"] == "input.0" and first.output[0].id in error["message"], error
    twice = {"type": "message", "id": "msg_1", "role": "user", "content": "Hi"}
    error = error_of(post(scripted_server, {"model": TEXT_MODEL, "input": [twice, twice]}))
    assert error["param"] == "input.1" and "msg_1" in error["message"], error


def test_stored_responses_answer_head_and_405s_name_every_method(oai, scripted_server):
    """Was: HEAD on GET /v1/responses/{id} and its input_items was a 405 (every GET route
    answers HEAD), and a 405 there offered only GET, not DELETE."""
    created = oai.responses.create(model=TEXT_MODEL, input="Hi")
    for path in (f"/v1/responses/{created.id}", f"/v1/responses/{created.id}/input_items"):
        head = httpx.head(scripted_server.url + path, headers=HEADERS)
        assert head.status_code == 200 and head.content == b"", (path, head.status_code)
    assert httpx.head(scripted_server.url + "/v1/responses/resp_nope", headers=HEADERS).status_code == 404
    r = httpx.put(scripted_server.url + f"/v1/responses/{created.id}", headers=HEADERS)
    assert r.status_code == 405 and set(r.headers["allow"].split(", ")) == {"GET", "HEAD", "DELETE"}


def test_timestamps_are_whole_seconds_as_openai_sends_them(scripted_server):
    """Was: created_at and completed_at were floats (1796226800.05); OpenAI sends integers, as
    the chat side's `created` does, and clients typed for them (u64) fail on a fraction."""
    body = post(scripted_server, {"model": TEXT_MODEL, "input": "Hi"}).json()
    assert isinstance(body["created_at"], int) and isinstance(body["completed_at"], int), body
    frames = parse_sse(post(scripted_server, {"model": TEXT_MODEL, "input": "Hi", "stream": True}).text)
    assert isinstance(frames[0][1]["response"]["created_at"], int)
    assert isinstance(frames[-1][1]["response"]["completed_at"], int)


# ---- streams: what the SDK's accumulator checks, and what is left behind --------------------------


def shown(item) -> tuple:
    """An output item as a client reads it (the SDK adds `parsed` to the final response's parts)."""
    texts = [part.text for part in getattr(item, "content", None) or ()]
    return item.id, item.type, item.status, texts, getattr(item, "arguments", None)


def test_streams_events_agree_with_their_final_response(oai):
    """Every event numbered in order; every item event names the item at its output_index in
    the final response; the accumulated response is the non-streamed one's shape."""
    for kwargs in (dict(model=TEXT_MODEL, input="Hi"), dict(model=TOOLS_MODEL, input="Hi", tools=[TOOL]),
                   dict(model=LOOP_MODEL, input="Hi", max_output_tokens=4)):
        with oai.responses.stream(**kwargs) as stream:
            events = list(stream)
        final = events[-1].response
        assert [e.sequence_number for e in events] == list(range(len(events)))
        for e in events:
            if hasattr(e, "output_index") and hasattr(e, "item_id"):
                assert final.output[e.output_index].id == e.item_id, e
        done = [(e.output_index, shown(e.item)) for e in events if e.type == "response.output_item.done"]
        assert done == [(i, shown(item)) for i, item in enumerate(final.output)]
        created = oai.responses.create(**kwargs)
        assert [i.type for i in created.output] == [i.type for i in final.output]
        assert (created.status, created.output_text) == (final.status, final.output_text)


def test_a_failure_mid_stream_ends_with_response_failed_and_frees_its_blocks(scripted_server, scripted_engines,
                                                                             monkeypatch):
    engine = scripted_engines[LOOP_MODEL]
    fail_after_steps(engine, monkeypatch, 3)
    r = post(scripted_server, {"model": LOOP_MODEL, "input": "Hi", "stream": True, "max_output_tokens": 50})
    frames = parse_sse(r.text)
    assert any(event == "response.output_text.delta" for event, _ in frames)  # output had started
    event, data = frames[-1]
    assert event == "response.failed" and data["response"]["status"] == "failed"
    assert data["response"]["error"]["code"] == "server_error"
    assert [d["sequence_number"] for _, d in frames] == list(range(len(frames)))
    assert wait_until(lambda: engine.stats().kv_blocks_used == 0)


def test_a_client_leaving_mid_stream_frees_its_blocks_and_stores_nothing(oai, scripted_server, scripted_engines,
                                                                         monkeypatch):
    engine = scripted_engines[LOOP_MODEL]
    slow_steps(engine, monkeypatch, 0.01)  # the whole answer would take ~4 s
    generated = engine.stats().generation_tokens
    with httpx.Client(base_url=scripted_server.url, headers=HEADERS, timeout=10) as client:
        with client.stream("POST", "/v1/responses", json={"model": LOOP_MODEL, "input": "Hi", "stream": True,
                                                          "max_output_tokens": 400}) as r:
            frames = r.iter_lines()
            created = next(f for f in frames if f.startswith("data: "))
            for _ in range(12):
                next(frames)
            assert engine.stats().kv_blocks_used > 0
    assert wait_until(lambda: engine.stats().kv_blocks_used == 0, timeout=2)
    assert engine.stats().generation_tokens - generated < 100  # aborted, not run to the end
    response_id = httpx.Response(200, content=created[len("data: "):]).json()["response"]["id"]
    with pytest.raises(openai.NotFoundError):
        oai.responses.retrieve(response_id)


def test_bad_requests_leave_no_blocks_behind(scripted_server, scripted_engines):
    for body in ({"input": [USER, call_item("c1")]}, {"max_output_tokens": 100_000},
                 {"text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "bogus"}}}},
                 {"previous_response_id": "resp_nope"}):
        assert post(scripted_server, {"model": TOOLS_MODEL, "input": "Hi", **body}).status_code == 400
    assert all(e.stats().kv_blocks_used == 0 for e in scripted_engines.values())


def test_parallel_continuations_of_one_response_each_keep_their_own_answer(oai):
    parent = oai.responses.create(model=TOOLS_MODEL, input="Weather?", tools=[TOOL])
    call_id = parent.output[1].call_id

    def continue_with(i: int):
        kwargs = dict(model=TOOLS_MODEL, previous_response_id=parent.id, tools=[TOOL],
                      input=[{"type": "function_call_output", "call_id": call_id, "output": f"result {i}"}])
        if i % 2:
            with oai.responses.stream(**kwargs) as stream:
                return stream.get_final_response()
        return oai.responses.create(**kwargs)

    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        responses = list(pool.map(continue_with, range(12)))
    assert {r.status for r in responses} == {"completed"} and len({r.id for r in responses}) == 12
    assert all(r.output_text == TOOL_PROSE for r in responses)
    for i, response in enumerate(responses):
        items = list(oai.responses.input_items.list(response.id))  # newest first
        assert items[0].output == f"result {i}" and items[0].call_id == call_id
