"""Finding tool calls in generated text.

Models learn one tool-call syntax from their chat template. tierlm understands the Hermes /
Qwen form, which the template itself shows the model:

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

Tool calls are parsed after generation. While streaming, text is passed through until a tool
call may be starting (`ToolCallStreamFilter` holds back trailing whitespace and a possible
partial `<tool_call>`), and everything from there on is buffered and parsed at the end, so
clients never see half a call and see the same prose as a non-streamed answer.
"""
from __future__ import annotations

import hashlib
import json
import re
import string
import uuid
from dataclasses import dataclass
from typing import Any

from tierlm.serving.validation import loads_strict

TOOL_CALL_START = "<tool_call>"
TOOL_CALL_END = "</tool_call>"
# A call counts only once closed: an unclosed one was cut off (max_tokens), whatever its JSON.
_CALL_RE = re.compile(re.escape(TOOL_CALL_START) + r"(.*?)(" + re.escape(TOOL_CALL_END) + r"|\Z)", re.S)


@dataclass
class ParsedToolCall:
    id: str
    name: str
    arguments: dict[str, Any]


@dataclass
class ParsedOutput:
    """Generated text split into the prose before the first call and the calls themselves."""

    text: str
    tool_calls: list[ParsedToolCall]


def template_supports_tools(chat_template: str | None) -> bool:
    """Whether the chat template renders a `tools` list (so the model is told about tools)."""
    return bool(chat_template) and "tools" in chat_template


def template_uses_hermes_calls(chat_template: str | None) -> bool:
    return bool(chat_template) and TOOL_CALL_START in chat_template


def new_tool_call_id(prefix: str = "toolu_") -> str:
    return prefix + uuid.uuid4().hex[:24]


_ID_ALPHABET = string.ascii_letters + string.digits


def template_tool_call_id(call_id: str) -> str:
    """The id a chat template sees for the client's `call_id`: 9 letters and digits, the same
    for a call and its result, in every request (a hash, not a counter).

    Mistral's templates refuse any other shape ("Tool call IDs should be alphanumeric strings
    with length 9!"), so a round trip with the API's own ids (`toolu_...`, `call_...`) was a 400;
    vLLM rewrites ids for Mistral the same way. Done for every template: an id only pairs a call
    with its result, 9 alphanumerics suit every known template, and spotting the templates
    that check would mean parsing Jinja. Two ids meet by chance with odds of about 1 in 10^16.
    """
    n = int.from_bytes(hashlib.sha256(call_id.encode()).digest()[:8], "big")
    chars = []
    for _ in range(9):
        n, r = divmod(n, len(_ID_ALPHABET))
        chars.append(_ID_ALPHABET[r])
    return "".join(chars)


def parse_tool_calls(text: str, id_prefix: str = "toolu_", names: frozenset[str] | None = None) -> ParsedOutput:
    """Split `text` into prose and Hermes tool calls.

    If any call is not valid JSON with a string `name`, names a tool not in `names` (the tools
    the request offered, when given: both APIs only ever call those), or is not closed by
    TOOL_CALL_END (cut off by max_tokens), nothing is treated as a call and the whole text is
    returned as prose: a half-parsed answer is worse than the raw one.
    """
    start = text.find(TOOL_CALL_START)
    if start < 0:
        return ParsedOutput(text=text, tool_calls=[])
    calls: list[ParsedToolCall] = []
    for match in _CALL_RE.finditer(text, start):
        call = _parse_one(match.group(1), id_prefix) if match.group(2) else None
        if call is None or (names is not None and call.name not in names):
            return ParsedOutput(text=text, tool_calls=[])
        calls.append(call)
    return ParsedOutput(text=text[:start].rstrip(), tool_calls=calls)


def _loads_output(text: str) -> Any:
    """A model's JSON, as strict as a request's: NaN, Infinity and 1e999 are not JSON (the answer
    failed to serialise, a 500, or streamed arguments a strict client cannot parse and tierlm
    itself refuses when they are sent back), nor is a lone surrogate (\\ud800) UTF-8."""
    data = loads_strict(text)
    json.dumps(data, ensure_ascii=False).encode("utf-8")  # raises on a lone surrogate
    return data


def _parse_one(body: str, id_prefix: str) -> ParsedToolCall | None:
    try:
        data = _loads_output(body.strip())
    except (ValueError, RecursionError):
        return None
    if not isinstance(data, dict) or not isinstance(data.get("name"), str):
        return None
    arguments = data.get("arguments", data.get("parameters", {}))
    if isinstance(arguments, str):  # some models emit the arguments JSON-encoded
        try:
            arguments = _loads_output(arguments)
        except (ValueError, RecursionError):
            return None
    if not isinstance(arguments, dict):
        return None
    return ParsedToolCall(id=new_tool_call_id(id_prefix), name=data["name"], arguments=arguments)


class ToolCallStreamFilter:
    """Passes streamed text through until a tool call may begin, then buffers the rest.

    `feed` returns the text that is safe to show now; `finish` parses what was held back.
    """

    def __init__(self, id_prefix: str = "toolu_", names: frozenset[str] | None = None) -> None:
        self._id_prefix = id_prefix
        self._names = names  # the tools offered (see parse_tool_calls)
        # Held back: trailing whitespace (dropped if a call follows, as parse_tool_calls strips
        # the prose before a call) and then what might be the start of TOOL_CALL_START.
        self._pending = ""
        self._space = ""  # the whitespace before TOOL_CALL_START, once seen
        self._buffer: str | None = None  # everything from TOOL_CALL_START on, once seen

    @property
    def in_tool_call(self) -> bool:
        return self._buffer is not None

    def feed(self, text: str) -> str:
        if self._buffer is not None:
            self._buffer += text
            return ""
        pending = self._pending + text
        start = pending.find(TOOL_CALL_START)
        if start >= 0:
            prose = pending[:start]
            shown = prose.rstrip()
            self._space, self._buffer = prose[len(shown):], pending[start:]
            self._pending = ""
            return shown
        marker = _partial_marker_suffix(pending)
        shown = pending[: len(pending) - marker].rstrip()
        self._pending = pending[len(shown):]
        return shown

    def finish(self) -> tuple[str, list[ParsedToolCall]]:
        """(text still to show, parsed calls). Unparseable calls come back as text."""
        if self._buffer is None:
            rest, self._pending = self._pending, ""
            return rest, []
        parsed = parse_tool_calls(self._buffer, self._id_prefix, self._names)
        buffered, self._buffer = self._space + self._buffer, None
        if not parsed.tool_calls:
            return buffered, []
        return parsed.text, parsed.tool_calls


def _partial_marker_suffix(text: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of TOOL_CALL_START."""
    for n in range(min(len(text), len(TOOL_CALL_START) - 1), 0, -1):
        if TOOL_CALL_START.startswith(text[-n:]):
            return n
    return 0


def anthropic_tools_to_template(tools: list[Any]) -> list[dict[str, Any]]:
    """Anthropic tool definitions in the OpenAI-function form HF chat templates expect."""
    return [
        {
            "type": "function",
            "function": {
                "name": t.name,
                "description": t.description or "",
                "parameters": t.input_schema,
            },
        }
        for t in tools
    ]


def forced_call_prefix(tool_name: str | None) -> str:
    """Assistant text that starts a tool call, used when the client requires one.

    Without constrained decoding the model cannot be made to call a tool; starting the call
    for it (and naming the tool when one is required) is the strongest nudge available.
    """
    if tool_name is None:
        return TOOL_CALL_START + "\n"
    return TOOL_CALL_START + "\n" + '{"name": ' + json.dumps(tool_name) + ', "arguments": '
