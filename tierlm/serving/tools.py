"""Finding tool calls in generated text.

Models learn one tool-call syntax from their chat template, and vLLM makes its users pick the
parser per model family (`--tool-call-parser`). tierlm knows four, as vLLM's parsers read them
(`ToolCallSyntax`; `tierlm serve --tool-call-parser`, by default detected from the template):

- `hermes` (Hermes, Qwen): `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, after
  prose or not, one per tag;
- `llama3_json` (Llama 3.1-3.3): the answer is `<|python_tag|>` (optionally) and then
  `{"name": ..., "parameters": {...}}` objects separated by `;`. Only an answer that begins so
  (after whitespace) is a call: Llama writes JSON in prose too;
- `mistral`: `[TOOL_CALLS]` then a JSON list of `{"name": ..., "arguments": {...}}` (older
  tokenizers), or `[TOOL_CALLS]name[ARGS]{...}`, repeated (newer ones), after prose or not;
- `harmony` (gpt-oss; vLLM's `openai`): a message addressed `to=functions.NAME`, its body the
  arguments' JSON. Its messages are read by harmony.HarmonySplitter, which writes each call into
  the text in one form of its own (harmony.call_text) that `HarmonySyntax` parses.

In llama3_json and mistral an object is a call only with `arguments` or `parameters` (as vLLM's
parsers, which index one or the other): `{"name": "get_weather"}` alone is JSON the model wrote.

`<|python_tag|>`, `[TOOL_CALLS]` and `[ARGS]` are special tokens in the real tokenizers, so a
decode that skips special tokens drops them: requests with tools keep their text
(`SamplingParams.keep_special_token_ids`), which the detokenizer wraps in two noncharacters
(KEPT_OPEN, KEPT_CLOSE). A wrapped marker parses as the marker (vLLM matches the marker's text,
so the same text in ordinary tokens parses too), and wherever text reaches the client the
wrapped ones are taken out (`scrub`): the same text written in ordinary tokens ("Usage: app
[ARGS]") is the model's prose and stays.

Tool calls are parsed after generation. While streaming, text is passed through until a tool
call may be starting (`ToolCallStreamFilter` holds back trailing whitespace and a possible
partial start marker), and everything from there on is buffered and parsed at the end, so
clients never see half a call and see the same prose as a non-streamed answer.
"""
from __future__ import annotations

import functools
import hashlib
import json
import re
import string
import uuid
from dataclasses import dataclass
from typing import Any

from tierlm.engine.detokenizer import KEPT_CLOSE, KEPT_OPEN
from tierlm.serving import harmony
from tierlm.serving.validation import loads_strict

TOOL_CALL_START = "<tool_call>"
TOOL_CALL_END = "</tool_call>"
PYTHON_TAG = "<|python_tag|>"
MISTRAL_CALLS = "[TOOL_CALLS]"
MISTRAL_ARGS = "[ARGS]"
MISTRAL_CALL_ID = "[CALL_ID]"
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


class ToolCallSyntax:
    """How one model family writes tool calls: where a call may start, how the text from there
    on parses, and how tierlm starts one when tool_choice requires it."""

    name = ""
    start = ""  # the text that starts calls
    at_start_only = False  # a call must begin the answer (after whitespace)
    markers: tuple[str, ...] = ()  # texts of the syntax's own tokens (special in real tokenizers)
    # A call's JSON must hold `arguments` or `parameters` (vLLM's llama3_json and mistral parsers
    # index one or the other): where a call is plain JSON, `{"name": ...}` alone is just JSON.
    needs_arguments = True
    # Calls end with a marker of their own (Hermes' </tool_call>): a closed call is whole however
    # the answer ended. Without one (llama3_json, mistral) the answer is calls only where the
    # model ended it: cut by max_tokens, a stop string or a stop token right after a complete
    # call, it may have been going on to another call or to prose, which was lost.
    closes_calls = False
    any_prefix = ""  # how tierlm starts a call to any tool (tool_choice required): every call begins so
    # Texts of the syntax a real tokenizer may hold as one token of its own: a required call's
    # grammar writes such a marker as that token, as the model learnt it (see tool_grammar.py).
    token_texts: tuple[str, ...] = ()
    # Calls are messages of their own that harmony.HarmonySplitter reads out of the answer first
    # (the answer's start, a forced call's, is given to it, not to this parser).
    splits_messages = False

    def locate(self, text: str) -> tuple[int | None, int]:
        """(where a call begins in `text`, the whole answer so far, or None; how many characters
        at its end may still turn out to begin one). By default calls begin at `start`, anywhere."""
        return _find_marker(text, self.start)

    def parse(self, text: str, id_prefix: str, names: frozenset[str] | None, ended: bool = True) -> ParsedOutput:
        """Prose and calls; the whole text as prose if any call fails (see parse_tool_calls)."""
        start, _ = self.locate(text)
        if start is None or not (ended or self.closes_calls):
            return ParsedOutput(text=text, tool_calls=[])
        calls = self._calls(text[start:], id_prefix)
        if not calls or any(names is not None and c.name not in names for c in calls):
            return ParsedOutput(text=text, tool_calls=[])
        return ParsedOutput(text=text[:start].rstrip(), tool_calls=calls)

    def _calls(self, text: str, id_prefix: str) -> list[ParsedToolCall] | None:
        """The calls `text` (from the start marker on; kept markers wrapped, see _unwrapped)
        holds, or None if it is not all calls."""
        raise NotImplementedError

    def call_parts(self, tool_name: str) -> tuple[str, str]:
        """A whole call to `tool_name` (from its start marker) as the text before its arguments'
        JSON and the text after it: what tierlm starts a named call with, and what a required
        call's grammar writes around the tool's schema."""
        raise NotImplementedError

    def forced_prefix(self, tool_name: str | None) -> str:
        """The start of a call tierlm writes when tool_choice requires one: the call up to its
        arguments when the tool is named, else the syntax's start of any call."""
        return self.any_prefix if tool_name is None else self.call_parts(tool_name)[0]


class HermesSyntax(ToolCallSyntax):
    name = "hermes"
    start = TOOL_CALL_START
    closes_calls = True
    needs_arguments = False  # the tag says it is a call: `{"name": ...}` alone calls with {}
    any_prefix = TOOL_CALL_START + "\n"
    token_texts = (TOOL_CALL_START, TOOL_CALL_END)  # (Qwen's tokenizers hold both)

    def _calls(self, text: str, id_prefix: str) -> list[ParsedToolCall] | None:
        # (an unclosed call, cut off: None, which no call takes)
        items = [_json_or_none(m.group(1)) if m.group(2) else None for m in _CALL_RE.finditer(_unwrapped(text))]
        return _all_calls(items, id_prefix, self.needs_arguments)

    def call_parts(self, tool_name: str) -> tuple[str, str]:
        return self.any_prefix + '{"name": ' + json.dumps(tool_name) + ', "arguments": ', "}\n" + TOOL_CALL_END


class Llama3JsonSyntax(ToolCallSyntax):
    name = "llama3_json"
    markers = (PYTHON_TAG,)
    start = PYTHON_TAG
    at_start_only = True
    any_prefix = '{"name": "'
    token_texts = markers

    def locate(self, text: str) -> tuple[int | None, int]:
        rest = text.lstrip()
        at = len(text) - len(rest)
        tag = KEPT_OPEN + PYTHON_TAG
        if rest.startswith("{") or rest.startswith(PYTHON_TAG) or rest.startswith(tag):
            return at, 0
        return None, len(rest) if PYTHON_TAG.startswith(rest) or tag.startswith(rest) else 0

    def _calls(self, text: str, id_prefix: str) -> list[ParsedToolCall] | None:
        body = _unwrapped(text).removeprefix(PYTHON_TAG)
        decoder = json.JSONDecoder()
        items, pos = [], 0
        while True:
            pos = len(body) - len(body[pos:].lstrip())
            try:
                _, end = decoder.raw_decode(body, pos)
            except (ValueError, RecursionError):  # not JSON, or cut off (max_tokens)
                return None
            items.append(_json_or_none(body[pos:end]))
            rest = body[end:].lstrip()
            if not rest:
                return _all_calls(items, id_prefix, self.needs_arguments)
            if not rest.startswith(";"):
                return None
            pos = len(body) - len(rest) + 1
            if not body[pos:].strip():  # a trailing `;`
                return _all_calls(items, id_prefix, self.needs_arguments)

    def call_parts(self, tool_name: str) -> tuple[str, str]:
        return '{"name": ' + json.dumps(tool_name) + ', "parameters": ', "}"


class MistralSyntax(ToolCallSyntax):
    name = "mistral"
    markers = (MISTRAL_CALLS, MISTRAL_ARGS, MISTRAL_CALL_ID)
    start = MISTRAL_CALLS
    any_prefix = MISTRAL_CALLS
    token_texts = markers

    def __init__(self, args_form: bool = False) -> None:
        self.args_form = args_form  # the template writes `name[ARGS]{...}` (how a forced call starts)

    def locate(self, text: str) -> tuple[int | None, int]:
        """Calls begin at the kept marker token where there is one (the same text in ordinary
        tokens before it is prose), else at the marker's text."""
        at = text.find(KEPT_OPEN + MISTRAL_CALLS + KEPT_CLOSE)
        return (at, 0) if at >= 0 else _find_marker(text, self.start)

    def _calls(self, text: str, id_prefix: str) -> list[ParsedToolCall] | None:
        items: list[Any] = []
        # Where the marker is a kept special token, only the wrapped one separates calls: the
        # same text in ordinary tokens is the model's own (an argument asking what
        # "[TOOL_CALLS]" means), which read as a marker made the whole answer text.
        wrapped = KEPT_OPEN + MISTRAL_CALLS + KEPT_CLOSE
        parts = text.split(wrapped if wrapped in text else MISTRAL_CALLS)[1:]
        for part in map(_unwrapped, parts):
            if MISTRAL_ARGS in part:  # name[ARGS]{...}, or name[CALL_ID]id[ARGS]{...}
                head, args = part.split(MISTRAL_ARGS, 1)
                name = head.split(MISTRAL_CALL_ID, 1)[0].strip()
                if not name or any(c.isspace() for c in name):
                    return None
                # (arguments not JSON, or cut off by max_tokens: None, which no call takes)
                items.append({"name": name, "arguments": _json_or_none(args)})
            else:
                data = _json_or_none(part)
                items += data if isinstance(data, list) else [data]
        return _all_calls(items, id_prefix, self.needs_arguments)

    def call_parts(self, tool_name: str) -> tuple[str, str]:
        if self.args_form:
            return MISTRAL_CALLS + tool_name + MISTRAL_ARGS, ""
        return MISTRAL_CALLS + ' [{"name": ' + json.dumps(tool_name) + ', "arguments": ', "}]"  # as v0.3's template


class HarmonySyntax(ToolCallSyntax):
    """gpt-oss's calls, as harmony.HarmonySplitter writes them into the text it shows: each one
    `harmony.call_text(name, body)`, in wrapped markers no ordinary token spells. A call the
    parser refuses (cut off, its body not a JSON object, a tool not offered) is text: its body,
    never its header or markers. The model ends a call with `<|call|>`, an EOS token, so calls
    count only in an answer the model ended (as llama3_json's)."""

    name = "harmony"
    start = harmony.CALL_OPEN
    markers = harmony.MARKERS
    # A forced call is written as gpt-oss's template writes past calls, after `<|start|>assistant`
    any_prefix = " to=" + harmony.FUNCTIONS
    token_texts = (harmony.CHANNEL, harmony.CONSTRAIN, harmony.MESSAGE)
    splits_messages = True
    _call = re.compile(re.escape(harmony.CALL_OPEN) + f"([^{KEPT_OPEN}]*)" + re.escape(harmony.CALL_ARGS)
                       + f"([^{KEPT_OPEN}]*)" + re.escape(harmony.CALL_CLOSE))

    def locate(self, text: str) -> tuple[int | None, int]:
        at = text.find(self.start)
        if at >= 0:
            return at, 0
        return None, next((n for n in range(min(len(text), len(self.start) - 1), 0, -1)
                           if self.start.startswith(text[-n:])), 0)

    def parse(self, text: str, id_prefix: str, names: frozenset[str] | None, ended: bool = True) -> ParsedOutput:
        start, _ = self.locate(text)
        if start is None:
            return ParsedOutput(text=text, tool_calls=[])
        calls = self._calls(text[start:], id_prefix) if ended else None
        if not calls or any(names is not None and c.name not in names for c in calls):
            return ParsedOutput(text=self._call.sub(lambda m: m.group(2), text), tool_calls=[])
        return ParsedOutput(text=text[:start].rstrip(), tool_calls=calls)

    def _calls(self, text: str, id_prefix: str) -> list[ParsedToolCall] | None:
        items, pos = [], 0
        while pos < len(text):
            m = self._call.match(text, pos)
            if m is None:
                return None
            items.append({"name": m.group(1), "arguments": _json_or_none(m.group(2))})
            pos = len(text) - len(text[m.end():].lstrip())
        return _all_calls(items, id_prefix, self.needs_arguments)

    def call_parts(self, tool_name: str) -> tuple[str, str]:
        return self.any_prefix + tool_name + harmony.CHANNEL + "commentary json" + harmony.MESSAGE, ""


HERMES = HermesSyntax()
PARSERS = ("hermes", "llama3_json", "mistral", "harmony", "openai")


def tool_call_syntax(parser: str, chat_template: str | None) -> ToolCallSyntax:
    """The syntax `parser` names (one of PARSERS, or "auto": detected from the chat template)."""
    if parser == "auto":
        parser = detect_parser(chat_template)
    if parser == "hermes":
        return HERMES
    if parser == "llama3_json":
        return Llama3JsonSyntax()
    if parser == "mistral":
        return MistralSyntax(args_form=bool(chat_template) and MISTRAL_ARGS in chat_template)
    if parser in ("harmony", "openai"):
        return HarmonySyntax()
    raise ValueError(f"unknown tool-call parser '{parser}'; use auto or one of {', '.join(PARSERS)}")


def detect_parser(chat_template: str | None) -> str:
    """The parser a chat template shows the model (it writes past calls, or explains the syntax):
    hermes when it shows none (tools described in prose only). Before parsers could be chosen
    such a template was not parsed at all (only one showing `<tool_call>` was) and tool_choice
    required started no call; now its answers are read as Hermes and a required call starts
    `<tool_call>`. `--tool-call-parser` picks another."""
    template = chat_template or ""
    if isinstance(template, dict):  # several named templates
        template = "\n".join(map(str, template.values()))
    if all(marker in template for marker in harmony.SIGNATURE):
        return "harmony"
    if TOOL_CALL_START in template:
        return "hermes"
    if MISTRAL_CALLS in template:
        return "mistral"
    if PYTHON_TAG in template or "<|start_header_id|>ipython" in template or "Environment: ipython" in template:
        return "llama3_json"
    return "hermes"


@dataclass(frozen=True)
class ToolCallFormat:
    """A served model's tool calls: their syntax, and which of its marker tokens the tokenizer
    marks special, so that a decode skipping special tokens drops them (kept for requests
    with tools, then taken out of the text the client sees)."""

    syntax: ToolCallSyntax
    keep_token_ids: tuple[int, ...] = ()
    hidden: tuple[str, ...] = ()
    marker_tokens: tuple[tuple[str, int], ...] = ()  # the syntax's token_texts that are one token here, and its id


def tool_call_format(parser: str, tokenizer: Any) -> ToolCallFormat:
    """`parser` (see tool_call_syntax) for a model with this tokenizer."""
    from tierlm.engine.detokenizer import skipped_ids

    if parser == "auto" and harmony.is_harmony(tokenizer):  # (its vocabulary may say so, its template not)
        parser = "harmony"
    syntax = tool_call_syntax(parser, getattr(tokenizer, "chat_template", None))
    added = tokenizer.get_added_vocab() if hasattr(tokenizer, "get_added_vocab") else {}
    skipped = skipped_ids(tokenizer) if syntax.markers or syntax.token_texts else frozenset()
    kept = [(added[m], m) for m in syntax.markers if added.get(m) in skipped]
    # A required call's grammar writes these as their tokens, unless a decode would drop the token
    # (a special `</tool_call>`: the call would never close): it then writes the text.
    tokens = tuple((t, int(added[t])) for t in syntax.token_texts
                   if t in added and (added[t] not in skipped or t in syntax.markers))
    return ToolCallFormat(syntax, tuple(i for i, _ in kept), tuple(m for _, m in kept), tokens)


# The variables through which chat templates read the tools offered: `tools` (most), and
# `xml_tools` (SmolLM3's, which writes each with `| string` under <tools>).
TOOLS_VARIABLES = ("tools", "xml_tools")
_PROBE_TOOL = {"type": "function", "function": {"name": "tierlm_probe_tool_7f3a", "description": "probe",
                                                "parameters": {"type": "object", "properties": {}}}}
# Conversations to render the probe with: a template may refuse a lone user message
_PROBE_CONVERSATIONS = ([{"role": "user", "content": "hi"}],
                        [{"role": "system", "content": "probe"}, {"role": "user", "content": "hi"}])
_tools_variable_of: dict[Any, str | None] = {}  # chat template(s) -> its tools variable


def tools_variable(tokenizer: Any) -> str | None:
    """The variable through which `tokenizer`'s chat template reads the tools (one of
    TOOLS_VARIABLES), or None if it renders them through none, so the model would never be told.
    Found once per template by rendering a probe tool: the word alone says nothing (SmolLM3's
    template writes "<tools></tools>" and reads only xml_tools; tools passed as `tools` vanished).
    A tokenizer with several named templates (Hermes: `default` and `tool_use`) is probed as
    apply_chat_template renders it, which picks `tool_use` when tools are given."""
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):
        key: Any = tuple(sorted((str(k), str(v)) for k, v in template.items()))
        text = "\n".join(v for _, v in key)
    elif isinstance(template, str):
        key = text = template
    else:
        return None
    if not text:
        return None
    if key not in _tools_variable_of:
        _tools_variable_of[key] = _probe_tools_variable(tokenizer, text)
    return _tools_variable_of[key]


def _probe_tools_variable(tokenizer: Any, template_text: str) -> str | None:
    name = _PROBE_TOOL["function"]["name"]
    unsure: str | None = None  # a variable the template names but whose probes all failed
    for variable in TOOLS_VARIABLES:
        if variable not in template_text:
            continue
        for conversation in _PROBE_CONVERSATIONS:
            try:
                text = tokenizer.apply_chat_template(conversation, tokenize=False, add_generation_prompt=True,
                                                     **{variable: [template_tool(variable, _PROBE_TOOL)]})
            except Exception:  # this conversation is one the template refuses: try the next
                continue
            if name in text:
                return variable
            # Rendered without the tool: not through this variable. (A template that shows tools
            # only beside a system prompt is refused: accepted, it dropped them from the others.)
            break
        else:
            unsure = unsure or variable  # every probe failed: taken at its word (requests will tell)
    return unsure


def template_tool(variable: str, tool: dict[str, Any]) -> dict[str, Any]:
    """A tool as the template reading `variable` takes it: OpenAI's {"type": "function",
    "function": {...}} for `tools`; the function alone for SmolLM3's `xml_tools`, as its model
    card passes them (it prints each as it comes, so the model sees that shape)."""
    return tool["function"] if variable == "xml_tools" else tool


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


def parse_tool_calls(text: str, id_prefix: str = "toolu_", names: frozenset[str] | None = None,
                     syntax: ToolCallSyntax = HERMES, ended: bool = True) -> ParsedOutput:
    """Split `text` into prose and the tool calls `syntax` finds.

    If any call is not valid JSON with a string `name`, names a tool not in `names` (the tools
    the request offered, when given: both APIs only ever call those), or is not closed
    (cut off by max_tokens), nothing is treated as a call and the whole text is returned as
    prose: a half-parsed answer is worse than the raw one. `ended`: the model ended the answer
    (EOS), not max_tokens, a stop string or a stop token; without it a syntax whose calls have
    no end marker finds none (see ToolCallSyntax.closes_calls).
    """
    return syntax.parse(text, id_prefix, names, ended)


def scrub(text: str, markers: tuple[str, ...]) -> str:
    """`text` without the kept special tokens `markers` (kept only to find calls): without each
    one the detokenizer wrapped, and without any lone sentinel (a stop string that cut one).
    The same text in ordinary tokens is the model's own and stays."""
    return _scrub_re(markers).sub("", text) if markers else text


@functools.cache
def _scrub_re(markers: tuple[str, ...]) -> re.Pattern[str]:
    wrapped = "|".join(re.escape(m) for m in markers)
    sentinels = re.escape(KEPT_OPEN + KEPT_CLOSE)
    return re.compile(f"{KEPT_OPEN}(?:{wrapped}){KEPT_CLOSE}|[{sentinels}]")


def _unwrapped(text: str) -> str:
    """`text` with its kept markers as plain ones, as a syntax reads them."""
    return text.replace(KEPT_OPEN, "").replace(KEPT_CLOSE, "") if KEPT_OPEN in text or KEPT_CLOSE in text else text


def _loads_output(text: str) -> Any:
    """A model's JSON, as strict as a request's: NaN, Infinity and 1e999 are not JSON (the answer
    failed to serialise, a 500, or streamed arguments a strict client cannot parse and tierlm
    itself refuses when they are sent back), nor is a lone surrogate (\\ud800) UTF-8."""
    data = loads_strict(text)
    json.dumps(data, ensure_ascii=False).encode("utf-8")  # raises on a lone surrogate
    return data


def _json_or_none(text: str) -> Any:
    """`text` (stripped) as a model's JSON (see _loads_output), or None where it is not JSON
    (nor is JSON's null ever a call or its arguments)."""
    try:
        return _loads_output(text.strip())
    except (ValueError, RecursionError):
        return None


def _all_calls(items: list[Any], id_prefix: str, needs_arguments: bool) -> list[ParsedToolCall] | None:
    """The calls parsed JSON `items` describe, or None if any one is not a call (then the whole
    answer is text: a half-parsed answer is worse than the raw one)."""
    calls = [_call_of(item, id_prefix, needs_arguments) for item in items]
    return None if any(c is None for c in calls) else calls  # type: ignore[return-value]


def _call_of(data: Any, id_prefix: str, needs_arguments: bool = True) -> ParsedToolCall | None:
    """The call `data` (parsed JSON) describes, or None. `needs_arguments`: see ToolCallSyntax."""
    if not isinstance(data, dict) or not isinstance(data.get("name"), str):
        return None
    if needs_arguments and "arguments" not in data and "parameters" not in data:
        return None
    arguments = data.get("arguments", data.get("parameters", {}))
    if isinstance(arguments, str):  # some models emit the arguments JSON-encoded
        arguments = _json_or_none(arguments)
    if not isinstance(arguments, dict):
        return None
    return ParsedToolCall(id=new_tool_call_id(id_prefix), name=data["name"], arguments=arguments)


class ToolCallStreamFilter:
    """Passes streamed text through until a tool call may begin, then buffers the rest.

    `feed` returns the text that is safe to show now; `finish` parses what was held back.
    `hidden` are marker texts the client must not see (special tokens kept only to find calls):
    taken out of all text shown, held back while one may be arriving.
    """

    def __init__(self, id_prefix: str = "toolu_", names: frozenset[str] | None = None,
                 syntax: ToolCallSyntax = HERMES, hidden: tuple[str, ...] = ()) -> None:
        self._id_prefix = id_prefix
        self._names = names  # the tools offered (see parse_tool_calls)
        self._syntax = syntax
        self._scrub = _MarkerScrubber(hidden)
        # Held back: trailing whitespace (dropped if a call follows, as parse_tool_calls strips
        # the prose before a call) and then what might be the start of a call.
        self._pending = ""
        self._space = ""  # the whitespace before the call's start, once seen
        self._buffer: str | None = None  # everything from the call's start on, once seen
        self._shown = False  # prose went out: a syntax whose calls begin the answer finds none now

    @property
    def in_tool_call(self) -> bool:
        return self._buffer is not None

    def feed(self, text: str) -> str:
        return self._scrub.feed(self._feed(text))

    def _feed(self, text: str) -> str:
        if self._buffer is not None:
            self._buffer += text
            return ""
        pending = self._pending + text
        if self._shown and self._syntax.at_start_only:
            self._pending = ""
            return pending
        start, hold = self._syntax.locate(pending)
        if start is not None:
            prose = pending[:start]
            shown = prose.rstrip()
            self._space, self._buffer = prose[len(shown):], pending[start:]
            self._pending = ""
            return shown
        shown = pending[: len(pending) - hold].rstrip()
        self._pending = pending[len(shown):]
        self._shown = self._shown or bool(shown)
        return shown

    def finish(self, ended: bool = True) -> tuple[str, list[ParsedToolCall]]:
        """(text still to show, parsed calls). Unparseable calls come back as text. `ended`: see
        parse_tool_calls."""
        rest, calls = self._finish(ended)
        return self._scrub.feed(rest) + self._scrub.finish(), calls

    def _finish(self, ended: bool) -> tuple[str, list[ParsedToolCall]]:
        if self._buffer is None:
            rest, self._pending = self._pending, ""
            return rest, []
        parsed = parse_tool_calls(self._buffer, self._id_prefix, self._names, self._syntax, ended)
        self._buffer = None
        if not parsed.tool_calls:  # (the text as the syntax shows a failed call: harmony's, its body)
            return self._space + parsed.text, []
        # prose in the buffer: the calls begin at a kept marker after the same text in ordinary
        # tokens, where buffering began (see MistralSyntax.locate)
        return (self._space + parsed.text if parsed.text else ""), parsed.tool_calls


class _MarkerScrubber:
    """Streamed text less kept markers (see scrub), holding back what may be the start of one."""

    def __init__(self, markers: tuple[str, ...]) -> None:
        self._markers = markers
        self._wrapped = tuple(KEPT_OPEN + m + KEPT_CLOSE for m in markers)
        self._held = ""

    def feed(self, text: str) -> str:
        if not self._markers:
            return text
        text = self._held + text
        # A wrapped marker holds KEPT_OPEN only as its first character: only the last one in
        # the text can begin one still arriving.
        at = text.rfind(KEPT_OPEN)
        if at >= 0 and any(w.startswith(text[at:]) and w != text[at:] for w in self._wrapped):
            text, self._held = text[:at], text[at:]
        else:
            self._held = ""
        return scrub(text, self._markers)

    def finish(self) -> str:
        rest, self._held = self._held, ""
        return scrub(rest, self._markers)


def _find_marker(text: str, marker: str) -> tuple[int | None, int]:
    """(where `marker` is in `text`, plain or wrapped as a kept token (from its KEPT_OPEN), or
    None; the length of the longest suffix of `text` that is a proper prefix of either)."""
    at = text.find(marker)
    if at >= 0:
        return (at - 1 if at and text[at - 1] == KEPT_OPEN else at), 0
    wrapped = KEPT_OPEN + marker
    for n in range(min(len(text), len(wrapped) - 1), 0, -1):
        if marker.startswith(text[-n:]) or wrapped.startswith(text[-n:]):
            return None, n
    return None, 0


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


def forced_call_prefix(tool_name: str | None, syntax: ToolCallSyntax = HERMES) -> str:
    """Assistant text that starts a tool call, used when the client requires one: the call's
    start (and the tool's name when one is named), which the call's grammar then completes
    (tool_grammar.py), and which alone nudges a model where no grammar can be followed."""
    return syntax.forced_prefix(tool_name)
