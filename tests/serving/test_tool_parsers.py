"""Tool calls in the llama3_json and mistral syntaxes, end to end through the official SDKs.

Two scripted checkpoints (see scripted_model.py) with chat templates of the Llama 3.1 and
Mistral shape, whose tokenizer has `<|python_tag|>`, `[TOOL_CALLS]` and `[ARGS]` as special
tokens (as the real ones do), and which write their calls as those models do. The server
detects each syntax from the template (`--tool-call-parser auto`).
"""
from __future__ import annotations

import json

import pytest

from tests.serving.harness import API_KEY, ServerThread, sdk_clients
from tests.serving.scripted_model import Script, build_scripted_model, build_templated_models, chat_prompt_ids
from tests.serving.test_anthropic_fidelity import MISTRAL_TEMPLATE
from tierlm.serving.app import build_app
from tierlm.serving.auth import ApiKeyAuth

SPECIALS = ("<|python_tag|>", "[TOOL_CALLS]", "[ARGS]")
# The layout of Llama 3.1's template, cut down: tools in an ipython system turn, past calls
# after <|python_tag|>.
LLAMA_TEMPLATE = (
    "{%- if tools %}<|start_header_id|>system<|end_header_id|>\n\nEnvironment: ipython\n"
    "{{ tools|tojson }}<|eot_id|>{%- endif %}"
    "{%- for message in messages %}<|start_header_id|>{{ message.role }}<|end_header_id|>\n\n"
    "{%- if message.tool_calls %}<|python_tag|>{{ message.tool_calls[0].function|tojson }}"
    "{%- else %}{{ message.content }}{%- endif %}<|eot_id|>{%- endfor %}"
    "{%- if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{%- endif %}"
)
LLAMA_MODEL, MISTRAL_MODEL = "scripted-llama3", "scripted-mistral-calls"
# Writes "[ARGS]" in ordinary tokens (prose quoting a usage line), then a call after the special
# [TOOL_CALLS] token.
PROSE_MODEL = "scripted-mistral-prose"
LLAMA_REPLY = ('<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}; '
               '{"name": "get_time", "parameters": {"zone": "CET"}}')
MISTRAL_PROSE = "Let me check."
MISTRAL_REPLY = MISTRAL_PROSE + '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}]'
USAGE = "Usage: app [ARGS], see docs."
USAGE_CALL = '[{"name": "get_weather", "arguments": {"city": "Oslo"}}]'

USER = [{"role": "user", "content": "Hi there"}]


def claude_tool(name: str) -> dict:
    return {"name": name, "description": "a tool", "input_schema": {"type": "object"}}


def openai_tool(name: str) -> dict:
    return {"type": "function", "function": {"name": name, "description": "a tool", "parameters": {"type": "object"}}}


@pytest.fixture(scope="module")
def server(demo_tokenizer, tmp_path_factory):
    models = build_templated_models(tmp_path_factory.mktemp("tool-parsers"), demo_tokenizer, [
        (LLAMA_MODEL, LLAMA_TEMPLATE, LLAMA_REPLY, SPECIALS), (MISTRAL_MODEL, MISTRAL_TEMPLATE, MISTRAL_REPLY, SPECIALS),
        (PROSE_MODEL, MISTRAL_TEMPLATE, USAGE + "[TOOL_CALLS]" + USAGE_CALL, ("[TOOL_CALLS]",)),
    ], added=SPECIALS)
    engines = {name: model.engine(name) for name, model in models.items()}
    server = ServerThread(build_app(engines, ApiKeyAuth.from_keys({"alice": API_KEY}))).start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def clients(server):
    return sdk_clients(server.url)


EXPECTED = {
    LLAMA_MODEL: ("", [("get_weather", {"city": "Paris"}), ("get_time", {"zone": "CET"})]),
    MISTRAL_MODEL: (MISTRAL_PROSE, [("get_weather", {"city": "Paris"})]),
}


@pytest.mark.parametrize("model", [LLAMA_MODEL, MISTRAL_MODEL])
def test_openai_tool_calls(clients, model):
    oai = clients[1]
    kwargs = dict(model=model, messages=USER, tools=[openai_tool("get_weather"), openai_tool("get_time")])
    created = oai.chat.completions.create(**kwargs).choices[0]
    with oai.chat.completions.stream(**kwargs) as stream:
        streamed = stream.get_final_completion().choices[0]
    prose, calls = EXPECTED[model]
    for choice in (created, streamed):
        assert choice.finish_reason == "tool_calls"
        assert (choice.message.content or "") == prose
        assert [(c.function.name, openai_json(c.function.arguments)) for c in choice.message.tool_calls] == calls
        assert all(c.id.startswith("call_") for c in choice.message.tool_calls)


def openai_json(text: str):
    return json.loads(text)


@pytest.mark.parametrize("model", [LLAMA_MODEL, MISTRAL_MODEL])
def test_anthropic_tool_use(clients, model):
    claude = clients[0]
    kwargs = dict(model=model, max_tokens=200, messages=USER, tools=[claude_tool("get_weather"), claude_tool("get_time")])
    created = claude.messages.create(**kwargs)
    with claude.messages.stream(**kwargs) as stream:
        streamed = stream.get_final_message()
    prose, calls = EXPECTED[model]
    for message in (created, streamed):
        assert message.stop_reason == "tool_use"
        assert [b.text for b in message.content if b.type == "text"] == ([prose] if prose else [])
        assert [(b.name, b.input) for b in message.content if b.type == "tool_use"] == calls


@pytest.mark.parametrize("model, text", [
    # only get_time offered: Llama's first call is to get_weather, so the whole answer is text
    (LLAMA_MODEL, LLAMA_REPLY.removeprefix("<|python_tag|>")),
    (MISTRAL_MODEL, MISTRAL_REPLY.replace("[TOOL_CALLS]", "")),
])
def test_a_call_not_offered_is_text_without_the_marker(clients, model, text):
    """The special marker token is kept only to find calls: text never shows it, as with
    skip_special_tokens it never did."""
    claude, oai = clients
    claude_kw = dict(model=model, max_tokens=200, messages=USER, tools=[claude_tool("get_time")])
    created = claude.messages.create(**claude_kw)
    with claude.messages.stream(**claude_kw) as stream:
        streamed = stream.get_final_message()
    for message in (created, streamed):
        assert [(b.type, b.text) for b in message.content] == [("text", text)]
        assert message.stop_reason == "end_turn"
    kwargs = dict(model=model, messages=USER, tools=[openai_tool("get_time")])
    created = oai.chat.completions.create(**kwargs).choices[0]
    with oai.chat.completions.stream(**kwargs) as stream:
        streamed = stream.get_final_completion().choices[0]
    for choice in (created, streamed):
        assert choice.message.content == text and not choice.message.tool_calls and choice.finish_reason == "stop"


@pytest.mark.parametrize("model", [LLAMA_MODEL, MISTRAL_MODEL])
def test_a_call_cut_by_max_tokens_is_text_with_length(clients, model):
    claude, oai = clients
    kwargs = dict(model=model, messages=USER, max_tokens=12, tools=[openai_tool("get_weather"), openai_tool("get_time")])
    created = oai.chat.completions.create(**kwargs).choices[0]
    chunks = [c.choices[0] for c in oai.chat.completions.create(stream=True, **kwargs) if c.choices]
    assert "".join(c.delta.content or "" for c in chunks) == created.message.content  # (the stream helper
    assert not any(c.delta.tool_calls for c in chunks) and chunks[-1].finish_reason == "length"  # raises on length)
    assert created.finish_reason == "length" and not created.message.tool_calls
    assert created.message.content and not any(m in created.message.content for m in SPECIALS)
    message = claude.messages.create(model=model, max_tokens=12, messages=USER,
                                     tools=[claude_tool("get_weather"), claude_tool("get_time")])
    assert message.stop_reason == "max_tokens" and [b.type for b in message.content] == ["text"]
    assert message.content[0].text == created.message.content


@pytest.mark.parametrize("model", [LLAMA_MODEL, MISTRAL_MODEL])
def test_without_tools_special_tokens_stay_skipped(clients, model):
    """No tools offered: nothing is parsed, and the marker is skipped as any special token."""
    choice = clients[1].chat.completions.create(model=model, messages=USER).choices[0]
    assert choice.message.content == EXPECTED_TEXT[model] and choice.finish_reason == "stop"


EXPECTED_TEXT = {LLAMA_MODEL: LLAMA_REPLY.removeprefix("<|python_tag|>"),
                 MISTRAL_MODEL: MISTRAL_REPLY.replace("[TOOL_CALLS]", "")}


@pytest.mark.parametrize("offered, content, calls", [
    ("get_weather", USAGE, [("get_weather", {"city": "Oslo"})]),
    ("get_time", USAGE + USAGE_CALL, []),  # not offered: text, less the special marker only
])
def test_marker_text_the_model_wrote_in_ordinary_tokens_stays(clients, offered, content, calls):
    """Only the special marker tokens kept to find calls are taken out of the text: "[ARGS]"
    written in ordinary tokens is the model's prose (it was cut out: "Usage: app , see docs.")."""
    claude, oai = clients
    kwargs = dict(model=PROSE_MODEL, messages=USER, tools=[openai_tool(offered)])
    created = oai.chat.completions.create(**kwargs).choices[0]
    with oai.chat.completions.stream(**kwargs) as stream:
        streamed = stream.get_final_completion().choices[0]
    for choice in (created, streamed):
        assert choice.message.content == content
        assert [(c.function.name, openai_json(c.function.arguments)) for c in choice.message.tool_calls or []] == calls
    claude_kw = dict(model=PROSE_MODEL, max_tokens=200, messages=USER, tools=[claude_tool(offered)])
    created = claude.messages.create(**claude_kw)
    with claude.messages.stream(**claude_kw) as stream:
        streamed = stream.get_final_message()
    for message in (created, streamed):
        assert [b.text for b in message.content if b.type == "text"] == [content]
        assert [(b.name, b.input) for b in message.content if b.type == "tool_use"] == calls


@pytest.mark.parametrize("model", [MISTRAL_MODEL, PROSE_MODEL])
def test_logprobs_cover_every_token_of_an_answer_with_kept_markers(clients, model):
    """The kept marker's text (wrapped for the parser, then taken out of the content) is placed
    like any token's: every generated token but the EOS has its logprob, streamed or not."""
    oai = clients[1]
    kwargs = dict(model=model, messages=USER, tools=[openai_tool("get_weather")], logprobs=True, top_logprobs=1)
    reply = MISTRAL_REPLY if model == MISTRAL_MODEL else USAGE + "[TOOL_CALLS]" + USAGE_CALL
    created = oai.chat.completions.create(**kwargs).choices[0]
    chunks = [c.choices[0] for c in oai.chat.completions.create(stream=True, **kwargs) if c.choices]
    streamed = [t for c in chunks if c.logprobs and c.logprobs.content for t in c.logprobs.content]
    for tokens in (created.logprobs.content, streamed):
        assert "".join(t.token for t in tokens) == reply
        assert b"".join(bytes(t.bytes) for t in tokens if t.token != "[TOOL_CALLS]") == reply.replace(
            "[TOOL_CALLS]", "").encode()
    assert [t.token for t in streamed] == [t.token for t in created.logprobs.content]


@pytest.mark.parametrize("stop, content, included", [
    # across the kept marker, as without tools (it is skipped there); included, the marker goes whole
    ("docs.[", "Usage: app [ARGS], see ", "Usage: app [ARGS], see docs."),
    ("[TOOL", "Usage: app [ARGS], see docs.", "Usage: app [ARGS], see docs."),  # at it: cut where it begins
    ("[ARGS], s", "Usage: app ", "Usage: app [ARGS], s"),  # plain text
])
def test_stop_strings_match_across_kept_markers(clients, stop, content, included):
    """The kept marker's text is wrapped for the parser; stop strings match as if it were not,
    and a cut never shows part of the marker (it showed "docs.[TOOL" with include_stop)."""
    oai = clients[1]
    kwargs = dict(model=PROSE_MODEL, messages=USER, tools=[openai_tool("get_weather")], stop=stop)
    created = oai.chat.completions.create(**kwargs).choices[0]
    chunks = [c.choices[0] for c in oai.chat.completions.create(stream=True, **kwargs) if c.choices]
    assert created.message.content == content and created.finish_reason == "stop" and not created.message.tool_calls
    assert "".join(c.delta.content or "" for c in chunks) == content and chunks[-1].finish_reason == "stop"
    kwargs["extra_body"] = {"include_stop_str_in_output": True}
    with_stop = oai.chat.completions.create(**kwargs).choices[0]
    chunks = [c.choices[0] for c in oai.chat.completions.create(stream=True, **kwargs) if c.choices]
    assert with_stop.message.content == included == "".join(c.delta.content or "" for c in chunks)
    del kwargs["extra_body"]
    if stop != "[TOOL":  # without tools the marker is skipped: the same cut
        plain = oai.chat.completions.create(model=PROSE_MODEL, messages=USER, stop=stop).choices[0]
        assert plain.message.content == content


@pytest.mark.parametrize("model, stop", [
    (PROSE_MODEL, "CALLS]"), (PROSE_MODEL, "LS][{"), (MISTRAL_MODEL, "S]"),
    (LLAMA_MODEL, "|>"), (LLAMA_MODEL, "_tag"), (LLAMA_MODEL, "tag|>{"),
])
@pytest.mark.parametrize("include", [False, True])
def test_a_stop_string_starting_inside_a_kept_marker_does_not_match(clients, model, stop, include):
    """Without tools the marker is skipped, so such a stop string never matched there; with
    them a cut inside the marker showed its head ('[TOOL_CALLS', '<|python_tag'). It does not
    match: the answer is the one without the stop string, streamed and not."""
    oai = clients[1]
    tools = [openai_tool("get_weather"), openai_tool("get_time")]
    kwargs = dict(model=model, messages=USER, tools=tools, stop=[stop],
                  extra_body={"include_stop_str_in_output": include})
    unstopped = oai.chat.completions.create(model=model, messages=USER, tools=tools).choices[0]
    created = oai.chat.completions.create(**kwargs).choices[0]
    chunks = [c.choices[0] for c in oai.chat.completions.create(stream=True, **kwargs) if c.choices]
    streamed_calls = [t.function.name for c in chunks for t in c.delta.tool_calls or [] if t.function.name]
    assert created.finish_reason == chunks[-1].finish_reason == unstopped.finish_reason == "tool_calls"
    assert created.message.content == unstopped.message.content
    assert "".join(c.delta.content or "" for c in chunks) == (unstopped.message.content or "")
    names = [t.function.name for t in unstopped.message.tool_calls]
    assert [t.function.name for t in created.message.tool_calls] == streamed_calls == names


@pytest.mark.parametrize("model", [LLAMA_MODEL, MISTRAL_MODEL])
def test_an_answer_not_ended_by_the_model_is_text(clients, model):
    """llama3_json and mistral calls have no end marker: an answer cut by max_tokens, or ended
    by a stop string or stop token, right after a complete call may have been going on to
    another call or to prose. It came back as that call, silently losing the rest; it is text
    now, as a call cut by max_tokens always was. (Hermes' calls end with </tool_call>.)"""
    claude, oai = clients
    tools = [openai_tool("get_weather"), openai_tool("get_time")]
    whole = oai.chat.completions.create(model=model, messages=USER, tools=tools)
    assert whole.choices[0].finish_reason == "tool_calls"
    for max_tokens in range(1, whole.usage.completion_tokens):  # the last one is the EOS
        kwargs = dict(model=model, messages=USER, tools=tools, max_tokens=max_tokens)
        created = oai.chat.completions.create(**kwargs).choices[0]
        chunks = [c.choices[0] for c in oai.chat.completions.create(stream=True, **kwargs) if c.choices]
        assert created.finish_reason == chunks[-1].finish_reason == "length", max_tokens
        assert not created.message.tool_calls and not any(c.delta.tool_calls for c in chunks), max_tokens
        assert "".join(c.delta.content or "" for c in chunks) == created.message.content
    message = claude.messages.create(model=model, max_tokens=whole.usage.completion_tokens - 1, messages=USER,
                                     tools=[claude_tool("get_weather"), claude_tool("get_time")])
    assert message.stop_reason == "max_tokens" and [b.type for b in message.content] == ["text"]
    # right after the (first) call: Llama's "; " cut off, Mistral's closing "]" kept
    stop, include = ("; ", False) if model == LLAMA_MODEL else ("]", True)
    text = EXPECTED_TEXT[model].split("; ")[0] if model == LLAMA_MODEL else EXPECTED_TEXT[model]
    kwargs = dict(model=model, messages=USER, tools=tools, stop=stop, extra_body={"include_stop_str_in_output": include})
    created = oai.chat.completions.create(**kwargs).choices[0]
    chunks = [c.choices[0] for c in oai.chat.completions.create(stream=True, **kwargs) if c.choices]
    assert created.message.content == text == "".join(c.delta.content or "" for c in chunks)
    assert created.finish_reason == chunks[-1].finish_reason == "stop" and not created.message.tool_calls
    if not include:
        message = claude.messages.create(model=model, max_tokens=200, messages=USER, stop_sequences=[stop],
                                         tools=[claude_tool("get_weather"), claude_tool("get_time")])
        assert message.stop_reason == "stop_sequence" and [(b.type, b.text) for b in message.content] == [("text", text)]


# Mistral 7B Instruct v0.3's chat template as published (its tokenizer_config.json).
MISTRAL03_REAL_TEMPLATE = r'''{%- if messages[0]["role"] == "system" %}
    {%- set system_message = messages[0]["content"] %}
    {%- set loop_messages = messages[1:] %}
{%- else %}
    {%- set loop_messages = messages %}
{%- endif %}
{%- if not tools is defined %}
    {%- set tools = none %}
{%- endif %}
{%- set user_messages = loop_messages | selectattr("role", "equalto", "user") | list %}

{#- This block checks for alternating user/assistant messages, skipping tool calling messages #}
{%- set ns = namespace() %}
{%- set ns.index = 0 %}
{%- for message in loop_messages %}
    {%- if not (message.role == "tool" or message.role == "tool_results" or (message.tool_calls is defined and message.tool_calls is not none)) %}
        {%- if (message["role"] == "user") != (ns.index % 2 == 0) %}
            {{- raise_exception("After the optional system message, conversation roles must alternate user/assistant/user/assistant/...") }}
        {%- endif %}
        {%- set ns.index = ns.index + 1 %}
    {%- endif %}
{%- endfor %}

{{- bos_token }}
{%- for message in loop_messages %}
    {%- if message["role"] == "user" %}
        {%- if tools is not none and (message == user_messages[-1]) %}
            {{- "[AVAILABLE_TOOLS] [" }}
            {%- for tool in tools %}
                {%- set tool = tool.function %}
                {{- '{"type": "function", "function": {' }}
                {%- for key, val in tool.items() if key != "return" %}
                    {%- if val is string %}
                        {{- '"' + key + '": "' + val + '"' }}
                    {%- else %}
                        {{- '"' + key + '": ' + val|tojson }}
                    {%- endif %}
                    {%- if not loop.last %}
                        {{- ", " }}
                    {%- endif %}
                {%- endfor %}
                {{- "}}" }}
                {%- if not loop.last %}
                    {{- ", " }}
                {%- else %}
                    {{- "]" }}
                {%- endif %}
            {%- endfor %}
            {{- "[/AVAILABLE_TOOLS]" }}
            {%- endif %}
        {%- if loop.last and system_message is defined %}
            {{- "[INST] " + system_message + "\n\n" + message["content"] + "[/INST]" }}
        {%- else %}
            {{- "[INST] " + message["content"] + "[/INST]" }}
        {%- endif %}
    {%- elif message.tool_calls is defined and message.tool_calls is not none %}
        {{- "[TOOL_CALLS] [" }}
        {%- for tool_call in message.tool_calls %}
            {%- set out = tool_call.function|tojson %}
            {{- out[:-1] }}
            {%- if not tool_call.id is defined or tool_call.id|length != 9 %}
                {{- raise_exception("Tool call IDs should be alphanumeric strings with length 9!") }}
            {%- endif %}
            {{- ', "id": "' + tool_call.id + '"}' }}
            {%- if not loop.last %}
                {{- ", " }}
            {%- else %}
                {{- "]" + eos_token }}
            {%- endif %}
        {%- endfor %}
    {%- elif message["role"] == "assistant" %}
        {{- " " + message["content"]|trim + eos_token}}
    {%- elif message["role"] == "tool_results" or message["role"] == "tool" %}
        {%- if message.content is defined and message.content.content is defined %}
            {%- set content = message.content.content %}
        {%- else %}
            {%- set content = message.content %}
        {%- endif %}
        {{- '[TOOL_RESULTS] {"content": ' + content|string + ", " }}
        {%- if not message.tool_call_id is defined or message.tool_call_id|length != 9 %}
            {{- raise_exception("Tool call IDs should be alphanumeric strings with length 9!") }}
        {%- endif %}
        {{- '"call_id": "' + message.tool_call_id + '"}[/TOOL_RESULTS]' }}
    {%- else %}
        {{- raise_exception("Only user and assistant roles are supported, with the exception of an initial optional system message!") }}
    {%- endif %}
{%- endfor %}
'''


# Qwen3's shape: an assistant turn opens with an empty think block, which its generation prompt
# leaves out (written here for these tests).
QWEN3_STYLE_TEMPLATE = (
    "{% if tools %}<|im_start|>system\n# Tools\n{% for tool in tools %}{{ tool | tojson }}\n{% endfor %}"
    "Call a tool as <tool_call>{\"name\": ..., \"arguments\": ...}</tool_call><|im_end|>\n{% endif %}"
    "{% for message in messages %}"
    "{% if message.role == 'user' %}<|im_start|>user\n{{ message.content }}<|im_end|>\n"
    "{% elif message.role == 'assistant' %}<|im_start|>assistant\n<think>\n\n</think>\n\n{{ message.content or '' }}"
    "{% for call in message.tool_calls or [] %}<tool_call>\n{\"name\": \"{{ call.function.name }}\", \"arguments\": "
    "{{ call.function.arguments | tojson }}}\n</tool_call>{% endfor %}<|im_end|>\n"
    "{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@pytest.mark.parametrize("template", [MISTRAL_TEMPLATE, MISTRAL03_REAL_TEMPLATE, QWEN3_STYLE_TEMPLATE])  # (LLAMA_TEMPLATE writes
# <|python_tag|> before a call, which a forced llama3_json call leaves out)
@pytest.mark.parametrize("tool_name", [None, "get_weather"])
@pytest.mark.parametrize("system", [False, True])
def test_a_forced_call_starts_as_the_template_writes_a_call(demo_tokenizer, tmp_path, template, tool_name, system):
    """tool_choice required / a named tool: the prompt is how the template renders the
    conversation with that call as the assistant turn, cut inside the call. As an assistant
    prefill it was not for Mistral v0.3, whose assistant branch writes " " + content first:
    "[/INST] [TOOL_CALLS]" where a call renders "[/INST][TOOL_CALLS] [{"; after the generation
    prompt it is not for Qwen3's shape, whose call turn opens with an empty think block. With a
    system message Mistral v0.3 writes it into the last user turn only, so the system prompt is
    compared out of a call turn's rendering: the forms are judged by the text before the call."""
    import asyncio

    from transformers import AutoTokenizer

    from tierlm.serving.generation import chat_prompt
    from tierlm.serving.tools import template_tool_call_id

    demo_tokenizer.save_pretrained(str(tmp_path / "tokenizer"))
    tok = AutoTokenizer.from_pretrained(str(tmp_path / "tokenizer"))
    tok.add_tokens([*SPECIALS, "[INST]", "[/INST]", "[AVAILABLE_TOOLS]", "[/AVAILABLE_TOOLS]"], special_tokens=True)
    tok.chat_template = template
    engine = build_scripted_model(tmp_path / "m", [Script(chat_prompt_ids(tok), "x")], tok).engine("m")
    tools = [openai_tool("get_weather")]
    call = {"id": template_tool_call_id("c"), "type": "function",
            "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
    conversation = [{"role": "system", "content": "Answer in French."}, *USER] if system else USER
    asked = tok.apply_chat_template(conversation, tools=tools, tokenize=False, add_generation_prompt=True)
    natural = tok.apply_chat_template([*conversation, {"role": "assistant", "content": "", "tool_calls": [call]}],
                                      tools=tools, tokenize=False)
    prompt = asyncio.run(chat_prompt(engine, "m", conversation, tools=tools, call_required_by="required",
                                     tool_name=tool_name))
    got = tok.decode(prompt.token_ids, skip_special_tokens=False)
    if asked.startswith(natural[:len(asked)]):  # the call turn's rendering keeps the conversation as it is
        assert natural.startswith(got) and len(got) > len(asked)
    else:  # (Mistral v0.3 with a system message): the conversation as asked, then the call as written
        assert got.startswith(asked) and (asked + natural[natural.rindex("[/INST]") + 7:]).startswith(got)
