"""Anthropic Messages API: /v1/messages and /v1/messages/count_tokens.

Translation rules (the parts the API leaves to the server):
- consecutive turns of the same role are merged, their text joined by a blank line; text
  blocks within one turn are joined by a newline;
- a final assistant turn is a prefill: the prompt ends inside that turn and the answer (only
  the new text) continues it;
- tool_result blocks become `tool` messages and assistant tool_use blocks become `tool_calls`,
  the shapes Hugging Face chat templates render, with ids rewritten to 9 alphanumerics
  (tools.template_tool_call_id: Mistral's templates accept no other);
- tool_choice `any` / `tool` start the assistant turn with a call in the model's syntax
  (`<tool_call>`, `[TOOL_CALLS]`, ...: tools.py; and the tool's name), and the rest of the call
  follows the tool's input_schema (tool_grammar.py); `none` leaves tools out;
- plain-text documents and search results are text (title, context or source, then the text),
  at the top of a user message or in a tool_result;
- `thinking` becomes the template's `enable_thinking` (Qwen3, SmolLM3); a reasoning model's think
  block (reasoning.py) comes back as a thinking block (see thinking_signature), empty with
  `display: omitted`.
"""
from __future__ import annotations

import base64
import binascii
import hashlib
import json
import uuid
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, AsyncIterator

from fastapi import APIRouter
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from tierlm.engine.outputs import StreamDelta
from tierlm.serving import tools as toolcalls
from tierlm.serving.auth import RequestContext
from tierlm.serving.errors import InvalidRequest, anthropic_error_body, stream_error
from tierlm.serving.generation import (
    ChatPrompt,
    EngineStream,
    Generation,
    StreamedAnswer,
    chat_prompt,
    check_structured,
    output_budget,
    sampling_params,
    top_k_limit,
    top_p_value,
)
from tierlm.serving.protocol_anthropic import (
    ConversationBody,
    CountTokensRequest,
    DocumentBlock,
    ImageBlock,
    MessageResponse,
    MessagesRequest,
    PlainTextSource,
    RedactedThinkingBlock,
    SearchResultBlock,
    TextBlock,
    TextContent,
    ThinkingBlock,
    ThinkingContent,
    TokenCount,
    ToolResultBlock,
    ToolUseBlock,
    ToolUseContent,
    Usage,
)
from tierlm.sampling_params import StructuredOutputsParams
from tierlm.serving.reasoning import ReasoningFormat, both_names
from tierlm.serving.safety import FINISH_REASON
from tierlm.serving.sla import fallback_marked, with_fallback
from tierlm.serving.responses import json_answer
from tierlm.serving.sse import EventStreamResponse, sse_event
from tierlm.serving.state import server_state
from tierlm.serving.telemetry import request_telemetry

if TYPE_CHECKING:
    from tierlm.engine.async_engine import AsyncEngine

router = APIRouter()


@router.post("/v1/messages")
async def create_message(request: Request) -> Response:
    state = server_state(request)
    context = await state.admit(request)
    body = await state.parse(request, MessagesRequest)
    state.models.get(body.model, context.models)  # an unknown model is named first (404), as Anthropic does
    await read_file_documents(state, context, body)
    # With interleaved thinking (a beta Claude Code sends) the budget covers the whole turn and
    # may exceed max_tokens, as Anthropic's docs allow.
    interleaved = "interleaved-thinking" in ",".join(request.headers.getlist("anthropic-beta"))
    if not interleaved and (problem := body.thinking_problem()) is not None:
        raise InvalidRequest(f"thinking.budget_tokens: {problem}", param="thinking.budget_tokens")
    asked = body.model
    served, started = await with_fallback(
        state.sla, request_telemetry(request), asked,
        lambda name: _start_message(request, state, context, body if name == asked else body.model_copy(update={"model": name})))
    return fallback_marked(await _answer(request, context, started), asked, served)


@dataclass
class _Started:
    body: MessagesRequest  # (its model: the one serving it, a fallback's when the SLA guard sent it there)
    prompt: ChatPrompt
    stream: EngineStream
    first: StreamDelta
    warming: bool


async def _start_message(request: Request, state: Any, context: RequestContext, body: MessagesRequest) -> _Started:
    """Render `body` for its model and open its engine request (the SLA guard's refusal, SlaShed,
    surfaces here, before the engine sees anything)."""
    engine = state.models.get(body.model, context.models)
    structured = await checked_format(engine, body)
    if structured is not None and body.tools and body.tool_choice is not None and body.tool_choice.type in ("any", "tool"):
        raise InvalidRequest("tool_choice: a required tool call cannot follow output_config.format as well; use "
                             "tool_choice 'auto', or drop the format", param="tool_choice")
    prompt = await build_prompt(engine, body, tool_calls=state.models.tool_calls(body.model),
                                reasoning=state.models.reasoning(body.model), structured=structured is not None)
    max_tokens = output_budget(engine, body.model, len(prompt.token_ids), body.max_tokens)
    # max_tokens 0 pre-warms the cache: the engine runs one token (it cannot prefill alone), so
    # the prompt's blocks are cached, and the token is never shown (see warmed_response).
    warming = max_tokens == 0
    token_ids = prompt.token_ids
    if warming:
        # A prompt that fills the context leaves the engine no room for its token: it runs all
        # but the last, which caches the blocks any later request can read (at most all but
        # the last token of a prompt that fits).
        token_ids = token_ids[: int(engine.max_model_len) - 1]
    params = sampling_params(
        engine.sampling_defaults,
        max_tokens=max_tokens or 1,
        temperature=body.temperature,
        top_p=top_p_value(body.top_p),
        top_k=top_k_limit(engine, body.top_k),
        stop=body.stop_sequences,
        keep_special_token_ids=prompt.keep_special_token_ids,
        thinking_budget=prompt.thinking_budget(body.thinking_budget_tokens),
        structured_outputs=prompt.structured_outputs(structured),
    )
    stream = EngineStream(engine, body.model, token_ids, params, context.salted(body.cache_salt), state.inflight,
                          markup=prompt.markup, screen_text=prompt.screen_text)
    if warming:
        request_telemetry(request).warming(len(prompt.token_ids))
    first = await stream.open(request)
    warming = warming and first.finish_reason != FINISH_REASON  # a refused prompt is refused, not warmed
    return _Started(body, prompt, stream, first, warming)


async def _answer(request: Request, context: RequestContext, started: _Started) -> Response:
    body, prompt, stream, first, warming = started.body, started.prompt, started.stream, started.first, started.warming
    message_id = "msg_" + uuid.uuid4().hex[:24]
    request_telemetry(request).response_id = message_id
    if body.stream:
        num_prompt = len(prompt.token_ids) if warming else first.num_prompt_tokens or len(prompt.token_ids)
        events = (warming_events(stream, body.model, message_id, context.request_id, num_prompt,
                                 first.num_cached_tokens) if warming else
                  message_events(stream, prompt, body.model, message_id, context.request_id, num_prompt,
                                 first.num_cached_tokens, body.omits_thinking))
        return EventStreamResponse(events, on_close=stream.close)
    result = await stream.collect(request)
    if warming:
        return JSONResponse(warmed_response(result, len(prompt.token_ids), body.model, message_id).model_dump())
    return await json_answer(lambda: message_response(result, prompt, body.model, message_id, body.omits_thinking),
                             result.num_output_tokens)


@router.post("/v1/messages/count_tokens")
async def count_tokens(request: Request) -> Response:
    state = server_state(request)
    context = state.identify(request)
    body = await state.parse(request, CountTokensRequest, counting=True)
    engine = state.models.get(body.model, context.models)
    await read_file_documents(state, context, body)
    await checked_format(engine, body)  # (refused here as by /v1/messages; it adds nothing to the prompt)
    # Counted whatever the length: the count is the answer, even past the model's context.
    prompt = await build_prompt(engine, body, check_length=False, tool_calls=state.models.tool_calls(body.model))
    return JSONResponse(TokenCount(input_tokens=len(prompt.token_ids)).model_dump())


# ---- request → prompt ------------------------------------------------------------------


async def read_file_documents(state: Any, context: RequestContext, body: ConversationBody) -> None:
    """Document blocks whose source is a file uploaded through the Files API (`{"type": "file",
    "file_id": ...}`, also inside tool results) read as that file's text, in place; a file the
    model cannot read (not text) is left for check_blocks to refuse, naming the block."""
    from tierlm.serving.batches import owner_of_key
    from tierlm.serving.files import file_text

    owner = owner_of_key(context.api_key_id)
    for i, message in enumerate(body.messages):
        for j, block in enumerate(message.blocks()):
            nested = block.content if isinstance(block, ToolResultBlock) and isinstance(block.content, list) else [block]
            for k, part in enumerate(nested):
                source = part.source if isinstance(part, DocumentBlock) else None
                if not (isinstance(source, dict) and source.get("type") == "file"):
                    continue
                where = f"messages.{i}.content.{j}" + (f".content.{k}" if part is not block else "") + ".source.file_id"
                file_id = source.get("file_id")
                if not isinstance(file_id, str):
                    raise InvalidRequest(f"{where}: give the id of a file uploaded through the Files API", param=where)
                text = await file_text(state.batches.files, owner, file_id, where, api="anthropic")
                if text is not None:
                    part.source = PlainTextSource(type="text", media_type="text/plain", data=text)


async def checked_format(engine: "AsyncEngine", body: ConversationBody) -> StructuredOutputsParams | None:
    """The reply's JSON schema (output_config.format, or the beta's output_format), once the
    engine has found it followable; a 400 naming the field otherwise."""
    structured = body.structured()
    where = "output_config.format" if body.output_config is not None and body.output_config.format else "output_format"
    await check_structured(engine, structured, where)
    return structured


async def build_prompt(engine: "AsyncEngine", body: ConversationBody, *, check_length: bool = True,
                       tool_calls: toolcalls.ToolCallFormat | None = None,
                       reasoning: ReasoningFormat | None = None, structured: bool = False) -> ChatPrompt:
    """The request as a rendered prompt; `check_length` refuses one certainly too long for the context."""
    check_blocks(body)
    if isinstance(body.system, list) and _only_blank_text(body.system):
        raise InvalidRequest("system: text content blocks must contain non-whitespace text", param="system")
    check_tool_pairing(body)
    messages = template_messages(body)
    body.check_template_kwargs(continue_final_message=messages[-1]["role"] == "assistant")
    choice = body.tool_choice.type if body.tool_choice else "auto"
    use_tools = bool(body.tools) and choice != "none"
    return await chat_prompt(
        engine,
        body.model,
        messages,
        tools=toolcalls.anthropic_tools_to_template(body.tools) if use_tools else None,
        continue_final_message=messages[-1]["role"] == "assistant",
        call_required_by=choice if choice in ("any", "tool") else None,
        tool_name=body.tool_choice.name if choice == "tool" else None,
        check_length=check_length,
        template_kwargs=body.template_kwargs,
        tool_calls=tool_calls,
        reasoning=reasoning,
        structured=structured,
        schema_field="tools.{}.input_schema",
    )


def check_blocks(body: ConversationBody) -> None:
    """Refuse empty messages (but the final assistant one, which means no prefill) and blocks
    the model cannot read or that sit in the wrong role, naming the message or block."""
    last = len(body.messages) - 1
    for i, message in enumerate(body.messages):
        if not message.content and not (i == last and message.role == "assistant"):
            raise InvalidRequest(  # Anthropic's own wording
                f"messages.{i}: all messages must have non-empty content except for the optional final "
                "assistant message",
                param=f"messages.{i}",
            )
        blocks = message.blocks()
        if message.role == "user" and _only_blank_text(blocks):
            # Anthropic's words. Not for assistant turns: a model's answer may be blank (tierlm's
            # too), and refusing it when the client sends it back wedged the conversation.
            raise InvalidRequest(f"messages.{i}: text content blocks must contain non-whitespace text",
                                 param=f"messages.{i}")
        for j, block in enumerate(blocks):
            where = f"messages.{i}.content.{j}"
            if (kind := _unreadable(block)) is not None:
                raise InvalidRequest(
                    f"{where}: model '{body.model}' is text-only and cannot read {kind}; "
                    "send the content as text",
                    param=where,
                )
            if (problem := _misplaced(block, message.role)) is not None:
                raise InvalidRequest(f"{where}: {problem}", param=where)


def _unreadable(block: Any) -> str | None:
    """What in `block` a text-only model cannot read (an image, a PDF; also inside a tool
    result or a document), or None: plain-text documents and search results are read as text."""
    nested = block.content if isinstance(block, ToolResultBlock) and isinstance(block.content, list) else [block]
    for part in nested:
        if isinstance(part, ImageBlock):
            return "image blocks"
        if isinstance(part, DocumentBlock) and part.text() is None:
            if not isinstance(part.source, dict):  # content blocks, an image among them
                return "image blocks (in this document's content)"
            return f"document blocks other than plain text (this one's source is {part.source.get('type')!r})"
    return None


_ROLE_OF = {ToolUseBlock: "assistant", ThinkingBlock: "assistant", RedactedThinkingBlock: "assistant",
            ToolResultBlock: "user", DocumentBlock: "user", SearchResultBlock: "user"}


def _misplaced(block: Any, role: str) -> str | None:
    """Why `block` cannot sit in a message of `role` (Anthropic's rule), or None."""
    belongs = _ROLE_OF.get(type(block))
    if belongs is None or belongs == role:
        return None
    return f"{block.type} blocks belong in {belongs} messages"


def _only_blank_text(blocks: list[Any]) -> bool:
    """Text blocks only, each whitespace alone (the real API accepts a blank block beside others)."""
    return bool(blocks) and all(isinstance(b, TextBlock) and not b.text.strip() for b in blocks)


def check_tool_pairing(body: ConversationBody) -> None:
    """Anthropic's rule, in its words: every tool_use is answered by a tool_result in the next
    (user) turn, and every tool_result answers a tool_use of the turn before. Templates render
    an unanswered call or a stray result as if it were fine (or fail with a template error).
    A final assistant turn with tool_use is refused where prefills are (_assistant_turn). Ids are
    unique across the conversation (a repeat makes a result answer two calls), and the turn after
    n calls begins with n tool_result blocks, before any text, image or document."""
    seen: set[str] = set()
    for i, message in enumerate(body.messages):
        for j, block in enumerate(message.blocks()):
            if isinstance(block, ToolUseBlock):
                where = f"messages.{i}.content.{j}"
                if block.id in seen:
                    raise InvalidRequest(f"{where}: `tool_use` ids must be unique; {block.id} is used twice",
                                         param=where)
                seen.add(block.id)
    turns: list[list[int]] = []  # message indices, consecutive same-role messages together
    for i, message in enumerate(body.messages):
        if turns and body.messages[turns[-1][0]].role == message.role:
            turns[-1].append(i)
        else:
            turns.append([i])

    def blocks(turn: list[int], kind: type) -> list[tuple[int, int, Any]]:
        return [(i, j, b) for i in turn for j, b in enumerate(body.messages[i].blocks()) if isinstance(b, kind)]

    for k, turn in enumerate(turns):
        if body.messages[turn[0]].role == "assistant":
            if k + 1 == len(turns):
                continue
            answered = {b.tool_use_id for _, _, b in blocks(turns[k + 1], ToolResultBlock)}
            missing = [(i, b.id) for i, _, b in blocks(turn, ToolUseBlock) if b.id not in answered]
            if missing:
                where = f"messages.{missing[0][0]}"
                raise InvalidRequest(
                    f"{where}: `tool_use` ids were found without `tool_result` blocks immediately after: "
                    f"{', '.join(i for _, i in missing)}. Each `tool_use` block must have a corresponding "
                    "`tool_result` block in the next message.",
                    param=where,
                )
        else:
            asked = {b.id for _, _, b in blocks(turns[k - 1], ToolUseBlock)} if k else set()
            leading = [b for i in turn for b in body.messages[i].blocks()][:len(asked)]
            if not all(isinstance(b, ToolResultBlock) for b in leading):
                where = f"messages.{turn[0]}"
                raise InvalidRequest(
                    f"{where}: Did not find {len(asked)} `tool_result` block(s) at the beginning of this message. "
                    "Messages following `tool_use` blocks must begin with a matching number of `tool_result` blocks.",
                    param=where,
                )
            for i, j, b in blocks(turn, ToolResultBlock):
                if b.tool_use_id not in asked:
                    where = f"messages.{i}.content.{j}"
                    raise InvalidRequest(
                        f"{where}: unexpected `tool_use_id` found in `tool_result` blocks: {b.tool_use_id}. "
                        "Each `tool_result` block must have a corresponding `tool_use` block in the previous message.",
                        param=where,
                    )


def system_text(system: str | list[TextBlock] | None) -> str | None:
    if system is None:
        return None
    if isinstance(system, str):
        return system or None
    return "\n".join(block.text for block in system) or None


@dataclass
class _Turn:
    """Consecutive same-role messages, merged; `first` is the index of the first of them."""

    role: str
    first: int
    blocks: list[Any]


_TURN_BREAK = object()  # marks where two same-role messages were merged


def template_messages(body: ConversationBody) -> list[dict[str, Any]]:
    """Anthropic turns → Hugging Face chat-template messages."""
    turns: list[_Turn] = []
    for i, message in enumerate(body.messages):
        if turns and turns[-1].role == message.role:
            turns[-1].blocks += [_TURN_BREAK, *message.blocks()]
        else:
            turns.append(_Turn(message.role, i, message.blocks()))
    out: list[dict[str, Any]] = []
    system = system_text(body.system)
    if system:
        out.append({"role": "system", "content": system})
    if turns[-1].role == "assistant" and not turns[-1].blocks:
        turns.pop()  # an empty final assistant message: no prefill, the answer starts a new turn
    if not turns:
        raise InvalidRequest("messages: needs a message with content; add a user message", param="messages")
    for turn in turns:
        if turn.role == "user":
            out.extend(_user_turn(turn))
        else:
            out.append(_assistant_turn(turn, final=turn is turns[-1], last_index=len(body.messages) - 1))
    return out


def _block_text(block: Any) -> str | None:
    """What a block puts into the prompt's text: text, a plain-text document, a search result
    (check_blocks has refused what cannot be read); None for the others."""
    if isinstance(block, TextBlock):
        return block.text
    if isinstance(block, (DocumentBlock, SearchResultBlock)):
        return block.text()
    return None


def _join_text(blocks: list[Any]) -> str:
    text = ""
    after_break = False
    for block in blocks:
        if block is _TURN_BREAK:
            after_break = True
        elif (piece := _block_text(block)) is not None:
            if text:
                text += "\n\n" if after_break else "\n"
            text += piece
            after_break = False
    return text


def _user_turn(turn: _Turn) -> list[dict[str, Any]]:
    """Tool results first (as `tool` messages, the order Anthropic requires), then the text."""
    messages = [
        {"role": "tool", "tool_call_id": toolcalls.template_tool_call_id(block.tool_use_id),
         "content": _tool_result_text(block)}
        for block in turn.blocks
        if isinstance(block, ToolResultBlock)
    ]
    text = _join_text(turn.blocks)
    if text:
        messages.append({"role": "user", "content": text})
    if not messages:
        where = f"messages.{turn.first}"
        raise InvalidRequest(f"{where}: a user message needs text (or a document or search result holding "
                             "some) or tool_result content", param=where)
    return messages


def _tool_result_text(block: ToolResultBlock) -> str:
    content = block.content
    if content is None:
        text = ""
    elif isinstance(content, str):
        text = content
    else:
        text = "\n".join(piece for b in content if (piece := _block_text(b)) is not None)
    return f"Error: {text}" if block.is_error else text


def _assistant_turn(turn: _Turn, final: bool, last_index: int) -> dict[str, Any]:
    """Text plus `tool_calls`, and thinking blocks' text as `reasoning_content` and `reasoning`
    (vLLM's mapping): Qwen3's template writes it back into the turns after the last user query,
    as in a tool loop; other templates ignore it. Redacted thinking, unreadable, is dropped."""
    message: dict[str, Any] = {"role": "assistant", "content": _join_text(turn.blocks)}
    thinking = [text for b in turn.blocks if isinstance(b, ThinkingBlock) and (text := _thinking_text(b))]
    if thinking:  # (under both names vLLM gives it: templates read one or the other)
        message.update(both_names("\n".join(thinking)))
    calls = [
        {"id": toolcalls.template_tool_call_id(b.id), "type": "function",
         "function": {"name": b.name, "arguments": b.input}}
        for b in turn.blocks
        if isinstance(b, ToolUseBlock)
    ]
    where = f"messages.{last_index}"
    if calls and final:
        raise InvalidRequest(
            f"{where}: the final assistant message ends in tool_use; add a user message with the "
            "matching tool_result blocks",
            param=where,
        )
    if calls:
        message["tool_calls"] = calls
    elif final and not message["content"]:
        raise InvalidRequest(
            f"{where}.content: a final assistant message (prefill) needs text to continue",
            param=f"{where}.content",
        )
    elif final and message["content"] != message["content"].rstrip():  # refused by Anthropic's API too
        raise InvalidRequest(
            f"{where}.content: final assistant content cannot end with trailing whitespace; "
            "remove it from the prefill",
            param=f"{where}.content",
        )
    return message


# ---- generation → response ---------------------------------------------------------------


def stop_details(result: Generation, has_tool_calls: bool) -> tuple[str, str | None]:
    """(stop_reason, stop_sequence) in Anthropic's terms. A cut-off answer is `max_tokens`
    even after complete calls (a call cut off itself is text: tools.parse_tool_calls)."""
    if result.finish_reason == "length":
        return "max_tokens", None
    if result.finish_reason == FINISH_REASON:  # stopped by the safety layer
        return "refusal", None
    if has_tool_calls:
        return "tool_use", None
    if isinstance(result.stop_reason, str):
        return "stop_sequence", result.stop_reason
    return "end_turn", None


def usage_of(num_prompt: int, num_cached: int, num_output: int) -> Usage:
    return Usage(
        input_tokens=num_prompt - num_cached,
        output_tokens=num_output,
        cache_creation_input_tokens=0,
        cache_read_input_tokens=num_cached,
    )


# A signature that carries its block's thinking (display omitted), after this prefix
_CARRIED_THINKING = "tierlm-thinking:"


def thinking_signature(thinking: str, carry: bool = False) -> str:
    """A thinking block's `signature`, opaque to clients. Anthropic's carries the thinking,
    encrypted, so that a block sent back with `display: omitted` (empty text) still gives the
    model its reasoning; with `carry` tierlm's does too (base64, not encrypted: a client could
    send any thinking text anyway). Otherwise it is a digest of the text, which the block
    already holds. Nothing checks a signature that comes back."""
    if carry:
        return _CARRIED_THINKING + base64.b64encode(thinking.encode()).decode()
    return base64.b64encode(hashlib.sha256(b"tierlm thinking\0" + thinking.encode()).digest()).decode()


def _thinking_text(block: ThinkingBlock) -> str:
    """A thinking block's text as sent back: its own, or that its signature carries."""
    if block.thinking or not (block.signature or "").startswith(_CARRIED_THINKING):
        return block.thinking
    try:
        return base64.b64decode(block.signature[len(_CARRIED_THINKING):], validate=True).decode()
    except (binascii.Error, UnicodeDecodeError):  # not tierlm's: read as the empty block it is
        return ""


def message_response(result: Generation, prompt: ChatPrompt, model: str, message_id: str,
                     omit_thinking: bool = False) -> MessageResponse:
    content: list[ThinkingContent | TextContent | ToolUseContent] = []
    answer = prompt.split(result, id_prefix="toolu_")
    text, calls = answer.text, answer.calls
    if answer.reasoning:
        content.append(ThinkingContent(thinking="" if omit_thinking else answer.reasoning,
                                       signature=thinking_signature(answer.reasoning, carry=omit_thinking)))
    if text:
        content.append(TextContent(text=text))
    content.extend(ToolUseContent(id=c.id, name=c.name, input=c.arguments) for c in calls)
    stop_reason, stop_sequence = stop_details(result, bool(calls))
    return MessageResponse(
        id=message_id,
        content=content,
        model=model,
        stop_reason=stop_reason,
        stop_sequence=stop_sequence,
        usage=usage_of(result.num_prompt_tokens, result.num_cached_tokens, result.num_output_tokens),
    )


def warmed_response(result: Generation, num_prompt: int, model: str, message_id: str) -> MessageResponse:
    """The answer to max_tokens 0: the prompt (`num_prompt` tokens) is cached, nothing was
    generated (the one token the engine ran is dropped, whatever it was: text, EOS, a stop
    string, a call's start)."""
    return MessageResponse(id=message_id, content=[], model=model, stop_reason="max_tokens",
                           usage=usage_of(num_prompt, result.num_cached_tokens, 0))


class _Blocks:
    """Content-block bookkeeping for a stream: indices from 0, one block open at a time. A
    thinking block's signature (of all its text) is sent as its last delta, as Anthropic's."""

    def __init__(self, omit_thinking: bool = False) -> None:
        self.count = 0
        self.open_type: str | None = None
        self.pinged = False
        self.omit_thinking = omit_thinking
        self._thinking: list[str] = []

    def thinking(self, text: str) -> list[bytes]:
        frames = []
        if self.open_type != "thinking":
            frames += self.close()
            frames += self._start({"type": "thinking", "thinking": "", "signature": ""})
        self._thinking.append(text)
        if not self.omit_thinking:
            frames.append(self._delta({"type": "thinking_delta", "thinking": text}))
        return frames

    def text(self, text: str) -> list[bytes]:
        frames = []
        if self.open_type != "text":
            frames += self.close()
            frames += self._start({"type": "text", "text": ""})
        frames.append(self._delta({"type": "text_delta", "text": text}))
        return frames

    def tool_use(self, call: toolcalls.ParsedToolCall) -> list[bytes]:
        frames = self.close()
        frames += self._start({"type": "tool_use", "id": call.id, "name": call.name, "input": {}})
        frames.append(self._delta({"type": "input_json_delta", "partial_json": json.dumps(call.arguments)}))
        return frames + self.close()

    def close(self) -> list[bytes]:
        if self.open_type is None:
            return []
        frames = []
        if self.open_type == "thinking":
            signature = thinking_signature("".join(self._thinking), carry=self.omit_thinking)
            frames.append(self._delta({"type": "signature_delta", "signature": signature}))
            self._thinking = []
        self.open_type = None
        return frames + [sse_event("content_block_stop", {"type": "content_block_stop", "index": self.count - 1})]

    def _delta(self, delta: dict[str, Any]) -> bytes:
        return sse_event("content_block_delta", {"type": "content_block_delta", "index": self.count - 1,
                                                 "delta": delta})

    def ping(self) -> list[bytes]:
        if self.pinged:
            return []
        self.pinged = True
        return [sse_event("ping", {"type": "ping"})]

    def _start(self, block: dict[str, Any]) -> list[bytes]:
        self.open_type = block["type"]
        self.count += 1
        frames = [sse_event("content_block_start", {
            "type": "content_block_start", "index": self.count - 1, "content_block": block,
        })]
        return frames + self.ping()


async def message_events(
    stream: EngineStream,
    prompt: ChatPrompt,
    model: str,
    message_id: str,
    request_id: str,
    num_prompt: int,
    num_cached: int,
    omit_thinking: bool = False,
) -> AsyncIterator[bytes]:
    """message_start → (content_block_start, ping, deltas, content_block_stop)* →
    message_delta → message_stop; a failure mid-stream becomes an `error` event."""
    yield _message_start(model, message_id, num_prompt, num_cached)
    blocks = _Blocks(omit_thinking)
    answer = StreamedAnswer(stream, prompt, id_prefix="toolu_")
    try:
        async for thought, text, _ in answer.pieces():
            if thought:
                for frame in blocks.thinking(thought):
                    yield frame
            if text:
                for frame in blocks.text(text):
                    yield frame
        for call in answer.calls:
            for frame in blocks.tool_use(call):
                yield frame
        for frame in blocks.close() + blocks.ping():
            yield frame
        result = answer.result
        stop_reason, stop_sequence = stop_details(result, bool(answer.calls))
        yield _message_delta(stop_reason, stop_sequence, usage_of(result.num_prompt_tokens, result.num_cached_tokens,
                                                                  result.num_output_tokens))
        yield sse_event("message_stop", {"type": "message_stop"})
    except Exception as exc:
        yield sse_event("error", anthropic_error_body(stream_error(exc, request_id), request_id))


async def warming_events(stream: EngineStream, model: str, message_id: str, request_id: str, num_prompt: int,
                         num_cached: int) -> AsyncIterator[bytes]:
    """max_tokens 0, streamed: message_start → message_delta (`max_tokens`, no output) →
    message_stop, with no content block; the engine's one token is run to the end and dropped."""
    yield _message_start(model, message_id, num_prompt, num_cached)
    try:
        result = await stream.run_to_end()
        yield _message_delta("max_tokens", None, usage_of(num_prompt, result.num_cached_tokens, 0))
        yield sse_event("message_stop", {"type": "message_stop"})
    except Exception as exc:
        yield sse_event("error", anthropic_error_body(stream_error(exc, request_id), request_id))


def _message_start(model: str, message_id: str, num_prompt: int, num_cached: int) -> bytes:
    return sse_event("message_start", {
        "type": "message_start",
        "message": {
            "id": message_id, "type": "message", "role": "assistant", "content": [], "model": model,
            "stop_reason": None, "stop_sequence": None,
            "usage": usage_of(num_prompt, num_cached, 0).model_dump(),
        },
    })


def _message_delta(stop_reason: str, stop_sequence: str | None, usage: Usage) -> bytes:
    return sse_event("message_delta", {
        "type": "message_delta",
        "delta": {"stop_reason": stop_reason, "stop_sequence": stop_sequence},
        "usage": usage.model_dump(),
    })
