"""Tool-call parsing (Hermes, llama3_json, mistral), whole and streamed."""
from __future__ import annotations

import pytest

from tierlm.engine.detokenizer import KEPT_CLOSE, KEPT_OPEN
from tierlm.serving.tools import (
    ToolCallStreamFilter,
    detect_parser,
    forced_call_prefix,
    parse_tool_calls,
    scrub,
    tool_call_syntax,
)

CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


def test_parses_prose_then_calls():
    out = parse_tool_calls("Let me check.\n" + CALL + CALL.replace("Paris", "Rome"))
    assert out.text == "Let me check."
    assert [(c.name, c.arguments) for c in out.tool_calls] == [
        ("get_weather", {"city": "Paris"}), ("get_weather", {"city": "Rome"})]
    assert out.tool_calls[0].id.startswith("toolu_") and out.tool_calls[0].id != out.tool_calls[1].id


def test_hermes_call_without_arguments_calls_with_none():
    """The tag marks a call, so Hermes (unlike llama3_json and mistral) needs no arguments key."""
    out = parse_tool_calls('<tool_call>{"name": "get_time"}</tool_call>')
    assert [(c.name, c.arguments) for c in out.tool_calls] == [("get_time", {})]


def test_string_arguments():
    out = parse_tool_calls('<tool_call>{"name": "f", "arguments": "{\\"x\\": 1}"}</tool_call>')
    assert [(c.name, c.arguments) for c in out.tool_calls] == [("f", {"x": 1})]


@pytest.mark.parametrize("text", [
    'Sure.\n<tool_call>\n{"name": "f", "arguments": {"x": 1}}',  # cut off after the JSON (max_tokens)
    'Sure.\n<tool_call>\n{"name": "f", "arguments": {"x": 1}}\n</tool_',
    CALL + '\n<tool_call>\n{"name": "f", "arguments": {}}',  # a closed call, then a cut-off one
])
def test_unclosed_call_is_text(text):
    out = parse_tool_calls(text)
    assert out.text == text and out.tool_calls == []


@pytest.mark.parametrize("text", [
    "no calls here", "<tool_call>{not json}</tool_call>", '<tool_call>{"arguments": {}}</tool_call>',
    '<tool_call>{"name": "f", "arguments": [1]}</tool_call>',
    # not JSON as a request must have it (the answer was a 500, or sent back, a 400)
    '<tool_call>{"name": "f", "arguments": {"t": NaN}}</tool_call>',
    '<tool_call>{"name": "f", "arguments": {"t": -Infinity}}</tool_call>',
    '<tool_call>{"name": "f", "arguments": {"t": 1e999}}</tool_call>',
    '<tool_call>{"name": "f", "arguments": "{\\"t\\": NaN}"}</tool_call>',
    '<tool_call>{"name": "f", "arguments": {"t": "\\ud800"}}</tool_call>',
])
def test_unparseable_output_stays_text(text):
    out = parse_tool_calls(text)
    assert out.text == text and out.tool_calls == []


def stream_through(pieces: list[str]) -> tuple[str, list]:
    f = ToolCallStreamFilter()
    shown = "".join(f.feed(p) for p in pieces)
    rest, calls = f.finish()
    return shown + rest, calls


def test_stream_filter_passes_text_and_buffers_the_call():
    text = "Sure: " + CALL
    for size in (1, 3, 7, len(text)):
        pieces = [text[i:i + size] for i in range(0, len(text), size)]
        shown, calls = stream_through(pieces)
        assert shown == "Sure:" == parse_tool_calls(text).text  # the whitespace before a call is dropped
        assert [c.name for c in calls] == ["get_weather"]


@pytest.mark.parametrize("text", ["Let me check.\n \n" + CALL, "a  b \n", "x \n<tool_cat>\n", "  \n" + CALL,
                                  "x \n<tool_call>{broken", "x\n" + CALL[:-3]])
def test_stream_filter_shows_what_parsing_shows(text):
    """Held-back whitespace is dropped before a call and flushed when anything else follows."""
    whole = parse_tool_calls(text)
    for size in (1, 2, 5, len(text)):
        shown, calls = stream_through([text[i:i + size] for i in range(0, len(text), size)])
        assert shown == whole.text and [c.arguments for c in calls] == [c.arguments for c in whole.tool_calls]


def test_stream_filter_releases_false_alarms():
    shown, calls = stream_through(["a <tool", "_ca", "t> b"])
    assert shown == "a <tool_cat> b" and calls == []
    shown, calls = stream_through(["x <tool_call>{broken"])
    assert shown == "x <tool_call>{broken" and calls == []
    shown, calls = stream_through(["ends with <too"])
    assert shown == "ends with <too"


def test_forced_prefix_completes_into_a_call():
    prefix = forced_call_prefix("get_weather")
    out = parse_tool_calls(prefix + '{"city": "Oslo"}}\n</tool_call>')
    assert [(c.name, c.arguments) for c in out.tool_calls] == [("get_weather", {"city": "Oslo"})]


def test_a_call_to_a_tool_not_offered_is_text_whole_and_streamed():
    offered = frozenset({"get_time"})
    text = "Sure.\n" + CALL
    assert parse_tool_calls(text, names=offered).tool_calls == []
    assert parse_tool_calls(text, names=offered).text == text
    assert [c.name for c in parse_tool_calls(text, names=frozenset({"get_weather"})).tool_calls] == ["get_weather"]
    f = ToolCallStreamFilter(names=offered)
    shown = "".join(f.feed(text[i:i + 4]) for i in range(0, len(text), 4))
    rest, calls = f.finish()
    assert shown + rest == text and calls == []


# ---- llama3_json and mistral (vLLM's parsers of those names) ------------------------------

LLAMA = tool_call_syntax("llama3_json", None)
MISTRAL = tool_call_syntax("mistral", None)
L_CALL = '{"name": "get_weather", "parameters": {"city": "Paris"}}'
M_LIST = '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}, {"name": "get_time", "arguments": {}}]'
M_ARGS = '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]get_time[ARGS]{}'


def kept(marker: str) -> str:
    """A marker as the detokenizer writes a kept special token."""
    return KEPT_OPEN + marker + KEPT_CLOSE


def wrapped(text: str, markers=("[TOOL_CALLS]", "[ARGS]", "[CALL_ID]", "<|python_tag|>")) -> str:
    for m in markers:
        text = text.replace(m, kept(m))
    return text


def calls_of(out):
    return [(c.name, c.arguments) for c in out.tool_calls]


@pytest.mark.parametrize("text", [
    L_CALL, "  \n" + L_CALL + "\n", "<|python_tag|>" + L_CALL, L_CALL.replace("parameters", "arguments"),
    L_CALL + "; " + L_CALL.replace("Paris", "Rome").replace("get_weather", "get_time") + ";",
])
def test_llama3_json_calls(text):
    assert calls_of(parse_tool_calls(wrapped(text), syntax=LLAMA)) == calls_of(parse_tool_calls(text, syntax=LLAMA))
    out = parse_tool_calls(text, syntax=LLAMA)
    assert out.text == "" and out.tool_calls and out.tool_calls[0].name == "get_weather"
    assert out.tool_calls[0].arguments == {"city": "Paris"}
    assert len(out.tool_calls) == text.count('"name"')


@pytest.mark.parametrize("text", [
    "Sure: " + L_CALL,  # a call must begin the answer
    L_CALL + " and some prose",
    L_CALL + " " + L_CALL,  # several calls need `;`
    '{"name": "get_weather", "parameters": {"city": "Paris"}',  # cut off (max_tokens)
    '{"name": "get_weather", "parameters": {"city": NaN}}', '{"names": "x"}', "<|python_tag|>brave.call(q='x')",
    L_CALL + "; {broken", "{}", "",
    # JSON with a name but neither arguments nor parameters is JSON, not a call (as vLLM's)
    '{"name": "get_weather", "description": "Returns the current weather"}', '{"name": "get_weather"}',
    L_CALL + '; {"name": "get_time"}',
])
def test_llama3_json_text(text):
    out = parse_tool_calls(text, syntax=LLAMA)
    assert out.text == text and out.tool_calls == []


@pytest.mark.parametrize("text", [M_LIST, "Checking.\n" + M_LIST, M_ARGS, "Checking. " + M_ARGS,
                                  '[TOOL_CALLS]get_weather[CALL_ID]a1b2c3d4e[ARGS]{"city": "Paris"}'
                                  '[TOOL_CALLS]get_time[CALL_ID]x[ARGS]{}'])
def test_mistral_calls(text):
    out = parse_tool_calls(text, syntax=MISTRAL)
    assert calls_of(out) == [("get_weather", {"city": "Paris"}), ("get_time", {})]
    assert out.text == text[:text.index("[TOOL_CALLS]")].rstrip()
    out = parse_tool_calls(wrapped(text), syntax=MISTRAL)  # the markers as kept special tokens
    assert calls_of(out) == [("get_weather", {"city": "Paris"}), ("get_time", {})]
    assert out.text == text[:text.index("[TOOL_CALLS]")].rstrip()


@pytest.mark.parametrize("text", [
    "[TOOL_CALLS][]", "[TOOL_CALLS][{", M_LIST[:-2], "[TOOL_CALLS]get_weather[ARGS]{\"city\": ",
    "[TOOL_CALLS]get_weather[ARGS]{} trailing", "[TOOL_CALLS]two words[ARGS]{}", "[TOOL_CALLS][{\"name\": 1}]",
    "[TOOL_CALLS]get_weather[ARGS][1]", "no [TOOL_CALL] here",
    '[TOOL_CALLS][{"name": "get_weather", "note": "x"}]', '[TOOL_CALLS]{"name": "get_weather"}',
])
def test_mistral_text(text):
    out = parse_tool_calls(text, syntax=MISTRAL)
    assert out.text == text and out.tool_calls == []


@pytest.mark.parametrize("syntax,text", [(LLAMA, L_CALL), (MISTRAL, "Checking. " + M_ARGS)])
def test_call_to_a_tool_not_offered_is_text(syntax, text):
    assert parse_tool_calls(text, names=frozenset({"other"}), syntax=syntax).text == text
    shown, calls = stream_with(syntax, text, 3, names=frozenset({"other"}))
    assert shown == text and calls == []


QUESTION = 'what does [TOOL_CALLS] mean in Mistral?'


@pytest.mark.parametrize("text", [
    kept("[TOOL_CALLS]") + 'search' + kept("[ARGS]") + '{"q": "' + QUESTION + '"}',
    kept("[TOOL_CALLS]") + ' [{"name": "search", "arguments": {"q": "' + QUESTION + '"}}]',
    "I quote [TOOL_CALLS] here. " + kept("[TOOL_CALLS]") + 'search' + kept("[ARGS]") + '{"q": "' + QUESTION + '"}',
])
def test_mistral_marker_text_inside_arguments_is_not_a_marker(text):
    """Where the marker is a kept special token, only that token separates calls: the same
    text in ordinary tokens (in an argument, or in prose before the call) is the model's own.
    It split the call, and the whole answer came back as text."""
    names = frozenset({"search"})
    prose = text[:text.index(KEPT_OPEN)].rstrip()
    out = parse_tool_calls(text, names=names, syntax=MISTRAL)
    assert calls_of(out) == [("search", {"q": QUESTION})] and out.text == prose
    for size in (1, 3, len(text)):
        shown, calls = stream_with(MISTRAL, text, size, names=names, hidden=MISTRAL.markers)
        assert shown == prose and calls_of_list(calls) == [("search", {"q": QUESTION})]


def stream_with(syntax, text, size, names=None, hidden=()):
    f = ToolCallStreamFilter(syntax=syntax, names=names, hidden=hidden)
    shown = "".join(f.feed(text[i:i + size]) for i in range(0, len(text), size))
    rest, calls = f.finish()
    return shown + rest, calls


@pytest.mark.parametrize("syntax,text", [
    (LLAMA, L_CALL), (LLAMA, " \n<|python_tag|>" + L_CALL + ";" + L_CALL), (LLAMA, "<|python_tag|>{broken"),
    (LLAMA, "Prose {\"a\": 1} <|python_tag|> x"), (LLAMA, "<|pyth"), (LLAMA, " \n "), (LLAMA, L_CALL[:-1]),
    (MISTRAL, M_LIST), (MISTRAL, "Checking.\n " + M_ARGS), (MISTRAL, "a [TOOL_CALL b"), (MISTRAL, "x [TOOL_CALLS][{"),
    (MISTRAL, "Usage: app [ARGS] " + wrapped(M_ARGS)), (MISTRAL, "Usage: app [ARGS] \n" + M_ARGS),
    (MISTRAL, "a " + KEPT_OPEN + "[TOOL"), (MISTRAL, "a " + KEPT_OPEN), (LLAMA, " " + wrapped("<|python_tag|>" + L_CALL)),
    (LLAMA, wrapped("Hi <|python_tag|> x")), (LLAMA, KEPT_OPEN + "<|pyth"),
])
def test_streaming_shows_what_parsing_shows(syntax, text):
    """Whatever the pieces (markers, plain or kept, split across them), streamed prose is the
    whole answer's."""
    whole = parse_tool_calls(text, syntax=syntax)
    for hidden in ((), syntax.markers):
        for size in (1, 2, 5, len(text) or 1):
            shown, calls = stream_with(syntax, text, size, hidden=hidden)
            assert shown == scrub(whole.text, hidden) and calls_of_list(calls) == calls_of(whole)


def calls_of_list(calls):
    return [(c.name, c.arguments) for c in calls]


def test_streaming_holds_back_a_possible_call_and_shows_prose_at_once():
    f = ToolCallStreamFilter(syntax=LLAMA)
    assert f.feed(" {") == "" and f.feed('"name"') == ""  # may be a call: nothing shown
    f = ToolCallStreamFilter(syntax=LLAMA)
    assert f.feed("Hi {") == "Hi {" and f.feed('"name": "f", "parameters": {}}') == '"name": "f", "parameters": {}}'
    assert f.finish() == ("", [])  # a call only begins an answer
    f = ToolCallStreamFilter(syntax=MISTRAL)
    assert f.feed("Sure [TOOL") == "Sure" and f.feed("_CALLS]f[ARGS]{}") == ""
    rest, calls = f.finish()
    assert rest == "" and calls_of_list(calls) == [("f", {})]


@pytest.mark.parametrize("syntax,text,shown", [
    (MISTRAL, wrapped("[TOOL_CALLS]bad[ARGS]{oops"), "bad{oops"),  # unparseable: text, without the markers
    (LLAMA, wrapped("Hi <|python_tag|>there"), "Hi there"),
    (LLAMA, wrapped("<|python_tag|>brave.call()"), "brave.call()"),
    # the same text in ordinary tokens is the model's prose: it stays
    (MISTRAL, "Usage: app [ARGS], see docs", "Usage: app [ARGS], see docs"),
    (MISTRAL, "[TOOL_CALLS]bad[ARGS]{oops", "[TOOL_CALLS]bad[ARGS]{oops"),
    (MISTRAL, "quote [ARGS] " + wrapped("[TOOL_CALLS]bad[ARGS]{oops"), "quote [ARGS] bad{oops"),
    (LLAMA, "Llama writes <|python_tag|> before code", "Llama writes <|python_tag|> before code"),
    # a stop string that cut a kept marker leaves no sentinel
    (MISTRAL, "a" + KEPT_OPEN, "a"), (MISTRAL, "a" + KEPT_OPEN + "[TOOL", "a[TOOL"),
])
def test_kept_special_markers_never_reach_the_client(syntax, text, shown):
    """Markers a real tokenizer marks special (kept only to find calls, wrapped by the
    detokenizer) are taken out of prose; the same text in ordinary tokens is not."""
    for size in (1, 4, len(text)):
        assert stream_with(syntax, text, size, hidden=syntax.markers)[0] == shown
    assert scrub(parse_tool_calls(text, syntax=syntax).text, syntax.markers) == shown


@pytest.mark.parametrize("template,parser", [
    ("{{ '<tool_call>' }}", "hermes"), ("{{ '[TOOL_CALLS] [' }}", "mistral"),
    ("{{- '<|python_tag|>' }}", "llama3_json"), ("<|start_header_id|>ipython<|end_header_id|>", "llama3_json"),
    ("{{ messages }}", "hermes"), (None, "hermes"),
])
def test_parser_detected_from_the_template(template, parser):
    assert detect_parser(template) == parser


@pytest.mark.parametrize("syntax,tail", [
    (LLAMA, '{"city": "Oslo"}}'), (MISTRAL, '{"city": "Oslo"}}]'),
    (tool_call_syntax("mistral", "[TOOL_CALLS]{{ name }}[ARGS]"), '{"city": "Oslo"}'),
])
def test_forced_prefix_per_syntax(syntax, tail):
    out = parse_tool_calls(forced_call_prefix("get_weather", syntax) + tail, syntax=syntax)
    assert calls_of(out) == [("get_weather", {"city": "Oslo"})]


@pytest.mark.parametrize("syntax,text,calls", [
    (tool_call_syntax("hermes", None), CALL, ["get_weather"]),  # closed by </tool_call>: whole however the answer ended
    (LLAMA, L_CALL, []), (MISTRAL, M_ARGS, []), (MISTRAL, M_LIST, []),
])
def test_an_answer_the_model_did_not_end_has_calls_only_where_they_close(syntax, text, calls):
    assert [c.name for c in parse_tool_calls(text, syntax=syntax, ended=False).tool_calls] == calls
    f = ToolCallStreamFilter(syntax=syntax)
    shown = f.feed(text)
    rest, found = f.finish(ended=False)
    assert [c.name for c in found] == calls and (shown + rest == text if not calls else True)
