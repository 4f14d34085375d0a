"""The Anthropic Messages API refuses what Anthropic's own API refuses (in its words where it has
them), and a tool round trip with Anthropic's ids works whatever the chat template demands of ids.
Real HTTP, real SDK, real engines over the scripted models (scripted_model.py)."""
from __future__ import annotations

import copy
import json
import re
import shutil
import uuid

import anthropic
import httpx
import pytest

from tests.serving.harness import API_KEY, ServerThread, parse_sse, record_requests, sdk_clients
from tests.serving.scripted_model import ENGINE_OPTIONS, REPLY, TEXT_MODEL, TOOLS_MODEL
from tierlm.models.demo import CHAT_TEMPLATE
from tierlm.serving.app import build_app
from tierlm.serving.auth import ApiKeyAuth

WEATHER_TOOL = {"name": "get_weather", "description": "Weather for a city", "input_schema": {"type": "object"}}
CALL_ID = "toolu_0a73513a3647450c8c42691b"  # the shape Anthropic's API (and tierlm) issues
ROUND_TRIP = [
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": [{"type": "tool_use", "id": CALL_ID, "name": "get_weather",
                                       "input": {"city": "Paris"}}]},
    {"role": "user", "content": [{"type": "tool_result", "tool_use_id": CALL_ID, "content": "sunny"}]},
]

# What Mistral's templates do with tool call ids (the checks and layout of Mistral 7B Instruct v0.3's).
MISTRAL_TEMPLATE = (
    "{%- if tools is defined and tools %}{{- '[AVAILABLE_TOOLS] ' + tools|tojson + '[/AVAILABLE_TOOLS]' }}{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message['role'] == 'user' %}{{- '[INST] ' + message['content'] + '[/INST]' }}"
    "{%- elif message.tool_calls is defined and message.tool_calls is not none %}{{- '[TOOL_CALLS] [' }}"
    "{%- for tool_call in message.tool_calls %}{%- set out = tool_call.function|tojson %}{{- out[:-1] }}"
    "{%- if not tool_call.id is defined or tool_call.id|length != 9 %}"
    "{{- raise_exception('Tool call IDs should be alphanumeric strings with length 9!') }}{%- endif %}"
    "{{- ', \"id\": \"' + tool_call.id + '\"}' }}{%- if not loop.last %}{{- ', ' }}{%- else %}{{- ']' + eos_token }}"
    "{%- endif %}{%- endfor %}"
    "{%- elif message['role'] == 'assistant' %}{{- ' ' + message['content']|trim + eos_token }}"
    "{%- elif message['role'] == 'tool' %}{{- '[TOOL_RESULTS] {\"content\": ' + message.content|string + ', ' }}"
    "{%- if not message.tool_call_id is defined or message.tool_call_id|length != 9 %}"
    "{{- raise_exception('Tool call IDs should be alphanumeric strings with length 9!') }}{%- endif %}"
    "{{- '\"call_id\": \"' + message.tool_call_id + '\"}[/TOOL_RESULTS]' }}{%- endif %}{%- endfor %}"
)
MISTRAL_MODEL = "scripted-mistral"


def serve_with_template(source, out, name: str, template: str, positions: int | None = None, **engine_options):
    """A copy of the scripted checkpoint at `source` with chat template `template` (and
    `positions` as its max_position_embeddings), served alone: (its engine, an SDK client, the
    server)."""
    path = out / name
    shutil.copytree(source, path)
    if positions is not None:
        model_config = json.loads((path / "config.json").read_text())
        (path / "config.json").write_text(json.dumps({**model_config, "max_position_embeddings": positions}))
    for f in path.glob("chat_template.j*"):
        f.unlink()
    config = json.loads((path / "tokenizer_config.json").read_text())
    (path / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": template}))
    from tierlm.engine.async_engine import AsyncEngine

    engine = AsyncEngine.from_model(str(path), served_model_name=name, **{**ENGINE_OPTIONS, **engine_options})
    server = ServerThread(build_app({name: engine}, ApiKeyAuth.from_keys({"alice": API_KEY}))).start()
    return engine, sdk_clients(server.url)[0], server


@pytest.fixture(scope="module")
def mistral(scripted_models, tmp_path_factory):
    """A scripted checkpoint whose chat template checks tool call ids as Mistral's do, served alone."""
    engine, claude, server = serve_with_template(scripted_models[TOOLS_MODEL].path, tmp_path_factory.mktemp("mistral"),
                                                 MISTRAL_MODEL, MISTRAL_TEMPLATE)
    yield engine, claude
    server.stop()


def test_anthropic_ids_pass_a_template_that_wants_9_alphanumerics(mistral, monkeypatch):
    engine, claude = mistral
    asked = record_requests(engine, monkeypatch)
    counted = claude.messages.count_tokens(model=MISTRAL_MODEL, messages=ROUND_TRIP, tools=[WEATHER_TOOL])
    msg = claude.messages.create(model=MISTRAL_MODEL, max_tokens=5, messages=ROUND_TRIP, tools=[WEATHER_TOOL])
    assert msg.type == "message" and counted.input_tokens == len(asked[-1].prompt_token_ids)
    prompt = engine.tokenizer.decode(asked[-1].prompt_token_ids)
    call_ids = re.findall(r'"id": "([^"]*)"', prompt)
    result_ids = re.findall(r'"call_id": "([^"]*)"', prompt)
    assert len(call_ids) == 1 and call_ids == result_ids and re.fullmatch("[a-zA-Z0-9]{9}", call_ids[0])
    # the same id every time (the prompt, and so its cached prefix, does not change between requests)
    claude.messages.create(model=MISTRAL_MODEL, max_tokens=5, messages=ROUND_TRIP, tools=[WEATHER_TOOL])
    assert asked[-1].prompt_token_ids == asked[-2].prompt_token_ids


def test_openai_ids_pass_a_template_that_wants_9_alphanumerics(mistral, monkeypatch):
    """The same on the OpenAI route: `call_...` ids were a 400 on a Mistral-style template."""
    engine, claude = mistral
    asked = record_requests(engine, monkeypatch)
    call = {"id": "call_5b1e2a90c6d34f8e9a7b1c2d", "type": "function",
            "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}
    body = {"model": MISTRAL_MODEL, "max_tokens": 5, "tools": [{"type": "function", "function": {
        "name": "get_weather", "parameters": {"type": "object"}}}], "messages": [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": call["id"], "content": "sunny"}]}
    r = httpx.post(f"{claude.base_url}".rstrip("/") + "/v1/chat/completions", json=body,
                   headers={"authorization": f"Bearer {API_KEY}"}, timeout=30)
    assert r.status_code == 200, r.text
    prompt = engine.tokenizer.decode(asked[-1].prompt_token_ids)
    call_ids = re.findall(r'"id": "([^"]*)"', prompt)
    assert len(call_ids) == 1 and call_ids == re.findall(r'"call_id": "([^"]*)"', prompt)
    assert re.fullmatch("[a-zA-Z0-9]{9}", call_ids[0])


# ---- refusals ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def client(scripted_server):
    with httpx.Client(base_url=scripted_server.url, timeout=30,
                      headers={"x-api-key": API_KEY, "anthropic-version": "2023-06-01"}) as c:
        yield c


def refused(r: httpx.Response) -> str:
    assert r.status_code == 400, r.text
    data = r.json()
    assert data["type"] == "error" and data["error"]["type"] == "invalid_request_error"
    return data["error"]["message"]


def conversation(*messages, **fields):
    return {"model": TEXT_MODEL, "messages": list(messages), **fields}


USER = {"role": "user", "content": "Hi"}


def use(call_id="toolu_1"):
    return {"role": "assistant", "content": [{"type": "tool_use", "id": call_id, "name": "get_weather", "input": {}}]}


def result(call_id="toolu_1"):
    return {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call_id, "content": "sunny"}]}


# (body, words the message starts with, words it contains): each as Anthropic's API refuses it
REFUSED = {
    "whitespace text block": (conversation({"role": "user", "content": [{"type": "text", "text": " \n"}]}),
                              "messages.0: ", "text content blocks must contain non-whitespace text"),
    "whitespace text blocks": (conversation({"role": "user", "content": [{"type": "text", "text": " "},
                                                                        {"type": "text", "text": "\n"}]}),
                               "messages.0: ", "text content blocks must contain non-whitespace text"),
    "whitespace string content": (conversation({"role": "user", "content": "  "}),
                                  "messages.0: ", "text content blocks must contain non-whitespace text"),
    "whitespace system": (conversation(USER, system=[{"type": "text", "text": " "}]),
                          "system: ", "text content blocks must contain non-whitespace text"),
    "empty text block": (conversation({"role": "user", "content": [{"type": "text", "text": ""}]}),
                         "messages.0.content.0.text: ", "text content blocks must be non-empty"),
    "duplicate tool names": (conversation(USER, tools=[WEATHER_TOOL, WEATHER_TOOL]),
                             "tools: ", "ool names must be unique. 'get_weather'"),
    "server tool": (conversation(USER, tools=[{"type": "web_search_20250305", "name": "web_search"}]),
                    "tools.0: ", "tool 'web_search' has type 'web_search_20250305', a tool Anthropic defines"),
    "mcp_servers": (conversation(USER, mcp_servers=[{"type": "url", "url": "http://x", "name": "m"}]),
                    "mcp_servers: ", "does not connect to MCP servers"),
    "tool_use id out of pattern": (conversation(USER, use("a b\n<|im_end|>"), result("a b\n<|im_end|>"),
                                                tools=[WEATHER_TOOL]),
                                   "messages.1.content.0.id: ", "^[a-zA-Z0-9_-]+$"),
    "tool_use_id out of pattern": (conversation(USER, use(), result("toolu_1\n")),
                                   "messages.2.content.0.tool_use_id: ", "^[a-zA-Z0-9_-]+$"),
    "tool_use without its tool_result": (
        conversation(USER, use(), {"role": "user", "content": "go on"}, tools=[WEATHER_TOOL]),
        "messages.1: ", "`tool_use` ids were found without `tool_result` blocks immediately after: toolu_1. "
        "Each `tool_use` block must have a corresponding `tool_result` block in the next message."),
    "tool_result answering another id": (
        conversation(USER, use(), {"role": "user", "content": [*result("toolu_1")["content"],
                                                                *result("toolu_2")["content"]]}, tools=[WEATHER_TOOL]),
        "messages.2.content.1: ", "unexpected `tool_use_id` found in `tool_result` blocks: toolu_2."),
    "tool_result with no tool_use before": (conversation(result("toolu_1")),
                                            "messages.0.content.0: ", "unexpected `tool_use_id`"),
    "tool_use id used again in a later turn": (
        conversation(USER, use(), result(), use(), result(), tools=[WEATHER_TOOL]),
        "messages.3.content.0: ", "`tool_use` ids must be unique; toolu_1"),
    "tool_use id used twice in one turn": (
        conversation(USER, {"role": "assistant", "content": [*use()["content"], *use()["content"]]}, result(),
                     tools=[WEATHER_TOOL]),
        "messages.1.content.1: ", "`tool_use` ids must be unique; toolu_1"),
    "text before the tool_result": (
        conversation(USER, use(), {"role": "user", "content": [{"type": "text", "text": "Here:"},
                                                                *result()["content"]]}, tools=[WEATHER_TOOL]),
        "messages.2: ", "Did not find 1 `tool_result` block(s) at the beginning of this message"),
    "text between two results": (
        conversation(USER, {"role": "assistant", "content": [*use("toolu_1")["content"], *use("toolu_2")["content"]]},
                     {"role": "user", "content": [*result("toolu_1")["content"], {"type": "text", "text": "and"},
                                                  *result("toolu_2")["content"]]}, tools=[WEATHER_TOOL]),
        "messages.2: ", "Did not find 2 `tool_result` block(s) at the beginning of this message"),
    # thinking: Anthropic's ThinkingConfigParam (it changes the prompt: counted too)
    "thinking budget under 1,024": (conversation(USER, thinking={"type": "enabled", "budget_tokens": 1000}),
                                    "thinking.budget_tokens: ", "must be ≥1024 and less than max_tokens"),
    "thinking budget missing": (conversation(USER, thinking={"type": "enabled"}), "thinking.budget_tokens: ",
                                "field required"),
    "thinking of no known type": (conversation(USER, thinking={"type": "on"}), "thinking.type: ",
                                  "'enabled', 'disabled', 'adaptive', 'between_tools'"),
    "thinking display": (conversation(USER, thinking={"type": "adaptive", "display": "full"}),
                         "thinking.display: ", "'summarized' or 'omitted'"),
    "thinking as a string": (conversation(USER, thinking="on"), "thinking: ", "dictionary"),
    "thinking block in a user message": (
        conversation({"role": "user", "content": [{"type": "thinking", "thinking": "hm", "signature": "s"},
                                                  {"type": "text", "text": "Hi"}]}),
        "messages.0.content.0: ", "thinking blocks belong in assistant messages"),
    "redacted_thinking block in a user message": (
        conversation({"role": "user", "content": [{"type": "text", "text": "Hi"},
                                                  {"type": "redacted_thinking", "data": "xyz"}]}),
        "messages.0.content.1: ", "thinking blocks belong in assistant messages"),
    # blocks tierlm does not model: named, not pydantic's "does not match any of the expected tags"
    "container_upload in a user message": (
        conversation({"role": "user", "content": [{"type": "text", "text": "Hi"},
                                                  {"type": "container_upload", "file_id": "file_1"}]}),
        "messages.0.content.1: ", "content blocks of type 'container_upload' are not supported by tierlm"),
    "server tool blocks in an assistant turn": (
        conversation(USER, {"role": "assistant", "content": [
            {"type": "server_tool_use", "id": "srvtoolu_1", "name": "web_search", "input": {"query": "x"}},
            {"type": "web_search_tool_result", "tool_use_id": "srvtoolu_1", "content": []}]}, USER),
        "messages.1.content.0: ", "content blocks of type 'server_tool_use' are not supported by tierlm"),
    "web_search_tool_result in an assistant turn": (
        conversation(USER, {"role": "assistant", "content": [
            {"type": "web_search_tool_result", "tool_use_id": "srvtoolu_1", "content": []}]}, USER),
        "messages.1.content.0: ", "tierlm runs no server tools"),
    "tool_reference in a tool_result": (
        conversation(USER, use(), {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1",
                                                                 "content": [{"type": "tool_reference",
                                                                              "tool_name": "x"}]}]},
                     tools=[WEATHER_TOOL]),
        "messages.2.content.0.content.0: ", "content blocks of type 'tool_reference' are not supported by tierlm"),
    "a PDF document": (
        conversation({"role": "user", "content": [{"type": "document", "source": {
            "type": "base64", "media_type": "application/pdf", "data": "JVBERi0="}}, {"type": "text", "text": "Hi"}]}),
        "messages.0.content.0: ", "text-only"),
    "a PDF document in a tool_result": (
        conversation(USER, use(), {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1",
                                                                 "content": [{"type": "document", "source": {
                                                                     "type": "url", "url": "https://x/a.pdf"}}]}]},
                     tools=[WEATHER_TOOL]),
        "messages.2.content.0: ", "text-only"),
    "a search result in an assistant turn": (
        conversation(USER, {"role": "assistant", "content": [{"type": "search_result", "source": "s", "title": "t",
                                                              "content": [{"type": "text", "text": "x"}]}]}, USER),
        "messages.1.content.0: ", "search_result blocks belong in user messages"),
    # refused by /v1/messages, and so by count_tokens
    "a schema that cannot be followed": (
        conversation(USER, output_config={"format": {"type": "json_schema", "schema": {"type": "objec"}}}),
        "output_config.format: ", "this json cannot be followed: Invalid type: objec"),
    "a format given twice": (
        conversation(USER, output_format={"type": "json_schema", "schema": {}},
                     output_config={"format": {"type": "json_schema", "schema": {}}}),
        "output_format: ", "give the format once"),
    "container": (conversation(USER, container="container_011CZ"), "container: ", "no container"),
}


# Accepted, as Anthropic's API accepts them (a false-refusal hunt's cases): a blank block beside
# text, a blank assistant answer sent back (tierlm's own can be one: refusing it wedged the
# conversation), a blank tool result, no MCP servers.
ACCEPTED = {
    "blank block beside text": conversation({"role": "user", "content": [{"type": "text", "text": "Summarise:"},
                                                                         {"type": "text", "text": "\n"}]}),
    "blank assistant answer sent back": conversation(USER, {"role": "assistant", "content": [{"type": "text",
                                                                                            "text": " "}]}, USER),
    "blank system block beside text": conversation(USER, system=[{"type": "text", "text": "Be brief."},
                                                                 {"type": "text", "text": " "}]),
    "blank tool result": conversation(USER, use(), {"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "toolu_1", "content": [{"type": "text", "text": "sunny"},
                                                                      {"type": "text", "text": "\n"}]}]},
        tools=[WEATHER_TOOL]),
    "no MCP servers": conversation(USER, mcp_servers=[]),
    # An agent's loop: parallel calls answered together, text after the results, then new calls.
    "parallel calls, results then text": conversation(
        USER,
        {"role": "assistant", "content": [*use("toolu_1")["content"], *use("toolu_2")["content"]]},
        {"role": "user", "content": [*result("toolu_2")["content"], *result("toolu_1")["content"],
                                     {"type": "text", "text": "And?"}]},
        use("toolu_3"), result("toolu_3"),
        tools=[WEATHER_TOOL]),
}


@pytest.mark.parametrize("name", ACCEPTED)
def test_accepted_as_anthropic_accepts(client, name):
    r = client.post("/v1/messages", json={**ACCEPTED[name], "max_tokens": 4})
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("name", REFUSED)
@pytest.mark.parametrize("path", ["/v1/messages", "/v1/messages/count_tokens"])
def test_refused_as_anthropic_refuses(client, requests_to, name, path):
    body, start, words = REFUSED[name]
    asked = requests_to(TEXT_MODEL)
    message = refused(client.post(path, json={**body, "max_tokens": 8} if path == "/v1/messages" else body))
    assert message.startswith(start) and words in message, message
    assert asked == []


@pytest.mark.parametrize("field, value, words", [
    ("stop_sequences", ["\n\n"], "each stop sequence must contain non-whitespace"),
    ("stop_sequences", ["END", " "], "each stop sequence must contain non-whitespace"),
    ("container", {"skills": []}, "no container"),
])
def test_generation_fields_refused_as_anthropic_refuses(client, requests_to, field, value, words):
    asked = requests_to(TEXT_MODEL)
    message = refused(client.post("/v1/messages", json=conversation(USER, max_tokens=8, **{field: value})))
    assert message.startswith(f"{field}: ") and words in message, message
    assert asked == []


def test_stop_sequences_around_text_still_work(client):
    r = client.post("/v1/messages", json=conversation(USER, max_tokens=8, stop_sequences=["\n\nHuman:", " END"]))
    assert r.status_code == 200, r.text


def test_sdk_round_trip_with_text_after_the_results(scripted_server):
    """The order Anthropic documents: results first, then the user's text, in one message."""
    claude = sdk_clients(scripted_server.url)[0]
    messages = [*ROUND_TRIP[:2], {"role": "user", "content": [
        *ROUND_TRIP[2]["content"], {"type": "text", "text": "And tomorrow?"}]}]
    msg = claude.messages.create(model=TOOLS_MODEL, max_tokens=64, messages=messages, tools=[WEATHER_TOOL])
    assert msg.stop_reason == "tool_use"
    with pytest.raises(anthropic.BadRequestError) as info:  # the call left unanswered
        claude.messages.create(model=TOOLS_MODEL, max_tokens=64, tools=[WEATHER_TOOL],
                               messages=[*ROUND_TRIP[:2], {"role": "user", "content": "And tomorrow?"}])
    assert "without `tool_result` blocks" in info.value.body["error"]["message"]


# ---- thinking ------------------------------------------------------------------------------

# Qwen3's switch: with enable_thinking false the generation prompt holds an empty think block
THINK_TEMPLATE = (CHAT_TEMPLATE + "{% if add_generation_prompt and enable_thinking is false %}"
                  "<think>\n\n</think>\n\n{% endif %}")
THINK_MODEL = "scripted-think"


@pytest.fixture(scope="module")
def thinking_model(scripted_models, tmp_path_factory):
    """A scripted checkpoint whose template switches think mode, with a context that holds
    max_tokens above Anthropic's smallest thinking budget (1,024)."""
    engine, claude, server = serve_with_template(scripted_models[TEXT_MODEL].path, tmp_path_factory.mktemp("think"),
                                                 THINK_MODEL, THINK_TEMPLATE, positions=2048, max_model_len=2048)
    yield engine, claude
    server.stop()


@pytest.mark.parametrize("thinking, think_block", [
    (None, False),
    ({"type": "disabled"}, True),
    ({"type": "enabled", "budget_tokens": 1024, "display": "omitted"}, False),
    ({"type": "adaptive"}, False),
    ({"type": "between_tools"}, False),
])
def test_thinking_sets_the_templates_enable_thinking(thinking_model, monkeypatch, thinking, think_block):
    """`thinking` was ignored: a Qwen3-style model thought (or not) whatever the client asked."""
    engine, claude = thinking_model
    asked = record_requests(engine, monkeypatch)
    fields = {} if thinking is None else {"thinking": thinking}
    counted = claude.messages.count_tokens(model=THINK_MODEL, messages=[USER], **fields)
    msg = claude.messages.create(model=THINK_MODEL, max_tokens=1100, messages=[USER], **fields)
    prompt = engine.tokenizer.decode(asked[-1].prompt_token_ids)
    assert prompt.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n") == think_block
    assert counted.input_tokens == msg.usage.input_tokens + msg.usage.cache_read_input_tokens
    assert all(block.type == "text" for block in msg.content)  # (the scripted reply has no think block)


@pytest.mark.parametrize("fields, think_block", [
    ({"chat_template_kwargs": {"enable_thinking": False}}, True),
    ({"thinking": {"type": "adaptive"}, "chat_template_kwargs": {"enable_thinking": False}}, True),  # explicit wins
    ({"thinking": {"type": "disabled"}, "chat_template_kwargs": {}}, True),
])
def test_chat_template_kwargs_reach_the_template_as_on_vllms_anthropic_route(thinking_model, monkeypatch, fields,
                                                                              think_block):
    """vLLM's Anthropic route passes chat_template_kwargs to the template; here they were
    ignored, so a client written for it left Qwen3's thinking on without a word."""
    engine, claude = thinking_model
    asked = record_requests(engine, monkeypatch)
    counted = claude.messages.count_tokens(model=THINK_MODEL, messages=[USER], extra_body=fields)
    msg = claude.messages.create(model=THINK_MODEL, max_tokens=8, messages=[USER], extra_body=fields)
    prompt = engine.tokenizer.decode(asked[-1].prompt_token_ids)
    assert prompt.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n") == think_block
    assert counted.input_tokens == msg.usage.input_tokens + msg.usage.cache_read_input_tokens


@pytest.mark.parametrize("kwargs, refusal", [
    ({"tools": [1]}, "chat_template_kwargs: tools cannot be set here"),
    ({"messages": []}, "chat_template_kwargs: messages cannot be set here"),
    ({"chat_template": "x"}, "chat_template_kwargs: chat_template cannot be set here"),
    ({"add_generation_prompt": False}, "chat_template_kwargs: add_generation_prompt false contradicts the messages"),
    ({"continue_final_message": True}, "chat_template_kwargs: continue_final_message true contradicts the messages"),
    ({"add_generation_prompt": True, "documents": [{"text": "x"}], "return_dict": False}, None),  # as the OpenAI route
])
def test_chat_template_kwargs_cannot_set_what_the_request_decides(client, kwargs, refusal):
    body = conversation(USER, max_tokens=8, chat_template_kwargs=kwargs)
    for path in ("/v1/messages", "/v1/messages/count_tokens"):
        r = client.post(path, json=body if path.endswith("messages") else
                        {k: v for k, v in body.items() if k != "max_tokens"})
        if refusal is None:
            assert r.status_code == 200, r.text
        else:
            assert refused(r).startswith(refusal), r.text


# Qwen3's use of reasoning_content in small: an assistant turn's reasoning, inside think tags
REASONING_TEMPLATE = (
    "{%- for m in messages %}{{- '<|im_start|>' + m.role + '\n' }}"
    "{%- if m.reasoning_content is defined and m.reasoning_content is string %}"
    "{{- '<think>\n' + m.reasoning_content + '\n</think>\n\n' }}{%- endif %}"
    "{{- (m.content if m.content is string else '') + '<|im_end|>\n' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}{%- endif %}"
)


def test_thinking_blocks_in_history_reach_the_template_as_reasoning_content(scripted_models, tmp_path, monkeypatch):
    """They were dropped, so Qwen3's template (which writes an assistant turn's reasoning back
    in a tool loop) rendered a different prompt than vLLM's, which maps them as here."""
    engine, claude, server = serve_with_template(scripted_models[TEXT_MODEL].path, tmp_path, "reasoning",
                                                 REASONING_TEMPLATE)
    try:
        asked = record_requests(engine, monkeypatch)
        turn = [{"type": "thinking", "thinking": "Check the sky first.", "signature": "sig"},
                {"type": "redacted_thinking", "data": "opaque"},
                {"type": "text", "text": "It is blue."}]
        messages = [USER, {"role": "assistant", "content": turn}, {"role": "user", "content": "Why?"}]
        counted = claude.messages.count_tokens(model="reasoning", messages=messages)
        msg = claude.messages.create(model="reasoning", max_tokens=4, messages=messages)
        prompt = engine.tokenizer.decode(asked[-1].prompt_token_ids)
        assert "<|im_start|>assistant\n<think>\nCheck the sky first.\n</think>\n\nIt is blue.<|im_end|>" in prompt, prompt
        assert "opaque" not in prompt and "sig" not in prompt
        assert counted.input_tokens == msg.usage.input_tokens + msg.usage.cache_read_input_tokens
    finally:
        server.stop()


def test_interleaved_thinking_is_read_from_every_beta_header_line(thinking_model):
    """HTTP joins repeated header lines; only the first anthropic-beta line was read."""
    _, claude = thinking_model
    body = conversation(USER, max_tokens=8, thinking={"type": "enabled", "budget_tokens": 2000}, model=THINK_MODEL)
    headers = [("x-api-key", API_KEY), ("anthropic-beta", "claude-code-20250219"),
               ("anthropic-beta", "interleaved-thinking-2025-05-14")]
    r = httpx.post(f"{str(claude.base_url).rstrip('/')}/v1/messages", json=body, headers=headers, timeout=30)
    assert r.status_code == 200, r.text


def test_interleaved_thinking_lets_the_budget_pass_max_tokens(thinking_model):
    """With Anthropic's interleaved-thinking beta (Claude Code sends it) the budget covers the
    whole turn and may exceed max_tokens; such requests were refused."""
    _, claude = thinking_model
    thinking = {"type": "enabled", "budget_tokens": 2000}
    msg = claude.beta.messages.create(model=THINK_MODEL, max_tokens=8, messages=[USER], thinking=thinking,
                                      betas=["interleaved-thinking-2025-05-14"])
    assert msg.type == "message"
    with pytest.raises(anthropic.BadRequestError, match="less than max_tokens"):
        claude.messages.create(model=THINK_MODEL, max_tokens=8, messages=[USER], thinking=thinking)


def test_thinking_budget_below_max_tokens(thinking_model):
    """Anthropic's rule, on /v1/messages only: count_tokens has no max_tokens to compare with."""
    _, claude = thinking_model
    thinking = {"type": "enabled", "budget_tokens": 1024}
    with pytest.raises(anthropic.BadRequestError) as info:
        claude.messages.create(model=THINK_MODEL, max_tokens=1024, messages=[USER], thinking=thinking)
    error = info.value.body["error"]
    assert error["message"].startswith("thinking.budget_tokens: must be ≥1024 and less than max_tokens"), error
    assert claude.messages.count_tokens(model=THINK_MODEL, messages=[USER], thinking=thinking).input_tokens > 0


# ---- max_tokens 0: pre-warming the cache ---------------------------------------------------


def test_max_tokens_0_warms_the_cache(scripted_server):
    """The SDK documents max_tokens 0 as "populate the prompt cache without generating a
    response"; tierlm refused it (max_tokens must be >= 1)."""
    claude = sdk_clients(scripted_server.url)[0]
    messages = [{"role": "user", "content": f"{uuid.uuid4().hex} Read this: " + "lorem ipsum " * 20}]
    warm = claude.messages.create(model=TEXT_MODEL, max_tokens=0, messages=messages)
    assert warm.content == [] and warm.stop_reason == "max_tokens" and warm.stop_sequence is None
    assert warm.usage.output_tokens == 0 and warm.usage.cache_read_input_tokens == 0
    assert warm.usage.input_tokens == claude.messages.count_tokens(model=TEXT_MODEL, messages=messages).input_tokens
    msg = claude.messages.create(model=TEXT_MODEL, max_tokens=64, messages=messages)
    assert msg.usage.cache_read_input_tokens > 0 and msg.content[0].text == REPLY


def test_max_tokens_0_streams_no_content(client):
    messages = [{"role": "user", "content": f"{uuid.uuid4().hex} Read this: " + "lorem ipsum " * 20}]
    r = client.post("/v1/messages", json=conversation(*messages, max_tokens=0, stream=True, stop_sequences=["alpha"]))
    assert r.status_code == 200, r.text
    frames = parse_sse(r.text)
    assert [e for e, _ in frames] == ["message_start", "message_delta", "message_stop"]
    assert frames[1][1]["delta"] == {"stop_reason": "max_tokens", "stop_sequence": None}
    assert frames[1][1]["usage"]["output_tokens"] == 0
    warmed = client.post("/v1/messages", json=conversation(*messages, max_tokens=8)).json()
    assert warmed["usage"]["cache_read_input_tokens"] > 0
    assert "max_tokens: " in refused(client.post("/v1/messages", json=conversation(USER, max_tokens=-1)))


def _prompt_of_length(claude, n: int) -> list[dict]:
    """Messages whose prompt is exactly `n` tokens (count_tokens decides; one word a token or more)."""
    words = n
    while words > 0:
        messages = [{"role": "user", "content": f"{uuid.uuid4().hex} " + "a " * words}]
        got = claude.messages.count_tokens(model=TEXT_MODEL, messages=messages).input_tokens
        if got == n:
            return messages
        words -= max(1, (got - n) // 2) if got > n else -1
    raise AssertionError(f"no prompt of exactly {n} tokens found")


def test_a_warm_counts_no_output_and_takes_a_prompt_as_long_as_the_context(scripted_server, scripted_engines):
    """A warm's one engine token was counted in /metrics as output (the client was told 0), and
    a prompt filling the context was refused as "512 + 0 > 512", which Anthropic's rule
    (input + max_tokens <= context) accepts."""
    from tests.serving.test_telemetry import value

    claude = sdk_clients(scripted_server.url)[0]
    context = scripted_engines[TEXT_MODEL].max_model_len
    messages = _prompt_of_length(claude, context)
    labels = {"model": TEXT_MODEL, "tenant": "default"}
    before = httpx.get(f"{scripted_server.url}/metrics").text
    warm = claude.messages.create(model=TEXT_MODEL, max_tokens=0, messages=messages)
    assert warm.content == [] and warm.usage.output_tokens == 0
    assert warm.usage.input_tokens + warm.usage.cache_read_input_tokens == context
    after = httpx.get(f"{scripted_server.url}/metrics").text
    for name, grew in (("tierlm:generation_tokens_total", 0), ("tierlm:prompt_tokens_total", context),
                       ("tierlm:request_generation_tokens_sum", 0), ("tierlm:request_prompt_tokens_sum", context),
                       ("tierlm:time_to_first_token_seconds_count", 0)):
        assert value(after, name, **labels) - value(before, name, **labels) == grew, name
    # a warm whose dropped token would have matched a stop sequence still ended at its length
    before = httpx.get(f"{scripted_server.url}/metrics").text
    claude.messages.create(model=TEXT_MODEL, max_tokens=0, messages=messages, stop_sequences=["alpha"])
    after = httpx.get(f"{scripted_server.url}/metrics").text
    for reason, grew in (("length", 1), ("stop", 0)):
        name, lbl = "tierlm:request_success_total", {**labels, "finished_reason": reason}
        assert value(after, name, **lbl) - value(before, name, **lbl) == grew, reason
    again = claude.messages.create(model=TEXT_MODEL, max_tokens=0, messages=messages)  # the blocks were cached
    assert again.usage.cache_read_input_tokens > 0
    assert again.usage.input_tokens + again.usage.cache_read_input_tokens == context
    with pytest.raises(anthropic.BadRequestError, match="exceed context limit"):
        claude.messages.create(model=TEXT_MODEL, max_tokens=1, messages=messages)


def test_an_unknown_model_is_named_before_the_thinking_budget(client):
    """The budget's rule was checked first: the client fixed it, then learned the model was wrong."""
    body = conversation(USER, max_tokens=10, thinking={"type": "enabled", "budget_tokens": 1024})
    r = client.post("/v1/messages", json={**body, "model": "no-such-model"})
    assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error", r.text
    assert "thinking.budget_tokens: " in refused(client.post("/v1/messages", json=body))


# ---- strict tools --------------------------------------------------------------------------


def test_strict_tools_are_accepted_on_both_routes(client):
    """Accepted, changing nothing (README); a strict that is not a boolean is refused."""
    tool = {**WEATHER_TOOL, "strict": True}
    r = client.post("/v1/messages", json=conversation(USER, max_tokens=64, tools=[tool]))
    assert r.status_code == 200 and r.json()["stop_reason"] == "end_turn", r.text
    function = {"name": "get_weather", "parameters": {"type": "object"}, "strict": True}
    r = client.post("/v1/chat/completions", headers={"authorization": f"Bearer {API_KEY}"}, json={
        "model": TEXT_MODEL, "max_tokens": 64, "messages": [USER],
        "tools": [{"type": "function", "function": function}]})
    assert r.status_code == 200, r.text
    not_bool = {**tool, "strict": "yes"}
    message = refused(client.post("/v1/messages", json=conversation(USER, max_tokens=8, tools=[not_bool])))
    assert message.startswith("tools.0.strict: "), message


# ---- how a chat template is told about tools ---------------------------------------------

# SmolLM3's layout in small: it reads the tools as `xml_tools` and names <tools> in its text.
XML_TOOLS_TEMPLATE = (
    "{%- if xml_tools %}{{- 'Tools within <tools></tools> XML tags:\\n<tools>\\n' }}"
    "{%- for tool in xml_tools[:] %}{{- tool | string }}{{- '\\n' }}{%- endfor %}{{- '</tools>\\n' }}{%- endif %}"
    "{%- for m in messages %}{{- '<|' + m.role + '|>' + (m.content if m.content is string else '') + '\\n' }}"
    "{%- endfor %}{%- if add_generation_prompt %}{{- '<|assistant|>' }}{%- endif %}"
)
# Says "tools" and reads none.
WORD_ONLY_TEMPLATE = (
    "{{- 'You have no tools.\\n' }}{%- for m in messages %}{{- '<|' + m.role + '|>' + m.content + '\\n' }}"
    "{%- endfor %}{%- if add_generation_prompt %}{{- '<|assistant|>' }}{%- endif %}"
)


@pytest.fixture(scope="module")
def tool_templates(scripted_models, tmp_path_factory):
    out = tmp_path_factory.mktemp("tool-templates")
    served = {name: serve_with_template(scripted_models[TEXT_MODEL].path, out, name, template)
              for name, template in (("xml-tools", XML_TOOLS_TEMPLATE), ("word-only", WORD_ONLY_TEMPLATE))}
    yield served
    for _, _, server in served.values():
        server.stop()


def test_a_template_that_reads_xml_tools_is_told_about_the_tools(tool_templates, monkeypatch):
    """SmolLM3's template reads `xml_tools`; tools passed as `tools` were accepted, parsed for
    calls, and never shown to the model (its template names "<tools>", which passed the check)."""
    engine, claude, server = tool_templates["xml-tools"]
    asked = record_requests(engine, monkeypatch)
    hi = [{"role": "user", "content": "Hi"}]
    bare = claude.messages.count_tokens(model="xml-tools", messages=hi).input_tokens
    counted = claude.messages.count_tokens(model="xml-tools", messages=hi, tools=[WEATHER_TOOL]).input_tokens
    msg = claude.messages.create(model="xml-tools", max_tokens=2, messages=hi, tools=[WEATHER_TOOL])
    prompt = engine.tokenizer.decode(asked[-1].prompt_token_ids)
    # the function alone, as SmolLM3's model card passes xml_tools (its template prints each as it comes)
    assert "<tools>\n{'name': 'get_weather'" in prompt and "'type': 'function'" not in prompt, prompt
    assert counted > bare and counted == msg.usage.input_tokens + msg.usage.cache_read_input_tokens
    r = httpx.post(f"{server.url}/v1/chat/completions", headers={"authorization": f"Bearer {API_KEY}"}, json={
        "model": "xml-tools", "max_tokens": 2, "messages": hi,
        "tools": [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]})
    assert r.status_code == 200, r.text
    assert "get_weather" in engine.tokenizer.decode(asked[-1].prompt_token_ids)


def test_a_template_that_only_says_tools_refuses_them(tool_templates):
    _, claude, _ = tool_templates["word-only"]
    hi = [{"role": "user", "content": "Hi"}]
    with pytest.raises(anthropic.BadRequestError, match="does not support tools"):
        claude.messages.create(model="word-only", max_tokens=2, messages=hi, tools=[WEATHER_TOOL])
    assert claude.messages.create(model="word-only", max_tokens=2, messages=hi).type == "message"


def test_tools_variable_probes_named_templates_and_templates_that_need_a_system_message(scripted_engines):
    """Hermes ships `default` and `tool_use` templates (a dict once loaded): tools were refused
    as unsupported. A template that refuses a lone user message was taken to read `tools`."""
    from tierlm.serving.tools import tools_variable

    tokenizer = copy.deepcopy(scripted_engines[TEXT_MODEL].tokenizer)
    tool_use = ("{%- if tools %}{{- '<tools>' + tools | tojson + '</tools>' }}{%- endif %}"
                "{%- for m in messages %}{{- m.role + ': ' + m.content + '\\n' }}{%- endfor %}")
    tokenizer.chat_template = {"default": "{%- for m in messages %}{{- m.content }}{%- endfor %}", "tool_use": tool_use}
    assert tools_variable(tokenizer) == "tools"
    needs_system = ("{%- if messages[0].role != 'system' %}{{- raise_exception('a system message first') }}{%- endif %}"
                    + XML_TOOLS_TEMPLATE)
    tokenizer.chat_template = needs_system
    assert tools_variable(tokenizer) == "xml_tools"
    tokenizer.chat_template = WORD_ONLY_TEMPLATE
    assert tools_variable(tokenizer) is None
    beside_system = ("{%- if messages[0].role == 'system' and tools %}{{- tools | tojson }}{%- endif %}"
                     "{%- for m in messages %}{{- m.content }}{%- endfor %}")
    tokenizer.chat_template = beside_system  # tools shown only beside a system prompt: accepted, they
    assert tools_variable(tokenizer) is None  # were dropped from requests without one (refused instead)
