"""The output safety layer over tool calls, end to end through the official SDKs: a phrase a
model writes inside a call's JSON with escapes (`\\u00fc`, `\\"`, `\\n`) is in the arguments the
client decodes, so the decoded call is checked too, not only the text as written."""
from __future__ import annotations

import json

import pytest

from tests.serving.harness import guarded_server, sdk_clients
from tests.serving.scripted_model import Script, build_scripted_model, chat_prompt_ids

MODEL = "scripted-escaped"
# A call whose argument spells "Zürich" only once its JSON is decoded.
ESCAPED = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Z\\u00fcrich"}}\n</tool_call>'
KEYS = {"blk": "sk-blk", "red": "sk-red", "nam": "sk-nam"}
TENANTS = """
[tenants.blk]
tier = "bronze"
keys = ["blk"]

[tenants.red]
tier = "gold"
keys = ["red"]

[tenants.nam]
tier = "gold"
keys = ["nam"]
"""
POLICIES = """
[policies.city]
phrases = ["zürich"]
check = "output"
tenants = ["blk"]

[policies.city_redacted]
phrases = ["zürich"]
check = "output"
action = "redact"
replacement = "[x]"
tenants = ["red"]

[policies.tool_name]
phrases = ["get_weather"]
check = "output"
action = "redact"
replacement = "[x]"
tenants = ["nam"]
"""
HI = [{"role": "user", "content": "Hi"}]
TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}
ATOOL = {"name": "get_weather", "input_schema": {"type": "object"}}
RTOOL = {"type": "function", "name": "get_weather", "parameters": {"type": "object"}}


@pytest.fixture(scope="module")
def server(demo_tokenizer, tmp_path_factory):
    root = tmp_path_factory.mktemp("safety-tools")
    model = build_scripted_model(root / MODEL, [Script(chat_prompt_ids(demo_tokenizer), ESCAPED)], demo_tokenizer)
    srv = guarded_server(root, {MODEL: model.engine(MODEL)}, KEYS, TENANTS, POLICIES)
    yield srv
    srv.stop()


def clients(server, key):
    return sdk_clients(server.url, KEYS[key])


def test_a_blocked_phrase_escaped_in_a_calls_json_stops_the_answer_in_every_api(server):
    claude, oai = clients(server, "blk")
    chat = oai.chat.completions.create(model=MODEL, max_tokens=60, messages=HI, tools=[TOOL])
    assert chat.choices[0].finish_reason == "content_filter" and not chat.choices[0].message.tool_calls
    assert "rich" not in (chat.choices[0].message.content or "")
    chunks = list(oai.chat.completions.create(model=MODEL, max_tokens=60, messages=HI, tools=[TOOL], stream=True,
                                              stream_options={"include_usage": True}))
    assert not any(c.choices[0].delta.tool_calls for c in chunks if c.choices)
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == \
        ["content_filter"]
    assert chunks[-1].usage.completion_tokens == chat.usage.completion_tokens

    response = oai.responses.create(model=MODEL, max_output_tokens=60, input="Hi", tools=[RTOOL])
    assert response.status == "incomplete" and response.incomplete_details.reason == "content_filter"
    assert not [o for o in response.output if o.type == "function_call"]
    events = list(oai.responses.create(model=MODEL, max_output_tokens=60, input="Hi", tools=[RTOOL], stream=True))
    assert events[-1].type == "response.incomplete" and not [e for e in events if "function_call" in e.type]

    message = claude.messages.create(model=MODEL, max_tokens=60, messages=HI, tools=[ATOOL])
    assert message.stop_reason == "refusal" and not [b for b in message.content if b.type == "tool_use"]
    with claude.messages.stream(model=MODEL, max_tokens=60, messages=HI, tools=[ATOOL]) as stream:
        final = stream.get_final_message()
    assert final.stop_reason == "refusal" and not [b for b in final.content if b.type == "tool_use"]
    assert final.usage.output_tokens == message.usage.output_tokens


def test_a_redacted_phrase_escaped_in_a_calls_json_is_masked_in_its_arguments(server):
    claude, oai = clients(server, "red")
    chat = oai.chat.completions.create(model=MODEL, max_tokens=60, messages=HI, tools=[TOOL])
    assert chat.choices[0].finish_reason == "tool_calls"
    assert json.loads(chat.choices[0].message.tool_calls[0].function.arguments) == {"city": "[x]"}
    with oai.chat.completions.stream(model=MODEL, max_tokens=60, messages=HI, tools=[TOOL]) as stream:
        final = stream.get_final_completion()
    assert json.loads(final.choices[0].message.tool_calls[0].function.arguments) == {"city": "[x]"}
    response = oai.responses.create(model=MODEL, max_output_tokens=60, input="Hi", tools=[RTOOL])
    assert [json.loads(o.arguments) for o in response.output if o.type == "function_call"] == [{"city": "[x]"}]
    message = claude.messages.create(model=MODEL, max_tokens=60, messages=HI, tools=[ATOOL])
    assert message.stop_reason == "tool_use" and message.content[-1].input == {"city": "[x]"}
    with claude.messages.stream(model=MODEL, max_tokens=60, messages=HI, tools=[ATOOL]) as stream:
        assert stream.get_final_message().content[-1].input == {"city": "[x]"}


def test_a_redact_phrase_written_in_a_tools_name_turns_the_call_into_text(server):
    """The text as written is masked before the call is parsed; a call naming no tool offered is
    text (what the README tells operators: keep redact phrases out of tool names)."""
    claude, oai = clients(server, "nam")
    chat = oai.chat.completions.create(model=MODEL, max_tokens=60, messages=HI, tools=[TOOL])
    assert chat.choices[0].finish_reason == "stop" and not chat.choices[0].message.tool_calls
    assert '"name": "[x]"' in chat.choices[0].message.content
    message = claude.messages.create(model=MODEL, max_tokens=60, messages=HI, tools=[ATOOL])
    assert message.stop_reason == "end_turn" and [b.type for b in message.content] == ["text"]
