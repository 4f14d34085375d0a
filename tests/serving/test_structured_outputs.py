"""Structured outputs through both APIs and the official SDKs, on the demo model (random
weights: whatever it writes, the answer must follow the schema, regex or choice): OpenAI's
response_format (json_schema, json_object), vLLM's guided_json / guided_regex / guided_choice /
structured_outputs, Anthropic's output_config.format (and the beta's output_format)."""
from __future__ import annotations

import json
import re

import anthropic
import httpx
import openai
import pytest

from tests.serving.harness import API_KEY, sdk_clients

USER = [{"role": "user", "content": "Describe a city."}]
SCHEMA = {"type": "object", "additionalProperties": False, "required": ["city", "big"],
          "properties": {"city": {"type": "string", "maxLength": 8}, "big": {"type": "boolean"}}}


def follows(text: str) -> bool:
    value = json.loads(text)
    return (set(value) == {"city", "big"} and isinstance(value["city"], str) and len(value["city"]) <= 8
            and isinstance(value["big"], bool))


@pytest.fixture(scope="module")
def model(demo_engine) -> str:
    return demo_engine.model_name


@pytest.fixture(scope="module")
def clients(demo_server):
    return sdk_clients(demo_server.url)


def post(demo_server, path: str, body: dict) -> httpx.Response:
    return httpx.post(demo_server.url + path, json=body, headers={"authorization": f"Bearer {API_KEY}"}, timeout=60)


def test_openai_response_format_json_schema_streamed_and_not(clients, model):
    _, oai = clients
    fmt = {"type": "json_schema", "json_schema": {"name": "city", "schema": SCHEMA, "strict": True}}
    for seed in range(4):
        done = oai.chat.completions.create(model=model, messages=USER, max_tokens=60, seed=seed, temperature=1.0,
                                           response_format=fmt)
        assert done.choices[0].finish_reason == "stop" and follows(done.choices[0].message.content)
        chunks = oai.chat.completions.create(model=model, messages=USER, max_tokens=60, seed=seed, temperature=1.0,
                                             response_format=fmt, stream=True)
        assert "".join(c.choices[0].delta.content or "" for c in chunks) == done.choices[0].message.content
    parsed = oai.chat.completions.parse(model=model, messages=USER, max_tokens=60, response_format=fmt)
    assert follows(parsed.choices[0].message.content)


def test_openai_json_object_and_vllms_fields(clients, model, demo_server):
    _, oai = clients
    obj = oai.chat.completions.create(model=model, messages=USER, max_tokens=40, seed=3,
                                      response_format={"type": "json_object"})
    text = obj.choices[0].message.content
    assert isinstance(json.loads(text), dict) if obj.choices[0].finish_reason == "stop" else text.startswith("{")
    for field, value, check in [
        ("guided_choice", ["north", "south"], lambda t: t in ("north", "south")),
        ("guided_regex", "[0-9]{2}-[a-z]{2}", lambda t: re.fullmatch("[0-9]{2}-[a-z]{2}", t)),
        ("guided_json", SCHEMA, follows),
        ("structured_outputs", {"choice": ["up", "down"]}, lambda t: t in ("up", "down")),
        ("response_format", {"type": "json_schema", "json_schema": {"name": "c", "schema": SCHEMA}}, follows),
    ]:
        chat = oai.chat.completions.create(model=model, messages=USER, max_tokens=60, extra_body={field: value})
        assert check(chat.choices[0].message.content), (field, chat.choices[0].message.content)
        done = post(demo_server, "/v1/completions", {"model": model, "prompt": "Go", "max_tokens": 60, field: value})
        assert done.status_code == 200 and check(done.json()["choices"][0]["text"]), (field, done.text)


@pytest.mark.parametrize("body, param, says", [
    ({"guided_regex": "[0-9]", "guided_choice": ["a"]}, "guided_choice", "ask for one structured output, not 2"),
    ({"response_format": {"type": "json_object"}, "guided_regex": "x"}, "guided_regex",
     "response_format and guided_regex"),
    ({"guided_regex": "(a"}, "guided_regex", "this regex cannot be followed"),
    ({"guided_json": {"type": "objec"}}, "guided_json", "this json cannot be followed: Invalid type: objec"),
    ({"guided_choice": []}, "guided_choice", "choice must be a non-empty list"),
    ({"structured_outputs": {"grammar": "root ::= 'a'"}}, "structured_outputs.grammar", "use json, regex or choice"),
    ({"structured_outputs": {"regex": "a", "whitespace": 1}}, "structured_outputs.whitespace", "unknown field"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objec"}}}},
     "response_format", "this json cannot be followed"),
    ({"response_format": {"type": "json_object"}, "tools": [{"type": "function", "function": {"name": "f"}}],
      "tool_choice": "required"}, "tool_choice", "cannot follow a structured output as well"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"const": 2 ** 53 + 1}}}},
     "response_format", "const: 9007199254740993 is past +-2**53"),  # (was written as 2**53)
])
def test_openai_structured_outputs_that_cannot_run_are_400s_naming_the_field(demo_server, model, body, param, says):
    r = post(demo_server, "/v1/chat/completions", {"model": model, "messages": USER, "max_tokens": 4, **body})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and says in error["message"], error


def test_anthropic_output_config_format(clients, model):
    claude, _ = clients
    fmt = {"type": "json_schema", "schema": SCHEMA}
    done = claude.messages.create(model=model, max_tokens=60, messages=USER, output_config={"format": fmt})
    assert done.stop_reason == "end_turn" and [b.type for b in done.content] == ["text"]
    assert follows(done.content[0].text)
    with claude.messages.stream(model=model, max_tokens=60, messages=USER, output_config={"format": fmt}) as stream:
        assert follows(stream.get_final_message().content[0].text)
    beta = claude.messages.create(model=model, max_tokens=60, messages=USER, extra_body={"output_format": fmt})
    assert follows(beta.content[0].text)
    plain = claude.messages.count_tokens(model=model, messages=USER).input_tokens
    assert claude.messages.count_tokens(model=model, messages=USER, output_config={"format": fmt}).input_tokens == plain
    with pytest.raises(anthropic.BadRequestError, match="output_config.format: this json cannot be followed"):
        claude.messages.count_tokens(model=model, messages=USER,
                                     output_config={"format": {"type": "json_schema", "schema": {"type": "objec"}}})
    tool = {"name": "f", "input_schema": {"type": "object"}}
    with pytest.raises(anthropic.BadRequestError, match="tool_choice: a required tool call cannot follow"):
        claude.messages.create(model=model, max_tokens=8, messages=USER, output_config={"format": fmt},
                               tools=[tool], tool_choice={"type": "any"})


def test_a_grammar_llguidance_gives_up_on_mid_answer_is_an_error_not_free_text(clients, model, demo_server):
    """(a{1000}){1000} passes every check up front and is past llguidance's limits after a token:
    the rest of the answer came back unconstrained, with 200."""
    _, oai = clients
    with pytest.raises(openai.BadRequestError, match=r"could not be followed past \d+ tokens.*simplify the schema"):
        oai.chat.completions.create(model=model, messages=USER, max_tokens=8, temperature=0,
                                    extra_body={"guided_regex": "(a{1000}){1000}"})
    r = post(demo_server, "/v1/chat/completions", {"model": model, "messages": USER, "max_tokens": 8, "stream": True,
                                                   "temperature": 0, "guided_regex": "(a{1000}){1000}"})
    if r.status_code == 400:  # (it failed at the first token: before the stream began)
        assert "could not be followed past" in r.json()["error"]["message"]
        return
    frames = [line for line in r.text.splitlines() if line.startswith("data: ")]
    assert r.status_code == 200 and "could not be followed past" in frames[-2] and frames[-1] == "data: [DONE]"
    said = "".join(json.loads(f[6:])["choices"][0]["delta"].get("content") or "" for f in frames[:-2]
                   if json.loads(f[6:]).get("choices"))
    assert set(said) <= {"a"}  # what came before the error kept to the grammar


def test_a_structured_answer_is_never_read_as_a_tool_call(openai_client):
    """With tools on auto beside a structured output, an answer that is a call's markup (here the
    grammar is the call itself) came back as a tool call instead of the structured content."""
    from tests.serving.scripted_model import CALL, CALL_MODEL

    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    body = {"model": CALL_MODEL, "messages": USER, "max_tokens": 64, "tools": tools}
    free = openai_client.post("/v1/chat/completions", json=body).json()["choices"][0]
    assert free["finish_reason"] == "tool_calls"  # (the scripted model's own answer is this call)
    held = openai_client.post("/v1/chat/completions", json={**body, "guided_regex": re.escape(CALL)})
    choice = held.json()["choices"][0]
    assert (choice["message"]["content"], choice["message"]["tool_calls"], choice["finish_reason"]) == (
        CALL, None, "stop"), held.text
