"""The official SDKs against the scripted models (exact answers; see scripted_model.py): what
the SDKs' own helpers make of tierlm's responses (stream helpers' final messages, exceptions,
pagination)."""
from __future__ import annotations

import anthropic
import openai
import pytest

from tests.serving.harness import sdk_clients
from tests.serving.scripted_model import CALL_MODEL, REPLY, TEXT_MODEL, TOOL_PROSE, TOOLS_MODEL

USER = [{"role": "user", "content": "Hi there"}]
CLAUDE_TOOL = {"name": "get_weather", "description": "Weather for a city", "input_schema": {"type": "object"}}
OPENAI_TOOL = {"type": "function", "function": {"name": "get_weather", "description": "Weather for a city",
                                                "parameters": {"type": "object"}}}


@pytest.fixture(scope="module")
def claude(scripted_server) -> anthropic.Anthropic:
    return sdk_clients(scripted_server.url)[0]


@pytest.fixture(scope="module")
def oai(scripted_server) -> openai.OpenAI:
    return sdk_clients(scripted_server.url)[1]


def test_claude_stream_shows_the_prose_before_a_call_as_create_does(claude):
    kwargs = dict(model=TOOLS_MODEL, max_tokens=200, messages=USER, tools=[CLAUDE_TOOL])
    created = claude.messages.create(**kwargs)
    with claude.messages.stream(**kwargs) as stream:
        final = stream.get_final_message()
    assert [b.type for b in final.content] == [b.type for b in created.content] == ["text", "tool_use"]
    assert final.content[0].text == created.content[0].text == TOOL_PROSE
    assert final.content[1].input == created.content[1].input == {"city": "Paris"}
    assert final.stop_reason == created.stop_reason == "tool_use"


def test_openai_stream_shows_the_prose_before_a_call_as_create_does(oai):
    kwargs = dict(model=TOOLS_MODEL, messages=USER, tools=[OPENAI_TOOL])
    created = oai.chat.completions.create(**kwargs).choices[0]
    with oai.chat.completions.stream(**kwargs) as stream:
        final = stream.get_final_completion().choices[0]
    assert final.message.content == created.message.content == TOOL_PROSE
    assert final.message.tool_calls[0].function.arguments == created.message.tool_calls[0].function.arguments
    assert final.finish_reason == created.finish_reason == "tool_calls"


def test_a_call_to_a_tool_the_request_did_not_offer_is_text(claude, oai):
    """The model calls get_weather; only get_time was offered. Both APIs only ever return calls
    to offered tools, and a client may run whatever name comes back."""
    claude_kw = dict(model=TOOLS_MODEL, max_tokens=200, messages=USER, tools=[{**CLAUDE_TOOL, "name": "get_time"}])
    created = claude.messages.create(**claude_kw)
    with claude.messages.stream(**claude_kw) as stream:
        final = stream.get_final_message()
    for message in (created, final):
        assert [b.type for b in message.content] == ["text"] and message.stop_reason == "end_turn"
        assert '"name": "get_weather"' in message.content[0].text
    oai_kw = dict(model=TOOLS_MODEL, messages=USER,
                  tools=[{**OPENAI_TOOL, "function": {**OPENAI_TOOL["function"], "name": "get_time"}}])
    choice = oai.chat.completions.create(**oai_kw).choices[0]
    with oai.chat.completions.stream(**oai_kw) as stream:
        streamed = stream.get_final_completion().choices[0]
    for c in (choice, streamed):
        assert not c.message.tool_calls and c.finish_reason == "stop"
        assert '"name": "get_weather"' in c.message.content


@pytest.mark.parametrize("model, tools, content", [
    (CALL_MODEL, [OPENAI_TOOL], None),  # tool calls alone: no content, as OpenAI streams them
    (TEXT_MODEL, [OPENAI_TOOL], REPLY),  # tools offered, text answered
    (TEXT_MODEL, None, REPLY),
])
def test_openai_stream_helper_content(oai, model, tools, content):
    kwargs = dict(model=model, messages=USER, **({"tools": tools} if tools else {}))
    with oai.chat.completions.stream(**kwargs) as stream:
        final = stream.get_final_completion().choices[0]
    assert final.message.content == content
    assert final.message.content == oai.chat.completions.create(**kwargs).choices[0].message.content
    assert bool(final.message.tool_calls) == (content is None)


def test_context_length_errors_as_the_sdks_see_them(claude, oai, scripted_engines):
    n = scripted_engines[TEXT_MODEL].max_model_len
    with pytest.raises(openai.BadRequestError) as info:
        oai.chat.completions.create(model=TEXT_MODEL, messages=USER, max_tokens=n)
    assert info.value.code == "context_length_exceeded" and info.value.param == "messages"
    assert info.value.body["message"].startswith(f"This model's maximum context length is {n} tokens. However, ")
    with pytest.raises(anthropic.BadRequestError, match=rf"input length and `max_tokens` exceed context limit: "
                                                        rf"\d+ \+ {n} > {n}, decrease input length"):
        claude.messages.create(model=TEXT_MODEL, messages=USER, max_tokens=n)
    with pytest.raises(anthropic.BadRequestError, match=rf"prompt is too long: \d+ tokens > {n} maximum"):
        claude.messages.create(model=TEXT_MODEL, messages=[{"role": "user", "content": "word " * n}], max_tokens=1)


def test_openai_response_fields(oai):
    done = oai.chat.completions.create(model=TEXT_MODEL, messages=USER)
    assert done.system_fingerprint and done.system_fingerprint.startswith("tierlm-")
    assert done.choices[0].message.refusal is None and done.choices[0].message.annotations == []
    chunks = list(oai.chat.completions.create(model=TEXT_MODEL, messages=USER, stream=True))
    assert {c.system_fingerprint for c in chunks} == {done.system_fingerprint}


def test_claude_models_pages(claude, scripted_engines):
    names = list(scripted_engines)
    page = claude.models.list(limit=1)
    assert [m.id for m in page.data] == names[:1] and page.has_more
    assert [m.id for m in claude.models.list(limit=1)] == names  # the SDK follows the pages (after_id)


@pytest.mark.parametrize("call", [
    lambda oai: oai.conversations.create(),
    lambda oai: oai.vector_stores.list(),
    lambda oai: oai.fine_tuning.jobs.list(),
    lambda oai: oai.uploads.create(bytes=1, filename="a.jsonl", mime_type="text/jsonl", purpose="batch"),
    lambda oai: oai.containers.list(),
    lambda oai: oai.evals.list(),
    lambda oai: oai.videos.list(),
    lambda oai: oai.beta.assistants.list(),
])
def test_openai_resources_tierlm_lacks_are_openai_shaped_404s(oai, call):
    with pytest.raises(openai.NotFoundError) as info:
        call(oai)
    error = info.value.body  # the SDK hands over the body's `error` object
    assert set(error) == {"message", "type", "param", "code"} and error["code"] == "not_found"
    assert error["message"].startswith("no such route: ")


def test_openai_sdk_sends_refusal_parts_and_gets_the_function_role_named(oai):
    refused = {"role": "assistant", "content": [{"type": "refusal", "refusal": "I cannot help with that."}]}
    answer = oai.chat.completions.create(model=TEXT_MODEL, messages=[*USER, refused, *USER])
    assert answer.choices[0].message.content == REPLY
    with pytest.raises(openai.BadRequestError) as info:
        oai.chat.completions.create(model=TEXT_MODEL, messages=[*USER, {"role": "function", "name": "f",
                                                                        "content": "x"}])
    assert info.value.body["param"] == "messages.1.role" and "send tool messages" in info.value.body["message"]
