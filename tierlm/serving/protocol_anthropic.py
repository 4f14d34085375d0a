"""Pydantic bodies of the Anthropic Messages API (requests and responses).

Unknown top-level fields are ignored rather than rejected, so newer SDKs that send fields
tierlm does not know yet (service_tier, speed, ...) keep working; known fields are validated
strictly and errors name the field.
"""
from __future__ import annotations

import re
from typing import Annotated, Any, Callable, Literal, Union

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Discriminator,
    Field,
    Tag,
    ValidationInfo,
    field_validator,
    model_validator,
)

from tierlm.sampling_params import StructuredOutputsParams, stop_strings_problem
from tierlm.serving.errors import InvalidRequest
from tierlm.serving.protocol_openai import (
    EFFORT_VARIABLE,
    checked_parameters,
    refused_unless_null,
    template_kwargs_refused,
    template_variables,
)

_TOOL_NAME = re.compile(r"^[a-zA-Z0-9_-]{1,128}$")
_TOOL_ID = re.compile(r"[a-zA-Z0-9_-]+")


def _tool_name(value: str) -> str:
    """Anthropic's rule for tool names. Chat templates write them into the prompt unescaped, so a
    name that breaks it could close a tool call and open a turn of its own."""
    if not _TOOL_NAME.fullmatch(value):  # not match: `$` would let a trailing newline through
        raise ValueError("tool names must be 1-128 characters of letters, digits, '_' or '-'")
    return value


def _tool_id(value: str) -> str:
    """Anthropic's rule for tool_use ids (and the tool_use_id that answers one). Some chat
    templates write ids into the prompt unescaped: "a b\\n<|im_end|>" could open a turn."""
    if not _TOOL_ID.fullmatch(value):  # fullmatch: `$` would let a trailing newline through
        raise ValueError("String should match pattern '^[a-zA-Z0-9_-]+$' (letters, digits, '_' or '-')")
    return value


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore")


class CacheControl(_Body):
    """A cache breakpoint, checked as Anthropic checks it (its type, its ttl, at most
    MAX_CACHE_BREAKPOINTS per request) and otherwise changing nothing: tierlm caches every
    prefix of full blocks automatically."""

    type: Literal["ephemeral"]
    ttl: Literal["5m", "1h"] | None = None


MAX_CACHE_BREAKPOINTS = 4  # Anthropic's bound on blocks (tools, system, messages) with cache_control


def _non_empty_text(value: str) -> str:
    """Anthropic's API refuses empty text blocks, in these words. A whitespace-only block is
    refused only where a user message or the system prompt holds nothing else
    (anthropic.check_blocks): next to other text it is accepted, as there."""
    if value == "":
        raise ValueError("text content blocks must be non-empty")
    return value


class TextBlock(_Body):
    type: Literal["text"]
    text: str
    cache_control: CacheControl | None = None  # checked; prefix caching is automatic here
    citations: Any = None

    @field_validator("text")
    @classmethod
    def _text(cls, value: str) -> str:
        return _non_empty_text(value)


def _known_blocks(kinds: tuple[str, ...]) -> Callable[[Any], Any]:
    """A before-validator for one content block: a type tierlm does not model is refused in
    words that name it, instead of pydantic's "input tag 'X' ... does not match any of the
    expected tags" (which reads as a malformed request, not as a missing feature)."""
    def check(value: Any) -> Any:
        kind = value.get("type") if isinstance(value, dict) else None
        if isinstance(kind, str) and kind not in kinds:
            raise ValueError(f"content blocks of type {kind!r} are not supported by tierlm (blocks it takes "
                             f"here: {', '.join(kinds)}); {_unsupported_hint(kind)}")
        return value
    return check


def _unsupported_hint(kind: str) -> str:
    if kind == "container_upload":
        return "tierlm runs no code execution, so there is no container to upload files to; remove the block"
    if kind in ("server_tool_use", "mcp_tool_use") or kind.endswith("_tool_result"):
        return ("tierlm runs no server tools (web search, web fetch, code execution, MCP); remove the block, "
                "or put what it holds into a text block")
    return "send its content as a text block, or remove it"


def _blocks_of(kinds: tuple[str, ...], *models: type) -> Any:
    """A content block: one of `models`, picked by `type`, other types refused by name."""
    return Annotated[Union[models], Field(discriminator="type"), BeforeValidator(_known_blocks(kinds))]


class ImageBlock(_Body):
    type: Literal["image"]
    source: dict[str, Any]
    cache_control: CacheControl | None = None


class PlainTextSource(_Body):
    type: Literal["text"]
    media_type: Literal["text/plain"]
    data: str


_SourceBlock = _blocks_of(("text", "image"), TextBlock, ImageBlock)


class ContentSource(_Body):
    """A document given as content blocks: readable where they are all text."""

    type: Literal["content"]
    content: str | list[_SourceBlock]


def _source_kind(value: Any) -> str:
    kind = value.get("type") if isinstance(value, dict) else getattr(value, "type", None)
    return kind if kind in ("text", "content") else "other"


# Text sources are modelled (tierlm reads them); the others (base64, url, file: PDFs) are kept as
# they came and refused as unreadable by anthropic.check_blocks, which names the block.
DocumentSource = Annotated[
    Union[Annotated[PlainTextSource, Tag("text")], Annotated[ContentSource, Tag("content")],
          Annotated[dict[str, Any], Tag("other")]],
    Discriminator(_source_kind),
]


class DocumentBlock(_Body):
    type: Literal["document"]
    source: DocumentSource
    title: str | None = None
    context: str | None = None
    citations: Any = None  # accepted; tierlm cites nothing
    cache_control: CacheControl | None = None

    def text(self) -> str | None:
        """The document as prompt text (title, context, then its text); None where the model
        cannot read it (a PDF, an image among its blocks)."""
        source = self.source
        if isinstance(source, PlainTextSource):
            body = source.data
        elif isinstance(source, ContentSource) and isinstance(source.content, str):
            body = source.content
        elif isinstance(source, ContentSource) and all(isinstance(b, TextBlock) for b in source.content):
            body = "\n".join(b.text for b in source.content)
        else:
            return None
        return "\n".join(part for part in (self.title, self.context, body) if part)


class SearchResultBlock(_Body):
    """A search result the client found (RAG): read as text, its title and source first."""

    type: Literal["search_result"]
    source: str
    title: str
    content: list[TextBlock]
    citations: Any = None  # accepted; tierlm cites nothing
    cache_control: CacheControl | None = None

    def text(self) -> str:
        return "\n".join([self.title, self.source, *(b.text for b in self.content)])


class ToolUseBlock(_Body):
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]
    cache_control: CacheControl | None = None

    @field_validator("name")
    @classmethod
    def _name(cls, value: str) -> str:
        return _tool_name(value)  # an earlier turn's call: written into the prompt too

    _id = field_validator("id")(_tool_id)


_ResultBlock = _blocks_of(("text", "image", "document", "search_result"), TextBlock, ImageBlock, DocumentBlock,
                          SearchResultBlock)


class ToolResultBlock(_Body):
    type: Literal["tool_result"]
    tool_use_id: str
    content: str | list[_ResultBlock] | None = None
    is_error: bool | None = None
    cache_control: CacheControl | None = None

    _id = field_validator("tool_use_id")(_tool_id)


class ThinkingBlock(_Body):
    """Echoed back by clients that replay earlier turns (tierlm's own, or another server's: the
    signature is not checked)."""

    type: Literal["thinking"]
    thinking: str
    signature: str | None = None


class RedactedThinkingBlock(_Body):
    type: Literal["redacted_thinking"]
    data: str


ContentBlock = _blocks_of(("text", "image", "document", "search_result", "tool_use", "tool_result", "thinking",
                           "redacted_thinking"), TextBlock, ImageBlock, DocumentBlock, SearchResultBlock, ToolUseBlock,
                          ToolResultBlock, ThinkingBlock, RedactedThinkingBlock)


def _check_content(value: Any) -> Any:
    """Runs before type validation so the message says what content may be. Empty content is
    refused later (anthropic.check_blocks), where it is known whether the message is the final
    assistant one, which may be empty."""
    if not isinstance(value, (str, list)):
        raise ValueError("content must be a string or a list of content blocks")
    return value


class InputMessage(_Body):
    role: Literal["user", "assistant"]
    content: str | list[ContentBlock]

    @field_validator("content", mode="before")
    @classmethod
    def _content(cls, value: Any) -> Any:
        return _check_content(value)

    def blocks(self) -> list[Any]:
        if isinstance(self.content, str):
            return [TextBlock(type="text", text=self.content)] if self.content else []
        return list(self.content)


class Tool(_Body):
    """A client-side (custom) tool; rendered through the chat template as a function."""

    @model_validator(mode="before")
    @classmethod
    def _no_server_tool(cls, value: Any) -> Any:
        """Typed tools are Anthropic's: server tools (web search, code execution) run on its side,
        and the others' schemas (bash, text_editor, computer) are built into Claude. tierlm has
        neither; without this check the client learned only that input_schema was missing."""
        kind = value.get("type") if isinstance(value, dict) else None
        if kind is not None and kind != "custom":
            raise ValueError(
                f"tool {value.get('name')!r} has type {kind!r}, a tool Anthropic defines (a server tool such as "
                "web search, or one whose schema is built into Claude, such as bash), which tierlm does not support; "
                "remove it, or define a client tool (name, description, input_schema) and run it yourself"
            )
        return value

    name: str
    description: str | None = None
    input_schema: dict[str, Any]
    type: Literal["custom"] | None = None
    cache_control: CacheControl | None = None
    # Accepted, and changes nothing: agent frameworks set it on every tool, and refusing it broke
    # them. Under tool_choice any / tool the call's input follows input_schema whatever it says
    # (tool_grammar.py); under auto it is a parsed JSON object, never checked against it (README).
    strict: bool | None = None

    @field_validator("name")
    @classmethod
    def _name(cls, value: str) -> str:
        return _tool_name(value)

    _object_schema = field_validator("input_schema")(checked_parameters)  # (whatever tool_choice says, as Anthropic)


class ToolChoice(_Body):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None

    @model_validator(mode="after")
    def _name_for_tool(self) -> "ToolChoice":
        if self.type == "tool" and not self.name:
            raise ValueError("tool_choice of type 'tool' needs the tool's 'name'")
        return self


class Metadata(_Body):
    user_id: str | None = None


class OutputFormat(_Body):
    """Structured output: the reply's text is JSON following `schema` (engine/grammar.py)."""

    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema")


class OutputConfig(_Body):
    # The chat template's `reasoning_effort` (see `template_effort`)
    effort: Literal["low", "medium", "high", "xhigh", "max"] | None = None
    format: OutputFormat | None = None

    @property
    def template_effort(self) -> str | None:
        """`effort` as OpenAI's reasoning_effort says it (what gpt-oss's template reads): low,
        medium and high as they are; xhigh and max, more than OpenAI's scale has, as its top."""
        return None if self.effort is None else {"xhigh": "high", "max": "high"}.get(self.effort, self.effort)


THINKING_MIN_BUDGET = 1024  # Anthropic's floor for budget_tokens


class ThinkingEnabled(_Body):
    type: Literal["enabled"]
    budget_tokens: int
    display: Literal["summarized", "omitted"] | None = None

    @field_validator("budget_tokens")
    @classmethod
    def _floor(cls, value: int) -> int:
        if value < THINKING_MIN_BUDGET:  # the ceiling (max_tokens) is checked by anthropic.create_message
            raise ValueError(f"must be ≥{THINKING_MIN_BUDGET} and less than max_tokens (got {value})")
        return value


class ThinkingDisabled(_Body):
    type: Literal["disabled"]


class ThinkingAdaptive(_Body):
    type: Literal["adaptive"]
    display: Literal["summarized", "omitted"] | None = None


class ThinkingBetweenTools(_Body):
    type: Literal["between_tools"]


# The SDK's ThinkingConfigParam. What it changes is the chat template's `enable_thinking` (Qwen3,
# SmolLM3: whether the model reasons before answering), `display` whether the thinking blocks of
# a model that does (see reasoning.py) carry its text, and budget_tokens how long its block may be.
ThinkingConfig = Annotated[Union[ThinkingEnabled, ThinkingDisabled, ThinkingAdaptive, ThinkingBetweenTools],
                           Field(discriminator="type")]


class ConversationBody(_Body):
    """What both /v1/messages and /v1/messages/count_tokens render into a prompt."""

    model: str = Field(min_length=1)
    messages: list[InputMessage]
    system: str | list[TextBlock] | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    thinking: ThinkingConfig | None = None
    # vLLM's (its Anthropic route takes it too): more variables for the model's chat template,
    # e.g. Qwen3's enable_thinking; over what `thinking` sets. Ignored, the prompt differed.
    chat_template_kwargs: dict[str, Any] | None = None
    # MCP connector (beta): tierlm connects to no MCP servers, and ignoring the field left the
    # client waiting for tools that never came
    mcp_servers: Any = None
    # Structured output (the SDK's `output_config={"format": ...}`, and the beta's `output_format`):
    # here, not on MessagesRequest alone, so that count_tokens takes (and checks) what
    # /v1/messages takes. It adds nothing to the prompt: the count is the same without it.
    output_config: OutputConfig | None = None
    output_format: OutputFormat | None = None
    # code execution's container (an id or settings): tierlm has no code execution to run in one
    container: Any = None

    _no_container = field_validator("container")(refused_unless_null(
        "tierlm runs no code execution, so there is no container to use; remove 'container'"))

    _template_variables = field_validator("chat_template_kwargs")(template_kwargs_refused)

    def check_template_kwargs(self, *, continue_final_message: bool) -> None:
        """`add_generation_prompt` / `continue_final_message` in chat_template_kwargs: the messages
        decide them here (a final assistant turn is continued), so a value that says otherwise is
        refused rather than obeyed or ignored."""
        implied = {"add_generation_prompt": not continue_final_message,
                   "continue_final_message": continue_final_message}
        for name, value in implied.items():
            given = (self.chat_template_kwargs or {}).get(name)
            if given is not None and bool(given) != value:
                asks = ("continue the final assistant turn (a prefill)" if continue_final_message
                        else "start a new assistant turn")
                raise InvalidRequest(f"chat_template_kwargs: {name} {str(bool(given)).lower()} contradicts the "
                                     f"messages, which {asks}; remove it", param="chat_template_kwargs")

    @property
    def template_kwargs(self) -> dict[str, Any] | None:
        """The chat template's variables this body sets: `enable_thinking` where `thinking` is
        given and `reasoning_effort` where `output_config.effort` is (templates that do not use
        them render as without), then `chat_template_kwargs` (less apply_chat_template's own
        arguments, which the request decides or which do not change the text, but `documents`,
        as on the OpenAI route)."""
        kwargs = {} if self.thinking is None else {"enable_thinking": self.thinking.type != "disabled"}
        if self.output_config is not None and self.output_config.effort is not None:
            kwargs[EFFORT_VARIABLE] = self.output_config.template_effort
        return {**kwargs, **template_variables(self.chat_template_kwargs or {})} or None

    def structured(self) -> StructuredOutputsParams | None:
        """The JSON schema the reply must follow, or None; a 400 if both fields give one."""
        configured = self.output_config.format if self.output_config is not None else None
        if configured is not None and self.output_format is not None:
            raise InvalidRequest("output_format: give the format once, in output_config.format (output_format is "
                                 "the older beta's name for it)", param="output_format")
        chosen = configured or self.output_format
        return StructuredOutputsParams(json=chosen.schema_) if chosen is not None else None

    @property
    def thinking_budget_tokens(self) -> int | None:
        """`budget_tokens` of enabled thinking: the most tokens a reasoning model's think block
        may hold before tierlm ends it (see sampling_params.ThinkingBudget)."""
        return self.thinking.budget_tokens if isinstance(self.thinking, ThinkingEnabled) else None

    @property
    def omits_thinking(self) -> bool:
        """`display: omitted`: thinking blocks come back with empty text (and their signature)."""
        return getattr(self.thinking, "display", None) == "omitted"

    @field_validator("mcp_servers")
    @classmethod
    def _no_mcp(cls, value: Any) -> Any:
        if value:  # (an empty list asks for none)
            raise ValueError("tierlm does not connect to MCP servers; remove 'mcp_servers' and pass the "
                             "servers' tools as client tools in 'tools'")
        return value

    @field_validator("tools")
    @classmethod
    def _unique_tool_names(cls, value: list[Tool] | None) -> list[Tool] | None:
        names = [t.name for t in value or ()]
        if len(set(names)) != len(names):  # Anthropic's words, then which
            dup = next(n for n in names if names.count(n) > 1)
            raise ValueError(f"Tool names must be unique. '{dup}' is defined more than once")
        return value

    @model_validator(mode="after")
    def _breakpoints(self) -> "ConversationBody":
        blocks = [*(self.tools or ()), *(self.system if isinstance(self.system, list) else ())]
        for block in (b for message in self.messages for b in message.blocks()):
            blocks.append(block)
            if isinstance(block, ToolResultBlock) and isinstance(block.content, list):
                blocks.extend(block.content)
        found = sum(1 for b in blocks if getattr(b, "cache_control", None) is not None)
        if found > MAX_CACHE_BREAKPOINTS:  # (Anthropic's words)
            raise InvalidRequest(f"A maximum of {MAX_CACHE_BREAKPOINTS} blocks with cache_control may be provided. "
                                 f"Found {found}.")
        return self

    @field_validator("messages")
    @classmethod
    def _some_messages(cls, value: list[InputMessage]) -> list[InputMessage]:
        if not value:
            raise ValueError("messages must contain at least one message")
        return value

    @field_validator("system", mode="before")
    @classmethod
    def _system_shape(cls, value: Any) -> Any:
        if value is not None and not isinstance(value, (str, list)):
            raise ValueError("system must be a string or a list of text blocks")
        return value

    @field_validator("tool_choice")
    @classmethod
    def _tool_choice_names_a_tool(cls, choice: ToolChoice | None, info: ValidationInfo) -> ToolChoice | None:
        tools = info.data.get("tools") or []
        if choice is not None and choice.type in ("any", "tool") and not tools:
            raise ValueError(f"tool_choice '{choice.type}' needs a non-empty 'tools' list")
        if choice is not None and choice.type == "tool":
            names = [t.name for t in tools]
            if choice.name not in names:
                raise ValueError(f"tool_choice names tool '{choice.name}', which is not in tools {names}")
        return choice


class MessagesRequest(ConversationBody):
    max_tokens: int = Field(ge=0)  # 0: prefill the prompt into the cache, answer nothing (the SDK's pre-warming)
    stop_sequences: list[str] | None = None
    temperature: float | None = Field(default=None, ge=0.0, le=1.0)
    top_p: float | None = Field(default=None, ge=0.0, le=1.0)  # 0: the top token only
    top_k: int | None = Field(default=None, ge=0)
    metadata: Metadata | None = None
    stream: bool = False
    # tierlm's (vLLM's field; send it with the SDK's extra_body): requests with different salts
    # never share cached prefix blocks, mixed under the tenant's
    cache_salt: str | None = Field(default=None, min_length=1, max_length=1024)

    def thinking_problem(self) -> str | None:
        """Anthropic's rule that the thinking budget leaves room for the answer: budget_tokens
        below max_tokens (count_tokens, without max_tokens, checks only the floor)."""
        thinking = self.thinking
        if isinstance(thinking, ThinkingEnabled) and thinking.budget_tokens >= self.max_tokens:
            return (f"must be ≥{THINKING_MIN_BUDGET} and less than max_tokens (got {thinking.budget_tokens}, "
                    f"max_tokens {self.max_tokens})")
        return None

    @field_validator("stop_sequences")
    @classmethod
    def _non_empty_stops(cls, value: list[str] | None) -> list[str] | None:
        if value and (problem := stop_strings_problem(value)) is not None:
            raise ValueError(f"the stop sequences {problem}")
        if value and any(s and not s.strip() for s in value):  # Anthropic's API refuses "\n\n", in these words
            raise ValueError("each stop sequence must contain non-whitespace")
        return value


class CountTokensRequest(ConversationBody):
    pass


# ---- responses -------------------------------------------------------------------------

StopReason = Literal["end_turn", "max_tokens", "stop_sequence", "tool_use", "refusal"]


class TextContent(BaseModel):
    type: Literal["text"] = "text"
    text: str


class ThinkingContent(BaseModel):
    type: Literal["thinking"] = "thinking"
    thinking: str
    signature: str


class ToolUseContent(BaseModel):
    type: Literal["tool_use"] = "tool_use"
    id: str
    name: str
    input: dict[str, Any]


class Usage(BaseModel):
    """Token counts. input + cache_creation + cache_read = the prompt's length.

    Prefix-cache hits are reported as `cache_read_input_tokens`. tierlm caches every prompt
    automatically (no `cache_control` needed), so nothing is billed as a cache write and
    `cache_creation_input_tokens` is always 0.
    """

    input_tokens: int
    output_tokens: int
    cache_creation_input_tokens: int = 0
    cache_read_input_tokens: int = 0


class MessageResponse(BaseModel):
    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    content: list[ThinkingContent | TextContent | ToolUseContent]
    model: str
    stop_reason: StopReason | None
    stop_sequence: str | None = None
    usage: Usage


class TokenCount(BaseModel):
    input_tokens: int
