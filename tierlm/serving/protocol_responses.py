"""Pydantic body of OpenAI's Responses API (POST /v1/responses), and its translation into a chat.

A Responses request is a chat in other clothes: its `input` items (messages, function calls and
their outputs, reasoning) are the turns of a conversation, `instructions` its system message,
`text.format` a structured output. tierlm renders and runs it through the chat path, so every
rule of the chat side (tool syntax, reasoning, structured outputs, limits) holds here too.

As on the chat side, unknown fields are ignored, and fields whose meaning tierlm cannot honour
are refused by name: OpenAI's built-in tools (web search, file search, code interpreter, MCP,
...), images and files (tierlm's models read text), background runs, stored prompts and
conversations, item references.
"""
from __future__ import annotations

from typing import Annotated, Any, Literal, Union

from pydantic import Field, ValidationInfo, field_validator, model_validator

from tierlm.serving.protocol_openai import (
    _FUNCTION_NAME,
    ReasoningEffort,
    _Body,
    checked_parameters,
    refused_unless_null,
    vllm_top_k,
)

# Item and part types of OpenAI's that tierlm cannot take, with what to send instead.
_BUILT_IN = ("it is a built-in tool of OpenAI's, which tierlm does not run; offer your own functions "
             "(type 'function') and send their calls and outputs as function_call / function_call_output items")
_REFUSED_ITEMS = {
    "item_reference": "item references are not supported; send the item itself, or previous_response_id",
    "image_generation_call": _BUILT_IN, "file_search_call": _BUILT_IN, "web_search_call": _BUILT_IN,
    "computer_call": _BUILT_IN, "computer_call_output": _BUILT_IN, "code_interpreter_call": _BUILT_IN,
    "local_shell_call": _BUILT_IN, "local_shell_call_output": _BUILT_IN, "shell_call": _BUILT_IN,
    "shell_call_output": _BUILT_IN, "apply_patch_call": _BUILT_IN, "apply_patch_call_output": _BUILT_IN,
    "mcp_list_tools": _BUILT_IN, "mcp_approval_request": _BUILT_IN, "mcp_approval_response": _BUILT_IN,
    "mcp_call": _BUILT_IN, "tool_search_call": _BUILT_IN, "tool_search_output": _BUILT_IN,
    "custom_tool_call": "custom (free-form) tools are not supported; use function tools",
    "custom_tool_call_output": "custom (free-form) tools are not supported; use function tools",
    "compaction": "compaction items are not supported; send the conversation's items",
}
_TEXT_ONLY = "tierlm's models read text only; send input_text parts"
_ITEM_TYPES = ("message", "function_call", "function_call_output", "reasoning")

# `include` values tierlm honours; OpenAI's others name outputs of built-in tools and images,
# which never occur here (accepted, adding nothing); any other value is a 400, as at OpenAI.
LOGPROBS_INCLUDE = "message.output_text.logprobs"
ENCRYPTED_REASONING_INCLUDE = "reasoning.encrypted_content"
Includable = Literal["message.output_text.logprobs", "reasoning.encrypted_content", "file_search_call.results",
                     "web_search_call.results", "web_search_call.action.sources", "message.input_image.image_url",
                     "computer_call_output.output.image_url", "code_interpreter_call.outputs"]

MAX_METADATA_PAIRS = 16  # OpenAI's bounds on metadata
MAX_METADATA_KEY = 64
MAX_METADATA_VALUE = 512


def metadata_problem(value: dict[str, str]) -> str | None:
    """What breaks OpenAI's bounds on a metadata map of strings (the Responses and Batch APIs'), or None."""
    if len(value) > MAX_METADATA_PAIRS:
        return f"may hold at most {MAX_METADATA_PAIRS} pairs (got {len(value)})"
    for key, text in value.items():
        if len(key) > MAX_METADATA_KEY or len(text) > MAX_METADATA_VALUE:
            return (f"keys may be at most {MAX_METADATA_KEY} characters and values {MAX_METADATA_VALUE} "
                    f"(key {key[:80]!r})")
    return None


class InputText(_Body):
    """A text part: the user's `input_text`, an assistant's `output_text` sent back (its
    annotations and logprobs are not the model's to read), or plain `text`."""

    type: Literal["input_text", "output_text", "text"]
    text: str


class RefusalText(_Body):
    type: Literal["refusal"]
    refusal: str


class InputFile(_Body):
    """A file: one uploaded through /v1/files (file_id) or inline (file_data: base64 or a data:
    URL). Kept in the conversation as sent; a text file is read as its text each time the
    conversation is rendered (openai_responses.read_input_files), any other is refused."""

    type: Literal["input_file"]
    file_id: str | None = None
    file_data: str | None = None
    filename: str | None = None
    file_url: str | None = None


MessagePart = Annotated[Union[InputText, RefusalText, InputFile], Field(discriminator="type")]


def _refuse_unreadable_parts(value: Any) -> Any:
    if isinstance(value, list):
        for j, part in enumerate(value):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind in ("input_image", "input_audio", "image_url", "computer_screenshot"):
                raise ValueError(f"content.{j}: parts of type '{kind}' cannot be read: {_TEXT_ONLY}")
    return value


class MessageItem(_Body):
    type: Literal["message"] = "message"
    id: str | None = None
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[MessagePart]
    status: str | None = None

    _readable = field_validator("content", mode="before")(_refuse_unreadable_parts)


class FunctionCallItem(_Body):
    type: Literal["function_call"]
    id: str | None = None
    call_id: str = Field(min_length=1)
    name: str = Field(pattern=_FUNCTION_NAME)
    arguments: str  # JSON text, as OpenAI sends it
    status: str | None = None


class FunctionCallOutputItem(_Body):
    type: Literal["function_call_output"]
    id: str | None = None
    call_id: str = Field(min_length=1)
    output: str | list[MessagePart]
    status: str | None = None

    _readable = field_validator("output", mode="before")(_refuse_unreadable_parts)


class ReasoningText(_Body):
    type: Literal["reasoning_text", "summary_text"]
    text: str


class ReasoningItem(_Body):
    """A reasoning item sent back: its text (`content`, or else the `summary`, or else what
    tierlm put in `encrypted_content`) becomes the next assistant turn's reasoning."""

    type: Literal["reasoning"]
    id: str | None = None
    summary: list[ReasoningText] = Field(default_factory=list)
    content: list[ReasoningText] | None = None
    encrypted_content: str | None = None
    status: str | None = None


InputItem = Annotated[Union[MessageItem, FunctionCallItem, FunctionCallOutputItem, ReasoningItem],
                      Field(discriminator="type")]


class FunctionTool(_Body):
    type: Literal["function"]
    name: str = Field(pattern=_FUNCTION_NAME)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None  # accepted, as on the chat side: arguments are parsed, not checked

    _object_schema = field_validator("parameters")(checked_parameters)


class FunctionChoice(_Body):
    type: Literal["function"]
    name: str


class TextFormat(_Body):
    """`text.format`: plain text, any JSON object, or JSON following a schema."""

    type: Literal["text", "json_object", "json_schema"]
    name: str | None = Field(default=None, max_length=64)
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None
    description: str | None = None

    @model_validator(mode="after")
    def _schema_given(self) -> "TextFormat":
        if self.type == "json_schema" and self.schema_ is None:
            raise ValueError("type 'json_schema' needs 'schema', the JSON schema to follow")
        return self


class TextConfig(_Body):
    format: TextFormat | None = None
    verbosity: str | None = None  # a hint to OpenAI's models; tierlm's follow the prompt alone


class ReasoningConfig(_Body):
    """`effort` reaches the chat template as `reasoning_effort`, as chat's field does (gpt-oss's
    template writes it into its system message; others render as without); `summary` asks for
    summaries, which tierlm does not write (the reasoning itself is returned)."""

    effort: ReasoningEffort | None = None
    summary: str | None = None
    generate_summary: str | None = None


class ResponsesRequest(_Body):
    model: str = Field(min_length=1)
    input: str | list[InputItem]
    instructions: str | None = None
    previous_response_id: str | None = None
    max_output_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, ge=0.0, le=1.0)
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    include: list[Includable] | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | FunctionChoice | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    reasoning: ReasoningConfig | None = None
    stream: bool = False
    store: bool = True
    metadata: dict[str, str] | None = None
    truncation: Literal["auto", "disabled"] | None = None
    user: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    service_tier: str | None = None
    max_tool_calls: int | None = Field(default=None, ge=1)  # bounds built-in tools' calls: none run here
    # vLLM-style extensions, as on the chat side
    top_k: int | None = None
    min_p: float | None = Field(default=None, ge=0.0, le=1.0)
    repetition_penalty: float | None = Field(default=None, ge=0.01, le=10.0)
    seed: int | None = None
    cache_salt: str | None = Field(default=None, min_length=1, max_length=1024)
    # OpenAI's, which tierlm cannot honour and must not ignore: refused unless null (or false)
    background: bool | None = None
    conversation: Any = None
    prompt: Any = None

    _no_conversation = field_validator("conversation")(refused_unless_null(
        "(server-side conversations) is not supported; pass previous_response_id, or send the items in 'input'"))
    _no_prompt = field_validator("prompt")(refused_unless_null(
        "(a stored prompt template) is not supported; send the instructions and input themselves"))

    @field_validator("stream", "store", mode="before")
    @classmethod
    def _null_is_the_default(cls, value: Any, info: ValidationInfo) -> Any:
        return cls.model_fields[info.field_name].default if value is None else value

    @field_validator("background")
    @classmethod
    def _not_in_background(cls, value: bool | None) -> bool | None:
        if value:
            raise ValueError("background responses are not supported: tierlm answers while the request is open "
                             "(stream it for early output); remove 'background'")
        return value

    @field_validator("input", mode="before")
    @classmethod
    def _items(cls, value: Any) -> Any:
        """Messages may leave out `type` (OpenAI's easy input messages); items tierlm cannot take
        are refused by type, saying what to send instead."""
        if isinstance(value, str):
            if not value:
                raise ValueError("must not be empty")
            return value
        if not isinstance(value, list):
            return value
        if not value:
            raise ValueError("must hold at least one item")
        items = []
        for i, item in enumerate(value):
            if isinstance(item, dict):
                kind = item.get("type")
                if kind is None and "role" in item:
                    item = {**item, "type": "message"}
                elif kind in _REFUSED_ITEMS:
                    raise ValueError(f"{i}: items of type '{kind}' are not supported: {_REFUSED_ITEMS[kind]}")
                elif kind not in _ITEM_TYPES:
                    raise ValueError(f"{i}: unknown item type {kind!r}; send one of {', '.join(_ITEM_TYPES)}")
            items.append(item)
        return items

    @field_validator("tools", mode="before")
    @classmethod
    def _function_tools(cls, value: Any) -> Any:
        if isinstance(value, list):
            for i, tool in enumerate(value):
                kind = tool.get("type") if isinstance(tool, dict) else None
                if kind != "function":
                    raise ValueError(f"{i}: tools of type {kind!r} are not supported: "
                                     + (_BUILT_IN if kind != "custom" else "use function tools"))
        return value

    @field_validator("tool_choice", mode="before")
    @classmethod
    def _function_choice(cls, value: Any, info: ValidationInfo) -> Any:
        if isinstance(value, dict) and value.get("type") != "function":
            raise ValueError(f"a choice of type {value.get('type')!r} is not supported; use 'none', 'auto', "
                             "'required' or {'type': 'function', 'name': ...}")
        return value

    @field_validator("tool_choice")
    @classmethod
    def _choice_names_a_tool(cls, value: Any, info: ValidationInfo) -> Any:
        tools = info.data.get("tools") or []
        if value == "required" and not tools:
            raise ValueError("tool_choice 'required' needs a non-empty 'tools' list")
        if isinstance(value, FunctionChoice) and value.name not in (names := [t.name for t in tools]):
            raise ValueError(f"names function '{value.name}', not in tools {names}")
        return value

    @field_validator("metadata")
    @classmethod
    def _metadata(cls, value: dict[str, str] | None) -> dict[str, str] | None:
        if value is not None and (problem := metadata_problem(value)) is not None:
            raise ValueError(problem)
        return value

    _top_k = field_validator("top_k")(lambda value: vllm_top_k(value))

    def items(self) -> list[MessageItem | FunctionCallItem | FunctionCallOutputItem | ReasoningItem]:
        """The input as items (a string is one user message)."""
        if isinstance(self.input, str):
            return [MessageItem(role="user", content=self.input)]
        return list(self.input)

    def wants(self, include: str) -> bool:
        return include in (self.include or ())

    def response_format(self) -> dict[str, Any] | None:
        """`text.format` as the chat side's response_format."""
        fmt = self.text.format if self.text is not None else None
        if fmt is None or fmt.type == "text":
            return None
        if fmt.type == "json_object":
            return {"type": "json_object"}
        return {"type": "json_schema", "json_schema": {"name": fmt.name or "response", "schema": fmt.schema_,
                                                       "strict": fmt.strict, "description": fmt.description}}
