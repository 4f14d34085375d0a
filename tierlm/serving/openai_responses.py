"""OpenAI's Responses API: POST /v1/responses (streamed or not), and the stored responses'
GET, DELETE, input_items and cancel.

A request is translated into a chat (protocol_responses) and run by the chat path
(`openai.start_chat`); its answer comes back as output items: a `reasoning` item (a reasoning
model's think block), a `message` with one `output_text` part, and a `function_call` per call.
Streams are typed events (`event:` + `data:` lines, each with a `sequence_number`), ending with
`response.completed`, `response.incomplete` (max_output_tokens, or content_filter: the safety
layer stopped it) or `response.failed`.
"""
from __future__ import annotations

import asyncio
import base64
import binascii
import json
import time
import uuid
from typing import TYPE_CHECKING, Any, AsyncIterator

from fastapi import APIRouter
from pydantic import ValidationError
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from tierlm.serving.auth import RequestContext
from tierlm.serving.errors import InvalidRequest, NotFound, stream_error
from tierlm.serving.generation import Answer, ChatPrompt, Generation, StreamedAnswer
from tierlm.serving.harmony import HarmonySplitter, analysis_tokens
from tierlm.serving.openai import ReturnedTokens, _close_all, _collect_all, chat_logprobs, start_chat
from tierlm.serving.protocol_openai import ChatCompletionRequest
from tierlm.serving.safety import FINISH_REASON
from tierlm.serving.protocol_responses import (ENCRYPTED_REASONING_INCLUDE, LOGPROBS_INCLUDE, ResponsesRequest)
from tierlm.serving.response_store import stored_size
from tierlm.serving.responses import off_loop
from tierlm.serving.sse import EventStreamResponse, sse_event
from tierlm.serving.state import server_state
from tierlm.serving.telemetry import request_telemetry
from tierlm.serving.validation import loads_strict

if TYPE_CHECKING:
    from tierlm.engine.async_engine import AsyncEngine
    from tierlm.engine.outputs import TokenLogprob

router = APIRouter()

# What a reasoning item's encrypted_content holds here: its text, base64 (not encrypted: a
# client could send any reasoning back anyway), so a stateless client's item still reads back.
_CARRIED_REASONING = "tierlm-reasoning:"


def _new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def owner_of(context: RequestContext) -> str:
    """Whose stored responses a request may read: its API key's ("" without auth). (Not its
    tenant's: a tenant's keys may belong to different people.)"""
    return f"key:{context.api_key_id}" if context.api_key_id is not None else ""


# ---- POST /v1/responses ------------------------------------------------------------------


@router.post("/v1/responses")
async def create_response(request: Request) -> Response:
    state = server_state(request)
    context = await state.admit(request)
    body = await state.parse(request, ResponsesRequest, items="input")
    owner = owner_of(context)
    history: list[dict[str, Any]] = []
    if body.previous_response_id is not None:
        previous = state.responses.get(owner, body.previous_response_id)
        if previous is None:
            raise InvalidRequest(f"Previous response with id '{body.previous_response_id}' not found. Responses are "
                                 "kept in this server's memory (store true) until it restarts or needs the room; "
                                 "send the conversation's items in 'input' instead",
                                 param="previous_response_id", code="previous_response_not_found")
        history = previous.conversation
    new_items = [_listed(item.model_dump(exclude_none=True, by_alias=True)) for item in body.items()]
    files = await read_input_files(state, owner, history, new_items)

    def prepare() -> tuple[list[dict[str, Any]], ChatCompletionRequest]:
        items = history + new_items
        return items, _chat_request(body, _with_file_texts(items, files), len(history))

    # The items as a chat, validated again: off the event loop for a long conversation, as the
    # chat route's validation is (100,000 items held every other client up for 2.8 s).
    count = len(history) + (len(body.input) if isinstance(body.input, list) else 1)
    items, chat = await off_loop(prepare, 4 * count)
    try:
        run = await start_chat(state, context, request, chat, limit_field="max_output_tokens",
                               schema_field="tools.{}.parameters")
    except InvalidRequest as exc:
        _renamed(exc)
        raise
    if run.model != body.model:  # a fallback model serves it (sla.py): the response names it
        body = body.model_copy(update={"model": run.model})
    shape = _Shape(body, _new_id("resp"), int(time.time()), run.engine, run.prompt, run.top_n, items)
    request_telemetry(request).response_id = shape.response_id
    if body.stream:
        return run.mark(EventStreamResponse(shape.events(run.streams[0], state, owner),
                                            on_close=lambda: _close_all(run.streams)))
    result = (await _collect_all(run.streams, request))[0]

    def build() -> tuple[dict[str, Any], JSONResponse, int]:
        response = shape.finished(result, run.prompt.split(result, id_prefix="call_"))
        return response, JSONResponse(response), stored_size(response, items) if body.store else 0

    entries = result.num_output_tokens * (1 if run.top_n is None else 2 + run.top_n)
    response, answer, size = await off_loop(build, entries + _chars(items) // 64)
    if body.store:
        state.responses.put(owner, response, items, size)
    return run.mark(answer)


def _chars(items: list[dict[str, Any]]) -> int:
    """About how many characters of text the items hold (what storing them costs to measure)."""
    total = 0
    for item in items:
        for key in ("content", "output", "arguments", "summary"):
            value = item.get(key)
            if isinstance(value, str):
                total += len(value)
            elif isinstance(value, list):
                total += sum(len(p.get("text", "")) for p in value if isinstance(p, dict))
    return total


def _renamed(exc: InvalidRequest) -> None:
    """The chat path's field names in its error (the param, and the name the message starts
    with) as the Responses API's: `response_format` is text.format; `messages` the input (as a
    whole: a message's index is not its item's, and the items' own rules were checked first)."""
    old = exc.param or ""
    new = "input" if old.startswith("messages") else "text.format" if old == "response_format" else None
    if new is None:
        return
    if exc.message.startswith(old + ":"):
        exc.message = new + exc.message[len(old):]
    exc.param = new


def _listed(item: dict[str, Any]) -> dict[str, Any]:
    """An input item as OpenAI lists it (input_items, and the SDK's types): with an id, and a
    message's text as one content part (`input_text`, or `output_text` for the assistant's),
    never a bare string. The prompt reads the same text either way."""
    if not item.get("id"):
        prefix = {"message": "msg", "function_call": "fc", "function_call_output": "fco", "reasoning": "rs"}[item["type"]]
        item["id"] = _new_id(prefix)
    if item["type"] == "message" and isinstance(item["content"], str):
        part = ({"type": "output_text", "text": item["content"], "annotations": []} if item["role"] == "assistant"
                else {"type": "input_text", "text": item["content"]})
        item["content"] = [part]
    return item


async def read_input_files(state: Any, owner: str, history: list[dict[str, Any]],
                           new_items: list[dict[str, Any]]) -> dict[int, str]:
    """The text of every input_file part of the conversation (by the part's id()), read as the
    chat route reads a file part; a 400 naming the part (or previous_response_id, for one of an
    earlier turn) for a file that is not there, not base64 or not text."""
    from tierlm.serving.files import part_text

    texts: dict[int, str] = {}
    for i, item in enumerate(history + new_items):
        parts = item.get("content") if item["type"] == "message" else item.get("output")
        for j, part in enumerate(parts if isinstance(parts, list) else ()):
            if part.get("type") != "input_file":
                continue
            key = "content" if item["type"] == "message" else "output"
            where = _where(i, len(history), key, j)
            text = await part_text(state.batches.files, owner, part.get("file_id"), part.get("file_data"),
                                   part.get("filename"), where)
            if text is None:
                raise InvalidRequest(f"{where}: tierlm's models read text only and this file is not UTF-8 text (a "
                                     "PDF, an image, ...); send text files (text/*, JSON, XML, YAML) or input_text "
                                     "parts", param=where)
            texts[id(part)] = text
    return texts


def _where(i: int, earlier: int, key: str, j: int) -> str:
    """A part's name in a 400: input.N.content.M, or previous_response_id for an earlier turn's."""
    return f"input.{i - earlier}.{key}.{j}" if i >= earlier else "previous_response_id"


def _with_file_texts(items: list[dict[str, Any]], texts: dict[int, str]) -> list[dict[str, Any]]:
    """`items` with each input_file part as the input_text of its file (copies; the conversation
    keeps the parts as sent)."""
    if not texts:
        return items

    def swap(parts: Any) -> Any:
        if not isinstance(parts, list):
            return parts
        return [{"type": "input_text", "text": texts[id(p)]} if id(p) in texts else p for p in parts]

    return [{**item, "content": swap(item["content"])} if item["type"] == "message" else
            {**item, "output": swap(item["output"])} if item["type"] == "function_call_output" else item
            for item in items]


def _part_text(parts: Any) -> str:
    if isinstance(parts, str):
        return parts
    return "\n".join(p.get("refusal", "") if p.get("type") == "refusal" else p.get("text", "") for p in parts)


def _reasoning_text(item: dict[str, Any]) -> str:
    """A reasoning item's text: its content, else its summary, else what tierlm carried in encrypted_content."""
    for key in ("content", "summary"):
        if texts := [p.get("text", "") for p in item.get(key) or ()]:
            return "\n".join(texts)
    carried = item.get("encrypted_content") or ""
    if carried.startswith(_CARRIED_REASONING):
        try:
            return base64.b64decode(carried[len(_CARRIED_REASONING):], validate=True).decode()
        except (binascii.Error, UnicodeDecodeError):
            pass
    return ""


def chat_messages(instructions: str | None, items: list[dict[str, Any]], first: int = 0) -> list[dict[str, Any]]:
    """The items as chat messages: an assistant message and the function calls after it are one
    assistant turn; a reasoning item is the reasoning of the assistant turn that follows it; each
    function_call_output is a tool message. Every call must be answered by an output after it,
    and every output must answer a call before it, and no two items have the same id (OpenAI's
    rules); and, as chat templates need (the chat path's rule), a turn's calls are answered
    before any other message or turn, and an output answers a call of the turn just before it.
    Items from `first` on are the request's own `input` and are named input.N as it counts
    them; those before it are the previous response's conversation, named by their id."""
    def at(i: int) -> str:
        return f"input.{i - first}" if i >= first else f"item {items[i]['id']} of the previous response"

    def param(i: int) -> str:
        return f"input.{i - first}" if i >= first else "input"

    messages: list[dict[str, Any]] = [{"role": "system", "content": instructions}] if instructions else []
    reasoning: str | None = None
    calls: dict[str, int] = {}  # call_id -> the index of its function_call item
    answered: set[str] = set()
    turn: dict[str, int] = {}  # the calls of the last assistant turn with calls
    turn_open = False  # the last message is an assistant turn that later calls join

    def turn_answered(i: int) -> None:
        """Item i starts a message or turn: the last turn's calls must all be answered by now."""
        if waiting := [c for c in turn if c not in answered]:
            call = waiting[0]
            raise InvalidRequest(f"{at(i)}: no tool output found for function call {call} ({at(turn[call])}) before "
                                 "this item; send each call's function_call_output right after the calls",
                                 param=param(i))
        turn.clear()

    ids: dict[str, int] = {}  # item id -> the index of its item
    for i, item in enumerate(items):
        kind = item["type"]
        if item.get("id") and (j := ids.setdefault(item["id"], i)) != i:  # (read twice, listed twice)
            again = ("the previous response holds it already; send only new items beside previous_response_id"
                     if j < first else f"as {at(j)}; remove one")
            raise InvalidRequest(f"{at(i)}: duplicate item found with id '{item['id']}' ({again})", param=param(i))
        if kind == "reasoning":
            reasoning = _reasoning_text(item) or reasoning
            continue
        if kind == "message":
            turn_answered(i)
            message = {"role": item["role"], "content": _part_text(item["content"])}
            turn_open = item["role"] == "assistant"
            if turn_open and reasoning:
                message["reasoning_content"] = reasoning
            elif reasoning:  # an answer that was reasoning alone (cut off while thinking): its turn
                messages.append(_reasoning_turn(reasoning))
            reasoning = None
            messages.append(message)
        elif kind == "function_call":
            _arguments_checked(item["arguments"], param(i))
            call = {"id": item["call_id"], "type": "function",
                    "function": {"name": item["name"], "arguments": item["arguments"] or "{}"}}
            if item["call_id"] in calls:
                raise InvalidRequest(f"{at(i)}: call_id '{item['call_id']}' is used by {at(calls[item['call_id']])} "
                                     "too; give each function call its own", param=param(i))
            calls[item["call_id"]] = i
            if not turn_open:
                turn_answered(i)
                messages.append({"role": "assistant", "content": None, "tool_calls": []})
                if reasoning:
                    messages[-1]["reasoning_content"] = reasoning
                reasoning, turn_open = None, True
            messages[-1].setdefault("tool_calls", []).append(call)
            turn[item["call_id"]] = i
        else:  # function_call_output
            if item["call_id"] not in calls:
                raise InvalidRequest(f"{at(i)}: no function_call item before it has call_id '{item['call_id']}'; "
                                     "send the call before its output", param=param(i))
            if item["call_id"] not in turn:
                raise InvalidRequest(f"{at(i)}: answers function call {item['call_id']} ({at(calls[item['call_id']])}) "
                                     "of an earlier turn; send each function_call_output right after its call's turn",
                                     param=param(i))
            answered.add(item["call_id"])
            messages.append({"role": "tool", "tool_call_id": item["call_id"], "content": _part_text(item["output"])})
            turn_open = False
    if reasoning:  # the conversation ends with an answer that was reasoning alone
        messages.append(_reasoning_turn(reasoning))
    if unanswered := [c for c in calls if c not in answered]:
        raise InvalidRequest(f"No tool output found for function call {unanswered[0]} ({at(calls[unanswered[0]])}); "
                             "send a function_call_output item for it", param=param(calls[unanswered[0]]))
    if not any(m["role"] != "system" for m in messages):
        raise InvalidRequest("input: needs a message besides instructions and system messages", param="input")
    return messages


def _reasoning_turn(reasoning: str) -> dict[str, Any]:
    """The assistant turn of an answer that was its reasoning alone: without it the prompt lost
    the answer and held two user turns in a row, which templates that alternate refuse."""
    return {"role": "assistant", "content": "", "reasoning_content": reasoning}


def _arguments_checked(text: str, where: str) -> None:
    try:  # strict, as the chat path reads them: no NaN or Infinity
        value = loads_strict(text) if text.strip() else {}
    except (ValueError, RecursionError):
        value = None
    if not isinstance(value, dict):
        raise InvalidRequest(f"{where}.arguments: must be a JSON object encoded as a string",
                             param=f"{where}.arguments")


def _chat_request(body: ResponsesRequest, items: list[dict[str, Any]], first: int) -> ChatCompletionRequest:
    """The chat request `body` is; `items` are the previous response's conversation, then (from
    `first` on) the request's own input."""
    logprobs = body.wants(LOGPROBS_INCLUDE)
    choice: Any = body.tool_choice
    if choice is not None and not isinstance(choice, str):
        choice = {"type": "function", "function": {"name": choice.name}}
    fields = {
        "model": body.model,
        "messages": chat_messages(body.instructions, items, first),
        "max_completion_tokens": body.max_output_tokens,
        "temperature": body.temperature, "top_p": body.top_p, "top_k": body.top_k, "min_p": body.min_p,
        "repetition_penalty": body.repetition_penalty, "seed": body.seed, "cache_salt": body.cache_salt,
        "logprobs": logprobs or None,
        "top_logprobs": body.top_logprobs if logprobs else None,
        "tools": [{"type": "function", "function": t.model_dump(exclude={"type"}, exclude_none=True)}
                  for t in body.tools] if body.tools else None,
        "tool_choice": choice,
        "parallel_tool_calls": body.parallel_tool_calls,
        "response_format": body.response_format(),
        "reasoning_effort": body.reasoning.effort if body.reasoning is not None else None,
    }
    try:
        return ChatCompletionRequest.model_validate({k: v for k, v in fields.items() if v is not None})
    except ValidationError as exc:  # (the items were checked: this names what is still wrong)
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first.get("loc", ()))
        raise InvalidRequest(f"input: {where}: {first.get('msg', 'invalid value')}", param="input") from None


# ---- generation → response -----------------------------------------------------------------


class _HarmonyTextTokens:
    """Which returned tokens of a harmony answer lie in its message's text: its final and
    preamble bodies', not its headers', its analysis' or its calls' (a think block's answer is
    the text past the block: `_Shape._answer_start`). Fed the answer's text as it grows."""

    def __init__(self, reader: Any) -> None:
        self._reader = reader  # a HarmonySplitter over the raw answer (ChatPrompt.markup)
        self._fed = 0
        self._spans: list[tuple[int, int]] = []

    @classmethod
    def of(cls, prompt: ChatPrompt) -> "_HarmonyTextTokens | None":
        reader = prompt.markup()
        return cls(reader) if isinstance(reader, HarmonySplitter) else None

    def take(self, tokens: list["TokenLogprob"], text: str,
             final: bool) -> tuple[list["TokenLogprob"], list["TokenLogprob"]]:
        """(the `tokens` in the text, those whose place is not known yet) with the answer's raw
        `text` so far (`final`: all of it)."""
        self._reader.feed(text[self._fed:])
        self._fed = len(text)
        if final:
            self._reader.finish()
        for start, end in self._reader.text_spans():  # (a message's pieces, one span)
            if self._spans and self._spans[-1][1] == start:
                start = self._spans.pop()[0]
            self._spans.append((start, end))
        decided = self._reader.markup()[0]
        shown, spans = [], self._spans
        for t in tokens:  # (both in the text's order)
            if t.text_start >= decided:
                break
            while spans and spans[0][1] <= t.text_start:
                spans.pop(0)
            if spans and spans[0][0] <= t.text_start:
                shown.append(t)
        return shown, [t for t in tokens if t.text_start >= decided]


class _Shape:
    """One response's fixed fields, and how its answer becomes output items and events."""

    def __init__(self, body: ResponsesRequest, response_id: str, created_at: int, engine: "AsyncEngine",
                 prompt: ChatPrompt, top_n: int | None, items: list[dict[str, Any]]) -> None:
        self.body, self.response_id, self.created_at = body, response_id, created_at
        self.engine, self.prompt, self.top_n, self.items = engine, prompt, top_n, items
        self.carry_reasoning = body.wants(ENCRYPTED_REASONING_INCLUDE)
        self.incomplete_reason = "max_output_tokens"

    def status(self, result: Generation) -> str:
        """`incomplete` for an answer cut off (max_output_tokens) or stopped by the safety layer
        (content_filter, as OpenAI's), else `completed`."""
        if result.finish_reason == FINISH_REASON:
            self.incomplete_reason = "content_filter"
            return "incomplete"
        return "incomplete" if result.finish_reason == "length" else "completed"

    def response(self, status: str, output: list[dict[str, Any]], usage: dict[str, Any] | None = None,
                 error: dict[str, Any] | None = None) -> dict[str, Any]:
        body = self.body
        fmt = body.text.format if body.text is not None and body.text.format is not None else None
        text_format = fmt.model_dump(exclude_none=True, by_alias=True) if fmt is not None else {"type": "text"}
        choice = body.tool_choice
        return {
            "id": self.response_id, "object": "response", "created_at": self.created_at, "status": status,
            "background": False, "error": error,
            "incomplete_details": {"reason": self.incomplete_reason} if status == "incomplete" else None,
            "instructions": body.instructions, "max_output_tokens": body.max_output_tokens,
            "max_tool_calls": body.max_tool_calls, "model": body.model, "output": output,
            "parallel_tool_calls": body.parallel_tool_calls if body.parallel_tool_calls is not None else True,
            "previous_response_id": body.previous_response_id,
            "reasoning": body.reasoning.model_dump() if body.reasoning is not None else {"effort": None, "summary": None},
            "service_tier": "default", "store": body.store,
            "temperature": body.temperature if body.temperature is not None else 1.0,
            "text": {"format": text_format},
            "tool_choice": (choice.model_dump() if choice is not None and not isinstance(choice, str)
                            else choice or "auto"),
            "tools": [t.model_dump(exclude_none=True) for t in body.tools or ()],
            "top_logprobs": body.top_logprobs, "top_p": body.top_p if body.top_p is not None else 1.0,
            "truncation": body.truncation or "disabled", "usage": usage, "user": body.user,
            "prompt_cache_key": body.prompt_cache_key, "safety_identifier": body.safety_identifier,
            "metadata": body.metadata or {},
            # whole seconds, as OpenAI sends them (clients typed for integers fail on a fraction)
            "completed_at": int(time.time()) if status in ("completed", "incomplete") else None,
        }

    def usage(self, result: Generation, reasoning: str) -> dict[str, Any]:
        return {
            "input_tokens": result.num_prompt_tokens,
            "input_tokens_details": {"cached_tokens": result.num_cached_tokens},
            "output_tokens": result.num_output_tokens,
            "output_tokens_details": {"reasoning_tokens": self._reasoning_tokens(result, reasoning)},
            "total_tokens": result.num_prompt_tokens + result.num_output_tokens,
        }

    def _reasoning_tokens(self, result: Generation, reasoning: str) -> int:
        """Output tokens of the think block: up to its end marker where that is one token, else
        the count of the reasoning re-tokenized with its markers (close, not exact); harmony's
        analysis messages, counted by their marker tokens."""
        fmt = self.prompt.reasoning
        if not reasoning or fmt is None:
            return 0
        if fmt.harmony and (counted := analysis_tokens(result.token_ids, self.engine.tokenizer)) is not None:
            return counted
        if len(fmt.end_token_ids) == 1 and fmt.end_token_ids[0] in result.token_ids:
            return result.token_ids.index(fmt.end_token_ids[0]) + 1
        if fmt.end not in result.text:  # cut off while thinking: every token is reasoning
            return result.num_output_tokens
        marked = reasoning + fmt.end if self.prompt.opens_in_reasoning else fmt.start + reasoning + fmt.end
        return min(result.num_output_tokens, len(self.engine.tokenizer.encode(marked, add_special_tokens=False)))

    # -- items --------------------------------------------------------------------------------
    def reasoning_item(self, item_id: str, text: str, status: str = "completed") -> dict[str, Any]:
        item = {"id": item_id, "type": "reasoning", "summary": [],
                "content": [{"type": "reasoning_text", "text": text}], "status": status}
        if self.carry_reasoning:
            item["encrypted_content"] = _CARRIED_REASONING + base64.b64encode(text.encode()).decode()
        return item

    def text_part(self, text: str, logprobs: list[dict[str, Any]] | None) -> dict[str, Any]:
        part: dict[str, Any] = {"type": "output_text", "text": text, "annotations": []}
        if self.top_n is not None:
            part["logprobs"] = logprobs or []
        return part

    def message_item(self, item_id: str, content: list[dict[str, Any]], status: str) -> dict[str, Any]:
        return {"id": item_id, "type": "message", "role": "assistant", "status": status, "content": content}

    @staticmethod
    def call_item(call: Any, arguments: str, status: str = "completed") -> dict[str, Any]:
        return {"id": "fc_" + call.id.removeprefix("call_"), "type": "function_call", "call_id": call.id,
                "name": call.name, "arguments": arguments, "status": status}

    def logprob_entries(self, logprobs: list["TokenLogprob"]) -> list[dict[str, Any]]:
        if self.top_n is None or not logprobs:
            return []
        return chat_logprobs(self.engine, logprobs, self.top_n)["content"]

    def _answer_logprobs(self, result: Generation, answer: Answer) -> list["TokenLogprob"]:
        """The returned tokens of the message's text: not the think block's, nor (with calls)
        the calls' markup after the prose, which a stream never shows either; in harmony, those
        of its text messages' bodies (see _HarmonyTextTokens)."""
        if (harmony := _HarmonyTextTokens.of(self.prompt)) is not None:
            return harmony.take(ReturnedTokens().add(result.logprobs, result.text), result.text, final=True)[0]
        start = self._answer_start(result.text)
        end = len(result.text)
        if answer.calls:  # the prose, where it lies in the raw text; the calls follow it
            at = result.text.find(answer.text, start) if answer.text else -1
            end = at + len(answer.text) if at >= 0 else start
        return [t for t in ReturnedTokens().add(result.logprobs, result.text) if start <= t.text_start < end]

    def _answer_start(self, text: str) -> int:
        """Where the answer starts in the generated `text`: past the think block's end marker,
        where the answer is in a block (opened by the prompt, or by the answer's start), even an
        empty one; else 0."""
        fmt = self.prompt.reasoning
        if fmt is None or not (self.prompt.opens_in_reasoning or text.lstrip().startswith(fmt.answer_start)):
            return 0
        end = text.find(fmt.answer_end)
        return len(text) if end < 0 else end + len(fmt.answer_end)

    def finished(self, result: Generation, answer: Answer) -> dict[str, Any]:
        """The response to a finished answer (not streamed)."""
        status = self.status(result)
        output: list[dict[str, Any]] = []
        if answer.reasoning and self.prompt.show_reasoning:
            output.append(self.reasoning_item(_new_id("rs"), answer.reasoning))
        if answer.text or not (answer.calls or output):  # (an answer of reasoning alone: no empty message)
            logprobs = self.logprob_entries(self._answer_logprobs(result, answer)) if self.top_n is not None else None
            output.append(self.message_item(_new_id("msg"), [self.text_part(answer.text, logprobs)], status))
        output.extend(self.call_item(c, json.dumps(c.arguments)) for c in answer.calls)
        return self.response(status, output, self.usage(result, answer.reasoning))

    # -- events ---------------------------------------------------------------------------------
    async def events(self, stream: Any, state: Any, owner: str) -> AsyncIterator[bytes]:
        """response.created → in_progress → items (added, part added, deltas, done) → completed /
        incomplete; a failure mid-stream ends it with response.failed."""
        frames = _Frames()
        output: list[dict[str, Any]] = []
        yield frames.event("response.created", response=self.response("in_progress", []))
        yield frames.event("response.in_progress", response=self.response("in_progress", []))
        answer = StreamedAnswer(stream, self.prompt, id_prefix="call_")
        returned = ReturnedTokens() if self.top_n is not None else None
        thinking: dict[str, Any] | None = None  # the open reasoning item: {"id", "text"}
        message: dict[str, Any] | None = None  # the open message: {"id", "text", "logprobs"}
        pending: list["TokenLogprob"] = []  # tokens whose text is out, not yet shown with text
        cut = 0
        harmony = _HarmonyTextTokens.of(self.prompt) if returned is not None else None
        try:
            async for thought, text, delta in answer.pieces():
                if returned is not None and delta is not None:
                    pending += returned.add(delta.logprobs or [], delta.text)
                if thought and self.prompt.show_reasoning:
                    if thinking is None:
                        thinking = {"id": _new_id("rs"), "text": ""}
                        item = self.reasoning_item(thinking["id"], "", "in_progress")
                        item["content"] = []
                        yield frames.event("response.output_item.added", output_index=len(output), item=item)
                        yield frames.event("response.content_part.added", item_id=thinking["id"],
                                           output_index=len(output), content_index=0,
                                           part={"type": "reasoning_text", "text": ""})
                    thinking["text"] += thought
                    yield frames.event("response.reasoning_text.delta", item_id=thinking["id"],
                                       output_index=len(output), content_index=0, delta=thought)
                if not text:
                    continue
                if thinking is not None:
                    for frame in self._close_reasoning(frames, output, thinking):
                        yield frame
                    thinking = None
                if message is None:
                    message = {"id": _new_id("msg"), "text": "", "logprobs": []}
                    for frame in self._open_message(frames, output, message):
                        yield frame
                    cut = self._answer_start(answer.result.text)  # (the think block's tokens lie before it)
                if harmony is not None:
                    shown, pending = harmony.take(pending, answer.result.text, final=delta is None)
                else:
                    shown, pending = [t for t in pending if t.text_start >= cut], []
                entries = self.logprob_entries(shown)
                message["text"] += text
                message["logprobs"] += entries
                yield frames.event("response.output_text.delta", item_id=message["id"], output_index=len(output),
                                   content_index=0, delta=text, logprobs=entries)
            result = answer.result
            status = self.status(result)
            if thinking is not None:
                for frame in self._close_reasoning(frames, output, thinking):
                    yield frame
            if message is None and not (answer.calls or output):  # an empty answer is an empty message, as not streamed
                message = {"id": _new_id("msg"), "text": "", "logprobs": []}
                for frame in self._open_message(frames, output, message):
                    yield frame
            # The closing events each carry the whole text and its logprobs: built off the loop when large.
            heavy = len(message["logprobs"]) * (2 + (self.top_n or 0)) if message is not None else 0
            if message is not None:
                closing = message
                for frame in await off_loop(lambda: self._close_message(frames, output, closing, status), heavy):
                    yield frame
            for call in answer.calls:
                arguments = json.dumps(call.arguments)
                item = self.call_item(call, "", "in_progress")
                yield frames.event("response.output_item.added", output_index=len(output), item=item)
                yield frames.event("response.function_call_arguments.delta", item_id=item["id"],
                                   output_index=len(output), delta=arguments)
                yield frames.event("response.function_call_arguments.done", item_id=item["id"],
                                   output_index=len(output), name=call.name, arguments=arguments)
                done = self.call_item(call, arguments)
                yield frames.event("response.output_item.done", output_index=len(output), item=done)
                output.append(done)
            usage = await asyncio.to_thread(self.usage, result, thinking_text(output))  # (may tokenize)
            response = self.response(status, output, usage)
            if self.body.store:
                state.responses.put(owner, response, self.items,
                                    await asyncio.to_thread(stored_size, response, self.items))
            yield await off_loop(lambda: frames.event(f"response.{status}", response=response), heavy)
        except Exception as exc:
            err = stream_error(exc, stream.request_id)
            failed = self.response("failed", output, error={"code": _failure_code(err.status_for("openai")),
                                                              "message": err.message_for("openai")})
            yield frames.event("response.failed", response=failed)

    def _open_message(self, frames: "_Frames", output: list[dict[str, Any]], message: dict[str, Any]) -> list[bytes]:
        index = len(output)
        return [
            frames.event("response.output_item.added", output_index=index,
                         item=self.message_item(message["id"], [], "in_progress")),
            frames.event("response.content_part.added", item_id=message["id"], output_index=index, content_index=0,
                         part=self.text_part("", [])),
        ]

    def _close_message(self, frames: "_Frames", output: list[dict[str, Any]], message: dict[str, Any],
                       status: str) -> list[bytes]:
        index, part = len(output), self.text_part(message["text"], message["logprobs"])
        item = self.message_item(message["id"], [part], status)
        output.append(item)
        return [
            frames.event("response.output_text.done", item_id=message["id"], output_index=index, content_index=0,
                         text=message["text"], logprobs=message["logprobs"]),
            frames.event("response.content_part.done", item_id=message["id"], output_index=index, content_index=0,
                         part=part),
            frames.event("response.output_item.done", output_index=index, item=item),
        ]

    def _close_reasoning(self, frames: "_Frames", output: list[dict[str, Any]], thinking: dict[str, Any]) -> list[bytes]:
        index = len(output)
        item = self.reasoning_item(thinking["id"], thinking["text"])
        output.append(item)
        return [
            frames.event("response.reasoning_text.done", item_id=thinking["id"], output_index=index, content_index=0,
                         text=thinking["text"]),
            frames.event("response.content_part.done", item_id=thinking["id"], output_index=index, content_index=0,
                         part={"type": "reasoning_text", "text": thinking["text"]}),
            frames.event("response.output_item.done", output_index=index, item=item),
        ]


def _failure_code(status: int) -> str:
    """A failed response's error.code, among OpenAI's (ResponseError.code): by the HTTP status
    the failure would have had."""
    return "rate_limit_exceeded" if status == 429 else "server_error" if status >= 500 else "invalid_prompt"


def thinking_text(output: list[dict[str, Any]]) -> str:
    return "".join(p["text"] for item in output if item["type"] == "reasoning" for p in item["content"])


class _Frames:
    """Typed SSE events numbered in the order they are sent."""

    def __init__(self) -> None:
        self.sequence = 0

    def event(self, kind: str, **fields: Any) -> bytes:
        frame = sse_event(kind, {"type": kind, "sequence_number": self.sequence, **fields})
        self.sequence += 1
        return frame


# ---- stored responses ------------------------------------------------------------------------


def _stored(request: Request, response_id: str) -> tuple[Any, str, Any]:
    state = server_state(request)
    owner = owner_of(state.identify(request))
    entry = state.responses.get(owner, response_id)
    if entry is None:
        raise NotFound(f"Response with id '{response_id}' not found. Only responses created with store true are "
                       "kept, in this server's memory, until it restarts or needs the room", param="response_id")
    return state, owner, entry


# One route for a stored response's methods, so that a 405 there names them all (the Allow
# header of a route per method named only the first's); HEAD beside GET, as on every GET route.
@router.api_route("/v1/responses/{response_id}", methods=["GET", "HEAD", "DELETE"])
async def stored_response(request: Request, response_id: str) -> Response:
    if request.method == "DELETE":
        state, owner, _ = _stored(request, response_id)
        state.responses.delete(owner, response_id)
        return JSONResponse({"id": response_id, "object": "response", "deleted": True})
    if request.query_params.get("stream") in ("true", "1"):
        raise InvalidRequest("stream: a stored response cannot be streamed again (tierlm runs no background "
                             "responses); GET it without stream", param="stream")
    _, _, entry = _stored(request, response_id)
    return JSONResponse(entry.response)


@router.post("/v1/responses/{response_id}/cancel")
async def cancel_response(request: Request, response_id: str) -> Response:
    _stored(request, response_id)
    raise InvalidRequest("Only responses created with background true can be cancelled, and tierlm runs none in "
                         "the background: this one has finished", param="response_id")


@router.api_route("/v1/responses/{response_id}/input_items", methods=["GET", "HEAD"])
async def list_input_items(request: Request, response_id: str) -> Response:
    """The items the response read (its history's and its own), a page at a time: `order` desc
    (the default, newest first) or asc, `limit` 1-100 (20), after the item id `after`."""
    _, _, entry = _stored(request, response_id)
    query = request.query_params
    order = query.get("order", "desc")
    if order not in ("asc", "desc"):
        raise InvalidRequest(f"order: must be 'asc' or 'desc' (got {order!r})", param="order")
    try:
        limit = int(query.get("limit", "20"))
    except ValueError:
        limit = 0
    if not 1 <= limit <= 100:
        raise InvalidRequest(f"limit: must be an integer from 1 to 100 (got {query.get('limit')!r})", param="limit")
    items = entry.input_items if order == "asc" else entry.input_items[::-1]
    start = 0
    if (after := query.get("after")) is not None:
        ids = [item.get("id") for item in items]
        if after not in ids:
            raise InvalidRequest(f"after: no input item of this response has id '{after}'", param="after")
        start = ids.index(after) + 1
    page = items[start:start + limit]
    return JSONResponse({"object": "list", "data": page, "first_id": page[0]["id"] if page else None,
                         "last_id": page[-1]["id"] if page else None, "has_more": start + limit < len(items)})
