"""Where the serving layer talks to an engine: prompts in, deltas out, cleanup guaranteed.

Both API adapters translate their bodies into (prompt token ids, SamplingParams, context)
and hand them to `EngineStream`, which

- fetches the first delta before the HTTP response starts, because the engine reports
  requests that can never run (too long, bad parameters) only then, and only before a 200
  is sent can they still become a 400;
- watches for the client going away while waiting, so an abandoned request is aborted at
  once instead of generating to the end;
- always aborts the engine request on close (idempotent), so KV blocks are freed whatever
  ended the request.
"""
from __future__ import annotations

import asyncio
import logging
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, AsyncIterator, Awaitable, Callable, TypeVar

import anyio
from starlette.requests import Request

from tierlm.engine.generation_defaults import apply_defaults
from tierlm.engine.outputs import StreamDelta, TokenLogprob
from tierlm.errors import TierlmError
from tierlm.sampling_params import PoolingParams, SamplingParams, StructuredOutputsParams, ThinkBlock, ThinkingBudget
from tierlm.serving import tool_grammar
from tierlm.serving import tools as toolcalls
from tierlm.serving.auth import RequestContext
from tierlm.serving.errors import (
    APIError,
    ClientDisconnected,
    ContextLengthExceeded,
    InternalError,
    InvalidRequest,
    Overloaded,
    from_engine_error,
)
from tierlm.serving.harmony import HarmonySplitter
from tierlm.serving.reasoning import AnswerSplitter, ReasoningFormat, reasoning_splitter
from tierlm.serving.safety import FINISH_REASON, Markup, OutputGuard, Policy, blocked_delta, refused_delta
from tierlm.serving.sla import SlaGuard
from tierlm.serving.vocab import vocabulary

if TYPE_CHECKING:
    from tierlm.engine.async_engine import AsyncEngine

logger = logging.getLogger("tierlm.serving")

T = TypeVar("T")

ABORT_TIMEOUT_S = 10.0
# count_tokens renders and tokenizes a prompt of any length (seconds per MB), in a worker of its
# own: in the default pool, shared with every request's prompt, six 5 MB counts held a short
# request up for 50 s. They wait for each other instead.
_COUNTING = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tierlm-count-tokens")
# What count_tokens tokenizes at most: this many characters of rendered prompt per token of the
# model's context (~4 contexts of English). A fast tokenizer keeps offsets and token strings for
# every token (~160 bytes each): a 25 MB prompt peaked at 4.9 GB. Past it, a 400: such a prompt
# cannot fit the context many times over, and a client learns nothing more from its exact count.
COUNT_CHARS_PER_CONTEXT_TOKEN = 16


@dataclass
class Answer:
    """A finished chat answer as the client sees it: the model's reasoning (its think block,
    where the model writes one), its prose and its tool calls."""

    reasoning: str
    text: str
    calls: list[toolcalls.ParsedToolCall]


@dataclass
class ChatPrompt:
    """A rendered conversation and how to read the answer."""

    token_ids: list[int]
    forced_prefix: str = ""  # assistant text tierlm put in front of the answer (a required call's start)
    call_grammar: StructuredOutputsParams | None = None  # what the rest of that call follows (tool_grammar.py)
    parse_tools: bool = False
    named_call: bool = False  # OpenAI's named tool_choice: its call ends with finish_reason "stop", as OpenAI's
    tokens_as_ids: bool = False  # vLLM's return_tokens_as_token_ids: logprobs name tokens "token_id:N"
    return_token_ids: bool = False  # vLLM's: the prompt's and answer's token ids beside the text
    tool_names: frozenset[str] = frozenset()  # the tools offered: a call to another one is text
    tool_calls: toolcalls.ToolCallFormat = toolcalls.ToolCallFormat(toolcalls.HERMES)
    reasoning: ReasoningFormat | None = None  # the model's think markers (None: no reasoning parsed)
    opens_in_reasoning: bool = False  # the prompt ends inside a think block
    continues_reasoning: bool = False  # ... in the middle of reasoning a prefill began writing
    thinking_off: bool = False  # the prompt ends with a whole think block: the answer opens none
    show_reasoning: bool = True  # False: the reasoning is parsed out of the answer, and dropped
    # What the client sent (messages, tools, template arguments): see screen_text
    client_parts: tuple[Any, ...] = ()

    def screen_text(self) -> str | None:
        """The client's own words, which input policies read: not the chat template's (role
        names, a default system prompt, gpt-oss's channel list). Joined when asked for: only a
        request under input policies pays for it."""
        return client_text(*self.client_parts) if self.client_parts else None

    @property
    def keep_special_token_ids(self) -> list[int] | None:
        """Marker tokens a decode would skip, kept while they are looked for: the tool-call
        syntax's (with tools) and the think markers (with reasoning parsed)."""
        kept = list(self.tool_calls.keep_token_ids) if self.parse_tools else []
        kept += self.reasoning.keep_token_ids if self.reasoning is not None else ()
        return kept or None

    def thinking_budget(self, budget: int | None) -> ThinkingBudget | None:
        """`budget` tokens for this answer's think block, as the engine keeps it (None: no
        budget, no block to cap, or markers that are not tokens of their own)."""
        fmt = self.reasoning
        if budget is None or fmt is None or not fmt.budget_kept or self.thinking_off:
            return None
        return ThinkingBudget(budget, fmt.end_token_ids, fmt.start_token_ids, starts_inside=self.opens_in_reasoning)

    def structured_outputs(self, spec: StructuredOutputsParams | None) -> StructuredOutputsParams | None:
        """`spec` as the engine keeps it for this answer: from after its think block where the
        reasoning is parsed (chat_prompt keeps it for a structured answer only where the markers
        are tokens of their own), else from the answer's first token. Without one, a required
        call's grammar (a forced call has no reasoning, and refuses a structured output beside it)."""
        fmt = self.reasoning
        if spec is None:
            return self.call_grammar
        if fmt is None or not fmt.budget_kept:
            return spec
        # (thinking switched off: the grammar holds from the first token, which may not open a block)
        start = None if self.thinking_off else fmt.start_token_ids[0]
        return replace(spec, after_reasoning=ThinkBlock(fmt.end_token_ids[0], start,
                                                        starts_inside=self.opens_in_reasoning))

    @property
    def harmony_calls(self) -> bool:
        """Tool calls are harmony messages: the splitter reads them out of the answer (harmony.py)."""
        return self.parse_tools and self.tool_calls.syntax.splits_messages

    @property
    def parsed_prefix(self) -> str:
        """The forced call's start as the tool parser reads it: harmony's goes to the splitter."""
        return "" if self.harmony_calls else self.forced_prefix

    def reasoning_splitter(self) -> AnswerSplitter | None:
        if self.reasoning is not None:
            splitter = reasoning_splitter(self.reasoning, self.opens_in_reasoning, self.continues_reasoning,
                                          calls=self.harmony_calls)
        elif self.harmony_calls:  # harmony calls, reasoning not parsed (--reasoning-parser none, a forced call)
            splitter = HarmonySplitter(wrapped=bool(self.tool_calls.keep_token_ids), calls=True,
                                       reasoning_as_text=True)
        else:
            return None
        if isinstance(splitter, HarmonySplitter) and self.forced_prefix:
            splitter.prime(self.forced_prefix)
        return splitter

    def markup(self) -> AnswerSplitter | None:
        """A reader of this answer's markup for the safety layer (see OutputGuard): the splitter
        that reads the answer, recording what the client never sees (harmony's markers and
        headers, a think block's markers and the blank space dropped around them)."""
        splitter = self.reasoning_splitter()
        return splitter.record() if splitter is not None else None

    def split(self, result: "Generation", id_prefix: str) -> Answer:
        """A finished answer as (reasoning, prose, tool calls). Calls are read from the text
        after the reasoning, only where the template's syntax is known (and, in a syntax without
        an end marker, where the model ended the answer)."""
        reasoning, text = "", result.text
        if (splitter := self.reasoning_splitter()) is not None:
            reasoning, text = splitter.split(text)
        if not self.parse_tools:
            return Answer(reasoning, text, [])
        parsed = toolcalls.parse_tool_calls(self.parsed_prefix + text, id_prefix=id_prefix, names=self.tool_names,
                                            syntax=self.tool_calls.syntax, ended=result.ended_by_eos)
        prose = toolcalls.scrub(parsed.text, self.tool_calls.hidden)
        calls = result.stream.screen_calls(parsed.tool_calls, result) if result.stream is not None else parsed.tool_calls
        return Answer(reasoning, self.without_forced_prefix(prose, parsed.tool_calls), calls)

    def stream_filter(self, id_prefix: str) -> toolcalls.ToolCallStreamFilter:
        return toolcalls.ToolCallStreamFilter(id_prefix=id_prefix, names=self.tool_names,
                                              syntax=self.tool_calls.syntax, hidden=self.tool_calls.hidden)

    def without_forced_prefix(self, text: str, calls: list[toolcalls.ParsedToolCall]) -> str:
        """A parsed answer's prose (its kept markers taken out), less the call start tierlm wrote.
        When the model does not finish the forced call (max_tokens, a stop string; bad JSON or
        another tool's name where no grammar holds it to the call) no call is parsed and the
        whole text comes back as prose: the client gets what the model wrote, never tierlm's own
        prefill (with calls parsed, the prose lies before them and cannot hold it)."""
        forced = self.forced_prefix  # plain text (its markers were never kept tokens): not scrubbed
        if forced and not calls and text.startswith(forced):
            return text[len(forced):]
        return text


# Fields of a template-form message that are structure, not words the client wrote
_STRUCTURE_KEYS = frozenset({"role", "type", "id", "tool_call_id", "call_id", "cache_control", "index"})


def client_text(*parts: Any) -> str:
    """Every string a client sent in a conversation (`parts`: its template-form messages, tools
    and template arguments), one per paragraph, for input policies: the words of messages (text
    parts, reasoning sent back, past calls' names and arguments, tool results) and of tool
    definitions, without the chat template's own. Structure fields (roles, ids) are left out."""
    found: list[str] = []

    def walk(value: Any) -> None:
        if isinstance(value, str):
            if value:
                found.append(value)
        elif isinstance(value, dict):
            for key, item in value.items():
                if key not in _STRUCTURE_KEYS:
                    walk(item)
        elif isinstance(value, (list, tuple)):
            for item in value:
                walk(item)
        elif value is not None and not isinstance(value, bool):
            found.append(str(value))

    walk(parts)
    return "\n\n".join(found)


async def chat_prompt(
    engine: "AsyncEngine",
    model: str,
    messages: list[dict[str, Any]],
    *,
    tools: list[dict[str, Any]] | None = None,
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
    call_required_by: str | None = None,
    tool_name: str | None = None,
    check_length: bool = True,
    template_kwargs: dict[str, Any] | None = None,
    tool_calls: toolcalls.ToolCallFormat | None = None,
    reasoning: ReasoningFormat | None = None,
    structured: bool = False,
    schema_field: str = "tools.{}.function.parameters",
) -> ChatPrompt:
    """Render a conversation, with its tools (in chat-template form), for either API.

    `tools` is None when the request has none or turned them off. `tool_calls` is the model's
    tool-call syntax (ModelRegistry.tool_calls; by default detected from its template).
    `call_required_by` names the tool_choice that demands a call (Anthropic `any`/`tool`, OpenAI
    `required`/a named one): the assistant turn is then started with the syntax's call start
    (`<tool_call>`, naming `tool_name` if given), and the rest of the call follows a grammar
    (`ChatPrompt.call_grammar`, see tool_grammar.py): one call, its arguments on the tool's
    schema; a schema that cannot be followed is a 400 naming `schema_field` (with the tool's index).
    `check_length` refuses a prompt that cannot fit the context (see `render_chat`).
    `reasoning` is the model's think syntax (ModelRegistry.reasoning; None: answers are text);
    a forced call's answer starts with the call, never with reasoning. A `structured` answer is
    never read for tool calls; it may think first, its grammar starting after the think block
    (ChatPrompt.structured_outputs), where the markers are tokens of their own (the engine finds
    the block's end by its token); otherwise it follows its grammar from its first token, and its
    reasoning is not parsed.
    """
    forced = ""
    parse_tools = False
    if tool_calls is None:
        tool_calls = toolcalls.tool_call_format("auto", engine.tokenizer)
    if tools:
        variable = toolcalls.tools_variable(engine.tokenizer)
        if variable is None:
            raise InvalidRequest(
                f"tools: the chat template of model '{model}' does not support tools; "
                "remove 'tools' or serve a model whose template renders them",
                param="tools",
            )
        if variable != "tools":  # (a value the client set through chat_template_kwargs wins)
            template_kwargs = {variable: [toolcalls.template_tool(variable, t) for t in tools],
                               **(template_kwargs or {})}
        parse_tools = True
        if call_required_by is not None:
            if continue_final_message:
                raise InvalidRequest(
                    f"tool_choice '{call_required_by}' cannot be combined with an assistant prefill; "
                    "drop the final assistant message or use tool_choice 'auto'",
                    param="tool_choice",
                )
            # Written where the template writes a call: see _forced_call_text.
            forced = toolcalls.forced_call_prefix(tool_name, tool_calls.syntax)
            add_generation_prompt = True
    call_name = tool_name or (tools[0]["function"]["name"] if tools else "")
    text, token_ids = await render_chat(engine, model, messages, tools=tools,
                                        add_generation_prompt=add_generation_prompt,
                                        continue_final_message=continue_final_message, check_length=check_length,
                                        template_kwargs=template_kwargs, suffix=forced, call_name=call_name)
    grammar = None
    if forced:
        # The start as the prompt ends with it: a prefill's trailing blank space may be trimmed by
        # the template (continue_final_message then ends the prompt without it).
        forced = forced if text.endswith(forced) or not text.endswith(forced.rstrip()) else forced.rstrip()
        grammar = await tool_grammar.call_grammar(engine, tool_calls, tools or [], tool_name, forced, schema_field)
    if forced or (structured and not (reasoning is not None and reasoning.budget_kept)):
        reasoning = None
    parse_tools = parse_tools and not structured
    prefill = messages[-1].get("content") if continue_final_message and messages else None
    prefill = prefill if isinstance(prefill, str) else None
    opens = reasoning is not None and reasoning.opens_in_reasoning(text, prefill)
    closed = reasoning is not None and not opens and reasoning.closed_in_prompt(text)
    return ChatPrompt(token_ids=list(token_ids), forced_prefix=forced, call_grammar=grammar, parse_tools=parse_tools,
                      client_parts=(messages, tools, template_kwargs),
                      tool_names=frozenset(t["function"]["name"] for t in tools or ()), tool_calls=tool_calls,
                      reasoning=reasoning, opens_in_reasoning=opens, thinking_off=closed,
                      continues_reasoning=opens and reasoning is not None and reasoning.continues_reasoning(prefill))


async def render_chat(
    engine: "AsyncEngine",
    model: str,
    messages: list[dict[str, Any]],
    *,
    tools: list[dict[str, Any]] | None = None,
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
    check_length: bool = True,
    template_kwargs: dict[str, Any] | None = None,
    suffix: str = "",
    call_name: str = "",
) -> tuple[str, list[int]]:
    """Chat messages → (prompt text, its token ids) through the model's own chat template (and
    `suffix`, a forced call's start of a call to `call_name`, where the template writes a call).

    Runs in a worker thread: rendering and tokenizing a long conversation takes seconds, during
    which the event loop must keep serving everyone else. With `check_length`, a rendered text
    certainly too long for the context is refused before it is tokenized.
    Everything a template can fail on comes from the request (roles out of order, a message
    shape it does not know), so failures are 400s that name `messages`.
    """
    args = (engine, model, messages, tools, add_generation_prompt, continue_final_message, check_length,
            template_kwargs, suffix, call_name)
    if not check_length:  # counting only: see _COUNTING
        return await asyncio.get_running_loop().run_in_executor(_COUNTING, _render_chat, *args)
    return await asyncio.to_thread(_render_chat, *args)


def _render_chat(
    engine: "AsyncEngine",
    model: str,
    messages: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None,
    add_generation_prompt: bool,
    continue_final_message: bool,
    check_length: bool,
    template_kwargs: dict[str, Any] | None = None,
    suffix: str = "",
    call_name: str = "",
) -> tuple[str, list[int]]:
    context = int(engine.max_model_len)
    if check_length and len(messages) > context:
        # Every message renders to a token at least (a role header): refused before the template
        # runs (200,000 one-letter messages took 8 s of it, slowing every other request 10x).
        raise ContextLengthExceeded(context=context, prompt_tokens=len(messages), max_tokens=None,
                                    prompt_field="messages", at_least=True)
    try:
        if suffix:
            text = _forced_call_text(engine, messages, tools, template_kwargs, suffix, call_name)
        else:
            text = engine.chat_text(
                messages,
                tools=tools,
                add_generation_prompt=add_generation_prompt and not continue_final_message,
                continue_final_message=continue_final_message,
                template_kwargs=template_kwargs,
            )
    except TierlmError as exc:
        raise from_engine_error(exc, model) from None
    except Exception as exc:  # jinja2 errors, raise_exception() in templates, ...
        raise InvalidRequest(
            f"the chat template of model '{model}' cannot render these messages: {exc}",
            param="messages",
        ) from None
    if check_length:  # the rendered text, not the messages: templates trim, add and repeat text
        refuse_certainly_too_long(engine, model, text, "messages")
    else:
        refuse_too_long_to_count(engine, model, text)
    return text, encode_prompt_text(engine, model, text, "messages", rendered=True)


def _forced_call_text(engine: "AsyncEngine", messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
                      template_kwargs: dict[str, Any] | None, start: str, call_name: str) -> str:
    """The prompt for a forced call: the conversation, then the call's `start` where the template
    writes a call. Templates differ on where that is, so two forms are rendered and the one whose
    text before the call agrees longer with the template's own rendering of a call turn is kept:
    - the start as an assistant prefill (continue_final_message): right where a template writes
      text of its own before a call (Qwen3's empty think block), wrong where it writes text
      before an assistant message's content (Mistral v0.3's " " + content: "[/INST] [TOOL_CALLS]",
      where it renders a call "[/INST][TOOL_CALLS] [{");
    - the generation prompt with the start appended: the other way round.
    Where the call turn cannot be rendered, the prefill (tierlm's form before both were tried)."""
    def render(extra: list[dict[str, Any]], **kwargs: Any) -> str:
        return engine.chat_text([*messages, *extra], tools=tools, template_kwargs=template_kwargs, **kwargs)

    prefill = render([{"role": "assistant", "content": start}], add_generation_prompt=False,
                     continue_final_message=True)
    appended = render([], add_generation_prompt=True, continue_final_message=False) + start
    if prefill == appended:
        return prefill
    placeholder = {"id": toolcalls.template_tool_call_id("forced"), "type": "function",
                   "function": {"name": call_name, "arguments": {}}}
    try:
        written = render([{"role": "assistant", "content": "", "tool_calls": [placeholder]}],
                         add_generation_prompt=False, continue_final_message=False)
    except Exception:  # a template that cannot render this turn: keep the prefill
        return prefill
    # Compared by the text just before the call (how the turn opens), not from the start: a
    # template may write earlier text differently once an assistant turn follows (Mistral v0.3
    # puts the system prompt into the last user turn only), which says nothing about the call.
    lead = _before_call(written, start)

    def agree(text: str) -> int:
        return len(os.path.commonprefix([_before_call(text, start)[::-1], lead[::-1]]))
    return appended if agree(appended) > agree(prefill) else prefill


def _before_call(text: str, start: str) -> str:
    """`text` up to where a call's `start` begins in it (its last occurrence; the longest part of
    the start found there, as a template may trim it or write the arguments differently)."""
    start = start.strip()
    for n in range(len(start), 0, -1):
        at = text.rfind(start[:n])
        if at >= 0:
            return text[:at]
    return text


def encode_prompt_text(engine: "AsyncEngine", model: str, text: str, prompt_field: str, rendered: bool = False) -> list[int]:
    """A prompt text's token ids (a rendered chat: without added special tokens, the template
    wrote them). The text is the only input, so a tokenizer failure is the client's 400."""
    try:
        return list(engine.encode_chat_text(text) if rendered else engine.encode(text))
    except Exception as exc:
        logger.warning("the tokenizer of model %s refused a prompt: %r", model, exc)
        raise InvalidRequest(
            f"{prompt_field}: the tokenizer of model '{model}' cannot encode this text ({type(exc).__name__}); "
            "send valid Unicode text",
            param=prompt_field,
        ) from None


def refuse_certainly_too_long(engine: "AsyncEngine", model: str, text: str, prompt_field: str) -> None:
    """A 400 when `text` certainly encodes to more tokens than the context holds, decided from
    its byte length alone (see vocab.Vocabulary.min_tokens), so it is never tokenized."""
    context = int(engine.max_model_len)
    at_least = vocabulary(engine.tokenizer).min_tokens(text)
    # `>`: "at least N tokens > N maximum" must be true; a prompt of exactly N is refused once counted.
    if at_least is not None and at_least > context:
        raise ContextLengthExceeded(context=context, prompt_tokens=at_least, max_tokens=None,
                                    prompt_field=prompt_field, at_least=True)


def refuse_too_long_to_count(engine: "AsyncEngine", model: str, text: str, field: str = "messages",
                             doing: str = "counts prompts") -> None:
    """The bound on what tierlm tokenizes of a prompt longer than the context (count_tokens; a
    prompt to truncate): COUNT_CHARS_PER_CONTEXT_TOKEN characters per context token. A fast
    tokenizer keeps ~160 bytes per token: a 25 MB prompt took 4.9 GB."""
    context = int(engine.max_model_len)
    limit = COUNT_CHARS_PER_CONTEXT_TOKEN * context
    if len(text) > limit:
        raise InvalidRequest(
            f"{field}: this prompt renders to {len(text)} characters; tierlm {doing} of up to {limit} "
            f"({COUNT_CHARS_PER_CONTEXT_TOKEN} per token of model '{model}'s {context}-token context), far more "
            "than the context holds; send a shorter prompt",
            param=field,
        )


async def check_structured(engine: "AsyncEngine", spec: StructuredOutputsParams | None, field: str) -> None:
    """A 400 naming `field` if the engine cannot follow this structured output (a schema or regex
    llguidance refuses, a tokenizer it cannot take), found on a worker thread before the request
    runs; the compiled grammar is kept for the request (and its n samples)."""
    if spec is None:
        return
    try:
        await asyncio.to_thread(engine.engine.grammars.grammar, spec)  # (compiled here, kept for the request)
    except TierlmError as exc:
        raise InvalidRequest(f"{field}: {str(exc).removeprefix('structured_outputs: ')}", param=field) from None


def output_budget(
    engine: "AsyncEngine",
    model: str,
    num_prompt_tokens: int,
    max_tokens: int | None,
    *,
    field_name: str = "max_tokens",
    prompt_field: str = "messages",
) -> int:
    """The max_tokens to run with, or a 400 (worded per API) if prompt + output cannot fit the context
    (max_tokens 0, Anthropic's cache warm, fits a prompt as long as the context)."""
    context = int(engine.max_model_len)
    room = context - num_prompt_tokens
    if room < (0 if max_tokens == 0 else 1) or (max_tokens is not None and max_tokens > room):
        raise ContextLengthExceeded(context=context, prompt_tokens=num_prompt_tokens, max_tokens=max_tokens,
                                    prompt_field=prompt_field, field_name=field_name)
    return room if max_tokens is None else max_tokens


def top_k_limit(engine: "AsyncEngine", top_k: int | None) -> int | None:
    """A validated top_k as SamplingParams takes it: -1 (no limit) for -1, 0 and anything not
    below the vocabulary size, so a huge value (2**70) never reaches the engine; None where the
    request left it unset (the model's default then applies, see `sampling_params`)."""
    if top_k is None:
        return None
    if top_k <= 0 or top_k >= len(engine.tokenizer):
        return -1
    return top_k


# What top_p = 0 becomes: SamplingParams needs top_p in (0, 1]; any positive value below the
# top token's probability (at least 1/vocabulary) keeps that token alone, as 0 means in both APIs.
TOP_P_ZERO = 1e-9


def top_p_value(top_p: float | None) -> float | None:
    """A validated top_p (in [0, 1]) as SamplingParams takes it."""
    return TOP_P_ZERO if top_p == 0 else top_p


def sampling_params(defaults: dict[str, Any] | None = None, **kwargs: Any) -> SamplingParams:
    """SamplingParams from already-validated fields; a rejection still names the field. Fields
    left unset (None) take the model's recommended `defaults` (engine.sampling_defaults, from its
    generation_config.json, as vLLM does), else SamplingParams' own."""
    try:
        fields = apply_defaults(kwargs, defaults or {})
        return SamplingParams(**{k: v for k, v in fields.items() if v is not None})
    except TierlmError as exc:
        raise from_engine_error(exc, "") from None


async def until_disconnect(request: Request, awaitable: Awaitable[T]) -> T:
    """Await `awaitable`, cancelling it (and raising ClientDisconnected) if the client leaves.

    Only valid once the request body has been read: after that, the next ASGI message a
    server can deliver is `http.disconnect`.
    """
    work = asyncio.ensure_future(awaitable)
    watcher = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({work, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        if not work.done():
            work.cancel()
            with anyio.CancelScope(shield=True):
                await asyncio.gather(work, return_exceptions=True)
        watcher.cancel()
    if work.cancelled():
        raise ClientDisconnected("client disconnected")
    return work.result()


async def _disconnected(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


@dataclass
class Generation:
    """A finished request's output, accumulated from its deltas."""

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    logprobs: list[TokenLogprob] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprob | None] | None = None  # when asked for (the first delta brings them)
    embedding: list[float] | None = None  # a pooling request's
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    num_output_tokens: int = 0
    # The stream it came from, whose output policies also read the tool calls parsed from it
    stream: "EngineStream | None" = field(default=None, repr=False, compare=False)

    def add(self, delta: StreamDelta) -> None:
        self.text += delta.text
        self.token_ids.extend(delta.token_ids)
        if delta.logprobs:
            self.logprobs.extend(delta.logprobs)
        if delta.prompt_logprobs is not None:
            self.prompt_logprobs = delta.prompt_logprobs
        if delta.embedding is not None:
            self.embedding = delta.embedding
        self.finish_reason = delta.finish_reason or self.finish_reason
        self.stop_reason = delta.stop_reason if delta.finished else self.stop_reason
        self.num_prompt_tokens = delta.num_prompt_tokens
        self.num_cached_tokens = delta.num_cached_tokens
        self.num_output_tokens = delta.num_output_tokens

    @property
    def ended_by_eos(self) -> bool:
        """The model ended the answer (an EOS token), not max_tokens, a stop string or a
        request's stop token."""
        return self.finish_reason == "stop" and self.stop_reason is None


class StreamedAnswer:
    """A streamed answer as a client may see it: the reasoning and the text as they come,
    except that whatever may be a think marker or a tool call is held back; calls are parsed
    into `calls` at the end (streaming's counterpart of `ChatPrompt.split`)."""

    def __init__(self, stream: "EngineStream", prompt: ChatPrompt, id_prefix: str) -> None:
        self._stream = stream
        self._prompt = prompt
        self._reasoning = prompt.reasoning_splitter()
        self._filter: toolcalls.ToolCallStreamFilter | None = None
        if prompt.parse_tools:
            self._filter = prompt.stream_filter(id_prefix)
            self._filter.feed(prompt.parsed_prefix)
        self.result = Generation()
        self.calls: list[toolcalls.ParsedToolCall] = []

    async def pieces(self) -> AsyncIterator[tuple[str, str, StreamDelta | None]]:
        """(reasoning to show now, text to show now, its delta) per delta; then, if held-back
        text remains (a think block cut off, text that turned out not to be a call),
        (that reasoning, that text, None). Errors arrive as APIError."""
        async for delta in self._stream.deltas():
            self.result.add(delta)
            thought, text = self._reasoning.feed(delta.text) if self._reasoning is not None else ("", delta.text)
            yield thought, self._filter.feed(text) if self._filter is not None else text, delta
        thought, text = self._reasoning.finish() if self._reasoning is not None else ("", "")
        if self._filter is not None:
            text = self._filter.feed(text)
            rest, calls = self._filter.finish(ended=self.result.ended_by_eos)
            self.calls = self._stream.screen_calls(calls, self.result)
            text += self._prompt.without_forced_prefix(rest, self.calls)
        if thought or text:
            yield thought, text, None


class InflightRequests:
    """Live engine streams, so shutdown can stop whatever outlives the grace period."""

    def __init__(self) -> None:
        self._streams: set[EngineStream] = set()

    def add(self, stream: "EngineStream") -> None:
        self._streams.add(stream)

    def discard(self, stream: "EngineStream") -> None:
        self._streams.discard(stream)

    def __len__(self) -> int:
        return len(self._streams)

    async def abort_all(self) -> None:
        """Abort in the engine: each stream then ends normally, telling its client why."""
        await asyncio.gather(*(stream.abort() for stream in list(self._streams)))

    async def close_all(self) -> None:
        """Last resort once the server stopped serving: release everything left."""
        for stream in list(self._streams):
            await stream.close()


_ESTIMATE_ONLY = SlaGuard(breaker=None)  # for a context with a target but no server's guard


class EngineStream:
    """One engine request from first delta to guaranteed cleanup."""

    def __init__(
        self,
        engine: "AsyncEngine",
        model: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        context: RequestContext,
        inflight: InflightRequests,
        pooling: PoolingParams | None = None,
        prompt_index: int = 0,
        markup: Callable[[], Markup | None] | None = None,
        screen_text: Callable[[], str | None] | None = None,
    ) -> None:
        """`markup` makes the reader of the answer's format (ChatPrompt.markup) whose markers and
        headers the output policies do not read: the client never sees them. `screen_text` makes
        what input policies read (ChatPrompt.screen_text: the client's words in a rendered chat);
        None: the prompt's tokens decoded (a raw prompt is all the client's)."""
        self.engine = engine
        self.model = model
        self.prompt_token_ids = prompt_token_ids
        self.params = params
        self.pooling = pooling  # set: the request asks for the prompt's embedding (one delta)
        self.prompt_index = prompt_index  # which of its HTTP request's prompts (a batch) it runs
        self.screen_text = screen_text
        self.context = context
        self._inflight = inflight
        self._iterator: AsyncIterator[StreamDelta] | None = None
        self._observer: Any = None
        self._first: StreamDelta | None = None
        self._closed = False
        self.finished = False
        self._guard: OutputGuard | None = (context.safety.output_guard(markup() if markup is not None else None)
                                           if context.safety is not None else None)
        self._redactions_told = 0

    @property
    def request_id(self) -> str:
        return self.context.request_id

    async def open(self, request: Request) -> StreamDelta:
        """Start generating and wait for the first delta (client errors surface here)."""
        ctx = self.context
        # Telemetry's middleware leaves a per-request observer in the scope (see telemetry.py).
        self._observer = request.scope.get("state", {}).get("telemetry")
        if ctx.safety is not None and ctx.safety.input is not None:
            # First in line (DESIGN.md: safety(input) → SLA guard): a refused prompt costs nothing.
            policy = await until_disconnect(request, asyncio.to_thread(self._prompt_breaks, ctx))
            if policy is not None:
                self._on_policy(policy, "input")
                if self._observer is not None:
                    self._observer.on_refused_prompt(len(self.prompt_token_ids), self.prompt_index)
                self.finished = True
                self._first = refused_delta(ctx.request_id, len(self.prompt_token_ids), policy)
                return self._first
        # Before the engine (and the tenant's token count) sees it: a shed request costs nothing.
        admission = (ctx.sla or _ESTIMATE_ONLY).admit(self.engine, self.model, ctx, len(self.prompt_token_ids))
        if self._observer is not None:
            self._observer.on_engine_request(self.model, self.params, tenant=ctx.tenant_id,
                                             prompt_tokens=len(self.prompt_token_ids), request_id=ctx.request_id,
                                             prompt_index=self.prompt_index)
        self._iterator = aiter(
            self.engine.generate(
                self.prompt_token_ids,
                self.params,
                ctx.request_id,
                priority=ctx.priority,
                tenant_id=ctx.tenant_id,
                cache_salt=ctx.cache_salt,
                tenant_weight=ctx.tenant_weight,
                kv_share=ctx.kv_share,
                kv_cache_share=ctx.kv_cache_share,
                pooling=self.pooling,
            )
        )
        self._inflight.add(self)
        if admission is not None:
            admission.start()
        try:
            self._first = await until_disconnect(request, self._next())
        except BaseException as exc:
            if admission is not None:
                admission.failed(exc)
            await self.close()
            raise
        first = self._first
        if admission is not None:
            ttft = (first.first_token_time - first.arrival_time
                    if first.first_token_time is not None and first.arrival_time is not None else None)
            admission.first_token(ttft)  # the tier's breaker and the estimate learn how it went
        return self._first

    def _prompt_breaks(self, ctx: RequestContext) -> Policy | None:
        """The input policy the prompt breaks, or None: a chat's client words (`screen_text`),
        else the prompt decoded without special tokens. On a worker thread: seconds per MB."""
        assert ctx.safety is not None
        text = self.screen_text() if self.screen_text is not None else None
        if text is None:
            text = self.engine.tokenizer.decode(self.prompt_token_ids, skip_special_tokens=True)
        return ctx.safety.check_prompt(text)

    def _on_policy(self, policy: Policy, stage: str) -> None:
        logger.info("request %s (tenant %s): safety policy '%s' %s its %s", self.request_id,
                    self.context.tenant_id, policy.name,
                    "redacted a phrase of" if stage == "redact" else "stopped", "prompt" if stage == "input" else "answer")
        if self._observer is not None:
            self._observer.on_safety(self.model, policy.name, stage)

    async def _next(self) -> StreamDelta:
        try:
            delta = await self._engine_next()
        except APIError as exc:
            if self._observer is not None:
                self._observer.on_error(exc)
            raise
        if self._observer is not None:
            self._observer.on_delta(delta)
        return delta

    async def _engine_next(self) -> StreamDelta:
        assert self._iterator is not None
        try:
            delta = await anext(self._iterator)
        except StopAsyncIteration:
            raise InternalError(f"engine for model '{self.model}' ended a request without output") from None
        except (APIError, asyncio.CancelledError):
            raise
        except Exception as exc:
            raise from_engine_error(exc, self.model) from None
        if delta.finish_reason == "error":  # (a structured output llguidance could not follow to its end)
            self.finished = True
            raise InvalidRequest(f"{delta.stop_reason}; simplify the schema or regex")
        if delta.finish_reason == "abort":
            self.finished = True
            raise Overloaded(
                f"request aborted by the engine for model '{self.model}' (the server is shutting "
                "down or overloaded); retry it"
            )
        self.finished = delta.finished
        return delta

    async def deltas(self) -> AsyncIterator[StreamDelta]:
        """All deltas, starting with the one `open` fetched. Errors arrive as APIError."""
        if self._first is None:
            raise RuntimeError("EngineStream.open() must be called first")
        delta: StreamDelta = self._first
        guard = self._guard
        if guard is None or (delta.finished and delta.finish_reason == FINISH_REASON):
            yield delta
            while not delta.finished:
                delta = await self._next()
                yield delta
            return
        scored = delta.prompt_logprobs  # (the first delta's, until a piece shown carries them)
        while True:  # the answer through the output policies: held back, redacted or stopped
            shown, blocked = guard.feed(delta)
            for policy in guard.redacted[self._redactions_told:]:
                self._on_policy(policy, "redact")
            self._redactions_told = len(guard.redacted)
            for piece in shown:
                if piece.prompt_logprobs is not None:
                    scored = None
                yield piece
            if blocked is not None:
                self._on_policy(blocked, "output")
                await self.abort()  # its KV blocks are freed now, not at the end of the answer
                self.finished = True
                # Prompt logprobs held back with the first delta still come: the policy stopped the
                # answer, not the prompt, whose echo (and its n choices', which share them) needs them
                yield replace(blocked_delta(delta, blocked), prompt_logprobs=scored)
                return
            if delta.finished:
                return
            delta = await self._next()

    async def run_to_end(self) -> Generation:
        """Every delta, gathered (errors arrive as APIError)."""
        result = Generation(stream=self)
        async for delta in self.deltas():
            result.add(delta)
        return result

    async def collect(self, request: Request) -> Generation:
        """Run to completion (non-streaming), aborting if the client disconnects."""
        try:
            return await until_disconnect(request, self.run_to_end())
        finally:
            await self.close()

    def screen_calls(self, calls: list[toolcalls.ParsedToolCall], result: Generation) -> list[toolcalls.ParsedToolCall]:
        """The finished answer's tool calls through the output policies, decoded (see
        OutputGuard.screen_calls); a block drops them and marks `result` stopped by its policy."""
        guard = self._guard
        if guard is None or not calls:
            return calls
        screened, blocked = guard.screen_calls(calls)
        for policy in guard.redacted[self._redactions_told:]:
            self._on_policy(policy, "redact")
        self._redactions_told = len(guard.redacted)
        if blocked is not None:
            self._on_policy(blocked, "output")
            result.finish_reason, result.stop_reason = FINISH_REASON, blocked.name
        return screened

    async def abort(self) -> None:
        """Ask the engine to stop this request; its stream then ends with an `abort` delta."""
        if not self.finished:
            try:
                await asyncio.wait_for(self.engine.abort(self.request_id), ABORT_TIMEOUT_S)
            except Exception:
                logger.exception("aborting %s failed", self.request_id)

    async def close(self) -> None:
        """Abort (if unfinished) and release the engine request. Safe to call repeatedly."""
        if self._closed:
            return
        self._closed = True
        self._inflight.discard(self)
        with anyio.CancelScope(shield=True):
            iterator, self._iterator = self._iterator, None
            aclose = getattr(iterator, "aclose", None)
            if aclose is not None:
                try:
                    await aclose()
                except Exception:
                    logger.exception("closing the engine stream of %s failed", self.request_id)
            await self.abort()  # returns once the KV blocks are free
