"""Hermes tool-call parsing, whole and streamed."""
from __future__ import annotations

import pytest

from tierlm.serving.tools import ToolCallStreamFilter, forced_call_prefix, parse_tool_calls

CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


def test_parses_prose_then_calls():
    out = parse_tool_calls("Let me check.\n" + CALL + CALL.replace("Paris", "Rome"))
    assert out.text == "Let me check."
    assert [(c.name, c.arguments) for c in out.tool_calls] == [
        ("get_weather", {"city": "Paris"}), ("get_weather", {"city": "Rome"})]
    assert out.tool_calls[0].id.startswith("toolu_") and out.tool_calls[0].id != out.tool_calls[1].id


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
