"""OpenAI API: /v1/chat/completions and /v1/completions (the Responses API runs through `start_chat`).

`developer` messages are rendered as `system` (chat templates predate that role); assistant
`tool_calls` arguments are decoded from their JSON text because templates render dicts.
tool_choice `required` / a named function start the answer with a call in the model's syntax
(`<tool_call>`, `[TOOL_CALLS]`, ...: tools.py), as on the Anthropic side, and the rest of the
call follows the tool's schema (tool_grammar.py); a call cut off (max_tokens, a stop string)
comes back as the text the model wrote, without that start (see ChatPrompt.without_forced_prefix).
"""
from __future__ import annotations

import asyncio
import dataclasses
import json
import time
import uuid
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, AsyncIterator, Callable, Sequence

import anyio
from fastapi import APIRouter
from starlette.requests import Request
from starlette.responses import Response

from tierlm import __version__
from tierlm.engine.outputs import TokenLogprob
from tierlm.errors import InvalidRequestError, TierlmError
from tierlm.sampling_params import SamplingParams, StructuredOutputsParams, choice_seed, truncate_prompt
from tierlm.serving import tools as toolcalls
from tierlm.serving.auth import RequestContext
from tierlm.serving.errors import InvalidRequest, from_engine_error, openai_error_body, stream_error
from tierlm.serving.generation import (
    ChatPrompt,
    EngineStream,
    Generation,
    StreamedAnswer,
    chat_prompt,
    check_structured,
    encode_prompt_text,
    output_budget,
    refuse_certainly_too_long,
    refuse_too_long_to_count,
    sampling_params,
    top_k_limit,
    top_p_value,
)
from tierlm.serving.protocol_openai import (
    ChatChoice,
    ChatCompletion,
    ChatCompletionRequest,
    ChatMessage,
    Completion,
    CompletionChoice,
    CompletionRequest,
    FunctionCall,
    FilePart,
    ImagePart,
    NamedToolChoice,
    ResponseMessage,
    ResponseToolCall,
    Usage,
)
from tierlm.serving.reasoning import ReasoningFormat, both_names
from tierlm.serving.responses import json_answer
from tierlm.serving.safety import FINISH_REASON, Markup
from tierlm.serving.scoring import echoed_legacy_logprobs, legacy_top, token_text, vllm_prompt_logprobs
from tierlm.serving.sla import fallback_marked, with_fallback
from tierlm.serving.sse import EventStreamResponse, sse_data
from tierlm.serving.state import server_state
from tierlm.serving.telemetry import request_telemetry
from tierlm.serving.validation import loads_strict
from tierlm.serving.vocab import vocabulary

if TYPE_CHECKING:
    from tierlm.engine.async_engine import AsyncEngine

router = APIRouter()

# OpenAI's responses and chunks carry the backend's configuration id; here, the tierlm version.
SYSTEM_FINGERPRINT = f"tierlm-{__version__}"


def _common_sampling(engine: "AsyncEngine", body: Any, max_tokens: int, logprobs: int | None) -> dict[str, Any]:
    return dict(
        max_tokens=max_tokens,
        temperature=body.temperature,
        top_p=top_p_value(body.top_p),
        top_k=top_k_limit(engine, body.top_k),
        min_p=body.min_p,
        repetition_penalty=body.repetition_penalty,
        min_tokens=body.min_tokens,
        presence_penalty=body.presence_penalty,
        frequency_penalty=body.frequency_penalty,
        seed=body.seed,
        stop=body.stops(),
        ignore_eos=body.ignore_eos,
        logprobs=logprobs,
        stop_token_ids=body.stop_token_ids,
        include_stop_str_in_output=body.include_stop_str_in_output,
        skip_special_tokens=body.skip_special_tokens,
        logit_bias=body.token_bias(),
        allowed_token_ids=body.allowed_token_ids,
        bad_words=body.bad_words,
    )


@dataclass
class ChatRun:
    """A chat request handed to its engine: what reads the answer, and its engine streams (open)."""

    engine: "AsyncEngine"
    prompt: ChatPrompt
    prompt_ids: list[int]
    top_n: int | None  # top logprobs per token (None: no logprobs)
    streams: list[EngineStream]
    model: str  # the model serving it: the one asked for, or its fallback (sla.py)
    asked: str  # the model the request named

    def mark(self, response: Response) -> Response:
        """`response`, with the fallback header where a fallback model served it."""
        return fallback_marked(response, self.asked, self.model)


@router.post("/v1/chat/completions")
async def chat_completions(request: Request) -> Response:
    state = server_state(request)
    context = await state.admit(request)
    body = await state.parse(request, ChatCompletionRequest)
    run = await start_chat(state, context, request, body)
    engine, prompt, streams, top_n = run.engine, run.prompt, run.streams, run.top_n
    completion_id = "chatcmpl-" + uuid.uuid4().hex[:24]
    request_telemetry(request).response_id = completion_id
    if body.stream:
        chunks = chat_chunks(streams, engine, prompt, run.model, completion_id, top_n, run.prompt_ids,
                             *_stream_usage(body, [len(run.prompt_ids)] * len(streams)))
        return run.mark(EventStreamResponse(chunks, on_close=lambda: _close_all(streams)))
    results = await _collect_all(streams, request)
    scored = body.prompt_logprobs
    entries = _entries(results, top_n) + (0 if scored is None else len(run.prompt_ids) * (2 + scored))
    return run.mark(await json_answer(lambda: chat_response(results, engine, prompt, run.model, completion_id, top_n,
                                                            scored, run.prompt_ids), entries))


async def start_chat(state: Any, context: RequestContext, request: Request, body: ChatCompletionRequest,
                     limit_field: str | None = None, schema_field: str = "tools.{}.function.parameters") -> ChatRun:
    """Render `body`'s conversation, check what it asks for and open its engine requests (one
    per choice): the chat path, shared with the Responses API (`limit_field` names its output
    limit in 400s, `schema_field` a tool's parameters: see chat_prompt). On its model, or on
    that model's fallback where the SLA guard refuses it there."""
    await read_file_parts(state, context, body)
    asked = body.model
    _, run = await with_fallback(
        state.sla, request_telemetry(request), asked,
        lambda name: _start_chat(state, context, request, body if name == asked else body.model_copy(update={"model": name}),
                                 limit_field, schema_field))
    run.asked = asked
    return run


async def _start_chat(state: Any, context: RequestContext, request: Request, body: ChatCompletionRequest,
                      limit_field: str | None, schema_field: str) -> ChatRun:
    engine = state.models.get(body.model, context.models)
    structured = await _checked_structured(engine, body)
    forced = body.tool_choice == "required" or isinstance(body.tool_choice, NamedToolChoice)
    if structured is not None and forced and body.tools:
        raise InvalidRequest("tool_choice: a required tool call cannot follow a structured output as well; use "
                             "tool_choice 'auto', or drop the structured output", param="tool_choice")
    reasoning = state.models.reasoning(body.model)
    if body.thinking_token_budget is not None and (reasoning is None or not reasoning.budget_kept):
        why = ("writes harmony (gpt-oss): its reasoning is a channel, not a think block a budget can end; "
               "remove the field, or set reasoning_effort" if reasoning is not None and reasoning.harmony else
               "has no think markers tierlm can follow (its chat template writes no <think>, --reasoning-parser "
               "none, or its tokenizer has no <think> and </think> tokens of their own); remove the field")
        raise InvalidRequest(f"thinking_token_budget: model '{body.model}' {why}", param="thinking_token_budget")
    prompt = await build_chat_prompt(engine, body, state.models.tool_calls(body.model), reasoning,
                                     structured=structured is not None, schema_field=schema_field)
    prompt.named_call = bool(body.tools) and isinstance(body.tool_choice, NamedToolChoice)
    prompt.tokens_as_ids, prompt.return_token_ids = body.return_tokens_as_token_ids, body.return_token_ids
    if prompt.reasoning is not None:
        prompt.reasoning = prompt.reasoning.decoded(body.skip_special_tokens)
        prompt.show_reasoning = body.include_reasoning
    prompt_ids = _truncated(engine, prompt.token_ids, body.truncate_prompt_tokens, body.output_limit())
    limit_field = limit_field or ("max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens")
    max_tokens = output_budget(engine, body.model, len(prompt_ids), body.output_limit(), field_name=limit_field)
    top_n = (body.top_logprobs or 0) if body.logprobs else None
    params = sampling_params(engine.sampling_defaults, **_common_sampling(engine, body, max_tokens, top_n),
                             prompt_logprobs=body.prompt_logprobs,
                             keep_special_token_ids=prompt.keep_special_token_ids,
                             thinking_budget=prompt.thinking_budget(body.thinking_token_budget),
                             structured_outputs=prompt.structured_outputs(structured))
    await _tokenize_bad_words(engine, body.bad_words)
    streams = _engine_streams(state, engine, body, prompt_ids, params, context.salted(body.cache_salt),
                              scored_once=True, markup=prompt.markup, screen_text=prompt.screen_text)
    await _open_all(streams, request)
    return ChatRun(engine, prompt, prompt_ids, top_n, streams, body.model, body.model)


async def read_file_parts(state: Any, context: RequestContext, body: ChatCompletionRequest) -> None:
    """Each file part's text where it is a text file: one uploaded through /v1/files (`file_id`,
    this key's) or sent inline (`file_data`); a 400 naming the part for a file that is not there
    or data that is not base64. Other files keep no text and are refused when rendered."""
    from tierlm.serving.batches import owner_of_key
    from tierlm.serving.files import part_text

    owner = owner_of_key(context.api_key_id)
    for i, message in enumerate(body.messages):
        for j, part in enumerate(message.content if isinstance(message.content, list) else ()):
            if isinstance(part, FilePart):
                part._text = await part_text(state.batches.files, owner, part.file.file_id, part.file.file_data,
                                             part.file.filename, f"messages.{i}.content.{j}.file")


@router.post("/v1/completions")
async def completions(request: Request) -> Response:
    state = server_state(request)
    context = await state.admit(request)
    body = await state.parse(request, CompletionRequest)
    state.models.get(body.model, context.models)  # an unknown model is named first (404)
    asked = body.model
    served, run = await with_fallback(
        state.sla, request_telemetry(request), asked,
        lambda name: _start_completion(state, context, request,
                                       body if name == asked else body.model_copy(update={"model": name})))
    completion_id = "cmpl-" + uuid.uuid4().hex[:24]
    request_telemetry(request).response_id = completion_id
    if run.body.stream:
        chunks = completion_chunks(run, completion_id, *_stream_usage(run.body, run.choice_prompt_tokens()))
        return fallback_marked(EventStreamResponse(chunks, on_close=lambda: _close_all(run.streams)), asked, served)
    results = await _collect_all(run.streams, request)
    entries = _entries(results, run.body.logprobs) + run.prompt_entries()
    return fallback_marked(await json_answer(lambda: completion_response(run, results, completion_id), entries),
                           asked, served)


@dataclass
class CompletionRun:
    """A completions request handed to its engine: each prompt's ids and echoed text, and every
    choice's engine stream (open), prompt i's n choices at i × n to i × n + n − 1."""

    body: CompletionRequest
    engine: "AsyncEngine"
    prompt_ids: list[list[int]]
    echoes: list[str]  # each prompt's text as echoed ("" without echo)
    streams: list[EngineStream]

    @property
    def n(self) -> int:
        return self.body.n or 1

    @property
    def generates(self) -> bool:
        """False for max_tokens 0 (with echo): the prompt alone comes back, scored."""
        return self.body.max_tokens > 0

    @property
    def echoes_logprobs(self) -> bool:
        return self.body.echo and self.body.logprobs is not None

    def choice_prompt_tokens(self) -> list[int]:
        return [len(self.prompt_ids[c // self.n]) for c in range(len(self.streams))]

    def prompt_entries(self) -> int:
        """The prompt logprob entries the answer holds (see _entries)."""
        top = _prompt_top(self.body)
        return 0 if top is None else sum(self.choice_prompt_tokens()) * (2 + top)


def _prompt_top(body: CompletionRequest) -> int | None:
    """How many top logprobs the engine reports per prompt token (None: the prompt is not
    scored): `logprobs` when echoed beside the answer's, vLLM's `prompt_logprobs`, the larger."""
    asked = [k for k in (body.logprobs if body.echo else None, body.prompt_logprobs) if k is not None]
    return max(asked) if asked else None


async def _start_completion(state: Any, context: RequestContext, request: Request, body: CompletionRequest
                            ) -> CompletionRun:
    """`body`'s prompts on its model, their engine requests open (one per choice)."""
    engine = state.models.get(body.model, context.models)
    structured = await _checked_structured(engine, body)
    prompts = body.prompts()
    prompt_ids = []
    for i, prompt in enumerate(prompts):
        field_name = "prompt" if len(prompts) == 1 else f"prompt.{i}"
        ids = await completion_prompt_ids(engine, body, prompt, field_name)
        prompt_ids.append(_truncated(engine, ids, body.truncate_prompt_tokens, body.max_tokens or 1))
    if body.logprobs is not None or body.prompt_logprobs is not None:  # built once, off the event loop
        await asyncio.to_thread(vocabulary, engine.tokenizer)
    streams: list[EngineStream] = []
    for i, ids in enumerate(prompt_ids):
        field_name = "prompt" if len(prompts) == 1 else f"prompt.{i}"
        # max_tokens 0 (echo only) runs one token, which is not returned (vLLM's way too).
        max_tokens = output_budget(engine, body.model, len(ids), body.max_tokens or 1, prompt_field=field_name)
        params = sampling_params(engine.sampling_defaults, **_common_sampling(engine, body, max_tokens, body.logprobs),
                                 prompt_logprobs=_prompt_top(body), structured_outputs=structured)
        streams += _engine_streams(state, engine, body, ids, params, context.salted(body.cache_salt),
                                   prompt=i, total=len(prompt_ids) * (body.n or 1), scored_once=True)
    await _tokenize_bad_words(engine, body.bad_words)
    await _open_all(streams, request)
    echoes = [_prompt_text(engine, p) if body.echo else "" for p in prompts]
    return CompletionRun(body, engine, prompt_ids, echoes, streams)


def _stream_usage(body: Any, prompt_tokens: list[int]) -> tuple[bool, list[int] | None]:
    """(stream_options.include_usage, each choice's prompt tokens if every chunk is to carry the
    usage so far: vLLM's continuous_usage_stats, which, as there, takes effect with include_usage only)."""
    options = body.stream_options
    include = bool(options and options.include_usage)
    return include, (prompt_tokens if include and options.continuous_usage_stats else None)


def _entries(results: list[Generation], top_n: int | None) -> int:
    """How many tokens and logprob entries an answer holds: how long it takes to build."""
    return sum(r.num_output_tokens for r in results) * (1 if top_n is None else 2 + top_n)


def completion_response(run: CompletionRun, results: list[Generation], completion_id: str) -> Completion:
    body, engine = run.body, run.engine
    choices = []
    for c, result in enumerate(results):
        prompt = c // run.n
        scored = results[prompt * run.n].prompt_logprobs or []  # (the prompt's first choice alone scores it)
        extra = ({"prompt_logprobs": vllm_prompt_logprobs(engine, scored, body.prompt_logprobs)}
                 if body.prompt_logprobs is not None else {})
        if body.return_token_ids:  # (vLLM's; the answer's tokens as usage counts them: none for max_tokens 0)
            extra |= {"prompt_token_ids": run.prompt_ids[prompt],
                      "token_ids": list(result.token_ids) if run.generates else []}
        choices.append(CompletionChoice(
            index=c,
            text=run.echoes[prompt] + (result.text if run.generates else ""),
            finish_reason=_finish_reason(result, False) if run.generates else "length",
            stop_reason=_stop_reason(result) if run.generates else None,
            logprobs=_completion_logprobs(run, prompt, result, scored) if body.logprobs is not None else None,
            **extra,
        ))
    return Completion(id=completion_id, created=int(time.time()), model=body.model, choices=choices,
                      usage=usage_of(results, run.n, count_output=run.generates), system_fingerprint=SYSTEM_FINGERPRINT)


def _completion_logprobs(run: CompletionRun, prompt: int, result: Generation,
                         scored: list[TokenLogprob | None]) -> dict[str, Any]:
    """A choice's legacy logprobs: the echoed prompt's first (with echo; `scored`, its prompt's
    logprobs), then the answer's."""
    engine, top_n, echo, as_id = run.engine, run.body.logprobs, run.echoes[prompt], run.body.return_tokens_as_token_ids
    answer = legacy_logprobs(engine, returned_logprobs(result) if run.generates else [], top_n, len(echo), as_id)
    if not run.echoes_logprobs:
        return answer
    echoed = echoed_legacy_logprobs(engine, run.prompt_ids[prompt], scored, top_n, echo, as_id)
    return {key: echoed[key] + answer[key] for key in answer}


async def _tokenize_bad_words(engine: "AsyncEngine", words: list[str] | None) -> None:
    """bad_words tokenized on a worker thread (up to 1,024 words, twice each, as vLLM): the
    engine keeps them, and each choice's request takes them from its cache, not from the event loop."""
    if words:
        try:
            await asyncio.to_thread(engine.engine.bad_words, words)
        except TierlmError as exc:
            raise from_engine_error(exc, "") from None


# ---- n choices: n engine requests -------------------------------------------------------


def _engine_streams(state: Any, engine: "AsyncEngine", body: Any, prompt_ids: list[int], params: SamplingParams,
                    context: RequestContext, prompt: int = 0, total: int | None = None,
                    scored_once: bool = False, markup: Callable[[], Markup | None] | None = None,
                    screen_text: Callable[[], str | None] | None = None) -> list[EngineStream]:
    """One engine request per choice of prompt `prompt` (of a batch), each with its own seed
    and, where the request has several choices (`total`, all prompts' together), its own id
    `<request id>-<index>`, this prompt's choices numbered from prompt × n. `scored_once`: the
    first choice alone scores the prompt, and the answer shows its prompt logprobs once (chat) or
    on every choice (completions): a scored prompt is computed whole, the prefix cache serving
    none of it, and its logprobs are the same whichever choice computes them. `markup` and
    `screen_text`: see EngineStream."""
    n = body.n or 1
    if (total or n) == 1:
        return [EngineStream(engine, body.model, prompt_ids, params, context, state.inflight, markup=markup,
                             screen_text=screen_text)]
    return [EngineStream(engine, body.model, prompt_ids,
                         dataclasses.replace(params, seed=choice_seed(params.seed, i),
                                             prompt_logprobs=None if scored_once and i else params.prompt_logprobs),
                         dataclasses.replace(context, request_id=f"{context.request_id}-{prompt * n + i}"),
                         state.inflight, prompt_index=prompt, markup=markup, screen_text=screen_text)
            for i in range(n)]


def _request_id(streams: list[EngineStream]) -> str:
    """The HTTP request's id (choice i's engine request is `<id>-<i>` when n > 1)."""
    first = streams[0].request_id
    return first.removesuffix("-0") if len(streams) > 1 else first


async def _close_all(streams: list[EngineStream]) -> None:
    await asyncio.gather(*(s.close() for s in streams))


async def _open_all(streams: list[EngineStream], request: Request) -> None:
    """Open every choice's request together; if any fails (a 400 the engine found, the client
    leaving), all are closed and the first failure is the answer."""
    outcomes = await asyncio.gather(*(s.open(request) for s in streams), return_exceptions=True)
    failure = next((o for o in outcomes if isinstance(o, BaseException)), None)
    if failure is not None:
        await _close_all(streams)
        raise failure


async def _collect_all(streams: list[EngineStream], request: Request) -> list[Generation]:
    """Every choice run to completion; a failure (or the client leaving) stops them all."""
    tasks = [asyncio.ensure_future(s.collect(request)) for s in streams]
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
    finally:
        for task in tasks:
            task.cancel()  # a no-op on finished ones; collect() closes (aborts) its request either way
        with anyio.CancelScope(shield=True):
            await asyncio.gather(*tasks, return_exceptions=True)
            await _close_all(streams)
    failure = next((t.exception() for t in tasks if not t.cancelled() and t.exception() is not None), None)
    if failure is not None:
        raise failure
    return [task.result() for task in tasks]


# ---- request → prompt ------------------------------------------------------------------


async def _checked_structured(engine: "AsyncEngine", body: Any) -> StructuredOutputsParams | None:
    """The body's structured output, once the engine has found it followable (a 400 naming the
    field otherwise)."""
    asked = body.structured()
    if asked is None:
        return None
    await check_structured(engine, asked[1], asked[0])
    return asked[1]


async def build_chat_prompt(engine: "AsyncEngine", body: ChatCompletionRequest,
                            tool_calls: toolcalls.ToolCallFormat | None = None,
                            reasoning: ReasoningFormat | None = None, structured: bool = False,
                            schema_field: str = "tools.{}.function.parameters", check_length: bool = True) -> ChatPrompt:
    """The conversation rendered by the model's template and tokenized; `check_length` false
    counts one longer than the context too (/tokenize), as count_tokens does."""
    _check_tool_turns(body.messages)
    messages = _one_leading_system([_template_message(m, i, body.model) for i, m in enumerate(body.messages)])
    choice = body.tool_choice or "auto"
    use_tools = bool(body.tools) and choice != "none"
    named = isinstance(choice, NamedToolChoice)
    add, cont, variables = body.template_settings()
    if add and cont:  # (set so through chat_template_kwargs: the fields themselves are checked sooner)
        raise InvalidRequest("chat_template_kwargs: continue_final_message cannot be true while "
                             "add_generation_prompt is true; set add_generation_prompt to false",
                             param="chat_template_kwargs")
    return await chat_prompt(
        engine,
        body.model,
        messages,
        tools=[t.model_dump(exclude_none=True) for t in body.tools] if use_tools else None,
        call_required_by="required" if choice == "required" or named else None,
        tool_name=choice.function.name if named else None,
        add_generation_prompt=add,
        continue_final_message=cont,
        template_kwargs=variables,
        tool_calls=tool_calls,
        reasoning=reasoning,
        structured=structured,
        schema_field=schema_field,
        check_length=check_length,
    )


def _check_tool_turns(messages: list[ChatMessage]) -> None:
    """OpenAI's rule, in its words: an assistant message's tool_calls are each answered by the tool
    messages right after it, and a tool message answers a call of that assistant message. Chat
    templates render orphans as they come, so the model read results of calls never made, or
    answered after its own unanswered call. A final assistant message is held to it too: without
    continue_final_message the model would answer after its unanswered call, and with it the
    template ends the prompt at the message's content, dropping its calls."""
    asked: list[str] = []  # the call ids of messages[owner], which the tool messages after it answer
    answered: set[str] = set()
    owner = 0
    for i, message in enumerate([*messages, None]):
        if message is not None and message.role == "tool":
            if message.tool_call_id not in asked:
                raise InvalidRequest(f"messages.{i}: messages with role 'tool' must be a response to a preceding "
                                     "message with 'tool_calls'", param=f"messages.{i}")
            answered.add(message.tool_call_id)
            continue
        if missing := [call_id for call_id in asked if call_id not in answered]:
            where = f"messages.{owner}"
            raise InvalidRequest(f"{where}: An assistant message with 'tool_calls' must be followed by tool messages "
                                 "responding to each 'tool_call_id'. The following tool_call_ids did not have "
                                 f"response messages: {', '.join(missing)}", param=where)
        asked = [c.id for c in message.tool_calls or ()] if message is not None else []
        answered, owner = set(), i


def _template_message(message: ChatMessage, index: int, model: str) -> dict[str, Any]:
    if isinstance(message.content, list):
        for j, part in enumerate(message.content):
            if isinstance(part, ImagePart):
                raise InvalidRequest(
                    f"messages.{index}.content.{j}: model '{model}' is text-only and cannot read images; "
                    "send text parts only",
                    param=f"messages.{index}.content.{j}",
                )
            if isinstance(part, FilePart) and part._text is None:
                raise InvalidRequest(
                    f"messages.{index}.content.{j}: model '{model}' is text-only and cannot read this file (not "
                    "UTF-8 text: a PDF, an image, ...); send text files (text/*, JSON, XML, YAML) or text parts",
                    param=f"messages.{index}.content.{j}",
                )
    role = "system" if message.role == "developer" else message.role
    out: dict[str, Any] = {"role": role, "content": message.text()}
    if message.role == "tool":
        out["tool_call_id"] = toolcalls.template_tool_call_id(message.tool_call_id)
    if message.tool_calls:
        out["tool_calls"] = [
            {"id": toolcalls.template_tool_call_id(call.id), "type": "function",
             "function": {"name": call.function.name, "arguments": _arguments(call.function.arguments, index, k)}}
            for k, call in enumerate(message.tool_calls)
        ]
    if message.name:
        out["name"] = message.name
    reasoning = message.reasoning_content or message.reasoning
    if reasoning and message.role == "assistant":
        out.update(both_names(reasoning))
    return out


def _one_leading_system(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """System and developer messages merged into one first system message, texts joined by a
    blank line: chat templates render only a system message at messages[0] (others vanish)."""
    system = [m for m in messages if m["role"] == "system"]
    if not system or (len(system) == 1 and messages[0] is system[0]):
        return messages
    merged = {"role": "system", "content": "\n\n".join(m["content"] for m in system if m["content"])}
    return [merged, *(m for m in messages if m["role"] != "system")]


def _arguments(text: str, index: int, k: int) -> Any:
    where = f"messages.{index}.tool_calls.{k}.function.arguments"
    try:
        # NaN and Infinity are not JSON: the prompt would show the model invalid arguments.
        value = loads_strict(text) if text.strip() else {}
    except (ValueError, RecursionError):
        value = None
    if not isinstance(value, dict):
        raise InvalidRequest(f"{where}: must be a JSON object encoded as a string", param=where)
    return value


async def completion_prompt_ids(engine: "AsyncEngine", body: CompletionRequest, prompt: str | list[int],
                                field_name: str = "prompt") -> list[int]:
    """One of the body's prompts as token ids (`field_name` names it in errors)."""
    if isinstance(prompt, str):
        # Off the event loop: tokenizing a long prompt takes seconds.
        return await asyncio.to_thread(_encode_prompt, engine, body.model, prompt,
                                       body.truncate_prompt_tokens is not None, field_name)
    vocab = len(engine.tokenizer)
    bad = [t for t in prompt if not 0 <= t < vocab]
    if bad:
        raise InvalidRequest(
            f"{field_name}: token ids must be in [0, {vocab}) for model '{body.model}'; got {bad[:5]}",
            param=field_name,
        )
    return list(prompt)


def _encode_prompt(engine: "AsyncEngine", model: str, text: str, truncated: bool = False,
                   field_name: str = "prompt") -> list[int]:
    """A text prompt's token ids; refused unencoded when certainly too long for the context
    (unless it is to be truncated)."""
    if truncated:  # tokenized whole, then cut: bounded as count_tokens is (memory)
        refuse_too_long_to_count(engine, model, text, field_name, "tokenizes prompts to truncate")
    else:
        refuse_certainly_too_long(engine, model, text, field_name)
    return encode_prompt_text(engine, model, text, field_name)


def _truncated(engine: "AsyncEngine", ids: list[int], keep: int | None, max_tokens: int | None) -> list[int]:
    """vLLM's `truncate_prompt_tokens`: the prompt's last `keep` tokens (-1: as many as fit beside
    `max_tokens`, see `truncation_kept`), done here so the output budget and usage count what runs."""
    if keep is None:
        return ids
    try:
        return truncate_prompt(ids, keep, int(engine.max_model_len), max_tokens)
    except InvalidRequestError as e:  # (the engine's rule and words, as a 400 of this API)
        raise InvalidRequest(str(e), param=e.param) from None


def _prompt_text(engine: "AsyncEngine", prompt: str | list[int]) -> str:
    return prompt if isinstance(prompt, str) else engine.tokenizer.decode(prompt)


# ---- generation → response ---------------------------------------------------------------


def usage_of(results: list[Generation], per_prompt: int | None = None, count_output: bool = True) -> Usage:
    """The choices' usage: each prompt counted once (as OpenAI and vLLM; `per_prompt` choices
    share one, all of them by default), completions summed (none when nothing is returned:
    max_tokens 0)."""
    firsts = results[::per_prompt or len(results)]
    prompt = sum(r.num_prompt_tokens for r in firsts)
    completion = sum(r.num_output_tokens for r in results) if count_output else 0
    return Usage(
        prompt_tokens=prompt,
        completion_tokens=completion,
        total_tokens=prompt + completion,
        prompt_tokens_details={"cached_tokens": sum(r.num_cached_tokens for r in firsts)},
    )


def _finish_reason(result: Generation, has_tool_calls: bool) -> str:
    """A cut-off answer is `length` even after complete calls (as in Anthropic's stop_details)."""
    if result.finish_reason in ("length", FINISH_REASON):  # (the safety layer's: content_filter, as OpenAI's)
        return result.finish_reason
    return "tool_calls" if has_tool_calls else "stop"


def _chat_finish_reason(result: Generation, prompt: ChatPrompt, calls: list) -> str:
    """A chat choice's finish_reason: a named tool_choice's call ends with `stop` (OpenAI, vLLM)."""
    return _finish_reason(result, bool(calls) and not prompt.named_call)


def _stop_reason(result: Generation) -> str | int | None:
    """vLLM's `stop_reason`: the stop string or stop token id that ended the answer; None for
    EOS, a limit, or the safety layer (whose policy name is the engine's stop_reason there)."""
    return result.stop_reason if result.finish_reason == "stop" else None


class StreamedIds:
    """vLLM's return_token_ids in a stream: each chunk of a choice carries the token ids that
    came since its last chunk (text held back, a stop string's start, comes with a later one);
    the first also the prompt's. Off, it adds nothing."""

    def __init__(self, on: bool, prompt_ids: list[int]) -> None:
        self.on, self._prompt = on, prompt_ids
        self._pending: list[int] = []

    def add(self, token_ids: Sequence[int]) -> None:
        if self.on:
            self._pending.extend(token_ids)

    def prompt(self) -> dict[str, Any]:
        return {"prompt_token_ids": self._prompt} if self.on else {}

    def take(self) -> dict[str, Any]:
        if not self.on:
            return {}
        taken, self._pending = self._pending, []
        return {"token_ids": taken}


class ReturnedTokens:
    """Which generated tokens' logprobs to return: those of the returned text only, released as
    the engine releases their text. A token whose text starts at or after the text's end is
    dropped (the EOS, a stop token, every token of a matched stop string); one straddling the end
    (part text, part stop string) is kept, since its bytes cannot be split: its `bytes` then run
    past the text, the only case where the joined bytes are not exactly the text. Positions are
    the engine's (`text_start`), in the text's characters: counting the tokens' own bytes instead
    ran ahead of the text wherever it held a U+FFFD, and released the EOS and stop tokens."""

    def __init__(self) -> None:
        self._pending: list[TokenLogprob] = []
        self._text_len = 0  # characters of text released so far

    def add(self, logprobs: list[TokenLogprob], text: str) -> list[TokenLogprob]:
        """A delta's new tokens and new text → the logprobs now known to lie in the returned text."""
        self._pending.extend(logprobs)
        self._text_len += len(text)
        n = 0
        while n < len(self._pending) and self._pending[n].text_start < self._text_len:
            n += 1
        released, self._pending = self._pending[:n], self._pending[n:]
        return released


def returned_logprobs(result: Generation) -> list[TokenLogprob]:
    return ReturnedTokens().add(result.logprobs, result.text)


def chat_logprobs(engine: "AsyncEngine", logprobs: list[TokenLogprob], top_n: int,
                  as_id: bool = False) -> dict[str, Any]:
    # Built in a worker thread when the prompt was rendered (render_chat's length check).
    vocab = vocabulary(engine.tokenizer)

    def entry(token_id: int, logprob: float) -> dict[str, Any]:
        # `token` is the text the token stands for (U+FFFD for part of a character, as OpenAI
        # shows it), or "token_id:N" (as_id); `bytes` are the token's own raw bytes, so a client
        # can join them into the text.
        return {"token": vocab.name(token_id, as_id), "logprob": logprob, "bytes": list(vocab.token_bytes(token_id))}

    return {
        "content": [
            {**entry(lp.token_id, lp.logprob), "top_logprobs": [entry(t, v) for t, v in lp.top[:top_n]]}
            for lp in logprobs
        ],
        "refusal": None,
    }


def legacy_logprobs(engine: "AsyncEngine", logprobs: list[TokenLogprob], top_n: int, offset: int,
                    as_id: bool = False) -> dict[str, Any]:
    """The Completions API's column-wise logprobs; `offset` is where the output text starts in
    the choice's text. `text_offset` indexes that text (a token that finishes a character begun
    by earlier ones starts where they do), not the sum of the tokens' own texts, which differ
    wherever a character spans tokens. Each `top_logprobs` entry holds the top `top_n` and the
    sampled token (up to top_n + 1 entries; just the sampled one for logprobs=0), as OpenAI's
    spec and vLLM do."""
    return {"tokens": [token_text(engine, lp.token_id, as_id) for lp in logprobs],
            "token_logprobs": [lp.logprob for lp in logprobs],
            "top_logprobs": [legacy_top(engine, lp, top_n, as_id) for lp in logprobs],
            "text_offset": [offset + lp.text_start for lp in logprobs]}


def reasoning_fields(reasoning: str, prompt: ChatPrompt) -> dict[str, str]:
    """A message's or delta's reasoning under both of vLLM's names; none when there is none
    (or the request's include_reasoning is false)."""
    return both_names(reasoning) if reasoning and prompt.show_reasoning else {}


def _tool_calls_out(calls: list[toolcalls.ParsedToolCall]) -> list[ResponseToolCall]:
    return [ResponseToolCall(id=c.id, function=FunctionCall(name=c.name, arguments=json.dumps(c.arguments)))
            for c in calls]


def chat_response(results: list[Generation], engine: "AsyncEngine", prompt: ChatPrompt, model: str,
                  completion_id: str, top_n: int | None, prompt_top_n: int | None = None,
                  prompt_ids: list[int] | None = None) -> ChatCompletion:
    """The chat completion of `results`; `prompt_ids` are the prompt's tokens as run (after any
    truncation), for return_token_ids."""
    choices = []
    for i, result in enumerate(results):
        answer = prompt.split(result, id_prefix="call_")
        text, calls = answer.text, answer.calls
        message = ResponseMessage(content=text if (text or not calls) else None,
                                  tool_calls=_tool_calls_out(calls) or None,
                                  **reasoning_fields(answer.reasoning, prompt))
        choices.append(ChatChoice(
            index=i,
            message=message,
            finish_reason=_chat_finish_reason(result, prompt, calls),
            stop_reason=_stop_reason(result),
            logprobs=(chat_logprobs(engine, returned_logprobs(result), top_n, prompt.tokens_as_ids)
                      if top_n is not None else None),
            **({"token_ids": list(result.token_ids)} if prompt.return_token_ids else {}),
        ))
    # vLLM's prompt_logprobs, once for the choices' shared prompt (only when asked: not in OpenAI's shape)
    extra = ({"prompt_logprobs": vllm_prompt_logprobs(engine, results[0].prompt_logprobs or [], prompt_top_n)}
             if prompt_top_n is not None else {})
    if prompt.return_token_ids:
        extra["prompt_token_ids"] = prompt_ids
    return ChatCompletion(id=completion_id, created=int(time.time()), model=model, choices=choices,
                          usage=usage_of(results), system_fingerprint=SYSTEM_FINGERPRINT, **extra)


@dataclass
class _StreamFrames:
    """The frames of one OpenAI stream, which all carry the same id, object, created and model."""

    completion_id: str
    object: str
    model: str
    include_usage: bool
    # Each choice's prompt tokens, set when every chunk carries its usage (continuous_usage_stats)
    continuous_prompt_tokens: list[int] | None = None
    per_prompt: int | None = None  # choices per prompt (a batch of prompts), for the closing usage
    count_output: bool = True  # False for completions' max_tokens 0: the token run is not returned
    created: int = field(default_factory=lambda: int(time.time()))

    def _frame(self, choices: list[dict[str, Any]], **extra: Any) -> bytes:
        return sse_data({"id": self.completion_id, "object": self.object, "created": self.created,
                         "model": self.model, "system_fingerprint": SYSTEM_FINGERPRINT, "choices": choices,
                         **extra})

    def choice(self, index: int, of: Generation, finish: str | None = None, logprobs: Any = None,
               stop_reason: str | int | None = None, ids: dict[str, Any] | None = None,
               top: dict[str, Any] | None = None, **fields: Any) -> bytes:
        """A chunk of choice `index`, whose tokens so far are `of`'s; `fields` are its `delta`
        (chat) or `text` (completions), `ids` vLLM's token ids in the choice, `top` fields of
        the chunk itself. With continuous usage, its usage is that choice's so far, as vLLM's."""
        usage: dict[str, Any] = {"usage": None} if self.include_usage else {}
        if self.continuous_prompt_tokens is not None:
            prompt, done = self.continuous_prompt_tokens[index], of.num_output_tokens if self.count_output else 0
            usage["usage"] = {"prompt_tokens": prompt, "completion_tokens": done, "total_tokens": prompt + done}
        closing = {"stop_reason": stop_reason} if finish is not None else {}  # (vLLM's, on the last chunk)
        return self._frame([{"index": index, **fields, "finish_reason": finish, "logprobs": logprobs, **closing,
                             **(ids or {})}], **usage, **(top or {}))

    def usage(self, results: list[Generation]) -> bytes:
        """The closing chunk of `stream_options.include_usage`: no choices, the usage."""
        return self._frame([], usage=usage_of(results, self.per_prompt, self.count_output).model_dump())


async def _interleaved(choices: list[AsyncIterator[bytes]]) -> AsyncIterator[bytes]:
    """The choices' chunks in the order they come (each choice's own in order), those ready
    together as one piece: one write a step, not one per choice (16 writes a step into a socket
    whose client had gone logged asyncio's "socket.send() raised exception" hundreds of times).
    The first failure of any choice ends them all and is raised, after what came before it."""
    if len(choices) == 1:
        async for chunk in choices[0]:
            yield chunk
        return
    queue: asyncio.Queue[tuple[int, bytes | BaseException | None]] = asyncio.Queue()

    async def pump(i: int, chunks: AsyncIterator[bytes]) -> None:
        try:
            async for chunk in chunks:
                await queue.put((i, chunk))
            await queue.put((i, None))
        except Exception as exc:
            await queue.put((i, exc))

    tasks = [asyncio.ensure_future(pump(i, c)) for i, c in enumerate(choices)]
    try:
        running = len(tasks)
        while running:
            ready = [await queue.get()]
            while not queue.empty():
                ready.append(queue.get_nowait())
            chunks, failure = [], None
            for _, item in ready:
                if item is None:
                    running -= 1
                elif isinstance(item, BaseException):
                    failure = failure or item
                else:
                    chunks.append(item)
            if chunks:
                yield b"".join(chunks)
            if failure is not None:
                raise failure
    finally:
        for task in tasks:
            task.cancel()
        with anyio.CancelScope(shield=True):
            await asyncio.gather(*tasks, return_exceptions=True)


async def chat_chunks(streams: list[EngineStream], engine: "AsyncEngine", prompt: ChatPrompt, model: str,
                      completion_id: str, top_n: int | None, prompt_ids: list[int], include_usage: bool,
                      continuous_prompt_tokens: list[int] | None = None) -> AsyncIterator[bytes]:
    frames = _StreamFrames(completion_id, "chat.completion.chunk", model, include_usage, continuous_prompt_tokens)
    answers = [StreamedAnswer(stream, prompt, id_prefix="call_") for stream in streams]
    try:
        async for chunk in _interleaved([_chat_choice(i, a, engine, prompt, frames, top_n, prompt_ids)
                                         for i, a in enumerate(answers)]):
            yield chunk
        if include_usage:
            yield frames.usage([a.result for a in answers])
    except Exception as exc:
        yield sse_data(openai_error_body(stream_error(exc, _request_id(streams))))
    yield sse_data("[DONE]")


async def _chat_choice(index: int, answer: StreamedAnswer, engine: "AsyncEngine", prompt: ChatPrompt,
                       frames: _StreamFrames, top_n: int | None, prompt_ids: list[int]) -> AsyncIterator[bytes]:
    """One choice's chunks, from its role to its finish_reason."""
    returned = ReturnedTokens() if top_n is not None else None
    ids = StreamedIds(prompt.return_token_ids, prompt_ids)
    shown = False
    result = answer.result  # the tokens so far, for continuous usage
    # As OpenAI: content "" opens a text answer, null one that may be tool calls alone (text
    # after a null still accumulates into the content, in the SDKs' stream helpers too).
    yield frames.choice(index, result, delta={"role": "assistant", "content": None if prompt.parse_tools else ""},
                        top=ids.prompt())
    async for thought, text, delta in answer.pieces():
        logprobs = None
        if delta is not None:
            ids.add(delta.token_ids)
        if returned is not None and top_n is not None and delta is not None:
            logprobs = chat_logprobs(engine, returned.add(delta.logprobs or [], delta.text), top_n, prompt.tokens_as_ids)
        said = {**reasoning_fields(thought, prompt), **({"content": text} if text else {})}
        if said or (logprobs and logprobs["content"]):
            shown = shown or bool(text)
            yield frames.choice(index, result, delta=said, logprobs=logprobs, ids=ids.take())
    for i, call in enumerate(_tool_calls_out(answer.calls)):
        yield frames.choice(index, result, delta={"tool_calls": [{"index": i, **call.model_dump()}]}, ids=ids.take())
    # an empty answer without calls has content "" (as when not streamed), never null
    last = {"content": ""} if prompt.parse_tools and not shown and not answer.calls else {}
    yield frames.choice(index, result, delta=last, finish=_chat_finish_reason(result, prompt, answer.calls),
                        stop_reason=_stop_reason(result), ids=ids.take())


async def completion_chunks(run: CompletionRun, completion_id: str, include_usage: bool,
                            continuous_prompt_tokens: list[int] | None = None) -> AsyncIterator[bytes]:
    frames = _StreamFrames(completion_id, "text_completion", run.body.model, include_usage, continuous_prompt_tokens,
                           per_prompt=run.n, count_output=run.generates)
    results = [Generation() for _ in run.streams]
    loop = asyncio.get_running_loop()
    scores = [loop.create_future() for _ in run.prompt_ids]  # each prompt's logprobs, its first choice's
    try:
        async for chunk in _interleaved([_completion_choice(run, c, results[c], frames, scores[c // run.n])
                                         for c in range(len(results))]):
            yield chunk
        if include_usage:
            yield frames.usage(results)
    except Exception as exc:
        yield sse_data(openai_error_body(stream_error(exc, _request_id(run.streams))))
    yield sse_data("[DONE]")


async def _completion_choice(run: CompletionRun, index: int, result: Generation, frames: _StreamFrames,
                             scored: asyncio.Future) -> AsyncIterator[bytes]:
    """One choice's chunks (accumulated into `result`), from the echoed prompt to its finish_reason.
    The echo comes first; with logprobs it waits for the prompt's (`scored`), which come with the
    first token of the prompt's first choice, the one that scores it."""
    engine, top_n, prompt = run.engine, run.body.logprobs, index // run.n
    as_id = run.body.return_tokens_as_token_ids
    echo = run.echoes[prompt]
    returned = ReturnedTokens() if top_n is not None else None
    ids = StreamedIds(run.body.return_token_ids, run.prompt_ids[prompt])
    first = ids.prompt()  # (vLLM's: the prompt's ids on the choice's first chunk)
    scorer = index % run.n == 0
    if echo and not run.echoes_logprobs:
        yield frames.choice(index, result, text=echo, ids=first)
        first = {}
    elif run.echoes_logprobs and not scorer:
        yield _scored_echo(run, index, result, frames, await scored, first)
        first = {}
    async for delta in run.streams[index].deltas():
        result.add(delta)
        if delta.prompt_logprobs is not None and scorer and not scored.done():
            scored.set_result(delta.prompt_logprobs)
            if run.echoes_logprobs:
                yield _scored_echo(run, index, result, frames, delta.prompt_logprobs, first)
                first = {}
        if not run.generates:
            continue
        ids.add(delta.token_ids)
        logprobs = None
        if returned is not None and top_n is not None:
            logprobs = legacy_logprobs(engine, returned.add(delta.logprobs or [], delta.text), top_n, len(echo), as_id)
        if delta.text or (logprobs and logprobs["tokens"]):
            yield frames.choice(index, result, text=delta.text, logprobs=logprobs, ids=first | ids.take())
            first = {}
    if scorer and not scored.done():  # never scored (an input policy refused the prompt): the others
        scored.set_result([])  # echo it without logprobs, not wait for ever, and so does this one
        if run.echoes_logprobs:
            yield _scored_echo(run, index, result, frames, [], first)
            first = {}
    finish = _finish_reason(result, False) if run.generates else "length"
    yield frames.choice(index, result, text="", finish=finish, stop_reason=_stop_reason(result) if run.generates else None,
                        ids=first | ids.take())


def _scored_echo(run: CompletionRun, index: int, result: Generation, frames: _StreamFrames,
                 scored: list[TokenLogprob | None], ids: dict[str, Any]) -> bytes:
    """Choice `index`'s first chunk when echo comes with logprobs: its prompt's text and `scored`,
    the prompt's logprobs (as its first choice computed them)."""
    prompt = index // run.n
    echo = run.echoes[prompt]
    return frames.choice(index, result, text=echo, ids=ids, logprobs=echoed_legacy_logprobs(
        run.engine, run.prompt_ids[prompt], scored, run.body.logprobs, echo, run.body.return_tokens_as_token_ids))
