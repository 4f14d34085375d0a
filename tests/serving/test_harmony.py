"""OpenAI's harmony format (gpt-oss): channels read as reasoning, text and tool calls.

The splitter and the parser on answers cut every way a stream may cut them, then scripted
checkpoints (see scripted_model.py) over a tokenizer with harmony's special tokens and a small
harmony chat template, whose generation config ends answers at `<|return|>` and `<|call|>` as
gpt-oss's does, served end to end through the official SDKs with the parsers detected from
the template.
"""
from __future__ import annotations

import itertools
import json
import random

import openai
import pytest

from tests.serving.harness import (API_KEY, ServerThread, assert_cut_off_is_all_thinking, guarded_server, output_policies_file, record_requests,
                                  sdk_clients, tenants_file)
from tests.serving.scripted_model import Script, build_scripted_model, build_templated_models, chat_prompt_ids
from tests.serving.test_reasoning import ANSWER, OPENAI_WEATHER, THINK_TEMPLATE, THOUGHT, USER, WEATHER, blocks
from tests.serving.test_tool_parsers import LLAMA_TEMPLATE
from tierlm.models.demo import CHAT_TEMPLATE
from tierlm.serving.app import build_app
from tierlm.serving.auth import ApiKeyAuth
from tierlm.serving.harmony import CALL, CHANNEL, END, MARKERS, MESSAGE, RETURN, START, HarmonySplitter
from tierlm.serving.harmony import wrapped as w
from tierlm.serving.reasoning import reasoning_format
from tierlm.serving.tools import (
    HarmonySyntax,
    ToolCallStreamFilter,
    detect_parser,
    forced_call_prefix,
    parse_tool_calls,
    tool_call_format,
)

# Renders system, developer (the tools), user, assistant (reasoning, answer, calls) and tool turns;
# reads an assistant turn's reasoning as `thinking`, as gpt-oss's own template does
HARMONY_TEMPLATE = (
    "{%- if tools %}<|start|>developer<|message|># Tools\n{%- for t in tools %}\n"
    "{{ t.function.name }}: {{ t.function.description }}{%- endfor %}<|end|>{%- endif %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'assistant' %}"
    "{%- if m.thinking is defined and m.thinking %}"
    "<|start|>assistant<|channel|>analysis<|message|>{{ m.thinking }}<|end|>{%- endif %}"
    "{%- if m.tool_calls %}{%- for c in m.tool_calls %}"
    "<|start|>assistant to=functions.{{ c.function.name }}<|channel|>commentary json<|message|>"
    "{{ c.function.arguments if c.function.arguments is string else c.function.arguments|tojson }}<|call|>"
    "{%- endfor %}{%- else %}<|start|>assistant<|channel|>final<|message|>{{ m.content }}<|end|>{%- endif %}"
    "{%- elif m.role == 'tool' %}<|start|>functions.tool to=assistant<|channel|>commentary<|message|>"
    "{{ m.content }}<|end|>"
    "{%- else %}<|start|>{{ m.role }}<|message|>{{ m.content }}<|end|>{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}<|start|>assistant{%- endif %}"
)

# gpt-oss's template writes the reasoning effort into its system message ("Reasoning: high")
EFFORT_TEMPLATE = ("{%- if reasoning_effort is defined %}<|start|>system<|message|>Reasoning: {{ reasoning_effort }}"
                   "<|end|>{%- endif %}" + HARMONY_TEMPLATE)

REPLY = f"<|channel|>analysis<|message|>{THOUGHT}<|end|><|start|>assistant<|channel|>final<|message|>{ANSWER}<|return|>"
CALL_THOUGHT = "Need the weather first."
CALL_REPLY = (f"<|channel|>analysis<|message|>{CALL_THOUGHT}<|end|><|start|>assistant<|channel|>commentary "
              'to=functions.get_weather <|constrain|>json<|message|>{"location": "Paris"}<|call|>')
# The recipient in the header before the channel, after a preamble (commentary without one)
PREAMBLE = "Let me check."
PREAMBLE_REPLY = (f"<|channel|>commentary<|message|>{PREAMBLE}<|end|><|start|>assistant to=functions.get_weather"
                  '<|channel|>commentary json<|message|>{"location": "Oslo"}<|call|>')
BAD_JSON = '{"location": Paris}'
BAD_REPLY = (f"<|channel|>analysis<|message|>{CALL_THOUGHT}<|end|><|start|>assistant<|channel|>commentary "
             f"to=functions.get_weather <|constrain|>json<|message|>{BAD_JSON}<|call|>")
# The recipient in the first message's header, right after the prompt's `<|start|>assistant`
HEADER_REPLY = ' to=functions.get_weather<|channel|>commentary json<|message|>{"location": "Oslo"}<|call|>'
THINKER, CALLER, HEADER_CALLER, BAD_CALLER = "harmony", "harmony-call", "harmony-header-call", "harmony-bad-call"
EFFORT = "harmony-effort"
# Writes harmony's markers in ordinary tokens in its answer (the tokenizer has them as special
# tokens, which this reply spells only the message markers in): the model's own text
LITERAL, LITERAL_TEXT = "harmony-literal", "Type <|call|> here."
LITERAL_REPLY = f"<|channel|>analysis<|message|>Quote it.<|end|><|start|>assistant<|channel|>final<|message|>{LITERAL_TEXT}"
# Answers REPLY, and finishes a call tool_choice started after `<|start|>assistant` (as the
# template writes calls): after ` to=functions.` (any tool) with the name, its channel and the
# arguments, after a named call's `<|message|>` with the arguments
FORCED = "harmony-forced"
FORCED_ARGS = '{"location": "Rome"}'
FORCED_ANY_REPLY = f"get_weather<|channel|>commentary json<|message|>{FORCED_ARGS}<|call|>"


def kept(text: str) -> str:
    """`text` as the detokenizer gives it where harmony's markers are kept special tokens."""
    for marker in MARKERS:
        text = text.replace(marker, w(marker))
    return text


def answer(reply: str) -> str:
    """A reply as decoded: its final EOS token (`<|return|>`, `<|call|>`) is not in the text."""
    return kept(reply.removesuffix(RETURN).removesuffix(CALL))


# ---- the splitter and the parser ------------------------------------------------------------

@pytest.mark.parametrize("text, expected", [
    (answer(REPLY), (THOUGHT, ANSWER)),
    (kept(REPLY), (THOUGHT, ANSWER)),  # (<|return|> in the text: include_stop_str_in_output)
    (kept("<|channel|>final<|message|>just this"), ("", "just this")),
    (kept("<|channel|>analysis<|message|>half a thou"), ("half a thou", "")),  # cut off while thinking
    (kept("<|channel|>analysis<|message|>a<|end|><|start|>assistant<|chan"), ("a", "")),  # cut in a header
    (kept("<|channel|>analysis<|message|>a<|end|><|start|>assistant<|channel|>analysis<|message|>b<|end|>"
          "<|start|>assistant<|channel|>final<|message|>c"), ("a\n\nb", "c")),  # two analysis messages
    (kept(f"<|channel|>commentary<|message|>{PREAMBLE}<|end|><|start|>assistant<|channel|>final<|message|>c"),
     ("", f"{PREAMBLE}\n\nc")),  # a preamble is text
    ("plain text, no markers", ("", "plain text, no markers")),  # out of format: text as written
    ("  ", ("", "  ")),
    ("", ("", "")),
    # marker text in ordinary tokens is the model's own
    (kept("<|channel|>final<|message|>") + "write <|end|> or <|channel|>", ("", "write <|end|> or <|channel|>")),
    (kept("<|channel|>analysis<|message|>") + "x <|message|>y", ("x <|message|>y", "")),
    # another kept token (not harmony's) never shows; a lone sentinel neither
    (kept("<|channel|>final<|message|>a") + "\ufdd0<other>\ufdd1b\ufdd0c", ("", "abc")),
])
def test_split(text, expected):
    assert HarmonySplitter().split(text) == expected


def test_plain_markers_when_special_tokens_are_not_skipped():
    assert HarmonySplitter(wrapped=False).split(REPLY) == (THOUGHT, ANSWER)
    assert HarmonySplitter(wrapped=False, calls=True).split(CALL_REPLY)[0] == CALL_THOUGHT


def parsed(text: str, ended: bool = True, names=frozenset({"get_weather"})):
    reasoning, rest = HarmonySplitter(calls=True).split(text)
    out = parse_tool_calls(rest, "call_", names, HarmonySyntax(), ended)
    return reasoning, out.text, [(c.name, c.arguments) for c in out.tool_calls]


@pytest.mark.parametrize("text, ended, names, expected", [
    (answer(CALL_REPLY), True, None, (CALL_THOUGHT, "", [("get_weather", {"location": "Paris"})])),
    (answer(PREAMBLE_REPLY), True, None, ("", PREAMBLE, [("get_weather", {"location": "Oslo"})])),
    (answer(HEADER_REPLY), True, None, ("", "", [("get_weather", {"location": "Oslo"})])),
    (kept(CALL_REPLY), True, None, (CALL_THOUGHT, "", [("get_weather", {"location": "Paris"})])),
    # bad JSON, a body that is no object, a tool not offered, a call cut off: its body as text
    (answer(BAD_REPLY), True, None, (CALL_THOUGHT, BAD_JSON, [])),
    (kept("<|channel|>commentary to=functions.get_weather<|message|>[1]"), True, None, ("", "[1]", [])),
    (answer(CALL_REPLY), True, frozenset({"other"}), (CALL_THOUGHT, '{"location": "Paris"}', [])),
    (answer(CALL_REPLY)[:-3], False, None, (CALL_THOUGHT, '{"location": "Pari', [])),
    (answer(PREAMBLE_REPLY), False, None, ("", PREAMBLE + '\n\n{"location": "Oslo"}', [])),
    # cut off in the call's header: nothing of it shows
    (kept("<|channel|>analysis<|message|>a<|end|><|start|>assistant<|channel|>commentary to=functions.get"),
     False, None, ("a", "", [])),
])
def test_calls(text, ended, names, expected):
    assert parsed(text, ended, names or frozenset({"get_weather"})) == expected


def test_calls_without_tools_offered_are_their_bodies_as_text():
    assert HarmonySplitter(calls=False).split(answer(CALL_REPLY)) == (CALL_THOUGHT, '{"location": "Paris"}')


def test_reasoning_not_parsed_is_text_and_calls_still_are_read():
    """--reasoning-parser none with harmony's tool calls: the analysis is text, the call a call."""
    reasoning, rest = HarmonySplitter(calls=True, reasoning_as_text=True).split(answer(CALL_REPLY))
    out = parse_tool_calls(rest, "call_", frozenset({"get_weather"}), HarmonySyntax())
    assert (reasoning, out.text, [c.name for c in out.tool_calls]) == ("", CALL_THOUGHT, ["get_weather"])


CASES = [answer(REPLY), kept(REPLY), answer(CALL_REPLY), answer(PREAMBLE_REPLY), answer(HEADER_REPLY),
         answer(BAD_REPLY),
         kept("<|channel|>final<|message|>") + "a <|end|> b\ufdd0<x>\ufdd1c",
         kept("<|channel|>analysis<|message|>half a thou"), "plain text <|end|>", answer(REPLY)[:-4]]


def streamed(text: str, cuts: tuple[int, ...], ended: bool = True):
    """`text` fed in pieces cut at `cuts`, through the splitter and the tool-call stream filter,
    as generation.StreamedAnswer does: (reasoning, text, calls) as the client sees them."""
    splitter = HarmonySplitter(calls=True)
    calls_filter = ToolCallStreamFilter("call_", frozenset({"get_weather"}), HarmonySyntax(), MARKERS)
    reasoning, shown = [], []
    bounds = (0, *cuts, len(text))
    for a, b in itertools.pairwise(bounds):
        thought, piece = splitter.feed(text[a:b])
        reasoning.append(thought)
        shown.append(calls_filter.feed(piece))
    thought, piece = splitter.finish()
    reasoning.append(thought)
    shown.append(calls_filter.feed(piece))
    rest, calls = calls_filter.finish(ended)
    return "".join(reasoning), "".join(shown) + rest, [(c.name, c.arguments) for c in calls]


@pytest.mark.parametrize("text", CASES)
def test_streamed_split_equals_the_whole_split_however_the_text_is_cut(text):
    """Cut at every boundary (one cut, and every character a piece of its own) and at random
    ones, a streamed answer shows what the whole one does, and never a marker or a sentinel."""
    whole = streamed(text, ())
    assert whole == parsed(text, names=frozenset({"get_weather"}))
    cuttings = [(i,) for i in range(1, len(text))] + [tuple(range(1, len(text)))]
    rng = random.Random(0)
    cuttings += [tuple(sorted(rng.sample(range(1, len(text)), k=min(len(text) - 1, 5)))) for _ in range(200)]
    for cuts in cuttings:
        assert streamed(text, cuts) == whole, cuts
    for part in whole[:2]:
        assert "\ufdd0" not in part and "\ufdd1" not in part


# ---- detection ---------------------------------------------------------------------------------

def copy_of(tokenizer, where):
    from transformers import AutoTokenizer

    tokenizer.save_pretrained(str(where))
    return AutoTokenizer.from_pretrained(str(where))


def test_the_parsers_are_detected_from_the_template_or_the_vocabulary(demo_tokenizer, tmp_path):
    assert detect_parser(HARMONY_TEMPLATE) == "harmony"
    tok = copy_of(demo_tokenizer, tmp_path)
    for template, syntax, thinks in [(HARMONY_TEMPLATE, "harmony", "harmony"), (CHAT_TEMPLATE, "hermes", None),
                                     (THINK_TEMPLATE, "hermes", "think"), (LLAMA_TEMPLATE, "llama3_json", None)]:
        tok.chat_template = template
        fmt = reasoning_format("auto", tok)
        assert tool_call_format("auto", tok).syntax.name == syntax
        assert (None if fmt is None else "harmony" if fmt.harmony else "think") == thinks
    # A template with only one of the two markers is not harmony
    tok.chat_template = CHAT_TEMPLATE + "<|channel|>"
    assert reasoning_format("auto", tok) is None and tool_call_format("auto", tok).syntax.name == "hermes"
    # vLLM's names for the parsers
    tok.chat_template = CHAT_TEMPLATE
    assert reasoning_format("openai_gptoss", tok).harmony and reasoning_format("harmony", tok).harmony
    assert tool_call_format("openai", tok).syntax.name == tool_call_format("harmony", tok).syntax.name == "harmony"


def test_the_vocabulary_alone_says_harmony(tmp_path, demo_tokenizer):
    tok = copy_of(demo_tokenizer, tmp_path)
    tok.add_tokens(list(MARKERS), special_tokens=True)
    tok.chat_template = CHAT_TEMPLATE
    fmt = reasoning_format("auto", tok)
    assert fmt is not None and fmt.harmony and fmt.answer_start == w(CHANNEL)
    assert sorted(fmt.keep_token_ids) == sorted(tok.convert_tokens_to_ids(list(MARKERS)))
    found = tool_call_format("auto", tok)
    assert found.syntax.name == "harmony" and set(found.hidden) == set(MARKERS)
    assert fmt.decoded(False).answer_start == CHANNEL  # not skipping special tokens: plain markers


# ---- end to end ----------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def server(demo_tokenizer, tmp_path_factory):
    models = build_templated_models(tmp_path_factory.mktemp("harmony"), demo_tokenizer, [
        (THINKER, HARMONY_TEMPLATE, REPLY, MARKERS), (CALLER, HARMONY_TEMPLATE, CALL_REPLY, MARKERS),
        (HEADER_CALLER, HARMONY_TEMPLATE, HEADER_REPLY, MARKERS), (BAD_CALLER, HARMONY_TEMPLATE, BAD_REPLY, MARKERS),
        (LITERAL, HARMONY_TEMPLATE, LITERAL_REPLY, (CHANNEL, MESSAGE, START, END)),
        (EFFORT, EFFORT_TEMPLATE, REPLY, MARKERS),
    ], added=MARKERS, eos_tokens=(RETURN, CALL))
    models[FORCED] = forced_model(tmp_path_factory.mktemp("harmony-forced"), models[THINKER].path)
    engines = {name: model.engine(name) for name, model in models.items()}
    server = ServerThread(build_app(engines, ApiKeyAuth.from_keys({"alice": API_KEY}))).start()
    yield server, engines
    server.stop()


def forced_model(root, tokenizer_dir):
    """A scripted model that answers REPLY, and finishes the calls tool_choice starts (the prompt
    ends with the call's start, which the server writes after the generation prompt)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    tools = [OPENAI_WEATHER]
    generation_prompt = tok.apply_chat_template(USER, tools=tools, tokenize=False, add_generation_prompt=True)

    def forced(name):
        return tok.encode(generation_prompt + forced_call_prefix(name, HarmonySyntax()), add_special_tokens=False)
    scripts = [Script(chat_prompt_ids(tok), REPLY), Script(forced(None), FORCED_ANY_REPLY),
               Script(forced("get_weather"), FORCED_ARGS + CALL)]
    return build_scripted_model(root / FORCED, scripts, tok, specials=MARKERS, eos_tokens=(RETURN, CALL))


@pytest.fixture(scope="module")
def clients(server):
    return sdk_clients(server[0].url)


def openai_stream(openai_client, **kwargs):
    reasoning, content, calls, finish = [], [], {}, None
    for chunk in openai_client.chat.completions.create(stream=True, **kwargs):
        delta = chunk.choices[0].delta
        extra = delta.model_extra or {}
        assert extra.get("reasoning_content") == extra.get("reasoning")
        reasoning.append(extra.get("reasoning_content") or "")
        content.append(delta.content or "")
        for call in delta.tool_calls or []:
            name, args = calls.get(call.index, ("", ""))
            calls[call.index] = (name + (call.function.name or ""), args + (call.function.arguments or ""))
        finish = chunk.choices[0].finish_reason or finish
    return "".join(reasoning), "".join(content), [(n, json.loads(a)) for n, a in calls.values()], finish


def test_openai_reasoning_and_answer(clients):
    _, openai_client = clients
    done = openai_client.chat.completions.create(model=THINKER, messages=USER, max_tokens=64)
    message = done.choices[0].message
    assert (message.content, message.model_extra) == (ANSWER, {"reasoning_content": THOUGHT, "reasoning": THOUGHT})
    assert done.choices[0].finish_reason == "stop"
    assert openai_stream(openai_client, model=THINKER, messages=USER, max_tokens=64) == (THOUGHT, ANSWER, [], "stop")
    # Not skipping special tokens, the markers come as plain text, and are read as markers still
    plain = {"skip_special_tokens": False}
    message = openai_client.chat.completions.create(model=THINKER, messages=USER, max_tokens=64,
                                                    extra_body=plain).choices[0].message
    assert (message.content, message.model_extra["reasoning"]) == (ANSWER, THOUGHT)
    streamed = openai_stream(openai_client, model=THINKER, messages=USER, max_tokens=64, extra_body=plain)
    assert streamed == (THOUGHT, ANSWER, [], "stop")


def test_openai_cut_off_in_the_analysis_is_all_reasoning(clients):
    _, openai_client = clients
    done = openai_client.chat.completions.create(model=THINKER, messages=USER, max_tokens=10)
    message = done.choices[0].message
    thought = message.model_extra["reasoning_content"]
    assert done.choices[0].finish_reason == "length" and not message.content
    assert thought and THOUGHT.startswith(thought)
    assert openai_stream(openai_client, model=THINKER, messages=USER, max_tokens=10) == (thought, "", [], "length")


@pytest.mark.parametrize("model, thought, content, arguments", [
    (CALLER, CALL_THOUGHT, None, {"location": "Paris"}), (HEADER_CALLER, None, None, {"location": "Oslo"}),
])
def test_openai_tool_calls(clients, model, thought, content, arguments):
    _, openai_client = clients
    done = openai_client.chat.completions.create(model=model, messages=USER, tools=[OPENAI_WEATHER])
    choice = done.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == content
    assert (choice.message.model_extra or {}).get("reasoning_content") == thought
    assert [(c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls] == [
        ("get_weather", arguments)]
    assert choice.message.tool_calls[0].id.startswith("call")
    streamed = openai_stream(openai_client, model=model, messages=USER, tools=[OPENAI_WEATHER])
    assert streamed == (thought or "", content or "", [("get_weather", arguments)], "tool_calls")
    plain = openai_client.chat.completions.create(model=model, messages=USER, tools=[OPENAI_WEATHER],
                                                  extra_body={"skip_special_tokens": False}).choices[0]
    assert (plain.finish_reason, plain.message.content) == ("tool_calls", content)
    assert [json.loads(c.function.arguments) for c in plain.message.tool_calls] == [arguments]


def test_marker_text_in_ordinary_tokens_is_the_models_own(clients):
    claude, openai_client = clients
    kwargs = dict(model=LITERAL, messages=USER, tools=[OPENAI_WEATHER])
    message = openai_client.chat.completions.create(**kwargs).choices[0].message
    assert (message.content, message.tool_calls, message.model_extra["reasoning"]) == (LITERAL_TEXT, None, "Quote it.")
    assert openai_stream(openai_client, **kwargs) == ("Quote it.", LITERAL_TEXT, [], "stop")
    done = claude.messages.create(model=LITERAL, max_tokens=128, messages=USER, tools=[WEATHER])
    assert blocks(done) == [("thinking", "Quote it."), ("text", LITERAL_TEXT)] and done.stop_reason == "end_turn"


def test_openai_bad_call_json_is_text(clients):
    _, openai_client = clients
    done = openai_client.chat.completions.create(model=BAD_CALLER, messages=USER, tools=[OPENAI_WEATHER])
    choice = done.choices[0]
    assert (choice.finish_reason, choice.message.content, choice.message.tool_calls) == ("stop", BAD_JSON, None)
    assert choice.message.model_extra["reasoning_content"] == CALL_THOUGHT
    streamed = openai_stream(openai_client, model=BAD_CALLER, messages=USER, tools=[OPENAI_WEATHER])
    assert streamed == (CALL_THOUGHT, BAD_JSON, [], "stop")


def test_anthropic_thinking_and_text(clients):
    claude, _ = clients
    done = claude.messages.create(model=THINKER, max_tokens=64, messages=USER)
    assert blocks(done) == [("thinking", THOUGHT), ("text", ANSWER)] and done.stop_reason == "end_turn"
    with claude.messages.stream(model=THINKER, max_tokens=64, messages=USER) as stream:
        streamed = stream.get_final_message()
    assert streamed.model_dump(exclude={"id", "usage"}) == done.model_dump(exclude={"id", "usage"})


@pytest.mark.parametrize("model, expected", [
    (CALLER, [("thinking", CALL_THOUGHT), ("tool_use", {"location": "Paris"})]),
    (HEADER_CALLER, [("tool_use", {"location": "Oslo"})]),
])
def test_anthropic_tool_use(clients, model, expected):
    claude, _ = clients
    done = claude.messages.create(model=model, max_tokens=128, messages=USER, tools=[WEATHER])
    assert blocks(done) == expected and done.stop_reason == "tool_use"
    assert done.content[-1].name == "get_weather" and done.content[-1].id.startswith("toolu_")
    with claude.messages.stream(model=model, max_tokens=128, messages=USER, tools=[WEATHER]) as stream:
        streamed = stream.get_final_message()
    assert blocks(streamed) == expected and streamed.stop_reason == "tool_use"
    # The turn sent back, with the tool's result, renders through the template
    messages = [*USER, {"role": "assistant", "content": [b.model_dump() for b in done.content]},
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": done.content[-1].id,
                                              "content": "sunny"}]}]
    assert claude.messages.count_tokens(model=model, messages=messages, tools=[WEATHER]).input_tokens > 0


def test_anthropic_bad_call_json_and_no_tools_are_text(clients):
    claude, _ = clients
    done = claude.messages.create(model=BAD_CALLER, max_tokens=128, messages=USER, tools=[WEATHER])
    assert blocks(done) == [("thinking", CALL_THOUGHT), ("text", BAD_JSON)] and done.stop_reason == "end_turn"
    with claude.messages.stream(model=BAD_CALLER, max_tokens=128, messages=USER, tools=[WEATHER]) as stream:
        assert blocks(stream.get_final_message()) == blocks(done)
    plain = claude.messages.create(model=CALLER, max_tokens=128, messages=USER)  # no tools offered
    assert blocks(plain) == [("thinking", CALL_THOUGHT), ("text", '{"location": "Paris"}')]


def test_anthropic_cut_off_in_the_analysis_is_all_thinking(clients):
    assert_cut_off_is_all_thinking(clients[0], THINKER, USER, THOUGHT, 10)


@pytest.mark.parametrize("choice, finish", [
    ("required", "tool_calls"), ({"type": "function", "function": {"name": "get_weather"}}, "stop"),
])
def test_openai_a_required_call_is_written_and_read_as_harmony(server, clients, monkeypatch, choice, finish):
    """tool_choice starts the call as the template writes calls, after the generation prompt's
    `<|start|>assistant`; the model finishes it, and it is read as the call (finish_reason as
    for a named call anywhere)."""
    _, engines = server
    _, openai_client = clients
    asked = record_requests(engines[FORCED], monkeypatch)
    kwargs = dict(model=FORCED, messages=USER, tools=[OPENAI_WEATHER], tool_choice=choice, max_tokens=64)
    choice_ = openai_client.chat.completions.create(**kwargs).choices[0]
    started = " to=functions." + ("" if choice == "required" else "get_weather<|channel|>commentary json<|message|>")
    prompt = engines[FORCED].tokenizer.decode(asked[-1].prompt_token_ids)
    assert prompt.endswith("<|end|><|start|>assistant" + started), prompt
    assert (choice_.finish_reason, choice_.message.content) == (finish, None)
    assert [(c.function.name, json.loads(c.function.arguments)) for c in choice_.message.tool_calls] == [
        ("get_weather", {"location": "Rome"})]
    assert openai_stream(openai_client, **kwargs) == ("", "", [("get_weather", {"location": "Rome"})], finish)


@pytest.mark.parametrize("choice", [{"type": "any"}, {"type": "tool", "name": "get_weather"}])
def test_anthropic_a_required_call_is_written_and_read_as_harmony(clients, choice):
    claude, _ = clients
    kwargs = dict(model=FORCED, max_tokens=64, messages=USER, tools=[WEATHER], tool_choice=choice)
    done = claude.messages.create(**kwargs)
    assert blocks(done) == [("tool_use", {"location": "Rome"})] and done.stop_reason == "tool_use"
    with claude.messages.stream(**kwargs) as stream:
        assert blocks(stream.get_final_message()) == blocks(done)


def test_responses_api_reasoning_item_then_message_and_a_function_call(server, clients):
    _, engines = server
    _, openai_client = clients
    created = openai_client.responses.create(model=THINKER, input="Hi")
    assert [i.type for i in created.output] == ["reasoning", "message"]
    assert created.output[0].content[0].text == THOUGHT and created.output_text == ANSWER
    # The analysis message's tokens, header to <|end|>, as the model wrote them (a re-tokenized
    # estimate missed its header's `analysis<|message|>`)
    chat = openai_client.chat.completions.create(model=THINKER, messages=USER, extra_body={"return_token_ids": True})
    written = chat.choices[0].model_extra["token_ids"]
    end = engines[THINKER].tokenizer.convert_tokens_to_ids(END)
    assert created.usage.output_tokens_details.reasoning_tokens == written.index(end) + 1
    assert created.usage.output_tokens == len(written)
    cut = openai_client.responses.create(model=THINKER, input="Hi", max_output_tokens=10)  # (in the analysis)
    assert cut.usage.output_tokens_details.reasoning_tokens == cut.usage.output_tokens == 10
    with openai_client.responses.stream(model=THINKER, input="Hi") as stream:
        final = stream.get_final_response()
    assert [i.type for i in final.output] == ["reasoning", "message"] and final.output_text == ANSWER
    tool = {"type": "function", "name": "get_weather", "parameters": {"type": "object"}}
    called = openai_client.responses.create(model=CALLER, input="Hi", tools=[tool])
    assert [(i.type, getattr(i, "name", None)) for i in called.output] == [("reasoning", None),
                                                                         ("function_call", "get_weather")]
    assert json.loads(called.output[1].arguments) == {"location": "Paris"}


def test_a_tool_loop_gives_the_template_the_calls_reasoning_as_thinking(server, clients, monkeypatch):
    """gpt-oss's template reads an assistant turn's analysis as `thinking` only: the reasoning
    both APIs hand templates (vLLM's reasoning_content) reaches it under that name too
    (transformers' apply_chat_template passes it so), so the model sees why it called."""
    _, engines = server
    claude, openai_client = clients
    asked = record_requests(engines[CALLER], monkeypatch)
    done = openai_client.chat.completions.create(model=CALLER, messages=USER, tools=[OPENAI_WEATHER])
    turn = done.choices[0].message.model_dump(exclude_none=True)
    loop = [*USER, turn, {"role": "tool", "tool_call_id": turn["tool_calls"][0]["id"], "content": "sunny"}]
    openai_client.chat.completions.create(model=CALLER, messages=loop, tools=[OPENAI_WEATHER], max_tokens=1)
    analysis = f"<|start|>assistant<|channel|>analysis<|message|>{CALL_THOUGHT}<|end|>"
    call = '<|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>'
    prompt = engines[CALLER].tokenizer.decode(asked[-1].prompt_token_ids)
    assert analysis + call in prompt, prompt
    first = claude.messages.create(model=CALLER, max_tokens=128, messages=USER, tools=[WEATHER])
    messages = [*USER, {"role": "assistant", "content": [b.model_dump() for b in first.content]},
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": first.content[-1].id,
                                              "content": "sunny"}]}]
    claude.messages.create(model=CALLER, max_tokens=1, messages=messages, tools=[WEATHER])
    assert analysis + call in engines[CALLER].tokenizer.decode(asked[-1].prompt_token_ids)


def test_reasoning_effort_reaches_the_template_from_every_api(server, clients, monkeypatch):
    """OpenAI chat's `reasoning_effort`, the Responses API's `reasoning.effort` and Anthropic's
    `output_config.effort` reach the chat template as `reasoning_effort`, as gpt-oss's template
    reads it (vLLM passes chat's so); they were accepted and dropped, so gpt-oss always reasoned
    at its template's default. chat_template_kwargs still win; a template without the variable
    renders as without; a value gpt-oss does not know is a 400."""
    _, engines = server
    claude, openai_client = clients
    asked = record_requests(engines[EFFORT], monkeypatch)

    def rendered() -> str:
        return engines[EFFORT].tokenizer.decode(asked[-1].prompt_token_ids)
    kwargs = dict(model=EFFORT, messages=USER, max_tokens=64)
    done = openai_client.chat.completions.create(reasoning_effort="high", **kwargs)
    assert rendered().startswith("<|start|>system<|message|>Reasoning: high<|end|>"), rendered()
    assert (done.choices[0].message.content, done.choices[0].message.model_extra["reasoning"]) == (ANSWER, THOUGHT)
    assert openai_stream(openai_client, reasoning_effort="low", **kwargs) == (THOUGHT, ANSWER, [], "stop")
    assert "Reasoning: low" in rendered()
    openai_client.chat.completions.create(**kwargs)
    assert "Reasoning:" not in rendered()
    openai_client.chat.completions.create(reasoning_effort="high", extra_body={
        "chat_template_kwargs": {"reasoning_effort": "medium"}}, **kwargs)
    assert "Reasoning: medium" in rendered()
    openai_client.responses.create(model=EFFORT, input="Hi", reasoning={"effort": "low"})
    assert "Reasoning: low<|end|>" in rendered()
    # Anthropic's effort scale goes past OpenAI's: its top two are OpenAI's top
    for effort, written in [("medium", "medium"), ("max", "high")]:
        message = claude.messages.create(model=EFFORT, max_tokens=64, messages=USER, output_config={"effort": effort})
        assert f"Reasoning: {written}<|end|>" in rendered() and blocks(message)[0] == ("thinking", THOUGHT)
    counted = claude.messages.count_tokens(model=EFFORT, messages=USER, output_config={"effort": "high"})
    assert counted.input_tokens > claude.messages.count_tokens(model=EFFORT, messages=USER).input_tokens
    # A template that does not read it renders as without
    plain = openai_client.chat.completions.create(model=THINKER, messages=USER, max_tokens=64, reasoning_effort="high")
    assert plain.choices[0].message.content == ANSWER
    # A budget of tokens is not how gpt-oss is told to think less: the 400 says what is
    with pytest.raises(openai.BadRequestError, match="harmony.*set reasoning_effort"):
        openai_client.chat.completions.create(extra_body={"thinking_token_budget": 5}, **kwargs)
    for call in (lambda: openai_client.chat.completions.create(reasoning_effort="minimal", **kwargs),
                 lambda: openai_client.responses.create(model=EFFORT, input="Hi", reasoning={"effort": "minimal"})):
        with pytest.raises(openai.BadRequestError) as refused:
            call()
        assert "reasoning" in str(refused.value) and "'high'" in str(refused.value), refused.value


# ---- the safety layer reads what the client does ------------------------------------------------

def masked(text: str, cuts: tuple[int, ...]) -> str:
    """`text` fed in pieces cut at `cuts` to a splitter, as the safety layer scans it: the
    characters its markup spans cover as "#", the undecided tail never scanned before the end."""
    splitter = HarmonySplitter(calls=True).record()
    scanned, hidden = [], []
    for a, b in itertools.pairwise((0, *cuts, len(text))):
        splitter.feed(text[a:b])
        decided, spans = splitter.markup()
        hidden += spans
        assert decided <= b and decided >= sum(map(len, scanned))
        scanned.append(text[sum(map(len, scanned)):decided])
    splitter.finish()
    decided, spans = splitter.markup()
    hidden += spans
    assert decided == len(text)
    out = list(text)
    for s, e in hidden:
        out[s:e] = "#" * (e - s)
    return "".join(out)


@pytest.mark.parametrize("text", CASES)
def test_markup_is_the_same_however_the_text_is_cut(text):
    """The spans the safety layer does not read (markers, headers) are decided as the text
    streams and come out the same for every cut; nothing of a marker or a header is left."""
    whole = masked(text, ())
    rng = random.Random(1)
    cuttings = [(i,) for i in range(1, len(text))] + [tuple(range(1, len(text)))]
    cuttings += [tuple(sorted(rng.sample(range(1, len(text)), k=min(len(text) - 1, 5)))) for _ in range(50)]
    for cuts in cuttings:
        assert masked(text, cuts) == whole, cuts
    for word in ("<|", "analysis", "assistant", "to=functions", "constrain", "\ufdd0"):
        assert word not in whole or word in HarmonySplitter(calls=True).split(text)[1], (word, whole)


def test_markup_of_a_forced_call():
    """A forced call's header begins in tierlm's prime (` to=functions.`): the answer's first
    characters continue it, undecided (not read) until its `<|message|>`."""
    splitter = HarmonySplitter(calls=True)
    splitter.prime(" to=functions.")
    splitter.record()
    text = kept('get_weather<|channel|>commentary json<|message|>{"city": "Rome"}')
    for i in range(len(text)):
        splitter.feed(text[i])
        decided, _ = splitter.markup()
        assert decided == 0 or decided >= text.index("{"), (i, decided)
    splitter.finish()
    assert splitter.markup()[0] == len(text)


def test_markup_of_an_answer():
    text = answer(CALL_REPLY)
    scanned = masked(text, ())
    assert scanned.replace("#", " ").split() == [CALL_THOUGHT.split()[0], *CALL_THOUGHT.split()[1:], '{"location":',
                                                 '"Paris"}']
    # out of format: all of it is read; a header cut off is not
    assert masked("plain to=x text", ()) == "plain to=x text"
    assert masked(kept("<|channel|>analysis<|message|>a<|end|><|start|>assistant<|chan"), ()).strip("#") == "a"


GUARDED_KEYS = {"hdr": "sk-hdr", "vis": "sk-vis"}
GUARDED_TENANTS = tenants_file({"hdr": "bronze", "vis": "gold"})
# Words only harmony's headers spell here, for tenant hdr: "anal" (not whole-word: it is in
# "analysis"), the role, a tool's namespace; for tenant vis, words of the reasoning and the answer
GUARDED_POLICIES = output_policies_file([("rude", ["anal", "assistant"], "block", "hdr"),
                                         ("names", ["functions", "get_weather"], "redact", "hdr"),
                                         ("thought", ["greets"], "redact", "vis"),
                                         ("answer", ["there"], "block", "vis")])


@pytest.fixture(scope="module")
def guarded(demo_tokenizer, tmp_path_factory):
    root = tmp_path_factory.mktemp("harmony-guarded")
    models = build_templated_models(root, demo_tokenizer, [
        (THINKER, HARMONY_TEMPLATE, REPLY, MARKERS), (CALLER, HARMONY_TEMPLATE, CALL_REPLY, MARKERS),
    ], added=MARKERS, eos_tokens=(RETURN, CALL))
    models[FORCED] = forced_model(tmp_path_factory.mktemp("harmony-guarded-forced"), models[THINKER].path)
    server = guarded_server(root, {name: model.engine(name) for name, model in models.items()}, GUARDED_KEYS,
                            GUARDED_TENANTS, GUARDED_POLICIES)
    yield server
    server.stop()


def guarded_clients(server, key):
    return sdk_clients(server.url, GUARDED_KEYS[key])


def test_output_policies_do_not_read_harmonys_headers(guarded):
    """A phrase only a header spells ("anal" in `analysis`, the role, the `functions.` of a
    recipient, the tool's name) neither stops nor redacts an answer the client never sees it in:
    "anal" stopped every gpt-oss answer at its first header, "functions" turned every call into
    text (a forced call's too, whose header tierlm starts)."""
    claude, openai_client = guarded_clients(guarded, "hdr")
    for plain in (True, False):  # (markers kept as special tokens, or decoded as their plain text)
        kwargs = dict(model=THINKER, messages=USER, max_tokens=64, extra_body={"skip_special_tokens": plain})
        done = openai_client.chat.completions.create(**kwargs)
        assert (done.choices[0].finish_reason, done.choices[0].message.content) == ("stop", ANSWER)
        assert openai_stream(openai_client, **kwargs) == (THOUGHT, ANSWER, [], "stop")
    called = openai_client.chat.completions.create(model=CALLER, messages=USER, tools=[OPENAI_WEATHER], n=2)
    for choice in called.choices:
        assert choice.finish_reason == "tool_calls"
        assert [json.loads(c.function.arguments) for c in choice.message.tool_calls] == [{"location": "Paris"}]
    assert openai_stream(openai_client, model=CALLER, messages=USER, tools=[OPENAI_WEATHER]) == (
        CALL_THOUGHT, "", [("get_weather", {"location": "Paris"})], "tool_calls")
    message = claude.messages.create(model=CALLER, max_tokens=128, messages=USER, tools=[WEATHER])
    assert blocks(message) == [("thinking", CALL_THOUGHT), ("tool_use", {"location": "Paris"})]
    forced = dict(model=FORCED, messages=USER, tools=[OPENAI_WEATHER], tool_choice="required", max_tokens=64)
    assert openai_stream(openai_client, **forced) == ("", "", [("get_weather", {"location": "Rome"})], "tool_calls")
    with claude.messages.stream(model=THINKER, max_tokens=64, messages=USER) as stream:
        assert blocks(stream.get_final_message()) == [("thinking", THOUGHT), ("text", ANSWER)]
    response = openai_client.responses.create(model=THINKER, input="Hi")
    assert response.status == "completed" and response.output_text == ANSWER


def test_output_policies_still_read_the_reasoning_and_the_answer(guarded):
    claude, openai_client = guarded_clients(guarded, "vis")
    redacted = THOUGHT.replace("greets", "[x]")
    done = openai_client.chat.completions.create(model=THINKER, messages=USER, max_tokens=64)
    choice = done.choices[0]
    assert choice.finish_reason == "content_filter" and "there" not in (choice.message.content or "")
    assert choice.message.model_extra["reasoning"] == redacted
    reasoning, content, _, finish = openai_stream(openai_client, model=THINKER, messages=USER, max_tokens=64)
    assert (reasoning, finish) == (redacted, "content_filter") and "there" not in content
    message = claude.messages.create(model=THINKER, max_tokens=64, messages=USER)
    assert message.stop_reason == "refusal" and blocks(message)[0] == ("thinking", redacted)


def test_responses_api_logprobs_are_the_messages_text_tokens(clients):
    """The message's output_text logprobs are its text's tokens: they held the final message's
    header tokens too (`<|start|>`, `assistant`, `<|channel|>`, `final`, `<|message|>`), which
    no text of the message spells; streamed, the deltas' logprobs are the same tokens."""
    _, openai_client = clients
    kwargs = dict(model=THINKER, input="Hi", top_logprobs=1, include=["message.output_text.logprobs"])
    done = openai_client.responses.create(**kwargs)
    tokens = [t.token for t in done.output[-1].content[0].logprobs]
    assert "".join(tokens) == ANSWER == done.output_text, tokens
    with openai_client.responses.stream(**kwargs) as stream:
        deltas = [t.token for event in stream if event.type == "response.output_text.delta" for t in event.logprobs]
        final = stream.get_final_response()
    assert deltas == tokens == [t.token for t in final.output[-1].content[0].logprobs]


def test_analysis_tokens_are_counted_by_their_markers(tmp_path, demo_tokenizer):
    from tierlm.serving.harmony import analysis_tokens

    tok = copy_of(demo_tokenizer, tmp_path)
    assert analysis_tokens([1, 2, 3], tok) is None  # (no harmony markers: no count)
    tok.add_tokens(list(MARKERS), special_tokens=True)

    def ids(text):
        return tok.encode(text, add_special_tokens=False)
    first, second = "<|channel|>analysis<|message|>a b<|end|>", "<|start|>assistant<|channel|>analysis<|message|>c<|end|>"
    final = "<|start|>assistant<|channel|>final<|message|>d e f"
    assert analysis_tokens(ids(first + second + final), tok) == len(ids(first + second))
    call = '<|start|>assistant<|channel|>commentary to=functions.f <|constrain|>json<|message|>{"analysis": 1}'
    assert analysis_tokens(ids(first + call), tok) == len(ids(first))
    assert analysis_tokens(ids(first + "<|start|>assistant<|channel|>analysis<|message|>cut of"), tok) == len(
        ids(first + "<|start|>assistant<|channel|>analysis<|message|>cut of"))
    assert analysis_tokens(ids(final), tok) == 0


@pytest.mark.parametrize("text", CASES)
def test_a_guarded_answer_is_shown_whole_and_redacted_outside_its_markup(text, tmp_path):
    """Through an output guard reading harmony's markup, however the answer is cut: with no
    match it comes out as it went in; a redaction of a word the headers spell too ("assistant",
    "get_weather") masks it where the client reads it, and leaves every header as written."""
    from tests.serving.test_safety_policies import _rules, deltas
    from tierlm.serving.safety import OutputGuard

    rules = _rules(tmp_path, "[policies.r]\nphrases = ['assistant', 'get_weather', 'Paris', 'user']\n"
                             "action = 'redact'\nreplacement = '~'\n")
    whole = HarmonySplitter(calls=True).split(text)
    expected = HarmonySplitter(calls=True).split(text.replace("Paris", "~").replace("user", "~"))
    rng = random.Random(2)
    for cuts in [(), *(tuple(sorted(rng.sample(range(1, len(text)), k=min(len(text) - 1, 6)))) for _ in range(30))]:
        pieces = [text[a:b] for a, b in itertools.pairwise((0, *cuts, len(text)))]
        guard = OutputGuard(rules, HarmonySplitter(calls=True).record())
        shown = "".join(d.text for delta in deltas(pieces) for d in guard.feed(delta)[0])
        assert HarmonySplitter(calls=True).split(shown) == expected, (cuts, shown)
    assert expected[0] == whole[0].replace("user", "~") and expected[1] == whole[1].replace("Paris", "~")


@pytest.mark.parametrize("stop, reasoning, content", [
    ("there", THOUGHT, "Hello "), ("greets", "The user ", ""),  # in the answer, in the analysis
    ("final", THOUGHT, ""), ("<|end|>", THOUGHT, ""),  # a header's word, a marker as its text (README)
])
def test_stop_strings_match_the_answer_as_written(clients, stop, reasoning, content):
    """As the README says (and vLLM matches them): the engine matches stop strings against the
    whole answer as written, analysis and headers included."""
    claude, openai_client = clients
    choice = openai_client.chat.completions.create(model=THINKER, messages=USER, max_tokens=64, stop=[stop]).choices[0]
    assert (choice.message.model_extra["reasoning"], choice.message.content) == (reasoning, content)
    assert (choice.finish_reason, choice.model_extra["stop_reason"]) == ("stop", stop)
    message = claude.messages.create(model=THINKER, max_tokens=64, messages=USER, stop_sequences=[stop])
    assert (message.stop_reason, message.stop_sequence) == ("stop_sequence", stop)
    assert [b for b in blocks(message) if b[1]] == [b for b in [("thinking", reasoning), ("text", content)] if b[1]]
